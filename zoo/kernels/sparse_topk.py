"""DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer scores every visible key of each query, and
the query attends only to its ``topk`` best keys.

The indexer (transformers' ``DeepseekV32Indexer``) has its own small projections: per query ``heads`` index
queries ``iq`` [b, t, heads, dim], per key one index key ``ik`` [b, t, dim], and per query one weight per head
``iw`` [b, t, heads]. A query's score of a key is ``sum_h iw[h] * relu(iq[h] . ik * dim**-0.5)``; the keys it
attends to are the ``topk`` of highest score among those it may see (all of them when it sees fewer). Ties go to
the lower key index (XLA's top-k is stable), so the selection is deterministic.

The selection is an integer choice, so no gradient flows through the indexer: transformers runs it under
``torch.no_grad()`` (its projections learn nothing from the language-model loss), and so does this module (its
inputs are stopped). The attention itself is ordinary softmax attention restricted to the selected keys, with the
gradients of dense masked attention.

Training (:func:`sparse_attention`) works by query blocks: each block scores its keys ([block, keys] per index
head), picks its top-k, and attends under that mask; the block is rematerialized in the backward pass, so no
[seq, seq] array is kept or built. Decoding (:func:`topk_visible`) scores the new tokens' index queries against
the cached index keys and narrows the cache mask to each query's top k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.kernels.blockwise import key_ranges, query_block
from zoo.model.masks import Visibility

NEG = float(jnp.finfo(jnp.float32).min)


def indexer_scores(iq: jax.Array, ik: jax.Array, iw: jax.Array) -> jax.Array:
    """Index scores float32 [b, q, k] of index queries iq [b, q, heads, dim] (roped), keys ik [b, k, dim] and
    per-query head weights iw [b, q, heads] (already scaled): ``sum_h iw[h] * relu(iq[h] . ik / sqrt(dim))``,
    as transformers' indexer computes them (in float32)."""
    f32 = jnp.float32
    s = jnp.einsum("bqhd,bkd->bqhk", iq.astype(f32), ik.astype(f32)) * iq.shape[-1] ** -0.5
    return jnp.einsum("bqh,bqhk->bqk", iw.astype(f32), jax.nn.relu(s))


def topk_visible(scores: jax.Array, visible: jax.Array, topk: int) -> jax.Array:
    """Bool [b, q, k]: the keys each query attends to, its ``topk`` highest ``scores`` among the ``visible`` ones
    (every visible key when there are at most ``topk``); ties to the lower key index."""
    k = scores.shape[-1]
    if topk >= k:
        return visible
    s = jnp.where(visible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(s, topk)  # [b, q, topk]
    b, q = s.shape[:2]
    chosen = jnp.zeros(s.shape, bool).at[jnp.arange(b)[:, None, None], jnp.arange(q)[None, :, None], idx].set(True)
    return chosen & visible


def selection(iq: jax.Array, ik: jax.Array, iw: jax.Array, visible: jax.Array, topk: int) -> jax.Array:
    """The indexer's choice (:func:`topk_visible` of :func:`indexer_scores`), with no gradient to its inputs."""
    iq, ik, iw = jax.lax.stop_gradient((iq, ik, iw))
    return topk_visible(indexer_scores(iq, ik, iw), visible, topk)


def _block_attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, scale: float) -> jax.Array:
    """Softmax attention of q [b, h, q, d] over k [b, h, k, d], v [b, h, k, dv] where ``keep`` [b, q, k]
    -> [b, h, q, dv] (float32 scores and softmax, output in v's dtype)."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(keep[:, None], s, NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v)


def _block(q: jax.Array, k: jax.Array, v: jax.Array, iq: jax.Array, ik: jax.Array, iw: jax.Array,
           visible: jax.Array, scale: float, topk: int) -> jax.Array:
    """One query block: its selection, then its attention."""
    return _block_attention(q, k, v, selection(iq, ik, iw, visible, topk), scale)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, iq: jax.Array, ik: jax.Array, iw: jax.Array,
                     vis: Visibility, scale: float, topk: int, block: int | None = None) -> jax.Array:
    """DeepSeek sparse attention for training: each query attends to the ``topk`` keys the indexer picks among
    those ``vis`` lets it see (causal within its packed document; padding sees padding).

    q [b, h, t, d], k [b, h, t, d], v [b, h, t, dv] (head-major); iq [b, t, index_heads, index_dim] (roped), ik
    [b, t, index_dim] (roped), iw [b, t, index_heads] (the indexer's scaled head weights). Returns [b, t, h * dv].
    Computed per block of ``block`` queries (default :func:`zoo.kernels.blockwise.query_block`) over the keys up
    to the block's end; each block is rematerialized for the backward pass, so only [block, keys] scores live at
    once.
    """
    b, h, t, _ = q.shape
    block = block or query_block(t)
    run = jax.checkpoint(_block, static_argnums=(7, 8))
    outs = []
    for qs, qe, ks, ke in key_ranges(t, block, vis.window, k.shape[2], vis.lookahead):
        visible = vis.block(qs, qe, ks, ke)
        outs.append(run(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], iq[:, qs:qe], ik[:, ks:ke], iw[:, qs:qe],
                        visible, scale, topk))
    out = jnp.concatenate(outs, axis=2)  # [b, h, t, dv]
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1)
