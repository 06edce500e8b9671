"""Attention masks of the training forward (causal within each packed document, optionally windowed, with
bidirectional blocks of image tokens where a vision-language model has them) and the sliding window of each
layer kind.

The cached forward (:mod:`zoo.model.decode`) builds its own masks over cache
slots, with the same windows; :func:`attention_mask` is over the rows of
one packed batch. The training forward builds none of them whole: its
kernels get a :class:`Visibility` (segment ids, row offsets, the window,
shared prefixes) and build each block's mask inside the block
(:mod:`zoo.kernels.blockwise`), or read the segment ids themselves (splash).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from zoo.model.config import ModelConfig


def kind_window(cfg: ModelConfig, kind: str) -> int | None:
    """The sliding window of layers of ``kind`` ("sliding" / "full" / "chunked"): None for full attention. A
    chunked layer's (Llama 4) is its chunk size: a query's keys lie within it, so the kernels skip the keys past it
    and a cache keeps that many slots; the chunk itself is :func:`kind_chunk`'s."""
    if kind == "chunked":
        return cfg.attention_chunk_size
    return cfg.sliding_window if kind == "sliding" else None


def kind_chunk(cfg: ModelConfig, kind: str) -> int | None:
    """The attention chunk of layers of ``kind``: Llama 4's ``attention_chunk_size`` on "chunked" layers (a token
    sees the earlier tokens whose position // chunk is its own), else None."""
    return cfg.attention_chunk_size if kind == "chunked" else None


def chunk_ids(chunk: int | None, positions: jax.Array) -> jax.Array | None:
    """Each token's attention chunk [b, t] (position // chunk: Llama 4's chunked layers), None without chunks."""
    if chunk is None:
        return None
    return positions // chunk if positions.ndim == 2 else positions[0] // chunk


def attention_mask(segment_ids: jax.Array, window: int | None = None,
                   prefix_ids: jax.Array | None = None) -> jax.Array:
    """Boolean [batch, 1, q, k] (broadcast over heads): causal within each packed document, nothing across.

    With ``window`` W a query sees only the W most recent keys, itself included
    (``0 <= q - k < W``, as transformers' sliding-window masks). Within a
    document index distance equals position distance, so packing is exact.

    ``prefix_ids`` [batch, seq] (0 = none) let a token also see the earlier
    tokens of one other segment, its shared prefix: a DPO pair's two answers
    both read the one copy of their prompt (prefs/pairs.py). Index distance then
    exceeds position distance, so this does not combine with ``window``.
    """
    t = segment_ids.shape[1]
    q, k = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    allowed = k <= q
    if window is not None:
        if prefix_ids is not None:
            raise ValueError("attention_mask: shared prefixes (prefix_ids) need full attention, not a sliding-window mask "
                             "mask (its window counts row indices)")
        allowed &= q - k < window
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_ids is not None:
        same |= (prefix_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    return (allowed[None] & same)[:, None]


@partial(jax.tree_util.register_dataclass,
         data_fields=("segment_ids", "key_segment_ids", "prefix_ids", "offset", "block_ids", "key_block_ids",
                      "chunk_ids", "key_chunk_ids"),
         meta_fields=("window", "segments", "lookahead"))
@dataclass(frozen=True)
class Visibility:
    """Which keys each query of a packed batch sees, as :func:`attention_mask` says, but built one block at a time
    (:meth:`block`), so no [seq, seq] array exists.

    ``segment_ids`` [b, tq] are the queries' documents, ``key_segment_ids`` [b, tk] the keys' (the same array
    unless context parallelism gathered the keys: :mod:`zoo.model.context`); ``prefix_ids`` [b, tq] or None, the
    queries' shared prefixes; ``offset`` the row index of the first query among the keys (0, or the shard's
    start under context parallelism: a traced int32); ``window`` the sliding window (None: full attention);
    ``segments`` the most documents a row holds, each one contiguous run of its id (1: one document, then
    padding; None: no bound known), so a kernel may take each document's start and length instead of
    segment ids (:func:`zoo.kernels.choice.cudnn_attention`).

    ``block_ids`` [b, t] or None: bidirectional blocks (a vision-language model's image tokens, Gemma 3; -1
    outside any block): a query also sees every key of its own block, later ones included, so a layer sees
    ``causal OR same-block`` and, windowed, ``window AND (causal OR same-block)`` with the one-sided window
    ``q - k < W`` (transformers' ``create_masks_for_vision_model``). ``lookahead`` bounds how far past a query
    its block's keys reach (the longest block less one), so a kernel skipping the keys after its queries
    (:func:`zoo.kernels.blockwise.key_ranges`) keeps those. ``key_block_ids`` [b, tk] are the keys' block ids
    where they are other rows than the queries' (context parallelism's gathered keys, as ``key_segment_ids``);
    None: the queries' ``block_ids``.

    ``chunk_ids`` [b, t] or None: Llama 4's chunked attention, each token's position // attention_chunk_size: a
    query sees only keys of its own chunk (with ``window`` the chunk size, so kernels skip the keys before it);
    ``key_chunk_ids`` the keys' where they are other rows (None: the queries').
    """

    segment_ids: jax.Array
    key_segment_ids: jax.Array
    prefix_ids: jax.Array | None
    offset: jax.Array
    window: int | None
    segments: int | None = None
    block_ids: jax.Array | None = None
    lookahead: int = 0
    key_block_ids: jax.Array | None = None
    chunk_ids: jax.Array | None = None
    key_chunk_ids: jax.Array | None = None

    def block(self, qs: int, qe: int, ks: int, ke: int) -> jax.Array:
        """Boolean [b, qe - qs, ke - ks]: whether query row qs.. sees key row ks.. (rows local to this array)."""
        q = self.offset + jnp.arange(qs, qe, dtype=jnp.int32)[:, None]
        k = jnp.arange(ks, ke, dtype=jnp.int32)[None, :]
        allowed = (k <= q)[None]
        if self.block_ids is not None:
            keys = self.block_ids if self.key_block_ids is None else self.key_block_ids
            qb, kb = self.block_ids[:, qs:qe, None], keys[:, None, ks:ke]
            allowed = allowed | ((qb == kb) & (qb >= 0))
        if self.window is not None:
            allowed &= (q - k < self.window)[None]
        if self.chunk_ids is not None:
            keys = self.chunk_ids if self.key_chunk_ids is None else self.key_chunk_ids
            allowed &= self.chunk_ids[:, qs:qe, None] == keys[:, None, ks:ke]
        qseg, kseg = self.segment_ids[:, qs:qe, None], self.key_segment_ids[:, None, ks:ke]
        same = qseg == kseg
        if self.prefix_ids is not None:
            same |= (self.prefix_ids[:, qs:qe, None] == kseg) & (kseg != 0)
        return allowed & same


def visibility(segment_ids: jax.Array, window: int | None = None, prefix_ids: jax.Array | None = None,
               segments: int | None = None, block_ids: jax.Array | None = None, lookahead: int = 0,
               chunk_ids: jax.Array | None = None) -> Visibility:
    """The :class:`Visibility` of one packed batch (queries and keys the same rows): :func:`attention_mask`'s
    mask, never built whole; with ``block_ids`` (and their ``lookahead``) each block bidirectional; with
    ``chunk_ids`` (Llama 4's chunked layers) each token sees its own chunk only."""
    if window is not None and prefix_ids is not None:
        raise ValueError("visibility: shared prefixes (prefix_ids) need full attention, not a sliding-window mask "
                         "(its window counts row indices)")
    return Visibility(segment_ids, segment_ids, prefix_ids, jnp.zeros((), jnp.int32), window, segments, block_ids,
                      lookahead, chunk_ids=chunk_ids)


def image_block_ids(tokens: jax.Array, image_token_id: int) -> jax.Array:
    """Int [b, t]: each run of consecutive ``image_token_id`` tokens one block (0, 1, ... along the row), -1
    elsewhere: transformers' ``get_block_sequence_ids_for_mask`` over Gemma 3's ``token_type_ids``."""
    is_image = tokens == image_token_id
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(is_image, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, -1)
