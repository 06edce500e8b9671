"""The training steps as a generator: each step's batch (an online task's rollout), its updates and its metrics
record, yielded as a :class:`pretrain.hooks.StepInfo` for the loop's hooks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pretrain.batch import Rollout, TokenBatch
from pretrain.config import TrainConfig
from pretrain.data.lanes import global_batch
from pretrain.data.run import RunData
from pretrain.hooks import StepInfo
from pretrain.jit_step import TrainState, TrainStep
from pretrain.task import FrozenInputs, Task
from zoo.data.batching import to_model_batch
from zoo.errors import UserError
from zoo.lora.weights import Weights
from zoo.storage import run_path


@dataclass
class Training:
    """What the steps need: the task, the jitted step, the data, LoRA's frozen base, the weights of the trained
    params (an online task's rollouts compute with them) and the frozen inputs; ``state`` is the train
    state, updated by each step; ``failed_first_step`` tells whether the run's first step failed on the user's
    inputs (an online task's reward function, say)."""

    cfg: TrainConfig
    task: Task[Any]
    step_fn: TrainStep[Any]
    data: RunData
    batch_sharding: NamedSharding
    batch_shape: tuple[int, int, int]
    frozen: dict[str, Any] | None
    weights: Callable[[dict[str, Any]], Weights]  # the trained params' weights, for rollouts (Model.weights)
    frozen_inputs: FrozenInputs
    schedule: Callable[[int], Any]
    state: TrainState
    step_flops: float = 0.0  # model FLOPs of one step (MFU's numerator)
    peak: float | None = None  # the devices' peak FLOP/s (None: unknown, no MFU)
    failed_first_step: bool = False

    def steps(self, start: int, total: int, before: Callable[[int], None]) -> Iterator[StepInfo]:
        """Steps ``start`` .. ``total`` - 1 (0-based), each yielded once taken; ``before(step)`` runs first."""
        cfg, task = self.cfg, self.task
        tokens_per_step = cfg.batch_size * cfg.data.seq_len
        seen = start * tokens_per_step
        updates = task.updates_per_step
        if task.online:
            if self.data.source is None:
                raise UserError("an online task reads one data.path, not a mixture")
            task.start_steps(start, total, self._next_rows, self.data.source)
        try:
            yield from self._steps(start, total, before, seen, updates, tokens_per_step)
        finally:
            if task.online:
                task.end_steps()

    def _steps(self, start: int, total: int, before: Callable[[int], None], seen: int, updates: int,
               tokens_per_step: int) -> Iterator[StepInfo]:
        cfg = self.cfg
        for step in range(start, total):
            before(step)
            t0 = time.perf_counter()
            try:
                rollout, m = self._step(step, updates)
            except UserError:
                self.failed_first_step = step == 0
                raise
            loss = float(m["loss"])
            if not np.isfinite(loss):
                raise UserError(f"loss became {loss} at step {step + 1}; the last good checkpoint is kept in "
                                f"{run_path(cfg.output_dir)}")
            dt = time.perf_counter() - t0
            seen += tokens_per_step
            record = {"step": step + 1, "loss": loss, "learning_rate": float(self.schedule(step * updates)),
                      "grad_norm": float(m["grad_norm"]), "tokens_seen": seen,
                      "tokens_per_sec": tokens_per_step / dt, "step_time": dt,
                      "mfu": self.step_flops / dt / self.peak if self.peak else None,
                      "padding_fraction": float(m["padding"]), **{k: float(v) for k, v in m["task"].items()}}
            if rollout is not None:
                record.update({**rollout.metrics, **rollout.timing(dt)})
            yield StepInfo(step + 1, total, self.state, record, rollout, loss)

    def _next_rows(self) -> dict[str, jax.Array]:
        """The next global batch of data rows (an online task's prompts), laid out on the mesh."""
        return global_batch(next(self.data.batches), self.data.rows, self.batch_sharding, self.batch_shape)

    def _step(self, step: int, updates: int) -> tuple[Rollout[TokenBatch] | None, dict[str, Any]]:
        """Step ``step``'s batch (made by an online task) and its ``updates`` updates; their mean metrics."""
        data, task = self.data, self.task
        rollout = None
        b: TokenBatch
        if task.online:  # the task makes the batch (GRPO: samples completions and scores them)
            assert data.source is not None, "steps() checked: an online task reads one data.path"
            rows = None if task.draws_rows else self._next_rows()
            rollout = task.rollout(self.weights(self.state["params"]), self.frozen_inputs, rows, step, data.source)
            b = rollout.batch
        else:
            b = task.batch(global_batch(to_model_batch(next(data.batches)), data.rows, self.batch_sharding,
                                        self.batch_shape))
        m: Any = None
        for _ in range(updates):
            self.state, one = self.step_fn(self.state, b, self.frozen, frozen_inputs=self.frozen_inputs)
            m = one if m is None else jax.tree.map(jnp.add, m, one)
        if updates > 1:  # each update's metrics, averaged
            m = jax.tree.map(lambda x: x / updates, m)
        return rollout, m
