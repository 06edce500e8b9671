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


def quantized_projections(cfg, flat: dict) -> dict:
    """``flat`` with every zoo.model.quant.quantized_paths projection quantized (NF4, double quantization)."""
    from zoo.model import quant

    paths = quant.quantized_paths(cfg)
    return {k: quant.quantize(np.asarray(v), *paths[k], "nf4", True) if k in paths else v for k, v in flat.items()}
