"""Incremental decoding: a KV cache and a cache-aware forward pass of the zoo decoder.

:func:`forward_cached` runs the same layers as :func:`zoo.model.forward`
(norms, projections, RoPE, soft caps, MLP / MoE from :mod:`zoo.layers` and
:mod:`zoo.moe`) on t new tokens per row, attending to what the cache holds
plus the new tokens, and returns the cache with the new keys/values written.
Prefill (t = prompt length) and decoding (t = 1) are the same function.

Every cache is a ring of S slots: position p lives in slot p % S. Full layers
get S = ``max_len``, so nothing wraps while the sequence fits; sliding-window
layers get S = min(sliding_window, max_len), since a query never looks
further back than the window. New tokens attend to the old slots and to each
other (not to the cache after writing), so a chunk longer than the ring still
sees every key its mask allows; only the last S positions are then written.
MLA layers (DeepSeek) cache the normed kv latent and the roped shared key,
and expand them into per-head keys and values at each call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from zoo.config import ModelConfig
from zoo.layers import (
    apply_rope,
    dense,
    mlp,
    projections,
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
    soft_cap,
)
from zoo.model import layer_segments
from zoo.moe import moe_mlp

NEG = float(jnp.finfo(jnp.float32).min)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Cache:
    """Per-layer keys/values and each row's length.

    ``layers[prefix][kind]`` holds, for the layers of that parameter stack
    (``layers`` / ``dense_layers``) and kind (``full`` / ``sliding``) in
    order, stacked arrays ``k``/``v`` [n, batch, S, kv_heads, head_dim]
    (roped keys), or for MLA ``latent`` [n, batch, S, kv_lora_rank] and
    ``k_pe`` [n, batch, S, qk_rope_head_dim]. ``lengths`` [batch] int32
    counts the tokens of each row already in the cache.
    """

    layers: dict[str, dict[str, dict[str, jax.Array]]]
    lengths: jax.Array


def _kind_sizes(cfg: ModelConfig, max_len: int) -> dict[str, int]:
    """Ring size of each layer kind."""
    sizes = {"full": max_len}
    if "sliding" in cfg.kinds:
        sizes["sliding"] = min(cfg.sliding_window, max_len)
    return sizes


def _entry_shapes(cfg: ModelConfig, n: int, batch: int, slots: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical axes) of one kind's cache arrays for n layers."""
    lead, axes = (n, batch, slots), ("layers", "batch", "sequence")
    if cfg.mla:
        return {"latent": (lead + (cfg.kv_lora_rank,), axes + (None,)),
                "k_pe": (lead + (cfg.qk_rope_head_dim,), axes + ("head_dim",))}
    kv = (lead + (cfg.num_kv_heads, cfg.head_dim), axes + ("kv_heads", "head_dim"))
    return {"k": kv, "v": kv}


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = jnp.float32,
               mesh: Mesh | None = None) -> Cache:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens each (prompt and generated together).

    With ``mesh`` every array is placed by :mod:`zoo.sharding`'s rule table,
    like the parameters: rows on data/fsdp, kv heads on the tensor axis.
    """
    from zoo.sharding import named_sharding

    def make(shape: tuple[int, ...], axes: tuple, dt: Any) -> jax.Array:
        a = jnp.zeros(shape, dt)
        return a if mesh is None else jax.device_put(a, named_sharding(mesh, axes, shape))

    sizes = _kind_sizes(cfg, max_len)
    layers: dict[str, dict[str, dict[str, jax.Array]]] = {}
    for prefix, start, stop, _ in cfg.layer_groups:
        kinds = cfg.kinds[start:stop]
        layers[prefix] = {
            kind: {name: make(shape, axes, dtype)
                   for name, (shape, axes) in _entry_shapes(cfg, kinds.count(kind), batch, sizes[kind]).items()}
            for kind in sorted(set(kinds))}
    return Cache(layers, make((batch,), ("batch",), jnp.int32))


def _slot_positions(lengths: jax.Array, slots: int) -> jax.Array:
    """Absolute position held by each slot [batch, S] of a ring, -1 where the slot is still empty."""
    s = jnp.arange(slots)[None, :]
    last = lengths[:, None] - 1 - s  # >= 0 iff the slot has been written
    return jnp.where(last >= 0, s + slots * (jnp.maximum(last, 0) // slots), -1)


def _mask(pos: jax.Array, valid: jax.Array, old_pos: jax.Array, window: int | None) -> jax.Array:
    """Which keys [batch, t, S + t] (old slots, then the new tokens) each new query may attend to."""
    q = pos[:, :, None]
    old = old_pos[:, None, :]
    old_ok = old >= 0
    new = pos[:, None, :]
    new_ok = valid[:, None, :] & (new <= q)
    if window is not None:
        old_ok = old_ok & (q - old < window)
        new_ok = new_ok & (q - new < window)
    return jnp.concatenate([jnp.broadcast_to(old_ok, q.shape[:2] + old.shape[2:]), new_ok], axis=-1)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig) -> jax.Array:
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


def _gqa_attention(x: jax.Array, p: dict, c: dict, cos: jax.Array, sin: jax.Array, mask: jax.Array,
                   cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """One layer's attention over cache ``c`` (k, v) and the new tokens; returns (output, new k/v)."""
    b, t, _ = x.shape
    d = cfg.head_dim
    qkv = projections(x, (p["q"], p["k"], p["v"]), cfg, p["attn_norm"])
    q, k, v = (y.reshape(b, t, -1, d) for y in qkv)
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys = jnp.concatenate([c["k"].astype(k.dtype), k], axis=1)
    values = jnp.concatenate([c["v"].astype(v.dtype), v], axis=1)
    out = dense(_attend(q, keys, values, mask, cfg), p["o"], contract=2)
    if cfg.o_bias:
        out = out + p["o_bias"]
    return out, {"k": k, "v": v}


def _mla_attention(x: jax.Array, p: dict, c: dict, cos: jax.Array, sin: jax.Array, mask: jax.Array,
                   cfg: ModelConfig, absorb: bool | None) -> tuple[jax.Array, dict]:
    """:func:`zoo.layers.mla_attention` over cache ``c`` (latent, k_pe); x is already normed.

    ``absorb`` None picks the cheaper of expanding the latents into per-head
    keys and values (prefill) and absorbing kv_b into the queries and the
    output (decoding); True/False force one.
    """
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        # transformers hard-codes eps=1e-6 for the two latent norms.
        q = jnp.einsum("btc,chd->bthd", rms_norm(x @ p["q_a"], p["q_a_norm"], 1e-6), p["q_b"])
    else:
        q = jnp.einsum("bte,ehd->bthd", x, p["q"])
    kv = x @ p["kv_a"]
    latent = rms_norm(kv[..., :r], p["kv_a_norm"], 1e-6)
    k_pe = apply_rope(kv[..., None, r:], cos, sin)[:, :, 0]
    q_nope, q_pe = q[..., :dn], apply_rope(q[..., dn:], cos, sin)
    all_latent = jnp.concatenate([c["latent"].astype(latent.dtype), latent], axis=1)
    all_pe = jnp.concatenate([c["k_pe"].astype(k_pe.dtype), k_pe], axis=1)
    w_k, w_v = p["kv_b"][..., :dn], p["kv_b"][..., dn:]
    if absorb is None:
        absorb = _absorb_is_cheaper(cfg, x.shape[1], all_latent.shape[1])
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
        out = _attend(q, k, v, mask, cfg).reshape(q.shape[:3] + v.shape[-1:])
    return jnp.einsum("bthd,hde->bte", out, p["o"]), {"latent": latent, "k_pe": k_pe}


def _absorb_is_cheaper(cfg: ModelConfig, t: int, s: int) -> bool:
    """Whether absorbed MLA takes fewer multiply-adds than expanded for t queries over s keys."""
    h, r, dn, dr, dv = (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim)
    expanded = s * r * h * (dn + dv) + t * s * h * (dn + dr + dv)
    absorbed = t * h * r * (dn + dv) + t * s * h * (2 * r + dr)
    return absorbed < expanded


def forward_cached(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array, cache: Cache,
                   valid: jax.Array | None = None, mla_absorb: bool | None = None) -> tuple[jax.Array, Cache]:
    """Logits [b, t, vocab] (float32) of t new tokens per row, and the cache with them appended.

    Row r's tokens take positions ``cache.lengths[r] + (number of valid tokens
    before them)`` (``lengths + arange(t)`` when all are valid) and attend
    causally to the cache and to each other. ``valid`` [b, t] bool marks real
    tokens: padding is neither attended to, nor written, nor counted into
    ``lengths`` (its logits are meaningless). Jit it with ``cfg`` static: one
    compilation per (batch, t, max_len). MoE layers route every token
    (dropless, whatever ``capacity_factor`` says: generation drops no token).
    A full-attention cache must have room for every position (``max_len``);
    past it, the oldest entries would be overwritten. ``mla_absorb`` (static)
    forces one way of MLA attention (see :func:`_mla_attention`); by default
    the cheaper is taken.
    """
    if cfg.capacity_factor is not None:
        cfg = dataclasses.replace(cfg, capacity_factor=None)
    b, t = tokens.shape
    valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)
    vi = valid.astype(jnp.int32)
    pos = cache.lengths[:, None] + jnp.cumsum(vi, axis=1) - vi
    new_lengths = cache.lengths + vi.sum(1)

    ropes = {"full": rope_tables(pos, rope_inv_freq(cfg.rope, cfg.rope_dim), rope_attention_factor(cfg.rope))}
    if "sliding" in cfg.kinds:
        local = cfg.rope_local or cfg.rope
        ropes["sliding"] = rope_tables(pos, rope_inv_freq(local, cfg.rope_dim), rope_attention_factor(local))
    slots = {kind: arrays[next(iter(arrays))].shape[2]
             for group in cache.layers.values() for kind, arrays in group.items()}
    masks = {kind: _mask(pos, valid, _slot_positions(cache.lengths, s),
                         cfg.sliding_window if kind == "sliding" else None) for kind, s in slots.items()}

    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)

    def norm(x: jax.Array, w: jax.Array) -> jax.Array:
        return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)

    def layer(x: jax.Array, p: dict, c: dict, kind: str, moe: bool) -> tuple[jax.Array, dict]:
        if cfg.mla:
            h, new = _mla_attention(norm(x, p["attn_norm"]), p, c, *ropes[kind], masks[kind], cfg, mla_absorb)
        else:
            h, new = _gqa_attention(x, p, c, *ropes[kind], masks[kind], cfg)
        if cfg.post_norms:
            h = norm(h, p["post_attn_norm"])
        x = x + h
        if moe:
            h, _ = moe_mlp(norm(x, p["mlp_norm"]), p, cfg, valid)
        else:
            h = mlp(x, p, cfg, norm_w=p["mlp_norm"])
        if cfg.post_norms:
            h = norm(h, p["post_mlp_norm"])
        return x + h, new

    written: dict[str, dict[str, list]] = {}
    for prefix, start, stop, moe in cfg.layer_groups:
        kinds = cfg.kinds[start:stop]
        group = cache.layers[prefix]
        written[prefix] = {kind: [] for kind in group}
        for seg in layer_segments(kinds):
            period = len(seg.kinds)
            xs, slots_of = [], []
            for j, kind in enumerate(seg.kinds):
                # Layers of one kind are stacked in order: this block position's layers are a strided slice.
                i0, step = kinds[:seg.start + j].count(kind), seg.kinds.count(kind)
                idx = jnp.arange(seg.repeats) * step + i0
                slots_of.append(len(written[prefix][kind]))
                written[prefix][kind].append(idx)
                xs.append((jax.tree.map(lambda a: a[seg.start + j: seg.stop: period], params[prefix]),
                           jax.tree.map(lambda a: a[i0: i0 + seg.repeats * step: step], group[kind])))

            def block(x: jax.Array, xs: list, kinds: tuple[str, ...] = seg.kinds, moe: bool = moe):
                news = []
                for (p, c), kind in zip(xs, kinds):
                    x, new = layer(x, p, c, kind, moe)
                    news.append(new)
                return x, news

            x, news = jax.lax.scan(block, x, xs)
            for kind, at, new in zip(seg.kinds, slots_of, news):
                written[prefix][kind][at] = (written[prefix][kind][at], new)

    x = norm(x, params["final_norm"])
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = soft_cap(dense(x, head, jnp.float32), cfg.final_softcap)
    return logits, Cache(_write(cache, written, pos, valid, new_lengths), new_lengths)


def _write(cache: Cache, written: dict, pos: jax.Array, valid: jax.Array,
           new_lengths: jax.Array) -> dict:
    """The cache arrays with each layer's new entries scattered into their ring slots.

    Only the last S positions of each row go in (earlier ones would collide
    in the ring and are out of every later query's reach); padding never does.
    """
    out: dict[str, dict[str, dict[str, jax.Array]]] = {}
    rows = jnp.arange(pos.shape[0])[None, :, None]
    for prefix, group in cache.layers.items():
        out[prefix] = {}
        for kind, arrays in group.items():
            s = next(iter(arrays.values())).shape[2]
            keep = valid & (pos >= new_lengths[:, None] - s)
            slot = jnp.where(keep, pos % s, s)[None]  # slot s is out of range: dropped
            idx = jnp.concatenate([i for i, _ in written[prefix][kind]])[:, None, None]
            out[prefix][kind] = {
                name: a.at[idx, rows, slot].set(
                    jnp.concatenate([new[name] for _, new in written[prefix][kind]]).astype(a.dtype), mode="drop")
                for name, a in arrays.items()}
    return out


forward_cached_jit = jax.jit(forward_cached, static_argnums=0, static_argnames="mla_absorb")
""":func:`forward_cached`, compiled per config and shape (the cache is not donated)."""
