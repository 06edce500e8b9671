"""Per-layer input embeddings (Gemma 4's PLE, as Gemma 3n's): a second embedding gives every layer a small input
of its own, which the layer gates into its residual stream after its MLP.

The inputs of all layers come from one table lookup ([vocab, layers * width]) plus a projection of the token
embeddings (:func:`per_layer_inputs`); each layer adds ``norm(proj(act(gate(x)) * its_input))`` to x
(:func:`add_per_layer_input`), as transformers' Gemma4TextModel does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zoo.layers.blocks import ACTIVATIONS, dense, rms_norm
from zoo.model.config import ModelConfig


def per_layer_inputs(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array, x: jax.Array) -> jax.Array:
    """Every layer's input [layers, batch, seq, width] for int tokens [batch, seq] whose (scaled) embeddings are
    x [batch, seq, hidden]: (norm(x @ ple_model_proj / sqrt(hidden)) + ple_embed[tokens] * sqrt(width)) / sqrt(2).

    Layers lead, so that a layer scan slices its layers' inputs as it slices their weights."""
    b, t = tokens.shape
    L, P = cfg.num_layers, cfg.per_layer_input_size
    table = params["ple_embed"]
    # transformers scales by a buffer cast to the table's dtype, as the main embedding's (zoo.model.decoder.embed_tokens).
    own = jnp.take(table, tokens, axis=0) * jnp.asarray(P**0.5, dtype=table.dtype)
    proj = dense(x, params["ple_model_proj"]) * cfg.hidden_size**-0.5
    proj = rms_norm(proj.reshape(b, t, L, P), params["ple_proj_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    both = (proj + own.reshape(b, t, L, P)) * 2.0**-0.5
    return jnp.moveaxis(both, 2, 0)


def add_per_layer_input(cfg: ModelConfig, x: jax.Array, p: dict, inp: jax.Array) -> jax.Array:
    """x plus one layer's gated per-layer input ``inp`` [batch, seq, width] (weights ``ple_gate``, ``ple_proj``
    and ``ple_norm`` of the layer ``p``)."""
    h = ACTIVATIONS[cfg.hidden_act](dense(x, p["ple_gate"])) * inp
    return x + rms_norm(dense(h, p["ple_proj"]), p["ple_norm"], cfg.rms_norm_eps, cfg.norm_offset)
