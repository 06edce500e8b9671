"""The weights a forward pass computes with, as one value: the base, LoRA's adapters beside it, their scale and
their dropout (rate and key).

A run trains either the whole model (``base`` is the trained params, no
adapters) or LoRA's adapters on a frozen base. Rather than every consumer
decoding "the trained params are the adapters when there is a scale, and
the base is then the frozen tree", the train step (and each sampler, each
log-probability program) builds one :class:`Weights` with :meth:`Weights.of`
and hands it down to the task, the model and its layers.

It is a pytree: ``base``, ``adapters`` and the dropout key are its leaves.
``scale`` and the dropout rate are static (the treedef's) when they are
Python numbers, as the train step's are, so they stay constants in the
program exactly as before; a traced scale or rate (a test's, say) is a leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax

from zoo.model.quant import cast_params


def _static(v: Any) -> bool:
    """Whether ``v`` is kept in the treedef (None or a Python number) rather than as a leaf."""
    return v is None or isinstance(v, (bool, int, float))


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Weights:
    """``base`` (the model's params), LoRA ``adapters`` (keyed like ``base``, see :func:`zoo.lora.params.init_lora`;
    None: the base alone) adding ``scale * (dropout(x) @ A) @ B`` to each adapted projection, and LoRA dropout:
    ``dropout`` the rate, ``rng`` the key (None: no dropout, as in evaluation)."""

    base: Any
    adapters: Any = None
    scale: float | jax.Array | None = None
    dropout: float | jax.Array = 0.0
    rng: jax.Array | None = None

    def __post_init__(self) -> None:
        if self.adapters is not None and self.scale is None:
            raise ValueError("LoRA adapters need a scale (zoo.lora.params.lora_scale(lora_cfg))")

    @classmethod
    def of(cls, trained: Any, frozen: Any, scale: float | jax.Array | None, dropout: float | jax.Array = 0.0,
           rng: jax.Array | None = None) -> Weights:
        """The weights of a run whose trained params are ``trained``: with a LoRA ``scale`` they are the adapters
        on the frozen base ``frozen`` (dropout ``dropout`` keyed by ``rng``); without, the whole model."""
        if scale is None:
            return cls(trained)
        return cls(frozen, trained, scale, dropout, rng)

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
        """Leaves: base, adapters, rng and a traced scale or rate; the treedef keeps them when they are numbers."""
        knobs = (self.scale, self.dropout)
        fixed = tuple(_static(v) for v in knobs)
        children = (self.base, self.adapters, self.rng, *(None if f else v for f, v in zip(fixed, knobs)))
        return children, (fixed, tuple(v if f else None for f, v in zip(fixed, knobs)))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> Weights:
        """The inverse of :meth:`tree_flatten`."""
        fixed, constants = aux
        base, adapters, rng, *traced = children
        scale, dropout = (c if f else t for f, c, t in zip(fixed, constants, traced))
        w = object.__new__(cls)  # no __post_init__: jax rebuilds with placeholder leaves
        for name, v in (("base", base), ("adapters", adapters), ("scale", scale), ("dropout", dropout),
                        ("rng", rng)):
            object.__setattr__(w, name, v)
        return w
