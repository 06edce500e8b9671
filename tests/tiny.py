"""Tiny random-weight Hugging Face models and the parity metrics the tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

# family -> (transformers config class, model class, defaults on top of _BASE)
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


def make_hf(folder: Path, family: str = "llama", seed: int = 0, dtype=None, save_kwargs=None, **overrides):
    """Save a tiny random model of ``family`` (built with transformers' own config class) to ``folder``.

    ``dtype`` (a torch dtype) casts the saved weights; ``save_kwargs`` go to save_pretrained.
    Returns the fp32 (or ``dtype``) transformers model, set to eager attention.
    """
    import transformers

    cfg_name, model_name, defaults = FAMILIES[family]
    kw = {**_BASE, **defaults, **overrides}
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


# The training tests' model: a tiny Llama of SmolLM2's vocabulary (49152 ids).
SMOLLM2_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1)


def smollm2_tiny_zoo(root: Path, tokenizer: Path | None = None):
    """SmolLM2's tokenizer (from the bundled GGUF file, or copied from the folder ``tokenizer``) saved at
    ``root/tok`` and a tiny random Llama of its vocabulary (seed 0) saved at ``root/hf`` and converted to a zoo
    checkpoint at ``root/zoo``: the model the training tests share (built once per session by conftest.py's
    ``smollm2_tiny``; see :func:`copy_smollm2_tiny`). Returns the tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    from convert.source import open_source
    from zoo.cli import main as zoo_main
    from zoo.registry import bundled_gguf as smollm2_gguf

    if tokenizer is not None:
        shutil.copytree(tokenizer, root / "tok")
    else:
        open_source(str(smollm2_gguf())).save_tokenizer(root / "tok")
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    make_llama(root / "hf", vocab_size=len(tok), **SMOLLM2_TINY)
    assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    return tok


def copy_smollm2_tiny(shared: Path, root: Path, names=("tok", "hf", "zoo")):
    """Copy the session's :func:`smollm2_tiny_zoo` folders (conftest.py's ``smollm2_tiny``) into a module's own
    ``root`` (a few MB: the module may write beside them and into them). Returns the tokenizer."""
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
