"""LongRoPE's switch from short to long factors under a KV cache (Phi-3/Phi-4).

transformers ropes a call's tokens with the long factors once the sequence passes
original_max_position_embeddings, and its Phi-3 ``generate`` recomputes the whole cache at that step, so every
cached key is roped with the long factors from then on: each step's logits are those of the full forward pass
over the sequence so far. The zoo's cache keeps roped keys; at the call that crosses the threshold they are
rotated once more, by the difference of the long and the short angles (both scaled alike), which gives the
long-roped keys up to float rounding, without running the sequence again.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from zoo.model.config import ModelConfig
from zoo.model.rope import longrope_inv_freq, rope_tables


def _rotate(k: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on cached keys k [n, b, hk, d, S] by cos/sin [b, S, r] (their leading r dimensions)."""
    r = cos.shape[-1]
    c = jnp.swapaxes(cos, 1, 2)[None, :, None]  # [1, b, 1, r, S]
    s = jnp.swapaxes(sin, 1, 2)[None, :, None]
    kr = k[..., :r, :].astype(jnp.float32)
    half = r // 2
    rotated = jnp.concatenate([-kr[..., half:, :], kr[..., :half, :]], axis=-2)
    return jnp.concatenate([(kr * c + rotated * s).astype(k.dtype), k[..., r:, :]], axis=-2)


def switch_to_long(cfg: ModelConfig, layers: dict, lengths: jax.Array, new_lengths: jax.Array,
                   slot_positions: Callable[[jax.Array, int], jax.Array]) -> dict:
    """The cache's layer arrays ``layers`` (:class:`zoo.model.decode.Cache`) with every key roped again with the long
    factors when this call crosses the threshold (the longest row had at most original_max_position_embeddings
    tokens, and will have more), else as they are. ``slot_positions(lengths, S)`` gives each slot's position."""
    omax = cfg.rope.original_max_position_embeddings
    crossing = (jnp.max(lengths) <= omax) & (jnp.max(new_lengths) > omax)
    dim = cfg.rope_dim
    delta = longrope_inv_freq(cfg.rope, dim, long=True) - longrope_inv_freq(cfg.rope, dim, long=False)

    def rerope(layers: dict) -> dict:
        out: dict = {}
        for prefix, group in layers.items():
            out[prefix] = {}
            for kind, arrays in group.items():
                pos = jnp.maximum(slot_positions(lengths, arrays["k"].shape[-1]), 0)
                cos, sin = rope_tables(pos, delta)
                out[prefix][kind] = {**arrays, "k": _rotate(arrays["k"], cos, sin)}
        return out

    return jax.lax.cond(crossing, rerope, lambda layers: layers, layers)


def rerope_long(cfg: ModelConfig, k: jax.Array, positions: jax.Array) -> jax.Array:
    """Cached keys k [n, b, hk, d, S] roped with the short factors, at ``positions`` [b, S], roped with the long
    ones (rotated by the difference of the angles, as :func:`switch_to_long` does at the crossing call)."""
    dim = cfg.rope_dim
    delta = longrope_inv_freq(cfg.rope, dim, long=True) - longrope_inv_freq(cfg.rope, dim, long=False)
    cos, sin = rope_tables(jnp.maximum(positions, 0), delta)
    return _rotate(k, cos, sin)
