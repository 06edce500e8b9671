"""Llama-family logits: zoo convert -> zoo.load against transformers' fp32 forward."""

import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from tests.hf_models import hf_logits, make_llama, mean_kl, random_tokens
from zoo.cli import main

VARIANTS = {
    "llama2-mha": dict(num_attention_heads=4, num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-gqa": dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama3.1-rope-scaling": dict(
        num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "tied-embeddings": dict(tie_word_embeddings=True),
    "attention-and-mlp-bias": dict(attention_bias=True, mlp_bias=True),
    "explicit-head-dim": dict(head_dim=24),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    hf = make_llama(tmp_path / "hf", **VARIANTS[variant])
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    model = zoo.load(tmp_path / "zoo")
    tokens = random_tokens(hf.config.vocab_size, seq=64)
    ref = hf_logits(hf, tokens)
    got = np.asarray(model(jnp.asarray(tokens)))
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    # The comparison must be able to fail: logits are far from uniform.
    assert ref.std() > 1.0


def test_rope_scaling_changes_logits(tmp_path):
    """Guards the llama3-scaling test: the scaled and unscaled models really differ at long range."""
    scaled = make_llama(tmp_path / "a", **VARIANTS["llama3.1-rope-scaling"])
    plain = make_llama(tmp_path / "b", num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    tokens = random_tokens(96, seq=64)
    assert np.abs(hf_logits(scaled, tokens) - hf_logits(plain, tokens)).max() > 1e-2


def test_bfloat16_conversion_casts_every_parameter(tmp_path):
    make_llama(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo"), "--dtype", "bfloat16"]) == 0
    meta = zoo.checkpoints.format.read_meta(tmp_path / "zoo")
    assert {p["dtype"] for p in meta["params"].values()} == {"bfloat16"}
    params = zoo.load_params(tmp_path / "zoo")
    assert params["layers"]["q"].dtype == jnp.bfloat16
