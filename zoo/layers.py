"""Pure building blocks of the decoder: norms, RoPE, attention, gated MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from zoo.blockwise import blockwise_attention, query_block
from zoo.config import ModelConfig, RopeConfig

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}


def dense(x: jax.Array, w: jax.Array, out_dtype: Any = None, contract: int = 1) -> jax.Array:
    """x [..., K] @ w [K, N] (accumulated and returned in ``out_dtype`` when given), with a backward
    pass laid out for XLA:CPU's fast matmul kernels (see :func:`_dense`).

    The weight may keep its stored shape: its first ``contract`` axes make K and
    the rest N (q's [embed, heads, head_dim] is K=embed, N=heads*head_dim), so
    inside a layer scan the backward pass reads the parameter itself rather than
    a stacked copy of a reshaped one. The output is [..., N] and is named "dense"
    for :func:`jax.checkpoint` policies (``remat: save_dots`` saves exactly
    these), since the matmul inside a custom VJP is invisible to them.
    """
    return checkpoint_name(_dense(x, w, out_dtype, contract), "dense")


def _matrix(w: jax.Array, contract: int) -> jax.Array:
    return w.reshape(math.prod(w.shape[:contract]), -1)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x: jax.Array, w: jax.Array, out_dtype: Any = None, contract: int = 1) -> jax.Array:
    """x @ w, with a hand-written backward pass.

    The weight gradient contracts over every token, the leading axis of both
    x and the output gradient, so one of them has to be transposed; left to
    itself XLA often transposes the larger one and fuses that transpose into
    the elementwise work that produced it (slow strided writes). Here the
    smaller operand is transposed, as a plain copy, and the result is pinned
    with an optimization barrier so XLA cannot fold the choice back.
    Mathematically this is exactly ``x @ w``.
    """
    return jnp.einsum("...k,kn->...n", x, _matrix(w, contract), preferred_element_type=out_dtype)


def _dense_fwd(x: jax.Array, w: jax.Array, out_dtype: Any, contract: int) -> tuple[jax.Array, tuple]:
    return _dense(x, w, out_dtype, contract), (x, w)


def _dense_bwd(out_dtype: Any, contract: int, res: tuple[jax.Array, jax.Array],
               g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of x @ w for output gradient g, transposing the smaller of x and g for dw."""
    x, w_stored = res
    w = _matrix(w_stored, contract)
    k, n = w.shape
    g = g.astype(jnp.promote_types(x.dtype, w.dtype))
    dx = jnp.einsum("...n,kn->...k", g, w).astype(x.dtype)
    x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
    if k <= n:
        dw = jnp.einsum("tk,tn->kn", x2, g2)  # XLA transposes the first operand: x, the smaller
    else:
        dw = jax.lax.optimization_barrier(jnp.einsum("tn,tk->nk", g2, x2)).T
    return dx, dw.reshape(w_stored.shape).astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm scaled by (offset + weight), computed in float32 (as transformers does), cast back.

    ``offset`` 1.0 is Gemma's ``x * (1 + w)``; 0.0 is Llama's ``w * x``. The
    backward pass keeps only x and the per-row 1/rms (autodiff would also keep
    the float32 normalized x, one more [tokens, embed] array per norm).
    """
    return _rms_norm(x, weight, eps, offset)


def _inv_rms(x: jax.Array, eps: float) -> jax.Array:
    """Per-row 1/rms of x [..., 1], in float32."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def _normalize(x: jax.Array, norm_w: jax.Array, r: jax.Array, offset: float) -> jax.Array:
    """(offset + w) * x / rms(x), computed in float32 and cast back to x's dtype."""
    return ((offset + norm_w.astype(jnp.float32)) * (x.astype(jnp.float32) * r)).astype(x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> jax.Array:
    return _rms_norm_fwd(x, weight, eps, offset)[0]


def _rms_norm_fwd(x: jax.Array, weight: jax.Array, eps: float, offset: float):
    r = _inv_rms(x, eps)
    return _normalize(x, weight, r, offset), (x, weight, r)


def _rms_norm_bwd(eps: float, offset: float, res: tuple, g: jax.Array):
    x, weight, r = res
    n = x.astype(jnp.float32) * r
    gf = g.astype(jnp.float32)
    dw = jnp.sum((gf * n).reshape(-1, n.shape[-1]), axis=0).reshape(weight.shape)
    dn = gf * (offset + weight.astype(jnp.float32))
    dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def normed_dense(x: jax.Array, norm_w: jax.Array, ws: tuple[jax.Array, ...], eps: float,
                 offset: float = 0.0) -> tuple[jax.Array, ...]:
    """``dense(rms_norm(x, norm_w), w)`` for each w in ws (q/k/v, or gate/up), sharing one norm.

    Separately, each :func:`dense` would keep the normalized x for its
    backward pass: one more [tokens, embed] array per norm and layer. Here the
    backward pass recomputes it from x and the per-row 1/rms instead (cheap
    elementwise work), so only x is kept, which the residual stream keeps anyway.
    """
    return tuple(checkpoint_name(y, "dense") for y in _normed_dense(x, norm_w, tuple(ws), eps, offset))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _normed_dense(x, norm_w, ws, eps, offset):
    return _normed_dense_fwd(x, norm_w, ws, eps, offset)[0]


def _normed_dense_fwd(x, norm_w, ws, eps, offset):
    r = _inv_rms(x, eps)
    n = _normalize(x, norm_w, r, offset)
    return tuple(_dense(n, w, None, 1) for w in ws), (x, norm_w, r, ws)


def _normed_dense_bwd(eps, offset, res, gs):
    x, norm_w, r, ws = res
    n = _normalize(x, norm_w, r, offset)
    dn, dws = None, []
    for w, g in zip(ws, gs):
        dn_w, dw = _dense_bwd(None, 1, (n, w), g)
        dn = dn_w if dn is None else dn + dn_w
        dws.append(dw)
    dx, dnorm = _rms_norm_bwd(eps, offset, (x, norm_w, r), dn)
    return dx, dnorm, tuple(dws)


_normed_dense.defvjp(_normed_dense_fwd, _normed_dense_bwd)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


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


def attention_mask(segment_ids: jax.Array, window: int | None = None,
                   prefix_ids: jax.Array | None = None) -> jax.Array:
    """Boolean [batch, 1, q, k] (broadcast over heads): causal within each packed document, nothing across.

    With ``window`` W a query sees only the W most recent keys, itself included
    (``0 <= q - k < W``, as transformers' sliding-window masks). Within a
    document index distance equals position distance, so packing is exact.

    ``prefix_ids`` [batch, seq] (0 = none) let a token also see the earlier
    tokens of one other segment, its shared prefix: a DPO pair's two answers
    both read the one copy of their prompt (dpo/data.py). Index distance then
    exceeds position distance, so this does not combine with ``window``.
    """
    t = segment_ids.shape[1]
    q, k = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    allowed = k <= q
    if window is not None:
        if prefix_ids is not None:
            raise ValueError("attention_mask: shared prefixes (prefix_ids) need full attention, not a sliding-window "
                             "mask (its window counts row indices)")
        allowed &= q - k < window
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_ids is not None:
        same |= (prefix_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    return (allowed[None] & same)[:, None]


# Every weight that can carry a LoRA adapter, in a fixed order: its index is folded into the layer's dropout
# key, so each adapted projection draws its own mask (q's adapter never sees v's mask).
ADAPTABLE = ("q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down",
             "shared_gate", "shared_up", "shared_down")


@dataclass(frozen=True)
class LoraDropout:
    """LoRA dropout within one layer: ``rate`` and that layer's PRNG ``key``.

    Calling it on an adapter's input x zeroes each element with probability
    ``rate`` and scales the rest by 1/(1 - rate) (inverted dropout, so the
    expected adapter output is unchanged). Only the adapter branch sees the
    dropped input, as peft's ``scale * B(A(dropout(x)))``: the base weight
    still multiplies x itself.
    """

    rate: float | jax.Array
    key: jax.Array

    def __call__(self, x: jax.Array, name: str) -> jax.Array:
        """x with dropout applied, the mask drawn from this layer's key and the adapted weight ``name``."""
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(jax.random.fold_in(self.key, ADAPTABLE.index(name)), keep, x.shape)
        return jnp.where(mask, x / keep, 0).astype(x.dtype)


def _lora_branch(x: jax.Array, adapter: dict, scale: float | jax.Array, dtype: Any, contract: int = 1) -> jax.Array:
    """``scale * (x @ A) @ B`` on its own (not fused with a base matmul), cast to ``dtype``."""
    return lora_out(dense(x, adapter["a"], contract=contract), adapter["b"], scale, dtype)


def lora_out(u: jax.Array, b: jax.Array, scale: float | jax.Array, dtype: Any) -> jax.Array:
    """A LoRA adapter's output, ``scale * u @ B`` for u = x @ A [..., rank], cast to the base output's dtype.

    Not named "dense": under ``remat: save_dots`` only the small u is kept and
    this [tokens, out] product is recomputed (one rank-r matmul).
    """
    return (scale * _dense(u, b, None, 1)).astype(dtype)


def adapted_dense(x: jax.Array, w: jax.Array, adapter: dict | None, scale: float | jax.Array,
                  contract: int = 1, drop: LoraDropout | None = None, name: str = "o") -> jax.Array:
    """:func:`dense` of x and w, plus ``scale * (x @ A) @ B`` when ``adapter`` ({"a", "b"}) is given.

    The adapter runs beside the base matmul, never merged into w: a merged
    weight's gradient would cost as much as a full weight gradient. With
    ``drop`` the adapter's x is ``drop(x, name)`` (the base's stays x).
    """
    y = dense(x, w, contract=contract)
    if adapter is None:
        return y
    return y + _lora_branch(x if drop is None else drop(x, name), adapter, scale, y.dtype, contract)


def projections(x: jax.Array, ws: tuple[jax.Array, ...], cfg: ModelConfig,
                norm_w: jax.Array | None = None, adapters: tuple[dict | None, ...] | None = None,
                lora_scale: float | jax.Array = 1.0, drop: LoraDropout | None = None,
                names: tuple[str, ...] = ()) -> tuple[jax.Array, ...]:
    """x @ w for each w in ws; with ``norm_w``, of the RMS-normed x (see :func:`normed_dense`).

    ``adapters`` (one LoRA {"a", "b"} or None per w) add ``lora_scale * (x @ A) @ B``.
    The A matmuls go through the same :func:`normed_dense` as the base weights,
    so the normed x is still not kept for the backward pass. With ``drop``
    (LoRA dropout; ``names`` name the weights) see :func:`_dropped_projections`.
    """
    adapters = adapters or (None,) * len(ws)
    if drop is not None and any(ad is not None for ad in adapters):
        return _dropped_projections(x, ws, cfg, norm_w, adapters, lora_scale, drop, names)
    a_ws = tuple(ad["a"] for ad in adapters if ad is not None)
    if norm_w is None:
        ys = tuple(dense(x, w) for w in ws + a_ws)
    else:
        ys = normed_dense(x, norm_w, ws + a_ws, cfg.rms_norm_eps, cfg.norm_offset)
    out, us = list(ys[:len(ws)]), iter(ys[len(ws):])
    for i, ad in enumerate(adapters):
        if ad is not None:
            out[i] = out[i] + lora_out(next(us), ad["b"], lora_scale, out[i].dtype)
    return tuple(out)


def _dropped_projections(x: jax.Array, ws: tuple[jax.Array, ...], cfg: ModelConfig, norm_w: jax.Array | None,
                         adapters: tuple[dict | None, ...], lora_scale: float | jax.Array, drop: LoraDropout,
                         names: tuple[str, ...]) -> tuple[jax.Array, ...]:
    """:func:`projections` with LoRA dropout: the base matmuls stay fused on x, each adapter runs apart.

    The A matmuls cannot share the fused norm + projection here, since each
    adapter reads its own dropped copy of the (normed) x, which the base
    weights must not see. That copy is kept for the adapter's backward pass:
    dropout costs activation memory, which is why it is off by default.
    """
    ys = list(projections(x, ws, cfg, norm_w))
    n = x if norm_w is None else rms_norm(x, norm_w, cfg.rms_norm_eps, cfg.norm_offset)
    for i, (ad, name) in enumerate(zip(adapters, names, strict=True)):
        if ad is not None:
            ys[i] = ys[i] + _lora_branch(drop(n, name), ad, lora_scale, ys[i].dtype)
    return tuple(ys)


def _adapters(lora: dict | None, names: tuple[str, ...]) -> tuple[dict | None, ...]:
    """The LoRA adapter of each named weight of one layer (None where it has none)."""
    return tuple((lora or {}).get(n) for n in names)


def qkv_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, cfg: ModelConfig,
              norm_w: jax.Array | None = None, lora: dict | None = None, lora_scale: float | jax.Array = 1.0,
              drop: LoraDropout | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Roped q and k, and v, [batch, seq, heads, head_dim] (biases and q/k norms applied) of one attention layer."""
    b, t, _ = x.shape
    names = ("q", "k", "v")
    qkv = projections(x, (p["q"], p["k"], p["v"]), cfg, norm_w, _adapters(lora, names), lora_scale, drop, names)
    q, k, v = (y.reshape(b, t, -1, cfg.head_dim) for y in qkv)
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, mask: jax.Array, cfg: ModelConfig,
              window: int | None = None, norm_w: jax.Array | None = None, lora: dict | None = None,
              lora_scale: float | jax.Array = 1.0, drop: LoraDropout | None = None) -> jax.Array:
    """Grouped-query self-attention of one layer; x [batch, seq, embed].

    ``mask`` [batch, 1, q, k] is causal (see :func:`attention_mask`); ``window``
    is the sliding window it was built with, which lets whole key blocks
    outside it be skipped. With ``norm_w`` x is first RMS-normed by it.
    ``lora`` holds this layer's LoRA adapters by weight name (q, k, v, o);
    ``drop`` applies LoRA dropout to their inputs.
    """
    b, t, _ = x.shape
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = qkv_heads(x, p, cos, sin, cfg, norm_w, lora, lora_scale, drop)
    g = hq // hk
    # Each key/value head with its group of query heads: [b, kv_heads, group, t, d].
    qg = q.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)
    out = blockwise_attention(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, cfg.attn_scale,
                              cfg.attn_softcap, window, query_block(t))
    out = adapted_dense(out, p["o"], _adapters(lora, ("o",))[0], lora_scale, contract=2, drop=drop, name="o")
    if cfg.o_bias:
        out = out + p["o_bias"]
    return out


def mla_attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, mask: jax.Array,
                  cfg: ModelConfig, window: int | None = None) -> jax.Array:
    """DeepSeek's multi-head latent attention: q and kv through low-rank latents, a shared RoPE key.

    The RoPE dimensions are stored de-interleaved (the converter permutes
    them), so the usual rotate-half RoPE applies.
    """
    b, t, _ = x.shape
    dn, dr, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        # transformers hard-codes eps=1e-6 for the two latent norms.
        q = jnp.einsum("btc,chd->bthd", rms_norm(x @ p["q_a"], p["q_a_norm"], 1e-6), p["q_b"])
    else:
        q = jnp.einsum("bte,ehd->bthd", x, p["q"])
    kv = x @ p["kv_a"]
    latent, k_pe = kv[..., :r], kv[..., r:]
    kv = jnp.einsum("btr,rhd->bthd", rms_norm(latent, p["kv_a_norm"], 1e-6), p["kv_b"])
    k_nope, v = kv[..., :dn], kv[..., dn:]
    q_pe = apply_rope(q[..., dn:], cos, sin)
    k_pe = apply_rope(k_pe[:, :, None, :], cos, sin)
    q = jnp.concatenate([q[..., :dn], q_pe], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:-1] + (dr,))], axis=-1)
    scores = jnp.einsum("bqhd,bshd->bhqs", q, k).astype(jnp.float32) * cfg.attn_scale
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqs,bshd->bqhd", probs, v)
    return jnp.einsum("bthd,hde->bte", out, p["o"])


def glu_down(gate: jax.Array, up: jax.Array, w: jax.Array, act: str) -> jax.Array:
    """(act(gate) * up) @ w, keeping only gate and up for the backward pass (see :func:`glu_dense`)."""
    return glu_dense(gate, up, (w,), act)[0]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def glu_dense(gate: jax.Array, up: jax.Array, ws: tuple[jax.Array, ...], act: str) -> tuple[jax.Array, ...]:
    """(act(gate) * up) @ w for each w in ws (the down weight, and its LoRA A), keeping only gate and up.

    Autodiff would store act(gate), its derivative's terms and the product as
    well: three more [tokens, mlp] arrays per layer. Recomputing them in the
    backward pass is cheap elementwise work, and the smaller activation
    memory is what the CPU step is bound by.
    """
    h = ACTIVATIONS[act](gate) * up
    return tuple(dense(h, w) for w in ws)


def _glu_dense_fwd(gate: jax.Array, up: jax.Array, ws: tuple[jax.Array, ...], act: str):
    return glu_dense(gate, up, ws, act), (gate, up, ws)


def _glu_dense_bwd(act: str, res: tuple, gs: tuple[jax.Array, ...]):
    gate, up, ws = res
    h, glu_vjp = jax.vjp(lambda a, b: ACTIVATIONS[act](a) * b, gate, up)
    dh, dws = None, []
    for w, g in zip(ws, gs):
        dh_w, dw = _dense_bwd(None, 1, (h, w), g)
        dh = dh_w if dh is None else dh + dh_w
        dws.append(dw)
    return (*glu_vjp(dh), tuple(dws))


glu_dense.defvjp(_glu_dense_fwd, _glu_dense_bwd)


MLP_CHUNK_TOKENS = 1024  # tokens per MLP chunk (see mlp): [1024, mlp] buffers instead of [batch * seq, mlp]


def mlp_chunks(batch: int, seq: int) -> int:
    """How many sequence chunks :func:`mlp` runs in: the largest divisor n of ``seq`` with
    batch * seq / n >= MLP_CHUNK_TOKENS (1 when the whole batch is that small)."""
    most = batch * seq // MLP_CHUNK_TOKENS
    return max([n for n in range(1, min(most, seq) + 1) if seq % n == 0], default=1)


def mlp(x: jax.Array, p: dict, cfg: ModelConfig, norm_w: jax.Array | None = None, lora: dict | None = None,
        lora_scale: float | jax.Array = 1.0, drop: LoraDropout | None = None) -> jax.Array:
    """Gated MLP (SwiGLU / GeGLU): down(act(gate(x)) * up(x)); with ``norm_w`` x is first RMS-normed by it.

    ``lora`` holds this layer's LoRA adapters by weight name (gate, up, down);
    ``drop`` applies LoRA dropout to their inputs.

    The MLP works on each token alone, so a long batch runs as a scan over
    chunks of the sequence (:func:`mlp_chunks`), each about MLP_CHUNK_TOKENS
    tokens: the backward pass's [tokens, mlp]-wide temporaries (the gate and
    up gradients, the activation's, the recomputed products) then exist for
    one chunk at a time, where they were the step's largest buffers. The
    batch axis is never split, so the chunks keep x's data sharding. Results
    are those of one pass up to float summation order of the weight gradients.
    """
    b, t, _ = x.shape
    n = 1 if drop is not None else mlp_chunks(b, t)  # dropout masks are drawn for x's whole shape
    if n == 1:
        return _mlp(x, p, cfg, norm_w, lora, lora_scale, drop)
    xs = jnp.moveaxis(x.reshape(b, n, t // n, -1), 1, 0)
    ys = jax.lax.map(lambda xc: _mlp(xc, p, cfg, norm_w, lora, lora_scale, None), xs)
    return jnp.moveaxis(ys, 0, 1).reshape(b, t, -1)


def _mlp(x: jax.Array, p: dict, cfg: ModelConfig, norm_w: jax.Array | None, lora: dict | None,
         lora_scale: float | jax.Array, drop: LoraDropout | None) -> jax.Array:
    names = ("gate", "up")
    gate, up = projections(x, (p["gate"], p["up"]), cfg, norm_w, _adapters(lora, names), lora_scale, drop, names)
    if cfg.mlp_bias:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    down = _adapters(lora, ("down",))[0]
    if down is None:
        out = glu_down(gate, up, p["down"], cfg.hidden_act)
    elif drop is not None:
        # The adapter reads a dropped copy of act(gate) * up, so it cannot share glu_dense's product.
        out = glu_down(gate, up, p["down"], cfg.hidden_act)
        h = ACTIVATIONS[cfg.hidden_act](gate) * up
        out = out + _lora_branch(drop(h, "down"), down, lora_scale, out.dtype)
    else:
        out, u = glu_dense(gate, up, (p["down"], down["a"]), cfg.hidden_act)
        out = out + lora_out(u, down["b"], lora_scale, out.dtype)
    if cfg.mlp_bias:
        out = out + p["down_bias"]
    return out
