"""Attention of a cached forward (:mod:`zoo.model.decode`): new tokens attending to a KV cache's ring slots and to
each other.

The masks over ring slots and new tokens, softmax attention over several key sets at once (the cached slots and
the new tokens share one softmax: the cache is never concatenated with the new keys), and one layer's grouped-query
(:func:`gqa_attention`) or MLA (:func:`mla_attention`) attention over its cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.kernels.sparse_topk import selection
from zoo.layers.attention import causal_attention, head_major, mla_heads, output_projection, qkv_gate_heads
from zoo.layers.blocks import soft_cap
from zoo.layers.indexer import indexer_heads
from zoo.lora.projections import LayerLora
from zoo.model.config import ModelConfig

NEG = float(jnp.finfo(jnp.float32).min)


def slot_positions(lengths: jax.Array, slots: int) -> jax.Array:
    """Absolute position held by each slot [batch, S] of a ring, -1 where the slot is still empty."""
    s = jnp.arange(slots)[None, :]
    last = lengths[:, None] - 1 - s  # >= 0 iff the slot has been written
    return jnp.where(last >= 0, s + slots * (jnp.maximum(last, 0) // slots), -1)


def new_token_masks(pos: jax.Array, valid: jax.Array, old_pos: jax.Array | None, window: int | None,
                    block_ids: jax.Array | None = None,
                    chunk: int | None = None) -> tuple[jax.Array | None, jax.Array]:
    """Which keys each new query may attend to: old slots [batch, t, S] (None without), new tokens [batch, t, t].

    ``block_ids`` [batch, t] (-1 outside a block): bidirectional blocks among the new tokens (Gemma 3's image
    tokens at prefill, :func:`zoo.model.multimodal.image_blocks`): a query also sees its block's later tokens, and
    with ``window`` the one-sided window still applies (``window AND (causal OR same-block)``, as the training
    forward's :class:`zoo.model.masks.Visibility`). ``chunk``: Llama 4's chunked layers, a query sees only the
    keys of its own chunk (position // chunk)."""
    q = pos[:, :, None]
    new = pos[:, None, :]
    new_ok = valid[:, None, :] & (new <= q)
    if block_ids is not None:
        same = (block_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, :, None] >= 0)
        new_ok = new_ok | (valid[:, None, :] & same)
    if window is not None:
        new_ok = new_ok & (q - new < window)
    if chunk is not None:
        new_ok = new_ok & (q // chunk == new // chunk)
    if old_pos is None:
        return None, new_ok
    old = old_pos[:, None, :]
    old_ok = old >= 0
    if window is not None:
        old_ok = old_ok & (q - old < window)
    if chunk is not None:
        old_ok = old_ok & (q // chunk == old // chunk)
    return jnp.broadcast_to(old_ok, q.shape[:2] + old.shape[2:]), new_ok


def joint_mask(old_ok: jax.Array | None, new_ok: jax.Array) -> jax.Array:
    """The two masks of :func:`new_token_masks` as one over the old slots followed by the new tokens."""
    return new_ok if old_ok is None else jnp.concatenate([old_ok, new_ok], axis=-1)


def attend_grouped(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Grouped-query softmax attention: q [b, t, hq, d], k [b, s, hk, d], v [b, s, hk, dv] -> [b, t, hq * dv]."""
    b, t, hq, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, t, hk, hq // hk, d)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * cfg.attn_scale
    s = soft_cap(s, cfg.attn_softcap)
    s = jnp.where(mask[:, None, None], s, NEG)
    probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgts,bshd->bthgd", probs, v)
    return out.reshape(b, t, -1)


def attend_split(qg: jax.Array, parts: list[tuple[jax.Array, jax.Array, jax.Array]],
                  cfg: ModelConfig, sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention over several key sets at once: qg [b, hk, g, t, d] and per part transposed keys
    [b, hk, d, s], values [b, hk, s, dv] and mask [b, t, s]; one softmax over all parts' keys (and, with ``sinks``
    [hq], gpt-oss's one sink logit per head, whose probability is dropped). -> [b, t, hq * dv]."""
    scores = []
    for k, _, m in parts:
        s = jnp.einsum("bhgtd,bhds->bhgts", qg, k.astype(qg.dtype), preferred_element_type=jnp.float32)
        s = soft_cap(s * cfg.attn_scale, cfg.attn_softcap)
        scores.append(jnp.where(m[:, None, None], s, NEG))
    if sinks is not None:
        b, hk, g, t, _ = scores[0].shape
        sink = sinks.astype(jnp.float32).reshape(1, hk, g, 1, 1)
        scores.append(jnp.broadcast_to(sink, (b, hk, g, t, 1)))
    s = scores[0] if len(scores) == 1 else jnp.concatenate(scores, axis=-1)
    dt = parts[-1][1].dtype
    probs = jax.nn.softmax(s, axis=-1).astype(dt)
    out: jax.Array | None = None
    at = 0
    for k, v, _ in parts:
        n = k.shape[3]
        o = jnp.einsum("bhgts,bhsd->bhgtd", probs[..., at:at + n], v.astype(dt))
        out, at = (o if out is None else out + o), at + n
    assert out is not None, "no key sets to attend to"
    b, hk, g, t, dv = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hk * g * dv)


def gqa_attention(x: jax.Array, p: dict, c: dict | None, cos: jax.Array, sin: jax.Array,
                   masks: tuple[jax.Array | None, jax.Array], window: int | None,
                   cfg: ModelConfig, lora: LayerLora | None = None,
                   shared_kv: tuple[jax.Array, jax.Array] | None = None, causal: bool = True,
                   rope_on: jax.Array | None = None, q_scale: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """One layer's attention over cache ``c`` (k [b, hk, d, S], v [b, hk, S, d]; None when empty) and the new tokens
    (``lora``: the layer's LoRA, its adapters beside the base matmuls as in training). A KV-shared layer (Gemma 4) gets
    its stored layer's cache as ``c`` and that layer's new keys/values as ``shared_kv``. ``causal`` False: the new
    tokens' mask lets some see later ones (Gemma 3's image blocks at prefill). ``rope_on``, ``q_scale``: Llama 4's
    (:func:`zoo.layers.attention.qkv_heads`).

    Returns (output, new k/v [b, t, hk, d])."""
    q, k, v, gate = qkv_gate_heads(x, p, cos, sin, cfg, p.get("attn_norm"), lora=lora, shared_kv=shared_kv,
                                   rope_on=rope_on, q_scale=q_scale)
    qg, kh, vh = head_major(q, k, v)
    old_ok, new_ok = masks
    sinks = p["sinks"] if cfg.attn_sinks else None
    if c is None and causal:
        # An empty cache: the tokens attend to each other only, blockwise as in training (causal blocks skipped).
        att = causal_attention(qg, kh, vh, new_ok[:, None], cfg, window, sinks)
    elif c is None:
        # Keys after a query count (a bidirectional block): the whole mask, no block skipped.
        att = attend_split(qg, [(kh.transpose(0, 1, 3, 2), vh, new_ok)], cfg, sinks)
    else:
        assert old_ok is not None, "a cache read has its mask"
        att = attend_split(qg, [(c["k"], c["v"], old_ok), (kh.transpose(0, 1, 3, 2), vh, new_ok)], cfg, sinks)
    return output_projection(att, p, cfg, lora=lora, gate=gate), {"k": k, "v": v}


def mla_attention(x: jax.Array, p: dict, c: dict | None, cos: jax.Array, sin: jax.Array,
                   masks: tuple[jax.Array | None, jax.Array], cfg: ModelConfig,
                   absorb: bool | None) -> tuple[jax.Array, dict]:
    """:func:`zoo.layers.attention.mla_attention` over cache ``c`` (latent, k_pe; None when empty); x is already normed.
    DeepSeek-V3.2 (``cfg.sparse``): the cache also keeps each position's index key (``index_k``), and each new query
    attends only to its indexer's top ``index_topk`` of the keys its mask lets it see (:mod:`zoo.kernels.sparse_topk`).

    ``absorb`` None picks the cheaper of expanding the latents into per-head
    keys and values (prefill) and absorbing kv_b into the queries and the
    output (decoding); True/False force one.
    """
    dn = cfg.qk_nope_head_dim
    q_nope, q_pe, latent, k_pe = mla_heads(x, p, cos, sin, cfg)
    if c is None:
        all_latent, all_pe = latent, k_pe
    else:
        all_latent = jnp.concatenate([c["latent"].astype(latent.dtype), latent], axis=1)
        all_pe = jnp.concatenate([c["k_pe"].astype(k_pe.dtype), k_pe], axis=1)
    mask = joint_mask(*masks)
    new: dict[str, jax.Array] = {"latent": latent, "k_pe": k_pe}
    if cfg.sparse:  # DeepSeek-V3.2: each query keeps its indexer's top-k of the keys it sees, cached ones included
        iq, ik, iw = indexer_heads(x, p, cos, sin, cfg)
        keys = ik if c is None else jnp.concatenate([c["index_k"].astype(ik.dtype), ik], axis=1)
        mask = selection(iq, keys, iw, mask, cfg.index_topk)
        new["index_k"] = ik
    w_k, w_v = p["kv_b"][..., :dn], p["kv_b"][..., dn:]
    if absorb is None:
        absorb = absorb_is_cheaper(cfg, x.shape[1], all_latent.shape[1])
    if absorb:
        # q.k_nope = (q_nope W_k^T).latent and probs.v = (probs.latent) W_v: per-head keys/values never exist.
        q_lat = jnp.einsum("bthd,rhd->bthr", q_nope, w_k)
        s = (jnp.einsum("bthr,bsr->bhts", q_lat, all_latent)
             + jnp.einsum("bthd,bsd->bhts", q_pe, all_pe)).astype(jnp.float32) * cfg.attn_scale
        s = jnp.where(mask[:, None], s, NEG)
        probs = jax.nn.softmax(s, axis=-1).astype(latent.dtype)
        out = jnp.einsum("bthr,rhd->bthd", jnp.einsum("bhts,bsr->bthr", probs, all_latent), w_v)
    else:
        k_nope, v = jnp.einsum("bsr,rhd->bshd", all_latent, w_k), jnp.einsum("bsr,rhd->bshd", all_latent, w_v)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(all_pe[:, :, None], k_nope.shape[:-1] + all_pe.shape[-1:])],
                            axis=-1)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        out = attend_grouped(q, k, v, mask, cfg).reshape(q.shape[:3] + v.shape[-1:])
    return jnp.einsum("bthd,hde->bte", out, p["o"]), new


def absorb_is_cheaper(cfg: ModelConfig, t: int, s: int) -> bool:
    """Whether absorbed MLA takes fewer multiply-adds than expanded for t queries over s keys."""
    h, r, dn, dr, dv = (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim)
    expanded = s * r * h * (dn + dv) + t * s * h * (dn + dr + dv)
    absorbed = t * h * r * (dn + dv) + t * s * h * (2 * r + dr)
    return absorbed < expanded
