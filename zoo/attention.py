"""Self-attention of one decoder layer: grouped-query attention and DeepSeek's multi-head latent attention.

The projections into heads (:func:`qkv_heads`, :func:`mla_heads`), the
head-major layout of the attention kernels (:func:`head_major`) and the
output projection (:func:`output_projection`) are separate functions so that
the cached forward of :mod:`zoo.decode` runs exactly the same code around its
own cache reads and writes; only attending over cache slots differs there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.adapted import LoraDropout, adapted_dense, layer_adapters, projections
from zoo.blocks import rms_norm
from zoo.blockwise import blockwise_attention, query_block
from zoo.config import ModelConfig
from zoo.kernels import cudnn_attention, kernel_for, platform
from zoo.rope import apply_rope


def qkv_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, cfg: ModelConfig,
              norm_w: jax.Array | None = None, lora: dict | None = None, lora_scale: float | jax.Array = 1.0,
              drop: LoraDropout | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Roped q and k, and v, [batch, seq, heads, head_dim] (biases and q/k norms applied) of one attention layer.

    With ``norm_w`` x is first RMS-normed by it (fused with the projections:
    see :func:`zoo.adapted.projections`); ``lora``/``lora_scale``/``drop`` are
    this layer's q/k/v adapters and their dropout.
    """
    b, t, _ = x.shape
    names = ("q", "k", "v")
    qkv = projections(x, (p["q"], p["k"], p["v"]), cfg, norm_w, layer_adapters(lora, names), lora_scale, drop, names)
    q, k, v = (y.reshape(b, t, -1, cfg.head_dim) for y in qkv)
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def head_major(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [b, t, hq, d], k and v [b, t, hk, d] -> q [b, hk, group, t, d], k and v [b, hk, t, d].

    Each key/value head comes with its group of query heads, so grouped-query
    attention folds the group into the rows of one matmul per key/value head
    and never repeats K/V (see :func:`zoo.blockwise.blockwise_attention`).
    """
    b, t, hq, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, t, hk, hq // hk, d).transpose(0, 2, 3, 1, 4)
    return qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def causal_attention(qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig,
                     window: int | None = None) -> jax.Array:
    """Softmax attention of head-major q/k/v (:func:`head_major`) under a causal ``mask`` [b, 1, t, t].

    Computed in query blocks (:func:`zoo.blockwise.blockwise_attention`), so
    key blocks that the causal mask (and ``window``, the sliding window the
    mask was built with) hide are skipped. Returns [b, t, heads * head_dim].
    """
    return blockwise_attention(qg, k, v, mask, cfg.attn_scale, cfg.attn_softcap, window, query_block(qg.shape[3]))


def splash_heads(qg: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: ModelConfig,
                 window: int | None = None, cap: float | None = None) -> jax.Array:
    """:func:`causal_attention` through the splash kernel (:mod:`zoo.splash`), with no mask: causal by index within
    the documents of ``segment_ids`` [b, t] (None: one per row), ``window`` wide; interpreted off a TPU."""
    from zoo.splash import splash_attention

    if segment_ids is None:
        segment_ids = jnp.ones(qg.shape[:1] + qg.shape[3:4], jnp.int32)
    return splash_attention(qg, k, v, segment_ids, cfg.attn_scale, cap, window, interpret=platform() != "tpu")


def output_projection(out: jax.Array, p: dict, cfg: ModelConfig, lora: dict | None = None,
                      lora_scale: float | jax.Array = 1.0, drop: LoraDropout | None = None) -> jax.Array:
    """The attention output [b, t, heads * head_dim] through ``o`` (plus its bias and LoRA adapter) -> [b, t, embed].

    ``o`` keeps its stored [heads, head_dim, embed] shape (``contract=2``),
    so the backward pass reads the parameter itself.
    """
    out = adapted_dense(out, p["o"], layer_adapters(lora, ("o",))[0], lora_scale, contract=2, drop=drop, name="o")
    if cfg.o_bias:
        out = out + p["o_bias"]
    return out


def attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, mask: jax.Array | None, cfg: ModelConfig,
              window: int | None = None, norm_w: jax.Array | None = None, lora: dict | None = None,
              lora_scale: float | jax.Array = 1.0, drop: LoraDropout | None = None,
              segment_ids: jax.Array | None = None) -> jax.Array:
    """Grouped-query self-attention of one layer; x [batch, seq, embed].

    ``mask`` [batch, 1, q, k] is causal (see :func:`zoo.masks.attention_mask`); ``window``
    is the sliding window it was built with, which lets whole key blocks
    outside it be skipped. With ``norm_w`` x is first RMS-normed by it.
    ``lora`` holds this layer's LoRA adapters by weight name (q, k, v, o);
    ``drop`` applies LoRA dropout to their inputs. ``cfg.attention`` picks the kernel (:mod:`zoo.kernels`).
    ``mask`` None: the splash kernel (:func:`zoo.kernels.uses_splash`), which reads ``segment_ids`` [b, t] instead.
    """
    q, k, v = qkv_heads(x, p, cos, sin, cfg, norm_w, lora, lora_scale, drop)
    if mask is None:
        out = splash_heads(*head_major(q, k, v), segment_ids, cfg, window, cfg.attn_softcap)
    elif kernel_for(cfg, q.dtype) == "cudnn":  # cfg.attention (zoo.kernels); the cached forward stays blockwise
        out = cudnn_attention(*head_major(q, k, v), mask, cfg.attn_scale)
    else:
        out = causal_attention(*head_major(q, k, v), mask, cfg, window)
    return output_projection(out, p, cfg, lora, lora_scale, drop)


def mla_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array,
              cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """MLA's projections of (already normed) x [b, t, embed]: q_nope and roped q_pe [b, t, heads, .],
    the normed kv latent [b, t, kv_lora_rank] and the roped shared key k_pe [b, t, qk_rope_head_dim].

    The latent and k_pe are what a KV cache keeps (:mod:`zoo.decode`); the
    per-head keys and values are expanded from the latent through ``kv_b``.
    The RoPE dimensions are stored de-interleaved (the converter permutes
    them), so the usual rotate-half RoPE applies.
    """
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        # transformers hard-codes eps=1e-6 for the two latent norms.
        q = jnp.einsum("btc,chd->bthd", rms_norm(x @ p["q_a"], p["q_a_norm"], 1e-6), p["q_b"])
    else:
        q = jnp.einsum("bte,ehd->bthd", x, p["q"])
    kv = x @ p["kv_a"]
    latent = rms_norm(kv[..., :r], p["kv_a_norm"], 1e-6)
    # The shared key is one "head" for apply_rope's [b, t, heads, d] layout.
    k_pe = apply_rope(kv[..., None, r:], cos, sin)[:, :, 0]
    return q[..., :dn], apply_rope(q[..., dn:], cos, sin), latent, k_pe


def mla_attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, mask: jax.Array | None,
                  cfg: ModelConfig, window: int | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """DeepSeek's multi-head latent attention of (already normed) x: q and kv through low-rank latents,
    a shared RoPE key (see :func:`mla_heads`); ``mask`` [b, 1, q, k] (a sliding window is already in the
    mask: ``window`` only keeps the signature of :func:`attention`, as full scores are computed here).
    ``mask`` None: the splash kernel (its query/key heads may differ in size from its value heads) over the
    documents of ``segment_ids``, ``window`` wide."""
    dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope, q_pe, latent, k_pe = mla_heads(x, p, cos, sin, cfg)
    if mask is not None:
        kernel_for(cfg, q_nope.dtype)  # model.attention: cudnn is an error here (zoo.kernels.cudnn_obstacle)
    kv = jnp.einsum("btr,rhd->bthd", latent, p["kv_b"])
    k_nope, v = kv[..., :dn], kv[..., dn:]
    q = jnp.concatenate([q_nope, q_pe], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None], k_nope.shape[:-1] + (dr,))], axis=-1)
    if mask is None:  # one query head per key/value head: [b, h, 1, t, d], as head_major's
        qg = q.transpose(0, 2, 1, 3)[:, :, None]
        out = splash_heads(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segment_ids, cfg, window)
        return jnp.einsum("bthd,hde->bte", out.reshape(v.shape), p["o"])
    scores = jnp.einsum("bqhd,bshd->bhqs", q, k).astype(jnp.float32) * cfg.attn_scale
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqs,bshd->bqhd", probs, v)
    return jnp.einsum("bthd,hde->bte", out, p["o"])
