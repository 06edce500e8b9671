"""What the tests share: tiny random-weight Hugging Face models, the small-vocabulary tokenizer and model of the
training tests, parity metrics, subprocess runners, fake Hub and cache layouts, and tokenizer checks.

Test modules import from here (and conftest.py's fixtures), never from one another."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from safetensors import safe_open

import zoo
from zoo.checkpoints.adapter import adapter_meta
from zoo.checkpoints.format import read_meta
from zoo.checkpoints.writer import CheckpointWriter, save_params
from zoo.lora.adapters import LoraConfig, init_lora, lora_scale, lora_specs
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward
from zoo.model.params import flatten, nest, param_specs

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

# Families whose tiny models set their own token ids: the config classes' defaults (SmolLM3's pad id 128004,
# Phi-3's 32000) lie past the tiny vocabulary, where torch refuses a padding index. A config generated from the
# model alone (no source config.json) has the defaults: token ids are not architecture.
OWN_TOKEN_IDS = {"smollm3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                 "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)}


# family -> (transformers config class, model class, defaults on top of BASE)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7, num_hidden_layers=3)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, num_hidden_layers=4, sliding_window=7, query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, num_hidden_layers=7, sliding_window=7, query_pre_attn_scalar=24,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
        + ["full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=6.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=7, max_window_layers=1, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=2,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # Gemma 4 (text): wider full-layer heads with one key/value head, per-layer inputs, the last 3 layers reusing
    # keys/values (MLP doubled), proportional partial RoPE on full layers; tests/test_gemma4.py has its MoE variant.
    # Per-layer inputs 16 wide: at 8, the RMS norm of each layer's projected input amplified float32 rounding to
    # 1.1-1.3e-5 between cached decoding and the full forward (tests/test_decode.py bounds it at 1e-5); 4.5e-6 here.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=6,
        sliding_window=7, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=96, num_kv_shared_layers=3,
        use_double_wide_mlp=True, final_logit_softcapping=6.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}})),
    # Layer 1 dense (mlp_only_layers) between MoE layers 0 and 2.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1000000.0)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        num_nextn_predict_layers=0)),
    # Alternating sliding (window 7) and full layers, sinks, biased router and experts, YaRN without truncation.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=7, swiglu_limit=1.5, router_aux_loss_coef=0.02,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    # NoPE every 2nd layer (layer 1 of 3), tied embeddings.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        no_rope_layer_interval=2, rope_theta=50000.0, **OWN_TOKEN_IDS["smollm3"])),
    # Post-norm blocks, full-width q/k norms.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=500000.0)),
    # OLMo 3: sliding layers (window 7) around a full one, YaRN on the full layer only.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=7, rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                               "original_max_position_embeddings": 32, "attention_factor": 1.2},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    # Phi-4-mini's shape of attention: fused qkv/gate_up, partial rotary (12 of 16), LongRoPE (its short factors
    # up to 24 positions, the long ones past), sliding window (16) on every layer.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=True, max_position_embeddings=256, original_max_position_embeddings=24,
        sliding_window=16, **OWN_TOKEN_IDS["phi3"], rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.2, 1.0, 1.5], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            "original_max_position_embeddings": 24})),
}

def randomize(model) -> None:
    """Larger-than-default weights (and non-trivial norms/biases) give peaked distributions,
    so KL and argmax comparisons actually discriminate."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma-style norms scale by (1 + w) and start at w = 0: randomize around that.
                base = 0.0 if torch.all(p == 0) else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 selection bias
                buf.copy_(0.1 * torch.randn_like(buf))
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (a buffer, saved)
                buf.copy_(1.0 + 0.2 * torch.randn_like(buf))


def make_hf(folder: Path, family: str = "llama", seed: int = 0, dtype=None, save_kwargs=None, **overrides):
    """Save a tiny random model of ``family`` (built with transformers' own config class) to ``folder``.

    ``dtype`` (a torch dtype) casts the saved weights; ``save_kwargs`` go to save_pretrained.
    Returns the fp32 (or ``dtype``) transformers model, set to eager attention.
    """
    import transformers

    cfg_name, model_name, defaults = FAMILIES[family]
    kw = {**BASE, **defaults, **overrides}
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).eval()
    model.config._attn_implementation = "eager"
    randomize(model)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **(save_kwargs or {}))
    return model


def make_llama(folder: Path, seed: int = 0, dtype=None, save_kwargs=None, **overrides):
    """A tiny random LlamaForCausalLM saved to ``folder`` (see :func:`make_hf`)."""
    return make_hf(folder, "llama", seed, dtype, save_kwargs, **overrides)


# The training tests' model: a tiny Llama of a 512-id tokenizer (tiny_lm_zoo): its head and loss cost next to
# nothing, where SmolLM2's 49152-id vocabulary made them most of every step.
TINY_LM = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1)
TINY_VOCAB = 512
# Words the training tests write, so that the small vocabulary spells them in a few tokens each.
TINY_WORDS = ("the a cat dog sat ran on under mat log red blue big small quickly slowly and then green yellow black "
              "white circle square triangle star colour color Repeat What is Answer with just number name age city "
              "You are careful assistant. Read user's repeat it twice, nothing else.")


def small_vocab_tokenizer(folder: Path, like: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` ids saved at ``folder`` as a transformers tokenizer folder:
    trained (the `tokenizers` library; deterministic) on the demo's data (demo/data/*.jsonl) and TINY_WORDS, with
    the special tokens (same ids), pre-tokenizer, decoder, tokenizer settings and chat template of the tokenizer
    folder ``like`` (SmolLM2's), so chat templates, special tokens and byte-level decoding behave as with it."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    def strings(x):
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict | list):
            for v in x.values() if isinstance(x, dict) else x:
                yield from strings(v)

    real = Tokenizer.from_file(str(like / "tokenizer.json"))
    added = json.loads((like / "tokenizer.json").read_text())["added_tokens"]
    specials = [t["content"] for t in sorted(added, key=lambda t: t["id"])]
    assert [t["id"] for t in added] == list(range(len(added)))  # they keep their ids: the first ones
    texts = [TINY_WORDS] * 100
    for data in sorted((Path(__file__).resolve().parent.parent / "demo" / "data").glob("*.jsonl")):
        for line in data.read_text().splitlines():
            texts.extend(strings(json.loads(line)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder, tok.post_processor = real.pre_tokenizer, real.decoder, real.post_processor
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.get_vocab_size() == vocab_size
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (like / name).is_file():
            shutil.copy(like / name, folder / name)


def tiny_lm_zoo(root: Path, like: Path):
    """The small-vocabulary tokenizer (:func:`small_vocab_tokenizer`, shaped like the tokenizer folder ``like``)
    saved at ``root/tok`` and a tiny random Llama of its vocabulary (TINY_LM, seed 0) saved at ``root/hf`` and
    converted to a zoo checkpoint at ``root/zoo``: the model the training tests share (built once per session by
    conftest.py's ``tiny_lm``; see :func:`copy_tiny_lm`). Returns the tokenizer."""
    from transformers import AutoTokenizer

    from zoo.cli import main as zoo_main

    small_vocab_tokenizer(root / "tok", like)
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    make_llama(root / "hf", vocab_size=len(tok), **TINY_LM)
    assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    return tok


def copy_tiny_lm(shared: Path, root: Path, names=("tok", "hf", "zoo")):
    """Copy the session's :func:`tiny_lm_zoo` folders (conftest.py's ``tiny_lm``) into a module's own ``root``
    (a few hundred KB: the module may write beside them and into them). Returns the tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(shared / name, root / name)
    return AutoTokenizer.from_pretrained(str(root / "tok"))


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """transformers' fp32 logits for int tokens [batch, seq]."""
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax in float64."""
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kl(ref: np.ndarray, got: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(got))."""
    lp, lq = log_softmax(ref), log_softmax(got)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def random_tokens(vocab: int, batch: int = 2, seq: int = 48, seed: int = 0) -> np.ndarray:
    """Random int32 token ids."""
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq)).astype(np.int32)


def kill_midway(args: list[str], folder: Path, pattern: str, timeout: float = 120) -> bool:
    """Run `zoo ARGS` and SIGKILL it as soon as ``folder.glob(pattern)`` matches.

    Returns whether the match was seen (i.e. the command had started writing).
    """
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    # Polled (the files appear in another process; 20 ms apart), and no longer than the command runs.
    while time.time() < deadline and not list(folder.glob(pattern)) and proc.poll() is None:
        time.sleep(0.02)
    seen = bool(list(folder.glob(pattern)))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return seen


# `<command> ARGS` (the console script of CLI_MODULE) that SIGKILLs itself once the checkpoint of step ARGV[1] is
# complete on disk (orbax saves asynchronously: it waits for that one first), as `kill -9` from outside would,
# but exactly then (no polling). Run it as `python -c kill_after_checkpoint("dpo.cli") STEP ARGS...`.
_KILL_AFTER_CHECKPOINT = r"""
import os, signal, sys
import orbax.checkpoint as ocp
at, real = int(sys.argv[1]), ocp.CheckpointManager.save

def save(self, step, *a, **k):
    saved = real(self, step, *a, **k)
    if saved and step == at:
        self.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
    return saved

ocp.CheckpointManager.save = save
from {module} import main
sys.exit(main(sys.argv[2:]))
"""


def kill_after_checkpoint(cli_module: str) -> str:
    """The script (for ``python -c``) that runs ``cli_module``'s ``main`` and SIGKILLs itself after the checkpoint
    of the step given as its first argument is on disk."""
    return _KILL_AFTER_CHECKPOINT.format(module=cli_module)


def write_adapter_checkpoint(base: Path, out: Path, lora_cfg: LoraConfig, seed: int = 0) -> Path:
    """An adapter checkpoint of ``base`` laid out as pretrain/final.py writes one, with B random too."""
    cfg = zoo.read_config(base)
    flat = {p: np.asarray(v) for p, v in flatten(init_lora(cfg, lora_cfg, jax.random.key(seed))).items()}
    rng = np.random.RandomState(seed)
    # init_lora's B is zero (the adapter would change nothing); a random B makes every delta count.
    flat = {p: v if p.endswith(".a") else rng.normal(0.0, 0.1, v.shape).astype(v.dtype) for p, v in flat.items()}
    specs = lora_specs(cfg, lora_cfg)
    out.mkdir()
    stored = save_params(out, nest(flat), {p: s.axes for p, s in specs.items()})
    writer = CheckpointWriter(out)
    writer.adopt(read_meta(base)["params"])
    writer.finish(cfg, source=str(base), source_format="train", training={"method": "sft", "steps": 3},
                  lora=adapter_meta(lora_cfg, base, stored))
    return out


MIXED = (
    "Hello, world! The café's crème brûlée costs €12.50 — naïve façade.\n"
    "日本語のテキストと한국어 문장, Ελληνικά και русский текст. Emoji: 😀🚀👍🏽\n"
    "    indented code: def f(x): return x**2  # comment\n\ttabs\tand\r\nCRLF lines...\n"
    "Numbers 1234567 and 3.14159, URLs https://example.com/a?b=c&d=e, don't won't I'm we'll.\n"
    "<|im_start|>special tokens inline<|im_end|> and <|endoftext|> too; <repo_name> user tokens.\n"
    "   leading spaces, trailing spaces   \n\n\nmultiple blank lines"
)


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one word."},
    {"role": "user", "content": "What colour is the sky on a clear day?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass? Ünïcödé, please 😀"},
]


def assert_same_tokenizer(ours, ref, text: str, conversation=None):
    assert len(text) >= 200
    assert ours(text)["input_ids"] == ref(text)["input_ids"]
    ids = ref(text)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert len(ours) == len(ref)
    if conversation is not None:
        for gen in (False, True):
            a = ours.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
            b = ref.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
            assert a == b
            assert ours(a, add_special_tokens=False)["input_ids"] == ref(b, add_special_tokens=False)["input_ids"]
            assert ours.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=True) == \
                ref.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=True)


SPM_WORDS = ("the quick brown fox jumps over lazy dog hello world tokenizer pieces merge merges byte fallback "
          "lower upper case numbers one two three système naïve").split()


def spm_pieces(words) -> list[str]:
    """Every substring of each "\u2581word", shortest first: a sentencepiece vocabulary that spells the words."""
    pieces: list[str] = []
    for word in words:
        w = "\u2581" + word
        for n in range(1, len(w) + 1):
            for i in range(len(w) - n + 1):
                if w[i:i + n] not in pieces:
                    pieces.append(w[i:i + n])
    return sorted(pieces, key=lambda p: (len(p), p))


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, BYTE (gguf.TokenType)
    pieces = spm_pieces(SPM_WORDS)
    tokens += pieces + ["<|user|>"]
    types += [1] * len(pieces) + [4]  # NORMAL, USER_DEFINED
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    return tokens, scores, types


def hf_tensors(folder):
    """name -> (dtype string, raw bytes) of every tensor in a HF folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                out[name] = (str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return out


def lay_out_hf_cache(cache: Path, repo_id: str, files_dir: Path, revision: str = "0" * 40) -> None:
    """Write the layout huggingface_hub's cache uses: blobs by hash, snapshot symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in files_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def zoo_offline(args, cache: Path):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("HF_HOME", None)
    return subprocess.run([sys.executable, "-m", "zoo.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def devices_env(n: int) -> dict[str, str]:
    """The environment of a subprocess that simulates ``n`` CPU devices, keeping the suite's other XLA flags."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={n}"]),
            "JAX_PLATFORMS": "cpu"}


TEST_ONLY = ("torch", "peft", "trl", "accelerate", "bitsandbytes")


REPO = Path(__file__).resolve().parent.parent


def saved_residuals(f, *args) -> list[tuple[tuple[int, ...], str]]:
    """(shape, source) of what autodiff keeps for f's backward pass, from JAX's public printout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    rows = [re.match(r"\w+\[([\d,]*)\] (.*)", line) for line in out.getvalue().splitlines()]
    assert rows and all(rows), out.getvalue()
    return [(tuple(int(d) for d in m.group(1).split(",") if d), m.group(2)) for m in rows]


def count_eqns(jaxpr) -> int:
    """Equations in a jaxpr, including those of nested jaxprs (scan bodies, pjit calls)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                n += count_eqns(inner)
    return n


TOKEN = "hf_fake_secret_token_123"


def zoo_export(tmp_path: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """Run `zoo export ARGS` in a fresh interpreter pointed at ``endpoint``; TMPDIR is tmp_path/'tmp'."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_")) and k != "TRANSFORMERS_OFFLINE"}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update(
        HF_ENDPOINT=endpoint, HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf_home"), JAX_PLATFORMS="cpu",
        TMPDIR=str(tmp_path / "tmp"), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
    )
    return subprocess.run(
        [sys.executable, "-m", "zoo.cli", "export", *args], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )


def assert_token_not_leaked(proc: subprocess.CompletedProcess) -> None:
    assert TOKEN not in proc.stdout
    assert TOKEN not in proc.stderr


def tiny_config(family: str = "llama", **overrides):
    """A tiny ModelConfig of ``family``, from transformers-style config fields."""
    from zoo.model.from_hf import model_config_from_hf

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = {"llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
          "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
          "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                          num_experts_per_tok=2, intermediate_size=32)}[family]
    return model_config_from_hf({**base, **hf, **overrides})


def quantized_projections(cfg, flat: dict) -> dict:
    """``flat`` with every zoo.model.quant.quantized_paths projection quantized (NF4, double quantization)."""
    from zoo.model import quant

    paths = quant.quantized_paths(cfg)
    return {k: quant.quantize(np.asarray(v), *paths[k], "nf4", True) if k in paths else v for k, v in flat.items()}


# --- the DPO tests' data and configuration (tests/test_dpo*.py; conftest.py's dpo_models) ---------------------

DPO_COLORS = "red blue green yellow black white".split()


def dpo_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` preference rows: the prompt names a colour, the chosen answer repeats it, the rejected one another."""
    rng = np.random.RandomState(seed)
    rows = []
    for _ in range(n):
        c, o = rng.choice(DPO_COLORS, 2, replace=False)
        rows.append({"prompt": f"colour {c}:", "chosen": f" {c} {c}", "rejected": f" {o} {o}"})
    return rows


def write_jsonl(path, rows):
    """Write ``rows`` as JSON lines at ``path``; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_cfg(root, out, *overrides, data="prefs.jsonl"):
    """The DPO tests' config: the policy and tokenizer of dpo_models' folder ``root``, its ``data``, out at ``out``."""
    from dpo.config import DPOConfig
    from pretrain.config import load_config

    return load_config(None, [f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}",
                              f"data.path={root / data}", "data.seq_len=32", "batch_size=4",
                              "schedule.name=constant", "log_every=1", "checkpoint.every=100",
                              f"output_dir={out}", *overrides], DPOConfig)


def read_metrics(out) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def hf_logps(model, prompt: list[int], answer: list[int]) -> float:
    """transformers' summed log-probability of ``answer`` after ``prompt`` (float64)."""
    lp = log_softmax(hf_logits(model, np.asarray([prompt + answer]))[0])
    return float(sum(lp[len(prompt) - 1 + j, a] for j, a in enumerate(answer)))


# Preference rows whose answers have unequal lengths (a mean of per-pair means differs from a token mean).
UNEVEN_PAIRS = [{"prompt": "colour red:", "chosen": " red", "rejected": " blue blue blue blue"},
                {"prompt": "colour green:", "chosen": " green green green", "rejected": " black"},
                {"prompt": "colour white:", "chosen": " white white", "rejected": " yellow yellow yellow"},
                {"prompt": "colour blue:", "chosen": " blue blue blue blue blue", "rejected": " red red"}]

DPO_LORA = ("lora.rank=8", "lora.alpha=16")


# --- the LoRA tests' models (tests/test_lora.py and its 8-device child process) -------------------------------

LORA_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                 head_dim=16)
LORA_CONFIGS = {
    "llama": ModelConfig(family="llama", **LORA_BASE),
    # Gemma 2: (1 + w) norms, post norms, soft-caps, tied embeddings, and (sliding, full) blocks, so the
    # adapters are sliced with period 2 like their weights.
    "gemma2": ModelConfig(family="gemma2", **{**LORA_BASE, "num_layers": 4}, norm_offset=1.0, embed_scale=True,
                          post_norms=True, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                          attn_softcap=4.0, final_softcap=6.0, sliding_window=7, tie_word_embeddings=True,
                          layer_types=("sliding", "full") * 2),
    "mixtral": ModelConfig(family="mixtral", **LORA_BASE, num_experts=4, experts_per_token=2,
                           moe_intermediate_size=48),
    # DeepSeek-V3-like: MLA attention (no adapters), a dense first layer, shared experts, sigmoid routing.
    "deepseek": ModelConfig(family="deepseek_v3", **{**LORA_BASE, "num_kv_heads": 4}, num_experts=8,
                            experts_per_token=2, moe_intermediate_size=16, shared_experts=1, dense_layers=1,
                            router_score="sigmoid", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8),
}
LORA_TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, 96, (2, 12)), jnp.int32)


@functools.cache
def lora_base_params(cfg: ModelConfig) -> dict:
    """Random base weights ~ N(0, 0.02) (drawn with NumPy: jax.random compiles a kernel per shape, slowly)."""
    rng = np.random.RandomState(0)
    flat = {path: jnp.asarray(rng.normal(0, 0.02, spec.shape) if spec.init == "normal" else
                              np.full(spec.shape, 1.0 if spec.init == "ones" else 0.0), jnp.float32)
            for path, spec in sorted(param_specs(cfg).items())}
    return nest(flat)


def random_lora(cfg: ModelConfig, lc: LoraConfig, random: bool = False) -> dict:
    """Fresh adapters (B = 0), or with ``random`` every A and B random non-zero (a zero B hides most mistakes)."""
    lora = init_lora(cfg, lc, jax.random.key(1))
    if not random:
        return lora
    rng = np.random.RandomState(2)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.1, a.shape), jnp.float32), lora)


def lora_lm_loss(cfg, params, lora, lcfg, tokens, remat="none"):
    """Next-token cross-entropy (mean) of the model with adapters ``lora`` on ``tokens`` (tests/test_quant_model.py)."""
    logits = forward(cfg, params, tokens, lora=lora, lora_scale=lora_scale(lcfg), remat=remat)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


def keep_compiled_text(monkeypatch) -> list[str]:
    """The HLO text of every program ``zoo.compiled.compiler.compile_lowered`` compiles from here on (appended as
    each is compiled), for tests that read what the TPU compiler made of a step."""
    import zoo.compiled.compiler as step

    texts: list[str] = []
    compile_lowered = step.compile_lowered

    def keep(*args, **kwargs):
        compiled = compile_lowered(*args, **kwargs)
        texts.append(compiled.as_text())
        return compiled

    monkeypatch.setattr(step, "compile_lowered", keep)
    return texts


def beside(shared: Path, folder: Path) -> Path:
    """``folder`` with ``hf`` and ``zoo`` linked to the shared ``shared/hf`` and ``shared/zoo`` (conftest.py's
    ``tiny_family``), for tests that write their outputs beside the model's folders."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("hf", "zoo"):
        (folder / name).symlink_to(shared / name, target_is_directory=True)
    return folder


# --- one step against TRL's own trainer (issue 44's end-to-end checks) -------------------------------------------

# Our side of a step-1 comparison: one plain SGD step at learning rate 1, no momentum, clipping or decay, so the
# step's weight change is minus the gradient.
SGD_STEP_ONE = ("max_steps=1", "optimizer.name=sgd", "optimizer.b1=0", "optimizer.grad_clip=0",
                "optimizer.learning_rate=1.0", "optimizer.weight_decay=0", "schedule.name=constant")


def trl_step_one(trainer_cls, args_cls, model, out: Path, trainer_kwargs: dict, **args_kwargs
                 ) -> tuple[dict, dict[str, np.ndarray]]:
    """One step of TRL's ``trainer_cls`` on the torch ``model`` (CPU, float32), as SGD_STEP_ONE does ours: returns
    the metrics TRL logs at step 1 and the step's weight change per tensor name (minus the gradient).

    ``trainer_kwargs`` go to the trainer (train_dataset, processing_class, ref_model, ...), ``args_kwargs`` to its
    config (beta, per_device_train_batch_size, gradient_accumulation_steps, ...)."""
    import torch

    before = {k: v.detach().to(torch.float64).clone() for k, v in model.state_dict().items()}
    settings = dict(output_dir=str(out), max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                    max_grad_norm=0.0, weight_decay=0.0, warmup_steps=0, logging_steps=1, report_to=[],
                    use_cpu=True, save_strategy="no", seed=0, bf16=False, disable_tqdm=True)
    trainer = trainer_cls(model=model, args=args_cls(**{**settings, **args_kwargs}), **trainer_kwargs)
    trainer.train()
    change = {k: (v.detach().to(torch.float64) - before[k]).numpy() for k, v in model.state_dict().items()}
    return trainer.state.log_history[0], change


def exported_change(final: Path, before: Path, out: Path, *export_args: str) -> dict[str, np.ndarray]:
    """The weight change of our run, per Hugging Face tensor name: the run's ``final`` checkpoint exported with
    `zoo export` (plus ``export_args``) into ``out``, minus the safetensors of the folder ``before``."""
    from zoo.cli import main

    assert main(["export", str(final), "--out", str(out), "--overwrite", *export_args]) == 0
    from safetensors.numpy import load_file

    def tensors(folder: Path) -> dict[str, np.ndarray]:
        return {k: v.astype(np.float64) for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    after, start = tensors(out), tensors(before)
    return {k: after[k] - start[k] for k in after}


def assert_same_change(ours: dict[str, np.ndarray], trl: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    """Every tensor's step-1 change (minus the gradient) equals TRL's within ``rtol`` of its largest entry."""
    assert ours and set(ours) <= set(trl), sorted(set(ours) - set(trl))
    moved = 0
    for k, d in ours.items():
        scale = float(np.abs(trl[k]).max())
        moved += scale > 0
        np.testing.assert_allclose(d, trl[k], rtol=0, atol=rtol * max(scale, 1e-12), err_msg=k)
    assert moved, "no tensor moved: the comparison would pass on a step that did nothing"


def assert_same_metrics(ours: dict, trl: dict, names, operands: dict | None = None) -> None:
    """Each named step metric of ours equals TRL's logged one within 1e-5: relative to the metric, or, for a metric
    that is a difference of larger numbers (``operands[name]``: their magnitude; DPO's rewards are beta times a
    log-probability sum minus another), relative to those, since float32 sums of them agree to about 1e-7 of
    their size and a small difference inherits that error (atol 1e-7 at least, for values near 0)."""
    for k in names:
        atol = max(1e-7, 1e-5 * abs(float((operands or {}).get(k, 0.0))))
        np.testing.assert_allclose(float(ours[k]), float(trl[k]), rtol=1e-5, atol=atol, err_msg=k)


def reward_operands(metrics: dict, beta: float) -> dict[str, float]:
    """The magnitudes DPO-style rewards are differences of: beta x each answer's summed log-probability
    (``logps/*``), for :func:`assert_same_metrics`."""
    scale = beta * max(abs(float(metrics["logps/chosen"])), abs(float(metrics["logps/rejected"])))
    return {k: scale for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")}


# --- a forward pass replaced by a lookup (the preference tests' NumPy transcriptions through the real step) --------

from prefs.batch import KTOBatch  # noqa: E402


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LookupRows(KTOBatch):
    """Pair-layout rows (DPO's, or KTO's with ``label``) carrying fixed per-token numbers that
    :func:`lookup_batch_logps` reads in place of a forward pass."""

    fake_logps: Any
    fake_coef: Any
    fake_logits: Any


def lookup_batch_logps(mcfg, params, mb, remat="none", **kw):
    """zoo.model.logps.batch_logps with the forward pass replaced by the batch's fixed per-token log-probabilities,
    moved by the one parameter ``b`` along ``fake_coef`` (its mean logits: ``fake_logits``)."""
    return mb["fake_logps"] + params["b"] * mb["fake_coef"], mb["fake_logits"], None
