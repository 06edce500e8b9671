"""Rotary position embeddings: inverse frequencies per RoPE kind, cos/sin tables, the rotation itself.

The kinds follow transformers' ``rope_type``: default, linear, llama3, yarn,
longrope and (Gemma 4) proportional, computed in float32 numpy exactly as transformers computes
them, so converted checkpoints see the same angles. RoPE may rotate only the
leading ``cfg.rope_dim`` dimensions of a head (partial rotary), and layers
listed in ``cfg.nope_layers`` apply none (:func:`layer_rope`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from zoo.model.config import ModelConfig, RopeConfig
from zoo.model.layer_layout import kind_config


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
        with np.errstate(divide="ignore", invalid="ignore"):  # Llama 4 Scout: high = low, no medium band
            smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
            smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, rot_dim)
    if rope.kind == "proportional":
        return _proportional_inv_freq(rope, rot_dim)
    if rope.kind == "longrope":
        return longrope_inv_freq(rope, rot_dim, long=False)
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


def longrope_inv_freq(rope: RopeConfig, dim: int, long: bool) -> np.ndarray:
    """LongRoPE's inverse frequencies: the default ones divided by the short (or ``long``) factors, as
    transformers' ``_compute_longrope_parameters``."""
    factors = np.asarray(rope.long_factor if long else rope.short_factor, np.float32)
    if factors.shape != (dim // 2,):
        raise ValueError(f"longrope needs {dim // 2} factors, got {factors.shape[0]}")
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (factors * np.float32(rope.theta) ** shape)).astype(np.float32)


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN and LongRoPE multiply cos/sin by (1.0 for the other kinds)."""
    if rope.kind == "longrope":
        if rope.attention_factor is not None:
            return rope.attention_factor
        if rope.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
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


def mrope_axes(section: tuple[int, ...], n: int, interleaved: bool = False) -> np.ndarray:
    """The position axis (0 time, 1 row, 2 column) each of multimodal RoPE's ``n`` frequencies turns with: the i-th
    chunk of ``section`` frequencies with axis i % 3 (Qwen2.5-VL, transformers' ``recomposition_frequencies``), or
    ``interleaved`` (Qwen3-VL's): frequency j with the row where j % 3 == 1 and j < 3 * section[1], the column
    where j % 3 == 2 and j < 3 * section[2], else the time."""
    if not interleaved:
        return np.concatenate([np.full(size, i % 3) for i, size in enumerate(section)])
    j = np.arange(n)
    return np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))


def mrope_tables(positions: jax.Array, inv_freq: np.ndarray, section: tuple[int, ...],
                 scale: float = 1.0, interleaved: bool = False) -> tuple[jax.Array, jax.Array]:
    """Multimodal RoPE's cos/sin tables [batch, seq, rot_dim] (Qwen2.5-VL, Qwen3-VL) for positions [3, batch, seq]
    (time, row, column; [batch, seq] text positions drive all three alike), each frequency turned by its axis
    (:func:`mrope_axes`)."""
    if positions.ndim == 2:
        positions = jnp.broadcast_to(positions, (3, *positions.shape))
    axis = mrope_axes(section, len(inv_freq), interleaved)
    chosen = jnp.moveaxis(positions, 0, -1)[..., axis]  # [batch, seq, rot_dim / 2]: each frequency's position
    freqs = chosen.astype(jnp.float32) * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [batch, seq, heads, head_dim] (the Hugging Face layout).

    Tables narrower than the head (partial rotary: GLM-4.5, Phi-4) rotate its leading dimensions, rotate-half
    within them as transformers' ``apply_rotary_pos_emb`` does, and pass the rest through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s


def _tables(rope: RopeConfig, dim: int, positions: jax.Array,
            valid: jax.Array | None, per_row: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables of one RoPE for ``positions``.

    LongRoPE switches, as transformers does, on the call's length: the long factors for every position
    when the furthest one (of the ``valid`` tokens) is at or past original_max_position_embeddings, else
    the short ones (``per_row``: each row on its own length, as the inference engine's rows are requests of
    their own). A KV cache keeps the keys roped as they were when written.
    """
    scale = rope_attention_factor(rope)
    if rope.mrope_section:
        return mrope_tables(positions, rope_inv_freq(rope, dim), rope.mrope_section, scale, rope.mrope_interleaved)
    if rope.kind != "longrope":
        return rope_tables(positions, rope_inv_freq(rope, dim), scale)
    short = rope_tables(positions, longrope_inv_freq(rope, dim, long=False), scale)
    long = rope_tables(positions, longrope_inv_freq(rope, dim, long=True), scale)
    seen = positions if valid is None else jnp.where(valid, positions, 0)
    furthest = jnp.max(seen, axis=-1, keepdims=True)[..., None] if per_row else jnp.max(seen)
    use_long = furthest + 1 > rope.original_max_position_embeddings
    return jnp.where(use_long, long[0], short[0]), jnp.where(use_long, long[1], short[1])


def layer_rope(tables: tuple[jax.Array, jax.Array], rope_on: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """One layer's (cos, sin): as they are, or with ``rope_on`` 0 (a NoPE layer, :func:`rope_flags`) the
    identity rotation (cos 1, sin 0), so the layer's q and k pass unrotated."""
    if rope_on is None:
        return tables
    cos, sin = tables
    return jnp.where(rope_on > 0, cos, 1.0).astype(cos.dtype), jnp.where(rope_on > 0, sin, 0.0).astype(sin.dtype)


def rope_flags(cfg: ModelConfig, start: int, stop: int) -> jax.Array | None:
    """Per layer of ``start:stop``, 1.0 where it applies RoPE and 0.0 where it is a NoPE layer, to be scanned
    with the layers' weights; None when every layer applies RoPE (no flag enters the program)."""
    if not cfg.nope_layers:
        return None
    return jnp.asarray([0.0 if i in cfg.nope_layers else 1.0 for i in range(start, stop)], jnp.float32)


def rope_tables_by_kind(cfg: ModelConfig, positions: jax.Array, valid: jax.Array | None = None,
                        per_row: bool = False) -> dict[str, tuple[jax.Array, jax.Array]]:
    """(cos, sin) tables for integer positions [batch, seq] per layer kind of ``cfg`` (multimodal RoPE:
    [3, batch, seq] as well, :func:`mrope_tables`).

    "full" layers use ``cfg.rope``; "sliding" ones (when the model has any)
    use ``cfg.rope_local`` where it differs (Gemma 3's local RoPE), else the
    same RoPE. The training forward and the cached forward both take their
    tables from here, so their angles cannot drift apart. ``valid`` [batch, seq]
    marks the real tokens (LongRoPE's choice of factors reads only theirs; ``per_row``: each row's own).
    """
    # Gemma 4's full layers have heads of their own width (global_head_dim: zoo.model.layer_layout.kind_config).
    tables = {"full": _tables(cfg.rope, kind_config(cfg, "full").rope_dim, positions, valid, per_row)}
    if "sliding" in cfg.kinds:
        tables["sliding"] = _tables(cfg.rope_local or cfg.rope, cfg.rope_dim, positions, valid, per_row)
    if "chunked" in cfg.kinds:  # Llama 4's chunked layers turn as its full ones
        tables["chunked"] = tables["full"]
    return tables


def query_temperature(cfg: ModelConfig, positions: jax.Array) -> jax.Array | None:
    """Llama 4's attention temperature of each token [batch, seq] (float32), by which NoPE layers scale their
    queries: ``log1p(floor((pos + 1) / temperature_floor)) * temperature_scale + 1`` (transformers'
    ``attn_temperature_tuning``); None where the model has none (or no NoPE layer)."""
    if not (cfg.temperature_tuning and cfg.nope_layers):
        return None
    pos = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((pos + 1.0) / cfg.temperature_floor)) * cfg.temperature_scale + 1.0


def layer_query_scale(temperature: jax.Array | None, rope_on: jax.Array | None) -> jax.Array | None:
    """One layer's query scale [batch, seq]: ``temperature`` (:func:`query_temperature`) on a NoPE layer
    (``rope_on`` 0, :func:`rope_flags`), 1 on a RoPE layer; None without a temperature."""
    if temperature is None or rope_on is None:  # no temperature, or no NoPE layer
        return None
    return jnp.where(rope_on > 0, 1.0, temperature)
