"""Causal attention in query blocks, with a hand-written backward pass (flash-attention style).

Each block of queries is scored only against the keys it can see: with a
causal mask the upper-right blocks are never computed, which skips nearly
half of the attention matmuls and softmax work at long sequence lengths
(and, with a sliding window, the keys left of the window too). The forward
pass keeps only q, k, v, the output and each row's log-sum-exp; the backward
pass recomputes each block's probabilities from them, so the
[batch, heads, seq, seq] probabilities are never stored for the backward
pass. Grouped-query heads are handled by folding each group of query heads
into the rows of one matmul against its shared key/value head, so K/V are
never repeated.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from zoo.model.masks import Visibility

NEG = float(jnp.finfo(jnp.float32).min)
BLOCK = 128  # the shortest query block (measured best on the CPU at seq 512; 64 was no faster)


def query_block(t: int) -> int:
    """Query block length for a sequence of t: 128, or t/8 for long sequences (at most 8 blocks)."""
    return max(BLOCK, -(-t // 8))


def key_ranges(t: int, block: int, window: int | None, keys: int | None = None,
               lookahead: int = 0) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) per query block: the keys a causal (windowed) block can see.

    ``keys`` (default t) is how many keys there are: more than t under context parallelism (:mod:`zoo.model.context`),
    where the queries' offset among the keys is only known on the device, so every block scores all keys.
    ``lookahead`` keys past a block's last query are scored too: a bidirectional block (Gemma 3's image tokens,
    :class:`zoo.model.masks.Visibility`'s ``block_ids``) lets a query see later keys of its own block.
    """
    if keys is not None and keys != t:
        return [(qs, min(qs + block, t), 0, keys) for qs in range(0, t, block)]
    out = []
    for qs in range(0, t, block):
        qe = min(qs + block, t)
        ks = 0 if window is None else max(0, qs - window + 1)
        out.append((qs, qe, ks, min(qe + lookahead, t)))
    return out


def _lookahead(mask: jax.Array | Visibility) -> int:
    """How many keys past its queries a block of ``mask`` may see (0: causal)."""
    return mask.lookahead if isinstance(mask, Visibility) else 0


def _block_mask(mask: jax.Array | Visibility, qs: int, qe: int, ks: int, ke: int) -> jax.Array:
    """The [b, 1, q, k] mask of one block: built inside it from a :class:`zoo.model.masks.Visibility`, or sliced from a
    whole boolean mask (the cached forward's over its new tokens, :mod:`zoo.model.decode`)."""
    if isinstance(mask, Visibility):
        return mask.block(qs, qe, ks, ke)[:, None]
    return mask[:, :, qs:qe, ks:ke]


def _scores(qb: jax.Array, kb: jax.Array, mb: jax.Array, scale: float, cap: float | None):
    """Masked (soft-capped) float32 scores [b, kv, g, q, k] and tanh of the cap (for the backward)."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qb, kb, preferred_element_type=jnp.float32) * scale
    th = None
    if cap is not None:
        th = jnp.tanh(s / cap)
        s = cap * th
    return jnp.where(mb[:, :, None], s, NEG), th


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | Visibility, scale: float,
                        cap: float | None, window: int | None, block: int, sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention ``softmax(mask(cap(q k^T * scale))) v`` computed per block of queries.

    q [b, kv_heads, group, t, d] (the query heads of each key/value head),
    k [b, kv_heads, s, d] and v [b, kv_heads, s, dv] (s = t, or the whole
    sequence of keys under context parallelism), ``mask`` a
    :class:`zoo.model.masks.Visibility` (each block's mask built in the block) or
    bool [b, 1, t, t] (causal, and windowed when ``window`` is set: keys
    outside ``key_ranges`` must be masked). Returns [b, t, kv_heads * group * dv] in v's dtype: the heads
    concatenated per token, ready for the output projection, which keeps this
    same array for its own backward pass (so it is stored once, not twice).

    ``sinks`` [kv_heads * group] (gpt-oss's attention sinks): one more logit per query head in every row's
    softmax denominator, attending to nothing (its probability is dropped), so a row may attend to less than 1.
    """
    return _forward(q, k, v, mask, scale, cap, window, block, sinks)[0]


def _sink_logits(sinks: jax.Array, q: jax.Array) -> jax.Array:
    """Sinks [heads] as float32 [1, kv, g, 1, 1], the query heads of q [b, kv, g, t, d] (head n = kv * g + group)."""
    return sinks.astype(jnp.float32).reshape(q.shape[1], q.shape[2])[None, :, :, None, None]


def _token_major(out: jax.Array) -> jax.Array:
    """[b, kv, g, t, d] -> [b, t, kv * g * d]."""
    b, h, g, t, d = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h * g * d)


def _head_major(x: jax.Array, q: jax.Array) -> jax.Array:
    """Inverse of :func:`_token_major`: [b, t, kv * g * dv] -> [b, kv, g, t, dv], the heads of ``q``."""
    b, h, g, t, _ = q.shape
    return x.reshape(b, t, h, g, -1).transpose(0, 2, 3, 1, 4)


def _forward(q, k, v, mask, scale, cap, window, block, sinks=None):
    outs, lses = [], []
    sink = None if sinks is None else _sink_logits(sinks, q)
    for qs, qe, ks, ke in key_ranges(q.shape[3], block, window, k.shape[2], _lookahead(mask)):
        s, _ = _scores(q[:, :, :, qs:qe], k[:, :, ks:ke], _block_mask(mask, qs, qe, ks, ke), scale, cap)
        m = jnp.max(s, axis=-1, keepdims=True)
        if sink is not None:
            m = jnp.maximum(m, sink)
        e = jnp.exp(s - m)
        denom = jnp.sum(e, axis=-1, keepdims=True)
        if sink is not None:  # the sink's share of the denominator; it adds nothing to the output
            denom = denom + jnp.exp(sink - m)
        p = (e / denom).astype(v.dtype)
        outs.append(jnp.einsum("bhgqk,bhkd->bhgqd", p, v[:, :, ks:ke]))
        lses.append(m[..., 0] + jnp.log(denom[..., 0]))
    out = _token_major(jnp.concatenate(outs, axis=3))
    return out, (q, k, v, mask, out, jnp.concatenate(lses, axis=3), sinks)


def _bwd(scale, cap, window, block, res, dout):
    q, k, v, mask, out, lse, sinks = res
    out, dout = _head_major(out, q), _head_major(dout, q)
    # D_i = sum_d dout_i * out_i: the softmax backward's row term, once for all blocks.
    rows = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    dq_blocks = []
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for qs, qe, ks, ke in key_ranges(q.shape[3], block, window, k.shape[2], _lookahead(mask)):
        qb, kb, vb = q[:, :, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke]
        s, th = _scores(qb, kb, _block_mask(mask, qs, qe, ks, ke), scale, cap)
        p = jnp.exp(s - lse[..., qs:qe, None])
        dob = dout[:, :, :, qs:qe]
        dv = dv.at[:, :, ks:ke].add(jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(v.dtype), dob,
                                               preferred_element_type=jnp.float32))
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - rows[..., qs:qe, None])
        if cap is not None:
            ds = ds * (1 - th * th)
        ds = (ds * scale).astype(q.dtype)
        dq_blocks.append(jnp.einsum("bhgqk,bhkd->bhgqd", ds, kb))
        dk = dk.at[:, :, ks:ke].add(jnp.einsum("bhgqk,bhgqd->bhkd", ds, qb, preferred_element_type=jnp.float32))
    dq = jnp.concatenate(dq_blocks, axis=3)
    dsinks = None
    if sinks is not None:
        # d out / d sink = -p_sink * out per row, so dL/d sink = -sum over rows of p_sink * D (D = dout . out);
        # the keys' ds above is unchanged (lse holds the sink, D sums over the real keys alone).
        p_sink = jnp.exp(_sink_logits(sinks, q)[..., 0] - lse)
        dsinks = -(p_sink * rows).sum(axis=(0, 3)).reshape(sinks.shape).astype(sinks.dtype)
    # the mask (or its integer ids) has no gradient
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks


blockwise_attention.defvjp(_forward, _bwd)
