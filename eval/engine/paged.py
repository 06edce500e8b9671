"""The paged KV cache on the devices, and the engine's programs: a prefill and a decoding step over it.

The pool holds, per parameter stack and layer kind (as :class:`zoo.model.decode.Cache` groups them), every
layer's keys and values in pages: ``k`` [layers, pages, kv_heads, head_dim, page], ``v`` [layers, pages,
kv_heads, page, head_dim] (the cache's head-major layouts, a page in place of a ring), or for MLA ``latent``
[layers, pages, page, rank] and ``k_pe`` [layers, pages, page, rope_dim]. A row reads the pages of its page table
as the ring layout of :mod:`zoo.model.decode` (P pages as P * page slots, position p at slot p, each layer
gathering its rows' pages as it runs: :func:`zoo.model.cache_io.gather_pages`; the table's width is bucketed, so a
step reads what its rows can hold, not max_len) in the same cached forward every sampler uses
(:func:`zoo.model.decode.forward_step`: every family's attention, MoE, images), and its new keys and values are
scattered into its pages. Sliding-window layers keep every position too (the mask applies the
window), so a page serves every layer kind of a position.

A page shared by several rows (a cached prompt) is read by each: a layer's gather copies it per row, the pool
holds it once.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eval.engine.sampling import RowSampling, draw_rows
from zoo.lora.rows import RowAdapters
from zoo.lora.weights import Weights
from zoo.model.cache_io import Written, linear_state_shapes, put_entries, put_states
from zoo.model.config import ModelConfig
from zoo.model.decode import Cache, forward_step
from zoo.model.layer_layout import is_kv_shared, kind_config
from zoo.model.vision import VisionInputs

Pool = dict[str, dict[str, dict[str, jax.Array]]]


def _page_shapes(cfg: ModelConfig, n: int, pages: int, page: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical axes) of one layer kind's pool arrays for n layers."""
    axes: tuple
    if cfg.mla:
        lead, axes = (n, pages, page), ("layers", None, None)
        sparse = {"index_k": (lead + (cfg.index_head_dim,), axes + (None,))} if cfg.sparse else {}  # DeepSeek-V3.2
        return {"latent": (lead + (cfg.kv_lora_rank,), axes + (None,)),
                "k_pe": (lead + (cfg.qk_rope_head_dim,), axes + ("head_dim",)), **sparse}
    lead, axes = (n, pages, cfg.num_kv_heads), ("layers", None, "kv_heads")
    return {"k": (lead + (cfg.head_dim, page), axes + ("head_dim", None)),
            "v": (lead + (page, cfg.head_dim), axes + (None, "head_dim"))}


def _pool_tree(cfg: ModelConfig, pages: int, page: int, make: Any, seqs: int = 0) -> Pool:
    """A pool whose every array is ``make(shape, logical axes, dtype or None)`` (None: the pool's). Qwen3-Next's
    linear layers keep no pages: each of ``seqs`` sequence slots holds their fixed-size state (the cache's,
    :func:`zoo.model.cache_io.linear_state_shapes`; the delta rule's in float32)."""
    out: Pool = {}
    for prefix, stack, _ in cfg.layer_stacks:
        kinds = tuple(cfg.kinds[i] for i in stack)
        out[prefix] = {}
        if is_kv_shared(cfg, prefix):
            continue  # Gemma 4's KV-shared layers read their stored layers' pages
        for kind in sorted(set(kinds)):
            if kind == "linear":
                assert seqs > 0, "a pool for linear layers needs its sequence slots"
                shapes = linear_state_shapes(cfg, kinds.count(kind), seqs)
            else:
                shapes = _page_shapes(kind_config(cfg, kind), kinds.count(kind), pages, page)
            out[prefix][kind] = {name: make(shape, axes, jnp.float32 if name == "rec" else None)
                                 for name, (shape, axes) in shapes.items()}
    return out


def _pool_sharding(mesh: Mesh, axes: tuple, shape: tuple[int, ...]) -> Any:
    from zoo.model.sharding import DECODE_RULES, named_sharding

    return named_sharding(mesh, axes, shape, DECODE_RULES)


def init_pool(cfg: ModelConfig, pages: int, page: int, dtype: Any, mesh: Mesh | None = None,
              seqs: int = 0) -> Pool:
    """An empty pool of ``pages`` pages of ``page`` positions (with ``mesh``: split like the decoding weights'
    k/v heads, as :func:`zoo.model.decode.init_cache` splits a cache); ``seqs``: the sequence slots of a model
    with linear layers (:func:`_pool_tree`)."""
    def make(shape: tuple[int, ...], axes: tuple, dt: Any) -> jax.Array:
        a = jnp.zeros(shape, dt or dtype)
        return a if mesh is None else jax.device_put(a, _pool_sharding(mesh, axes, shape))

    return _pool_tree(cfg, pages, page, make, seqs)


def abstract_pool(cfg: ModelConfig, pages: int, page: int, dtype: Any, mesh: Mesh, seqs: int = 0) -> Pool:
    """:func:`init_pool`'s arrays as ``jax.ShapeDtypeStruct`` s with their shardings on ``mesh`` (nothing
    allocated): for compiling the engine's programs without a device."""
    return _pool_tree(cfg, pages, page, lambda shape, axes, dt: jax.ShapeDtypeStruct(
        shape, dt or dtype, sharding=_pool_sharding(mesh, axes, shape)), seqs)


def pool_bytes(pool: Pool) -> int:
    """Bytes the pool's arrays hold (all devices together)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(pool))


def scatter(pool: Pool, step: Written, tables: jax.Array, seq_rows: jax.Array | None = None) -> Pool:
    """The pool with a forward's new keys and values (:class:`zoo.model.cache_io.Written`) in the rows' pages:
    position p of row r at page ``tables[r, p // page]``, offset ``p % page``; padding goes nowhere. Linear
    layers' states go to the rows' sequence slots ``seq_rows`` [b] (out of range: a padding row's, dropped)."""
    out: Pool = {}
    for prefix, kinds in pool.items():
        out[prefix] = {}
        for kind, arrays in kinds.items():
            if kind == "linear":
                assert seq_rows is not None, "linear layers' states go to the rows' sequence slots"
                out[prefix][kind] = put_states(arrays, step.entries[prefix][kind], seq_rows)
                continue
            name0 = next(iter(arrays))
            # [n, pages, page, ...] for MLA's arrays (DeepSeek-V3.2's index keys too: a jitted pool's dicts come back
            # sorted, index_k first), k [n, pages, kv_heads, head_dim, page], v [n, pages, kv_heads, page, head_dim]
            page = arrays[name0].shape[2 if name0 in ("latent", "k_pe", "index_k") else (4 if name0 == "k" else 3)]
            n_pages = arrays[name0].shape[1]
            col = jnp.minimum(step.pos // page, tables.shape[1] - 1)
            where = jnp.take_along_axis(tables, col, axis=1)
            pg = jnp.where(step.valid, where, n_pages)[None]  # page n_pages is out of range: dropped
            off = (step.pos % page)[None]
            out[prefix][kind] = put_entries(arrays, step.entries[prefix][kind], pg, off)
    return out


def _row_weights(weights: Weights, adapters: RowAdapters | None, index: jax.Array | None) -> Weights:
    """The weights a batch decodes with: ``weights`` as they are, or with ``adapters`` each row's own LoRA adapter
    (``index`` [b]: 0 the base alone) over their base."""
    if adapters is None:
        return weights
    assert index is not None, "per-row adapters need each row's adapter index"
    return adapters.weights(weights.base, index)


@partial(jax.jit, static_argnums=(0, 8), donate_argnums=(2,))
def prefill_logits(cfg: ModelConfig, weights: Weights, pool: Pool, tokens: jax.Array, valid: jax.Array,
                   tables: jax.Array, lengths: jax.Array, delta: jax.Array | None, fresh: bool,
                   vision: VisionInputs | None = None, adapters: RowAdapters | None = None,
                   index: jax.Array | None = None, seq_rows: jax.Array | None = None
                   ) -> tuple[jax.Array, Pool, jax.Array, jax.Array | None]:
    """Run each row's uncached prompt tokens (``tokens``/``valid`` [b, t], right-padded) after the ``lengths``
    [b] tokens its pages already hold. ``adapters``: LoRA adapters per row, row r's ``index[r]`` (0: none).
    ``seq_rows`` [b]: each row's sequence slot (a model with linear layers: where their states live; a padding
    row's out of range).

    Returns (each row's last-position logits [b, V], the pool, the rows' new lengths, their rope delta).
    ``fresh`` (static): no row holds a cached token yet, so no page is read (the prompts attend to themselves,
    blockwise as in training). The draw is a program of its own (:func:`eval.engine.sampling.draw_rows`, which
    the engine jits once per batch shape): in every prefill and decoding program it was about half of a tiny
    model's compile time."""
    last = jnp.maximum(valid.sum(1) - 1, 0)
    logits, step = forward_step(cfg, _row_weights(weights, adapters, index), tokens, Cache(pool, lengths, delta),
                                valid, fresh=fresh, last=last, vision=vision, entries=True, pages=tables,
                                seq_rows=seq_rows)
    return logits, scatter(pool, step, tables, seq_rows), step.lengths, step.rope_delta


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def decode_logits(cfg: ModelConfig, weights: Weights, pool: Pool, tokens: jax.Array, active: jax.Array,
                  tables: jax.Array, lengths: jax.Array, delta: jax.Array | None,
                  adapters: RowAdapters | None = None, index: jax.Array | None = None,
                  seq_rows: jax.Array | None = None) -> tuple[jax.Array, Pool]:
    """One decoding step of every row: append its last token ``tokens`` [b] (the ``active`` rows only: the others
    write nothing). Returns (each row's logits for its next token [b, V], the pool); ``adapters``/``index``/
    ``seq_rows`` as :func:`prefill_logits`'s."""
    logits, step = forward_step(cfg, _row_weights(weights, adapters, index), tokens[:, None],
                                Cache(pool, lengths, delta), active[:, None], last=jnp.zeros_like(lengths),
                                entries=True, pages=tables, seq_rows=seq_rows)
    return logits, scatter(pool, step, tables, seq_rows)


@partial(jax.jit, static_argnums=(0, 9), donate_argnums=(2,))
def prefill(cfg: ModelConfig, weights: Weights, pool: Pool, tokens: jax.Array, valid: jax.Array,
            tables: jax.Array, lengths: jax.Array, delta: jax.Array | None, sampling: RowSampling,
            fresh: bool, vision: VisionInputs | None = None, adapters: RowAdapters | None = None,
            index: jax.Array | None = None, seq_rows: jax.Array | None = None
            ) -> tuple[tuple[jax.Array, jax.Array], Pool, jax.Array, jax.Array | None]:
    """:func:`prefill_logits` and each row's first new token drawn, as one program (``--compile-only`` lowers
    this: its peak holds both). Returns ((first tokens [b], their log-probabilities), the pool, the rows' new
    lengths, their rope delta)."""
    logits, pool, lengths, delta = prefill_logits(cfg, weights, pool, tokens, valid, tables, lengths, delta, fresh,
                                                  vision, adapters, index, seq_rows)
    return draw_rows(logits, sampling), pool, lengths, delta


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def decode(cfg: ModelConfig, weights: Weights, pool: Pool, tokens: jax.Array, active: jax.Array,
           tables: jax.Array, lengths: jax.Array, delta: jax.Array | None, sampling: RowSampling,
           adapters: RowAdapters | None = None, index: jax.Array | None = None, seq_rows: jax.Array | None = None
           ) -> tuple[tuple[jax.Array, jax.Array], Pool]:
    """:func:`decode_logits` and each row's next token drawn, as one program (``--compile-only`` lowers this).
    Returns ((next tokens [b], their log-probabilities), the pool)."""
    logits, pool = decode_logits(cfg, weights, pool, tokens, active, tables, lengths, delta, adapters, index,
                                 seq_rows)
    return draw_rows(logits, sampling), pool


@partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def rerope(cfg: ModelConfig, pool: Pool, tables: jax.Array) -> Pool:
    """The pool with the keys of the rows' pages (``tables`` [b, P]; pages no other row reads) roped again with
    LongRoPE's long factors: what a row's cache must hold from the call in which it passes
    original_max_position_embeddings on (:func:`zoo.model.longrope.switch_to_long` for a ring cache)."""
    from zoo.model.longrope import rerope_long

    b, p = tables.shape
    out: Pool = {}
    for prefix, kinds in pool.items():
        out[prefix] = {}
        for kind, arrays in kinds.items():
            k = arrays["k"]  # [n, pages, hk, d, page]
            n, _, hk, d, page = k.shape
            g = k[:, tables].transpose(0, 1, 3, 4, 2, 5).reshape(n, b, hk, d, p * page)
            positions = jnp.broadcast_to(jnp.arange(p * page)[None], (b, p * page))
            g = rerope_long(cfg, g, positions).reshape(n, b, hk, d, p, page).transpose(0, 1, 4, 2, 3, 5)
            out[prefix][kind] = {**arrays, "k": k.at[:, tables].set(g)}
    return out
