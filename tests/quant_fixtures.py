"""The quantization tests' models: a tiny zoo ModelConfig from transformers-style fields and weights with
every quantizable projection quantized."""

from __future__ import annotations

import numpy as np


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


def random_params(cfg, std: float = 0.1, seed: int = 0) -> dict:
    """Flat random weights of ``cfg`` as zoo.model.params.init_params makes them (matrices ~ N(0, std), norms 1,
    biases 0), drawn with NumPy: init_params's jax.random compiles a kernel per shape (seconds each on CPU)."""
    from zoo.model.params import param_specs

    rng = np.random.RandomState(seed)
    return {k: (rng.normal(0, std, s.shape) if s.init == "normal" else np.full(s.shape, float(s.init == "ones")))
            .astype(np.float32) for k, s in sorted(param_specs(cfg).items())}


def write_random_checkpoint(hf: dict, out) -> None:
    """A checkpoint of the transformers-style config ``hf`` written as `zoo init` writes one (convert.init.write_params),
    its weights :func:`random_params` (std 0.02, as `zoo init`'s): `zoo init` draws them in one jitted program, which
    XLA compiles for seconds per configuration."""
    from convert.init import write_params
    from zoo.model.from_hf import model_config_from_hf

    cfg = model_config_from_hf(hf)
    write_params(out, hf, cfg, random_params(cfg, std=0.02), "random weights (tests/quant_fixtures.py)")


def quantized_projections(cfg, flat: dict) -> dict:
    """``flat`` with every zoo.model.quant.quantized_paths projection quantized (NF4, double quantization)."""
    from zoo.model import quant

    paths = quant.quantized_paths(cfg)
    return {k: quant.quantize(np.asarray(v), *paths[k], "nf4", True) if k in paths else v for k, v in flat.items()}


def dequantized_numpy(qflat: dict) -> dict:
    """``qflat`` with every zoo.model.quant.QuantizedWeight dequantized (:func:`zoo.model.quant.dequantize`, as the
    forward does inside its program) to NumPy, all in one jitted program: eagerly each weight's dozen operations
    compiled a program of their own per shape (about 200 compilations for a tiny MoE model); the other leaves as
    they are."""
    import jax

    from zoo.model import quant

    quantized = {k: v for k, v in qflat.items() if isinstance(v, quant.QuantizedWeight)}
    out = jax.device_get(jax.jit(lambda q: {k: quant.dequantize(v) for k, v in q.items()})(quantized))
    return {k: np.asarray(out[k]) if k in out else v for k, v in qflat.items()}


def bnb_nf4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bitsandbytes' own NF4 of a weight (``quantize_4bit``, blocks of 64 over the tensor flattened row-major, the
    blocks straddling rows): (packed bytes, float32 absmax per block, ``dequantize_4bit``'s float32 values in
    ``w``'s shape).

    The values are dequantized as the flat tensor they were blocked as: bitsandbytes 0.50.2's AVX-512 CPU kernel,
    given a 2-D shape whose rows are a multiple of 16 wide, looks each row's absmax up as if every row began a block
    (``absmax[row * (cols // 64) + col // 64]``), disagreeing with its own quantize_4bit, its CUDA kernel and its
    PyTorch kernel wherever ``cols % 64 != 0``; over a 1-D shape every one of its kernels reads block
    ``index // 64``."""
    import bitsandbytes.functional as F  # in the test extra: a missing one fails here, loudly
    import torch

    w = np.ascontiguousarray(w, np.float32)
    q, state = F.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4")
    state.shape = torch.Size([w.size])  # dequantized as the flat tensor it was blocked as (above)
    values = F.dequantize_4bit(q, state).numpy().reshape(w.shape)
    return q.numpy().reshape(-1), state.absmax.numpy(), values
