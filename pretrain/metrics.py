"""What a task's loss returns: :class:`LossOutput`, with each metric declaring its own reduction.

A micro-batch's loss is a sum (the step divides by the global batch's count,
so ``grad_accum`` and the mesh change nothing). Its metrics are pytrees that
know how to combine over micro-batches (and eval batches) and how to finish:

* :class:`Mean` — a sum, finished divided by the task's count (a mean over the
  task's unit: target tokens, pairs);
* :class:`Ratio` — its own (sum, count), finished as their ratio (a token mean
  over some other set of tokens, say);
* :class:`Max` — a value, combined by its maximum and finished as it is;
* :class:`MicroMean` — one value per micro-batch, finished as their mean over micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean:
    """A sum, logged divided by the task's count."""

    sum: Any

    def combine(self, other: Mean) -> Mean:
        return Mean(self.sum + other.sum)

    def finish(self, count: Any) -> Any:
        return self.sum / count


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Ratio:
    """A (sum, count) pair, logged as its own ratio (0 where its count is 0)."""

    sum: Any
    count: Any

    def combine(self, other: Ratio) -> Ratio:
        return Ratio(self.sum + other.sum, self.count + other.count)

    def finish(self, count: Any) -> Any:
        return self.sum / jnp.maximum(self.count, 1e-30)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Max:
    """A value, combined by its maximum and logged as it is."""

    value: Any

    def combine(self, other: Max) -> Max:
        return Max(jnp.maximum(self.value, other.value))

    def finish(self, count: Any) -> Any:
        return self.value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Min:
    """A value, combined by its minimum and logged as it is."""

    value: Any

    def combine(self, other: Min) -> Min:
        return Min(jnp.minimum(self.value, other.value))

    def finish(self, count: Any) -> Any:
        return self.value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MicroMean:
    """A value per micro-batch (its ``sum``) and how many micro-batches it holds, logged as their plain mean:
    TRL's metrics that each micro-batch appends once (e.g. DPO's ``logits/*``, a token mean within the
    micro-batch), averaged over the step's micro-batches however many tokens each held."""

    sum: Any
    batches: Any

    def combine(self, other: MicroMean) -> MicroMean:
        return MicroMean(self.sum + other.sum, self.batches + other.batches)

    def finish(self, count: Any) -> Any:
        return self.sum / jnp.maximum(self.batches, 1.0)


Metric = Mean | Ratio | Max | Min | MicroMean


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossOutput:
    """One micro-batch's loss: the objective to differentiate, the loss sum and count it is logged as, and the
    task's other metrics by name."""

    objective: Any
    loss: Any
    count: Any
    metrics: dict[str, Metric] = dataclasses.field(default_factory=dict)

    def combine(self, other: LossOutput) -> LossOutput:
        """Two micro-batches' outputs as one: sums added, each metric combined by its own reduction."""
        return LossOutput(self.objective + other.objective, self.loss + other.loss, self.count + other.count,
                          {k: m.combine(cast(Any, other.metrics[k])) for k, m in self.metrics.items()})

    @staticmethod
    def empty(shapes: LossOutput) -> LossOutput:
        """The identity of :meth:`combine` for outputs of these shapes (``jax.eval_shape``'s): zeros, a Max's
        value -inf and a Min's +inf, so that a scan over micro-batches starts from it."""
        def fill(x: Any, value: float) -> Any:
            return jnp.full(x.shape, value, x.dtype)

        metrics: dict[str, Metric] = {}
        for k, m in shapes.metrics.items():
            if isinstance(m, Max):
                metrics[k] = Max(fill(m.value, -jnp.inf))
            elif isinstance(m, Min):
                metrics[k] = Min(fill(m.value, jnp.inf))
            else:
                metrics[k] = jax.tree.map(lambda x: fill(x, 0.0), m)
        return LossOutput(fill(shapes.objective, 0.0), fill(shapes.loss, 0.0), fill(shapes.count, 0.0), metrics)

    def means(self, count: Any = None) -> dict[str, Any]:
        """The metrics finished: each divided by ``count`` (default: this output's count) or by its own."""
        n = self.count if count is None else count
        return {k: m.finish(n) for k, m in self.metrics.items()}
