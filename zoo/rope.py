"""Rotary position embeddings: inverse frequencies per RoPE kind, cos/sin tables, the rotation itself.

The kinds follow transformers' ``rope_type``: default, linear, llama3 and
yarn, computed in float32 numpy exactly as transformers computes them, so
converted checkpoints see the same angles.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from zoo.config import ModelConfig, RopeConfig


def rope_inv_freq(rope: RopeConfig, rot_dim: int) -> np.ndarray:
    """Inverse frequencies [rot_dim/2] for the configured RoPE kind, in float32."""
    exponent = np.arange(0, rot_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rot_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.kind == "default":
        return inv_freq
    if rope.kind == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.kind == "llama3":
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, rot_dim)
    if rope.kind == "proportional":
        return _proportional_inv_freq(rope, rot_dim)
    raise ValueError(f"unsupported rope kind {rope.kind!r}")


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, ramp in between (as transformers)."""
    base, factor, omax = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(omax / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv.astype(np.float32)


def _proportional_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """Gemma 4's proportional RoPE: the first ``proportional_fraction`` of the angles keep the frequencies of a
    full-width RoPE (exponents over the whole head), the rest get frequency 0 (cos 1, sin 0: those dims pass
    through unrotated), all divided by ``factor``, as transformers computes them."""
    angles = int(rope.proportional_fraction * dim // 2)
    exponent = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    rotated = (1.0 / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    inv = np.concatenate([rotated, np.zeros(dim // 2 - angles, np.float32)])
    return (inv / np.float32(rope.factor)).astype(np.float32)


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN multiplies cos/sin by (1.0 for the other kinds)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim)
    return get_mscale(rope.factor)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [batch, seq, rot_dim] for integer positions [batch, seq] (times ``scale``)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [batch, seq, heads, head_dim] (the Hugging Face layout)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s


def rope_tables_by_kind(cfg: ModelConfig, positions: jax.Array) -> dict[str, tuple[jax.Array, jax.Array]]:
    """(cos, sin) tables for integer positions [batch, seq] per layer kind of ``cfg``.

    "full" layers use ``cfg.rope``; "sliding" ones (when the model has any)
    use ``cfg.rope_local`` where it differs (Gemma 3's local RoPE), else the
    same RoPE. The training forward and the cached forward both take their
    tables from here, so their angles cannot drift apart.
    """
    # Gemma 4's full layers have heads of their own width (global_head_dim).
    full_dim = cfg.global_head_dim or cfg.rope_dim
    tables = {"full": rope_tables(positions, rope_inv_freq(cfg.rope, full_dim), rope_attention_factor(cfg.rope))}
    if "sliding" in cfg.kinds:
        local = cfg.rope_local or cfg.rope
        tables["sliding"] = rope_tables(positions, rope_inv_freq(local, cfg.rope_dim), rope_attention_factor(local))
    return tables
