"""Reward models (rm/, `reward train`): TRL 1.16 RewardTrainer's loss and metrics, the score head against
transformers' *ForSequenceClassification (convert and export), the one-line errors, and one SGD step against
RewardTrainer itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pretrain.config import load_config
from rm.config import RMConfig
from zoo.errors import UserError


@pytest.fixture(scope="module")
def reward_models(dpo_models, tmp_path_factory):
    """dpo_models' tiny policy as a transformers LlamaForSequenceClassification (its score head seeded), at
    ``hf_rm`` and converted by `zoo convert` at ``rm``. Returns (folder, dpo_models' folder, tokenizer)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from zoo.cli import main

    root, tok, _ = dpo_models
    out = tmp_path_factory.mktemp("reward_models")
    torch.manual_seed(5)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForSequenceClassification.from_pretrained(root / "hf_policy", num_labels=1, pad_token_id=pad)
    model.save_pretrained(out / "hf_rm")
    tok.save_pretrained(out / "hf_rm")
    assert main(["convert", str(out / "hf_rm"), "--out", str(out / "rm")]) == 0
    return out, root, tok


def _cfg(folder, tok_dir, out, data, *overrides) -> RMConfig:
    return load_config(None, [f"model.path={folder}", f"model.tokenizer={tok_dir}", f"data.path={data}",
                              "data.seq_len=32", "batch_size=4", "log_every=1", "checkpoint.every=100",
                              f"output_dir={out}", *overrides], RMConfig)


def test_converted_scores_equal_transformers_and_export_round_trips(reward_models, tmp_path):
    """`zoo convert` of a LlamaForSequenceClassification keeps its score head and padding id: our score of a
    prompt + answer (the last token that is not padding, in the pair layout of a training row) equals
    transformers' logits; `zoo export` writes a LlamaForSequenceClassification that loads with equal scores."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForSequenceClassification

    from prefs.batch import PairBatch
    from prefs.pairs import normalize_pair, pair_document, tokenize_pair
    from rm.task import pair_scores
    from tests.preference_data import UNEVEN_PAIRS
    from zoo.checkpoints.format import read_config
    from zoo.checkpoints.loading import load_params
    from zoo.cli import main
    from zoo.data.batching import padded, to_model_batch

    out, _, tok = reward_models
    mcfg, params = read_config(out / "rm"), load_params(out / "rm")
    assert mcfg.num_labels == 1 and "score" in params and "lm_head" not in params
    hf = AutoModelForSequenceClassification.from_pretrained(out / "hf_rm").eval()
    assert main(["export", str(out / "rm"), "--out", str(tmp_path / "exp")]) == 0
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["architectures"] == \
        ["LlamaForSequenceClassification"]
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "exp").eval()
    pairs = [tokenize_pair(normalize_pair(row), tok) for row in UNEVEN_PAIRS[:2]]
    docs = [padded(pair_document(t), 32) for t in pairs]  # both rows in one batch: one program, not one per op
    mb = PairBatch.of({k: jnp.asarray(v) for k, v in to_model_batch({k: np.stack([d[k] for d in docs])
                                                                     for k in docs[0]}).items()})
    rc, rr, _ = jax.jit(lambda p, b: pair_scores(mcfg, p, b))(params, mb)
    for i, t in enumerate(pairs):
        for ours, answer in ((rc, t.chosen), (rr, t.rejected)):
            ids = torch.tensor([np.concatenate([t.prompt, answer]).tolist()])
            for model in (hf, back):
                np.testing.assert_allclose(float(ours[i]), float(model(ids).logits[0, 0]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_reward_step_one_equals_trl_reward_trainer(reward_models, tmp_path):
    """One SGD step of `reward train` (a margin column, center_rewards_coefficient, two micro-batches, answers of
    unequal length) against one step of trl.RewardTrainer on the same LlamaForSequenceClassification: loss,
    grad_norm, min/mean/max_reward, accuracy, margin and every weight's change (the score head's too) within
    1e-5."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from pretrain.loop import train
    from rm.task import RewardTask
    from tests.preference_data import UNEVEN_PAIRS
    from tests.run_files import read_metrics, write_jsonl
    from tests.trl_oracles import SGD_STEP_ONE, assert_same_change, assert_same_metrics, exported_change, trl_step_one

    out, _, tok = reward_models
    rows = [{**r, "margin": m} for r, m in zip(UNEVEN_PAIRS, (0.5, 0.0, 1.5, -0.25))]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    model = AutoModelForSequenceClassification.from_pretrained(out / "hf_rm", dtype=torch.float32,
                                                               attn_implementation="eager")
    want, trl_change = trl_step_one(RewardTrainer, RewardConfig, model, tmp_path / "trl",
                                    dict(train_dataset=Dataset.from_list(rows), processing_class=tok),
                                    per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                    center_rewards_coefficient=0.01, learning_rate=100.0)
    cfg = _cfg(out / "rm", out / "hf_rm", tmp_path / "ours", tmp_path / "pairs.jsonl", *SGD_STEP_ONE,
               "optimizer.learning_rate=100", "grad_accum=2", "rm.center_rewards_coefficient=0.01")
    train(cfg, progress=False, task=RewardTask(cfg))
    got = read_metrics(tmp_path / "ours")[0]
    assert_same_metrics(got, want, ("loss", "grad_norm", "min_reward", "mean_reward", "max_reward", "accuracy",
                                    "margin"))
    assert_same_change(exported_change(tmp_path / "ours" / "final", out / "hf_rm", tmp_path / "exp"), trl_change)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": " b", "label": True}], "a reward model trains on preference pairs: rows need "
                                                           "'chosen' and 'rejected' fields"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c", "margin": "big"}], "line 1: field 'margin' is 'big', not a "
                                                                            "number"),
])
def test_bad_reward_rows_are_one_line(reward_models, tmp_path, rows, message):
    from rm.task import RewardTask
    from tests.run_files import write_jsonl

    out, _, tok = reward_models
    write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = _cfg(out / "rm", out / "hf_rm", tmp_path / "run", tmp_path / "bad.jsonl", "max_steps=1")
    task = RewardTask(cfg)
    with pytest.raises(UserError) as e:
        task.documents(task.load(str(tmp_path / "bad.jsonl"), cfg), tok, str(tmp_path / "bad.jsonl"), False)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_lora_reward_model_equals_trl_with_peft_and_exports_as_peft_loads_it(reward_models, tmp_path, capsys):
    """A LoRA reward model started from a causal LM: the score head trains whole beside the adapters, as peft's
    SEQ_CLS ``modules_to_save`` trains it. One SGD step against trl.RewardTrainer on a peft model whose head is
    the one our run drew: loss and every reward metric within 1e-5, and the head's change within 1e-5 (the
    adapters' own change depends on A's random draw, which differs). The adapter checkpoint reads as a reward
    model: `zoo export` writes a LlamaForSequenceClassification, and `zoo export --adapter` a SEQ_CLS adapter
    that peft loads onto the causal base with the same scores; as the reward of a LoRA GRPO run on the same base
    it reads the policy's frozen base (the base loaded once) and scores as the merged model; beside it in the same
    `grpo train` step, the converted reward model (loaded whole) scores as transformers' does."""
    import jax
    import torch
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from grpo.config import GRPOConfig
    from grpo.task import GRPOTask
    from pretrain.loop import train
    from pretrain.setup import RUN, TokenIds
    from rm.task import RewardTask
    from tests.preference_data import UNEVEN_PAIRS
    from tests.run_files import read_metrics, write_jsonl
    from tests.trl_oracles import SGD_STEP_ONE, assert_same_metrics, trl_step_one
    from zoo.checkpoints.format import read_config
    from zoo.checkpoints.loading import load_params
    from zoo.cli import main
    from zoo.model.sharding import make_mesh

    out, root, tok = reward_models
    write_jsonl(tmp_path / "pairs.jsonl", UNEVEN_PAIRS)
    lora = ("lora.rank=4", "lora.alpha=8", "lora.targets=q_proj,v_proj")
    cfg = _cfg(root / "policy", root / "tok", tmp_path / "ours", tmp_path / "pairs.jsonl", *SGD_STEP_ONE,
               "optimizer.learning_rate=100", "grad_accum=2", *lora)
    task = RewardTask(cfg)
    # The head our run draws (its starting point, from the run's seed), given to the torch model.
    _, drawn = task.adapt_model(read_config(root / "policy"), load_params(root / "policy"), make_mesh(), RUN,
                                TokenIds.of(tok), cfg.seed)
    head0 = np.asarray(jax.device_get(drawn["score"]), np.float64)
    train(cfg, progress=False, task=task)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForSequenceClassification.from_pretrained(root / "hf_policy", num_labels=1, pad_token_id=pad,
                                                               dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        model.score.weight.copy_(torch.tensor(head0.T))
    peft_model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                  target_modules=["q_proj", "v_proj"]))
    want, trl_change = trl_step_one(RewardTrainer, RewardConfig, peft_model, tmp_path / "trl",
                                    dict(train_dataset=Dataset.from_list(UNEVEN_PAIRS), processing_class=tok),
                                    per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=100.0)
    assert_same_metrics(read_metrics(tmp_path / "ours")[0], want,
                        ("loss", "min_reward", "mean_reward", "max_reward", "accuracy", "margin"))

    final = tmp_path / "ours" / "final"
    assert main(["export", str(final), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    head_change = merged.score.weight.detach().numpy().astype(np.float64) - head0.T
    trl_head = trl_change["base_model.model.score.modules_to_save.default.weight"]
    assert np.abs(trl_head).max() > 0
    np.testing.assert_allclose(head_change, trl_head, rtol=0, atol=1e-5 * np.abs(trl_head).max())

    assert main(["export", str(final), "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    assert "AutoModelForSequenceClassification" in (tmp_path / "adapter" / "README.md").read_text()
    base = AutoModelForSequenceClassification.from_pretrained(root / "hf_policy", num_labels=1, pad_token_id=pad)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    texts = [r["prompt"] + r["chosen"] for r in UNEVEN_PAIRS]
    np.testing.assert_allclose(_hf_scores(loaded, tok, texts), _hf_scores(merged, tok, texts), rtol=1e-5, atol=1e-5)

    # As a GRPO reward of a LoRA policy on the same base: only its adapters load, beside the policy's frozen base,
    # and each completion's reward is the merged model's score; the whole converted reward model (rm_rm) beside it
    # scores each completion as transformers' LlamaForSequenceClassification does.
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "colour red:"}, {"prompt": "the cat"}])
    grpo = load_config(None, [f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}",
                              f"data.path={tmp_path / 'p.jsonl'}", "data.seq_len=8", "batch_size=4", "lora.rank=2",
                              "grpo.num_generations=2", "grpo.max_completion_length=4",
                              f"grpo.rewards=[rm:{final},rm:{out / 'rm'}]",
                              "max_steps=1", "grpo.log_completions_every=1", f"output_dir={tmp_path / 'grpo'}"],
                       GRPOConfig)
    capsys.readouterr()
    train(grpo, task=GRPOTask(grpo), progress=False)
    assert "its LoRA adapters over the policy's frozen base (not loaded twice)" in capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()]
    texts = [r["prompt"] + r["completion"] for r in rows]
    assert len(rows) == 4
    np.testing.assert_allclose([r["rewards"]["rm_ours"] for r in rows], _hf_scores(merged, tok, texts),
                               rtol=1e-4, atol=1e-5, err_msg="rm_ours: the LoRA reward model")
    hf = AutoModelForSequenceClassification.from_pretrained(out / "hf_rm").eval()
    np.testing.assert_allclose([r["rewards"]["rm_rm"] for r in rows], _hf_scores(hf, tok, texts),
                               rtol=1e-4, atol=1e-5, err_msg="rm_rm: the converted reward model")


def _hf_scores(model, tok, texts: list[str]) -> np.ndarray:
    """transformers' scores of texts as TRL's GRPOTrainer scores a reward model's inputs: no added special
    tokens, right-padded."""
    inputs = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    return model(**inputs).logits[:, 0].detach().numpy()


def test_grpo_reward_model_scores_completions_as_trl_does(reward_models, tmp_path):
    """grpo.rewards ["rm:PATH"]: the reward model, loaded once on the mesh, scores plain and conversational
    prompt + completion texts as transformers' LlamaForSequenceClassification does on TRL's inputs; a causal LM
    named as a reward model is one line."""
    import jax.numpy as jnp
    from transformers import AutoModelForSequenceClassification

    from grpo.rewards import load_rewards
    from zoo.model.sharding import make_mesh

    out, root, tok = reward_models
    rewards = load_rewards([f"rm:{out / 'rm'}"])
    assert rewards.names == ["rm_rm"]
    rewards.prepare(make_mesh(), jnp.float32)
    hf = AutoModelForSequenceClassification.from_pretrained(out / "hf_rm").eval()
    prompts = ["colour red:", "the cat", "colour blue: and then"]
    completions = [" red", " sat on the mat", " blue blue"]
    per_fn, total = rewards.compute(prompts, completions, [[1]] * 3, {}, lambda r: f"row {r}")
    np.testing.assert_allclose(total, _hf_scores(hf, tok, [p + c for p, c in zip(prompts, completions)]),
                               rtol=1e-4, atol=1e-5)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    answers = [[{"role": "assistant", "content": c.strip()}] for c in completions]
    _, chat_total = rewards.compute(chats, answers, [[1]] * 3, {}, lambda r: f"row {r}")
    texts = [tok.apply_chat_template(p + a, tokenize=False) for p, a in zip(chats, answers)]
    np.testing.assert_allclose(chat_total, _hf_scores(hf, tok, texts), rtol=1e-4, atol=1e-5)
    with pytest.raises(UserError) as e:
        load_rewards([f"rm:{root / 'policy'}"])
    assert "is a causal LM, not a reward model" in str(e.value) and "\n" not in str(e.value)


def test_grpo_reward_model_whose_layers_cannot_split_over_mesh_context_is_one_line(reward_models):
    """A reward model scores on the run's mesh, whose context axis set-up checked against the policy only: a
    reward model with linear-attention layers (Qwen3-Next's, a state carried along the sequence) on a mesh that
    splits the sequence is refused when the rewards are prepared, one line naming the grpo.rewards entry."""
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from grpo.rewards import load_rewards
    from zoo.model.from_hf import model_config_from_hf

    out, _, _ = reward_models
    rewards = load_rewards([f"rm:{out / 'rm'}"])
    (scorer,) = [rf.fn for rf in rewards.functions]
    scorer.mcfg = model_config_from_hf({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32})
    with pytest.raises(UserError) as e:
        rewards.prepare(AbstractMesh((1, 2), ("data", "context")), jnp.float32)
    assert str(e.value) == (f"grpo.rewards entry 'rm:{scorer.path}': mesh.context: 2 splits the sequence, but the "
                            "linear-attention layers (0, 1, 2) carry a state along it and cannot run split; set "
                            "mesh.context to 1")
