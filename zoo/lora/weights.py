"""The weights a forward pass computes with, as one value: the base, LoRA's adapters beside it, their scale and
their dropout (rate and key).

A run trains either the whole model (``base`` is the trained params, no
adapters) or LoRA's adapters on a frozen base. Rather than every consumer
decoding "the trained params are the adapters when there is a scale, and
the base is then the frozen tree", the set-up path builds a run's
:class:`LoraRun` once (None: full fine-tuning), and the train step and the
loop (for each rollout and evaluation) build one :class:`Weights` with
:meth:`Weights.of` and hand it down to the task, the model and its layers.

It is a pytree: ``base``, ``adapters`` and the dropout key are its leaves.
``scale`` and the dropout rate are static (the treedef's) when they are
Python numbers, as the train step's are, so they stay constants in the
program exactly as before; a traced scale or rate (a test's, say) is a leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax

from zoo.lora.params import LoraConfig, lora_scale
from zoo.model.quant import cast_params


def _static(v: Any) -> bool:
    """Whether ``v`` is kept in the treedef (None or a Python number) rather than as a leaf."""
    return v is None or isinstance(v, (bool, int, float))


@dataclass(frozen=True)
class LoraRun:
    """How a LoRA run's trained adapters join its frozen base: their ``scale``, and the LoRA ``dropout`` rate the
    train step applies (never evaluation or sampling), its masks keyed from ``seed``, the step and the
    micro-batch. Built once from the run's :class:`zoo.lora.params.LoraConfig` (:meth:`of`)."""

    scale: float
    dropout: float = 0.0
    seed: int = 0

    @classmethod
    def of(cls, cfg: LoraConfig | None, seed: int = 0) -> LoraRun | None:
        """The run's LoRA settings of ``cfg`` (None, full fine-tuning: None), dropout keyed from ``seed``."""
        return None if cfg is None else cls(lora_scale(cfg), cfg.dropout, seed)

    @property
    def dropout_seed(self) -> int | None:
        """The seed the train step's dropout keys come from, or None when there is no dropout."""
        return self.seed if self.dropout > 0 else None


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Weights:
    """``base`` (the model's params), LoRA ``adapters`` (keyed like ``base``, see :func:`zoo.lora.params.init_lora`;
    None: the base alone) adding ``scale * (dropout(x) @ A) @ B`` to each adapted projection, and LoRA dropout:
    ``dropout`` the rate, ``rng`` the key (None: no dropout, as in evaluation).

    ``rows`` (static): the adapters are per batch row, each leaf [layers, batch, ...] (one adapter for each row
    of the batch: :meth:`zoo.lora.rows.RowAdapters.select`), for decoding only (no dropout)."""

    base: Any
    adapters: Any = None
    scale: float | jax.Array | None = None
    dropout: float | jax.Array = 0.0
    rng: jax.Array | None = None
    rows: bool = False

    def __post_init__(self) -> None:
        if self.adapters is not None and self.scale is None:
            raise ValueError("LoRA adapters need a scale (zoo.lora.params.lora_scale(lora_cfg))")
        if self.rows and self.rng is not None:
            raise ValueError("per-row LoRA adapters (rows=True) decode only: no dropout key")

    @classmethod
    def of(cls, trained: Any, frozen: Any, lora: LoraRun | None, rng: jax.Array | None = None) -> Weights:
        """The weights of a run whose trained params are ``trained``: with ``lora`` they are the adapters on the
        frozen base ``frozen``, with LoRA dropout keyed by ``rng`` (None: none, as in evaluation and sampling);
        without, the whole model."""
        if lora is None:
            return cls(trained)
        return cls(frozen, trained, lora.scale, 0.0 if rng is None else lora.dropout, rng)

    @classmethod
    def wrap(cls, params: Any) -> Weights:
        """``params`` if already :class:`Weights`, else the plain params (a base alone) as Weights."""
        return params if isinstance(params, Weights) else cls(params)

    @property
    def trained(self) -> Any:
        """What a run with these weights trains: the adapters with LoRA, else the base."""
        return self.base if self.adapters is None else self.adapters

    def cast(self, compute: Any) -> Weights:
        """The base cast to ``compute`` (:func:`zoo.model.quant.cast_params`); the adapters stay as they are."""
        return replace(self, base=cast_params(self.base, compute))

    def without_dropout(self) -> Weights:
        """The same weights with no dropout (evaluation, sampling)."""
        return replace(self, dropout=0.0, rng=None)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Leaves: base, adapters, rng and a traced scale or rate; the treedef keeps them when they are numbers,
        and ``rows``."""
        knobs = (self.scale, self.dropout)
        fixed = tuple(_static(v) for v in knobs)
        children = (self.base, self.adapters, self.rng, *(None if f else v for f, v in zip(fixed, knobs)))
        return children, (fixed, tuple(v if f else None for f, v in zip(fixed, knobs)), self.rows)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> Weights:
        """The inverse of :meth:`tree_flatten`."""
        fixed, constants, rows = aux
        base, adapters, rng, *traced = children
        scale, dropout = (c if f else t for f, c, t in zip(fixed, constants, traced))
        w = object.__new__(cls)  # no __post_init__: jax rebuilds with placeholder leaves
        for name, v in (("base", base), ("adapters", adapters), ("scale", scale), ("dropout", dropout),
                        ("rng", rng), ("rows", rows)):
            object.__setattr__(w, name, v)
        return w
