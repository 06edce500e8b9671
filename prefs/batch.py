"""The batches of pair-layout rows (prefs/pairs.py): :class:`PairBatch` (preference pairs) and :class:`KTOBatch`
(KTO's rows, prefs/unpaired.py), typed pytrees over :class:`pretrain.batch.TokenBatch`."""

from __future__ import annotations

import dataclasses

import jax
from jax.typing import DTypeLike

from pretrain.batch import FLOAT, TokenBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PairBatch(TokenBatch):
    """Preference pairs (prefs/pairs.py), with the reference's per-token log-probabilities when precomputed."""

    ref_logps: jax.Array | None = None

    @classmethod
    def dtypes(cls) -> dict[str, DTypeLike]:
        return {**TokenBatch.dtypes(), "ref_logps": FLOAT}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class KTOBatch(PairBatch):
    """KTO rows (prefs/unpaired.py): the pair layout with each row's ``label`` (1.0 desirable, 0.0 undesirable) on
    every token."""

    label: jax.Array  # every KTO row has one

    @classmethod
    def dtypes(cls) -> dict[str, DTypeLike]:
        return {**PairBatch.dtypes(), "label": FLOAT}
