"""Attention masks of the training forward (causal within each packed document, optionally windowed)
and the sliding window of each layer kind.

The cached forward (:mod:`zoo.decode`) builds its own masks over cache
slots, with the same windows; :func:`attention_mask` is over the rows of
one packed batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.config import ModelConfig


def kind_window(cfg: ModelConfig, kind: str) -> int | None:
    """The sliding window of layers of ``kind`` ("sliding" / "full"): None for full attention."""
    return cfg.sliding_window if kind == "sliding" else None


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
