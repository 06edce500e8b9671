"""Sequence-classifier pooling: where a sequence's score is read, as transformers' ``*ForSequenceClassification``
pools (a reward model's training, rm/, and its scoring as a GRPO reward, grpo/reward_model.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def last_positions(segment_ids: jax.Array, inputs: jax.Array, segment: int, pad: int | None) -> jax.Array:
    """Each row's last input position of ``segment`` whose token is not ``pad`` (transformers' pooling: the
    rightmost non-padding token); 0 where the row has none."""
    on = segment_ids == segment
    if pad is not None:
        on = on & (inputs != pad)
    n = on.shape[-1]
    return jnp.where(on.any(-1), n - 1 - jnp.argmax(on[:, ::-1], axis=-1), 0)
