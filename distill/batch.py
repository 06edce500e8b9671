"""GKD's model batch with sampled completions (distill/online.py)."""

from __future__ import annotations

import dataclasses

import jax
from jax.typing import DTypeLike

from pretrain.batch import FLOAT, TokenBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillBatch(TokenBatch):
    """On-policy distillation rows (distill/online.py): the dataset's row, or its prompt with a sampled completion,
    and ``data_weights``, the dataset row's own target weights whatever the row now holds (TRL counts the batch's
    target tokens before sampling: its loss divides by them)."""

    data_weights: jax.Array | None = None

    @classmethod
    def dtypes(cls) -> dict[str, DTypeLike]:
        return {**TokenBatch.dtypes(), "data_weights": FLOAT}
