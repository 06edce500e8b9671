"""The checks the model-family test modules share (tests/test_families_2026_moe.py, test_qwen3_next.py,
test_qwen35.py, test_deepseek_v32.py, test_llama4.py): a tiny family's converted model, loaded once per process;
logits against transformers; the HF -> zoo -> HF round trip; a generated config; greedy KV-cache decoding against
``generate``; peft loading exported adapters; QLoRA's gradients against LoRA's on the dequantized weights.

Test modules must not import each other: what two of them ran alike lives here, once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

import zoo
from tests.hf_models import hf_logits, hf_tensors, mean_kl, random_tokens
from zoo.cli import main


class Converted(NamedTuple):
    """A tiny family's transformers model, its saved folder, the zoo checkpoint and the loaded zoo model."""

    hf: Any
    folder: Path
    ckpt: Path
    model: Any


_LOADED: dict[Path, Any] = {}


def converted(tiny_family: Any, family: str) -> Converted:
    """conftest.py's ``tiny_family(family)`` with its zoo checkpoint loaded, once per process (the modules that
    test a family share one loaded model, read-only)."""
    hf, root = tiny_family(family)
    if root / "zoo" not in _LOADED:
        _LOADED[root / "zoo"] = zoo.load(root / "zoo")
    return Converted(hf, root / "hf", root / "zoo", _LOADED[root / "zoo"])


def tiny_config(family: str, **overrides: Any) -> Any:
    """The zoo ModelConfig of tests/hf_models.py FAMILIES' tiny ``family`` with transformers-style ``overrides``
    (fewer layers, other kinds), read as a conversion reads config.json: no model built, nothing converted."""
    import transformers

    from tests.hf_models import BASE, FAMILIES
    from zoo.model.from_hf import model_config_from_hf

    config_class, model_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**BASE, **fields, **overrides})
    return model_config_from_hf({**config.to_dict(), "architectures": [model_class]})


def assert_logits_match(hf: Any, model: Any, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The zoo model's logits over ``seq`` random tokens are transformers' (1e-4, KL 1e-6), and peaked enough
    (std above 0.5) for the comparison to have teeth. Returns (the tokens, transformers' logits)."""
    tokens = random_tokens(hf.config.vocab_size, seq=seq)
    ref = hf_logits(hf, tokens)
    got = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5  # peaked enough for the comparison to have teeth
    return tokens, ref


def assert_round_trip(folder: Path, ckpt: Path, out: Path) -> None:
    """`zoo export` of ``ckpt`` to ``out`` gives ``folder``'s tensors bit for bit and its config (dtypes aside)."""
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert hf_tensors(folder) == hf_tensors(out)
    a = json.loads((folder / "config.json").read_text())
    b = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in a.items() if "dtype" not in k} == {k: v for k, v in b.items() if "dtype" not in k}


def exported_from_generated_config(ckpt: Path, tmp_path: Path) -> Any:
    """transformers' model (float32, eager attention) of ``ckpt`` exported without its source config.json:
    export writes one from the zoo config."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(ckpt, tmp_path / "zoo", ignore=shutil.ignore_patterns("hf_config.json"))
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    return back


def assert_greedy_cached_equals_generate(hf: Any, model: Any) -> None:
    """Greedy decoding through the KV cache (a prefill of a ragged pair of rows, 7 and 3 tokens in 9 slots of
    96, then one token a step) gives transformers' generate's 12 tokens for the first row."""
    from zoo.model.decode import forward_cached_jit, init_cache

    cfg, params = model.cfg, model.param_dict()
    prompt = random_tokens(cfg.vocab_size, batch=1, seq=7, seed=2)
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           pad_token_id=0)[0, 7:].tolist()
    toks, valid = np.zeros((2, 9), np.int32), np.zeros((2, 9), bool)
    toks[0, :7], valid[0, :7] = prompt[0], True  # row 1: another prompt, 3 tokens
    toks[1, :3], valid[1, :3] = prompt[0, :3], True
    logits, cache = forward_cached_jit(cfg, params, jnp.asarray(toks), init_cache(cfg, 2, 96), jnp.asarray(valid))
    got = [int(np.argmax(np.asarray(logits)[0, 6]))]
    while len(got) < 12:
        step = jnp.asarray([[got[-1]], [1]], jnp.int32)
        logits, cache = forward_cached_jit(cfg, params, step, cache, jnp.ones((2, 1), bool))
        got.append(int(np.argmax(np.asarray(logits)[0, 0])))
    assert got == want


def assert_peft_loads_our_adapters(folder: Path, ckpt: Path, tmp_path: Path, targets: list[str]) -> dict:
    """An adapter checkpoint of ``ckpt`` (LoRA rank 4 on ``targets``, B random) exported with `zoo export
    --adapter`: peft loads every key into ``folder``'s transformers model and gives our logits (1e-4), which the
    adapter moves by far more (0.1). Returns the exported adapter_config.json."""
    from tests.lora_fixtures import peft_logits_against_ours, write_adapter_checkpoint
    from zoo.lora.params import LoraConfig

    adapter = write_adapter_checkpoint(ckpt, tmp_path / "adapter", LoraConfig(rank=4, alpha=8.0, targets=targets))
    assert main(["export", str(adapter), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    diff, teeth = peft_logits_against_ours(folder, adapter, tmp_path / "peft")
    assert teeth > 0.1 and diff <= 1e-4, (diff, teeth)
    return config


def assert_qlora_equals_lora(cfg: Any, lc: Any, seq: int, quantized: set[str], base_grads: bool = False
                             ) -> tuple[dict, dict | None]:
    """QLoRA over NF4 weights with double quantization (every projection zoo.model.quant quantizes; random
    weights, std 0.1) against LoRA on the same weights dequantized, on ``seq`` random tokens: the loss (1e-6)
    and every adapter's gradient (1e-5) equal, and every adapter gets a gradient. ``quantized``: kinds that must
    be among the quantized weights. Returns (the adapters, the dequantized base's gradients when
    ``base_grads``)."""
    from tests.lora_fixtures import lora_lm_loss, random_lora
    from tests.quant_fixtures import dequantized_numpy, quantized_projections, random_params
    from zoo.model import quant
    from zoo.model.params import nest

    qflat = quantized_projections(cfg, random_params(cfg, std=0.1))
    assert {k.rpartition(".")[2] for k, v in qflat.items() if isinstance(v, quant.QuantizedWeight)} >= quantized
    flat = dequantized_numpy(qflat)
    lora = random_lora(cfg, lc, random=True)
    tokens = jnp.asarray(random_tokens(cfg.vocab_size, seq=seq))

    def loss(a: Any, p: Any) -> Any:
        return lora_lm_loss(cfg, p, a, lc, tokens)

    lq, gq = jax.jit(jax.value_and_grad(loss))(lora, nest(qflat))
    gbase = None
    if base_grads:
        ld, (gd, gbase) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(lora, nest(flat))
    else:
        ld, gd = jax.jit(jax.value_and_grad(loss))(lora, nest(flat))
    assert abs(float(lq) - float(ld)) <= 1e-6
    gq, gd = jax.device_get((gq, gd))  # NumPy from here: eager jnp compiles a program per op and shape
    for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gd), strict=True):
        assert np.abs(a - b).max() <= 1e-5
    assert min(float(np.abs(g).max()) for g in jax.tree.leaves(gq)) > 0
    return lora, gbase
