"""The tiny word-level GRPO task the GRPO tests share: its tokenizer, model, prompts and reward functions
(build_setup), a run's config (run_cfg) and metrics (read_metrics), and the fixed completions and TRL step the
TRL oracles give both sides (fixed_completions, trl_fixed_step)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tests.hf_models import make_llama

WORDS = "red blue green gold pink gray teal plum rust sand mint navy lime ruby jade onyx".split()
LOW = set(WORDS[:8])  # the synthetic task's reward: the share of completion words from the first half


def word_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *WORDS])}
    t = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>").save_pretrained(str(folder))
    return len(vocab)


REWARDS = '''
LOW = set({low!r})


def low_words(prompts, completions, completion_ids, **columns):
    """The share of a completion's words drawn from the first half of the word list (EOS counts as a miss)."""
    return [sum(w in LOW for w in c.split()) / max(len(ids), 1) for c, ids in zip(completions, completion_ids)]


def picky(prompts, completions, completion_ids, answer, **columns):
    """Raises on the rows whose answer is 'boom'."""
    return [1.0 / (a != "boom") if a == "boom" else 0.0 for a in answer]


def applies_to_none(prompts, completions, completion_ids, **columns):
    """Does not apply to any completion."""
    return [None] * len(completions)
'''


def build_setup(root: Path) -> Path:
    """Write :func:`setup`'s folder into ``root``: the tokenizer (tok), a tiny Llama (hf) converted (zoo), 64
    prompts and the reward functions (rewards.py)."""
    vocab = word_tokenizer(root / "tok")
    make_llama(root / "hf", vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    from zoo.cli import main

    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    rng = np.random.RandomState(0)
    with (root / "prompts.jsonl").open("w") as f:
        for i in range(64):
            words = rng.choice(WORDS, rng.randint(1, 6))
            f.write(json.dumps({"prompt": " ".join(words), "answer": "boom" if i % 4 == 1 else "ok"}) + "\n")
    (root / "rewards.py").write_text(REWARDS.format(low=sorted(LOW)))
    return root


def run_overrides(root: Path, out: Path, *overrides: str) -> list[str]:
    """The module's run settings (``key=value``, later ones winning), as _cfg reads them and `grpo train` takes
    them."""
    return [f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}", f"data.path={root / 'prompts.jsonl'}",
            "data.seq_len=8", "batch_size=16", "grpo.num_generations=4", "grpo.max_completion_length=6",
            f"grpo.rewards=[{root / 'rewards.py'}:low_words]", "max_steps=4", "log_every=1",
            "optimizer.learning_rate=3e-2", "schedule.name=constant", "checkpoint.every=1000", f"output_dir={out}",
            *overrides]


def run_cfg(root: Path, out: Path, *overrides: str):
    from grpo.config import GRPOConfig
    from pretrain.config import load_config

    return load_config(None, run_overrides(root, out, *overrides), GRPOConfig)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

def fixed_completions(folder: Path, g: int, vocab: int):
    """The fixed completions the TRL step oracles give both sides (a function of each prompt's first token and
    its place in the group, ending with EOS after 1 to 4 tokens): (completions(prompt_ids) -> each prompt's
    completion, for TRL's trainer; a stand-in for eval.rollout.sample_group_completions drawing them, the module ``score`` whose ``id_score`` rewards
    them, written to ``folder / "score.py"``)."""
    import importlib.util

    eos = 1

    def completion(first: int, k: int) -> list[int]:
        return [(first * 3 + k * 5 + j * 11) % (vocab - 2) + 2 for j in range(k + 1)] + [eos]

    def completions(prompt_ids: list[list[int]]) -> list[list[int]]:
        """TRL's side: each prompt's completions (its G rows are consecutive, as our groups are)."""
        seen: dict = {}
        out = []
        for ids in prompt_ids:
            k = seen.get(tuple(ids), 0)
            seen[tuple(ids)] = k + 1
            out.append(completion(ids[0], k))
        return out

    def fixed_sampler(cfg, params, tokens, valid, spec, key, *args, **kwargs):
        b, t = tokens.shape[0], spec.new_tokens
        table = np.zeros((vocab, g, t), np.int32)
        for first in range(vocab):
            for k in range(g):
                c = completion(first, k)
                table[first, k, :len(c)] = c
        k = jnp.arange(b) % g
        comp = jnp.asarray(table)[tokens[:, 0], k]
        return comp, jnp.zeros((b, t), jnp.float32), (k + 2).astype(jnp.int32)

    (folder / "score.py").write_text(
        "def id_score(prompts, completions, completion_ids, **kw):\n"
        "    return [(sum(ids) % 7) / 7 + len(ids) / 10 for ids in completion_ids]\n")
    spec = importlib.util.spec_from_file_location("score", folder / "score.py")
    score = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(score)
    return completions, fixed_sampler, score

def trl_fixed_step(trainer_cls, config_cls, setup: Path, out: Path, score, prompts: list[dict], g: int, **args):
    """One step of TRL's ``trainer_cls`` (a subclass drawing :func:`fixed_completions`') on the module's
    transformers model: two prompts' groups of ``g`` in two micro-batches of 4, completions of at most 5 tokens,
    no KL, ``args`` to its config; tests/trl_oracles.py ``trl_step_one``'s (metrics, weight change)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.trl_oracles import trl_step_one

    tok = AutoTokenizer.from_pretrained(setup / "tok")
    model = AutoModelForCausalLM.from_pretrained(setup / "hf", attn_implementation="eager", dtype=torch.float32)
    return trl_step_one(trainer_cls, config_cls, model, out,
                        dict(reward_funcs=[score.id_score], train_dataset=Dataset.from_list(prompts),
                             processing_class=tok),
                        num_generations=g, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                        max_completion_length=5, beta=0.0, **args)
