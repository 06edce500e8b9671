"""The zoo decoder: one Flax NNX module, driven by ModelConfig, scanning stacked layers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.config import ModelConfig
from zoo.layers import ACTIVATIONS, attention, attention_mask, mlp, rms_norm, rope_inv_freq, rope_tables
from zoo.params import flatten, nest, param_specs


def forward(
    cfg: ModelConfig,
    params: dict[str, Any],
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Logits [batch, seq, vocab] (float32) of the decoder for int tokens [batch, seq].

    ``segment_ids`` marks packed documents (attention never crosses a change
    of id); ``positions`` restart at each document. Both default to one
    document per row.
    """
    b, t = tokens.shape
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_tables(positions, rope_inv_freq(cfg.rope, cfg.head_dim))
    mask = attention_mask(segment_ids)
    x = jnp.take(params["embed"], tokens, axis=0)

    def layer(x: jax.Array, p: dict) -> tuple[jax.Array, None]:
        x = x + attention(rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), p, cos, sin, mask, cfg)
        x = x + mlp(rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), p, cfg)
        return x, None

    # One scan over the stacked layers: compile time does not grow with depth.
    x, _ = jax.lax.scan(layer, x, params["layers"])
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("bte,ev->btv", x, head, preferred_element_type=jnp.float32)


class Decoder(nnx.Module):
    """A decoder-only language model of any zoo family.

    Every parameter is an ``nnx.Param`` carrying ``logical_axes`` metadata,
    which :mod:`zoo.sharding` maps to mesh axes.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, Any] | None = None, *, rngs: nnx.Rngs | None = None,
                 dtype: Any = jnp.float32):
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.cfg = cfg
        specs = param_specs(cfg)
        flat = flatten(params) if params is not None else None
        if flat is None:
            rngs = rngs or nnx.Rngs(0)
            flat = {}
            for path, spec in specs.items():
                if spec.init == "ones":
                    flat[path] = jnp.ones(spec.shape, dtype)
                elif spec.init == "zeros":
                    flat[path] = jnp.zeros(spec.shape, dtype)
                else:
                    flat[path] = (0.02 * jax.random.normal(rngs.params(), spec.shape)).astype(dtype)
        missing = set(specs) - set(flat)
        if missing:
            raise ValueError(f"missing parameters: {sorted(missing)}")
        tree = nest({p: nnx.Param(flat[p], logical_axes=specs[p].axes) for p in specs})
        self.embed = tree.pop("embed")
        self.final_norm = tree.pop("final_norm")
        self.layers = nnx.Dict(tree.pop("layers"))
        if "lm_head" in tree:
            self.lm_head = tree.pop("lm_head")

    def param_dict(self) -> dict[str, Any]:
        """Parameters as a plain nested dict of arrays."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """Logits [batch, seq, vocab] for int32 tokens [batch, seq]."""
        return _jit_forward(self.cfg, self.param_dict(), tokens, segment_ids, positions)


_jit_forward = jax.jit(forward, static_argnums=0)
