"""The evaluation hook: every ``eval_every`` steps and at the last (its period, pretrain/loop.py), the eval loss
(per source of a mixture too) or the task's own held-out metrics, added to the step's metrics record. Scored
benchmarks (``eval.tasks``) are a hook of their own, added by the training commands
(eval/during_training.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pretrain import preflight
from pretrain.batch import TokenBatch
from pretrain.config import TrainConfig
from pretrain.data.pipeline import packed_batches
from pretrain.data.run import RunData
from pretrain.hooks import Hook, StepInfo
from pretrain.metrics import LossOutput
from zoo.data.batching import Document, Finish, replicated_batch, to_model_batch
from zoo.errors import UserError
from zoo.lora.weights import Weights


class Evaluation(Hook):
    """Eval loss over ``data``'s eval documents with ``eval_fn`` (the step's, frozen inputs bound; ``batch_of``
    types its batches), or the task's own held-out metrics (``own``, of the trained params' ``weights``), at each
    step it is passed."""

    def __init__(self, cfg: TrainConfig, data: RunData, micro: int, mesh: jax.sharding.Mesh,
                 eval_fn: Callable[..., LossOutput], batch_of: Callable[[dict[str, Any]], TokenBatch],
                 weights: Callable[[dict[str, Any]], Weights], primary: bool,
                 own: Callable[..., dict[str, float] | None] | None = None, finish: Finish | None = None,
                 budgets: dict[str, int] | None = None):
        self.cfg, self.data, self.micro, self.mesh, self.batch_of = cfg, data, micro, mesh, batch_of
        # The task's rows as the training batches make them (pretrain.task.Task.finish_rows, row_budgets): the
        # eval rows of a vision-language run get their images' patches as the training rows do.
        self.finish, self.budgets = finish, budgets
        self.own = own  # the task's own held-out metrics (Task.eval_metrics), in place of the eval loss
        self.eval_fn, self.weights = eval_fn, weights
        # A mixture's eval loss per source too (`eval_loss/NAME`), for each source eval set that fills a batch.
        self.eval_sets: dict[str, list[Document]] = {}
        for name, docs in (data.eval_sets if len(data.eval_sets) > 1 and cfg.eval_every else {}).items():
            if preflight.fills_batch(docs, cfg, micro, data.packing, budgets):
                self.eval_sets[name] = docs
            elif primary:
                print(f"warning: the eval set of source {name} ({len(docs)} examples) cannot fill one eval batch of "
                      f"{micro} rows: it counts in eval_loss, but gets no eval_loss/{name} of its own",
                      file=sys.stderr)

    def on_step(self, info: StepInfo) -> None:
        params = info.state["params"]
        own = self.own(self.weights(params), self.data.eval_docs, self.data.source, info.step) \
            if self.own is not None and self.data.eval_docs else None
        if own is not None:
            info.record.update(own)
        elif self.data.eval_docs:
            info.record.update(self.loss(params, self.data.eval_docs))
            for name, docs in self.eval_sets.items():
                info.record[f"eval_loss/{name}"] = self.loss(params, docs)["eval_loss"]

    def loss(self, params: dict[str, Any], docs: list[Document], max_batches: int = 50) -> dict[str, float]:
        """{eval_loss: mean per-target loss, eval_<name>: the task's other metrics} over (up to ``max_batches``)
        packed batches of the eval documents."""
        cfg = self.cfg
        it = packed_batches(docs, cfg.data.seq_len, self.micro, cfg.seed, 1, self.data.packing, cfg.data.max_segments,
                            self.budgets)
        sharding = NamedSharding(self.mesh, PartitionSpec(("data", "fsdp"), None))
        total: LossOutput | None = None
        for _ in range(max_batches):
            try:
                rows = next(it)
                b = to_model_batch(rows if self.finish is None else self.finish(rows))
            except StopIteration:
                break
            one: Any = jax.tree.map(float, self.eval_fn(params, self.batch_of(replicated_batch(b, sharding))))
            total = one if total is None else total.combine(one)
        if total is None or total.count == 0:
            raise UserError("the eval data is shorter than one batch of seq_len tokens; add data or lower "
                            "data.seq_len")
        return {"eval_loss": total.loss / total.count, **{f"eval_{k}": float(v) for k, v in total.means().items()}}
