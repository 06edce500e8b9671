"""Scored tasks during training (a run's ``eval.tasks``), as a step hook of the shared loop: `zoo eval`'s own tasks
and lm-evaluation-harness's (a name that is neither a shipped task nor a YAML file, scored through eval/harness.py
when the eval extra is installed), on the live weights, added to the step's metrics record as
``eval/TASK/METRIC``.

The training commands add :class:`ScoredTasks` through the loop's public hook call, every ``eval_every`` steps
(pretrain/cli.py); the loop itself never names it. It is a hook by its shape (``setup``, ``start``, ``on_step``,
``close``: :class:`pretrain.hooks.Hook`'s), so eval/ stands on zoo/ alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import jax

from zoo.errors import UserError
from zoo.lora.params import LoraConfig, merge_lora
from zoo.model.config import ModelConfig


class TrainedModel(Protocol):
    """What the hook reads of the run's model once it is loaded (:class:`pretrain.hooks.RunModel`)."""

    @property
    def mcfg(self) -> ModelConfig: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def lora(self) -> LoraConfig | None: ...
    @property
    def frozen(self) -> dict | None: ...


class Step(Protocol):
    """What the hook reads of a training step (:class:`pretrain.hooks.StepInfo`): the train state after it and
    its metrics record, which the hook adds to."""

    @property
    def state(self) -> dict: ...
    @property
    def record(self) -> dict[str, Any]: ...


def read_eval_tasks(spec: list[str] | str, include_path: str | None) -> tuple[list[Any], list[str], Any]:
    """``eval.tasks`` (``spec``: names and task files, a list or comma-separated) read and checked: (`zoo eval`'s
    tasks, lm-eval task names, lm-eval's TaskManager or None; ``include_path``: lm-eval's extra task folder). Task
    files and lm-eval names are checked here, before the model loads, so a bad name is said at once (lm-eval's
    index is built once per process)."""
    from eval.task_files import resolve_tasks, shipped_tasks

    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec or []) if s and s.strip()]
    shipped = shipped_tasks()
    native = [s for s in items if s in shipped or s.endswith((".yaml", ".yml")) or Path(s).exists()]
    harness = [s for s in items if s not in native]
    tasks = resolve_tasks(native) if native else []
    manager = None
    if harness:
        from eval.harness_run import check_task_names, require_lm_eval, task_manager

        try:
            require_lm_eval()
        except UserError:
            raise UserError(f"eval.tasks {', '.join(harness)}: not shipped tasks nor task files; as "
                            "lm-evaluation-harness task names they need the eval extra: pip install "
                            "'lmzoo[eval]'") from None
        manager = task_manager(include_path, harness)
        check_task_names(harness, manager, "eval.tasks")
    return tasks, harness, manager


def _refuse_images(tasks: list[Any], limit: int | None) -> None:
    """Rows with images are scored by `zoo eval` (which loads the model's image processor), not during training
    yet: the first such row is its one-line error before the model loads."""
    from eval.scoring import image_tasks

    for task in image_tasks(tasks, limit):
        i = next(i for i, row in enumerate(task.rows(limit)) if task.has_images(row))
        raise UserError(f"{task.row_where(i)}: the row has images, which eval.tasks does not score during training "
                        "yet; score the run's checkpoints with `zoo eval` (or leave the task out of eval.tasks)")


class ScoredTasks:
    """The run's eval tasks as a step hook: read and checked when made (before the model loads), then scored on
    the live weights at each step the loop passes it (``eval_every``'s), after the eval loss."""

    def __init__(self, spec: list[str] | str, include_path: str | None, limit: int | None, batch_size: int):
        self.tasks, self.harness, self.manager = read_eval_tasks(spec, include_path)
        if (self.tasks or self.harness) and jax.process_count() > 1:
            raise UserError("eval.tasks runs in single-process training only; score the run's checkpoints "
                            "with `zoo eval` instead")
        self.limit, self.batch_size = limit, batch_size
        self.model: TrainedModel | None = None
        _refuse_images(self.tasks, limit)

    def setup(self, model: TrainedModel) -> None:
        """The run's model, once loaded: its config, tokenizer, LoRA settings and frozen base."""
        self.model = model

    def start(self, step: int) -> None:
        """Nothing to trim: the scores live in the step's metrics record."""

    def on_step(self, info: Step) -> None:
        """The scores of the step's weights, added to its metrics record."""
        info.record.update(self.scores(info.state["params"]))

    def close(self) -> None:
        """Nothing held open."""

    def scores(self, params: dict) -> dict[str, float]:
        """``{"eval/TASK/METRIC": value}`` for the current weights (LoRA adapters merged into a temporary copy)."""
        from eval.scoring import evaluate

        m = cast(TrainedModel, self.model)  # set up before the first step
        weights = merge_lora(m.mcfg, cast(dict, m.frozen), params, m.lora) if m.lora else params
        out: dict[str, float] = {}
        if self.tasks:
            res = evaluate(m.mcfg, weights, m.tokenizer, self.tasks, limit=self.limit,
                           batch_size=self.batch_size, progress=False)
            out.update({f"eval/{name}/{metric}": float(value)
                        for name, r in res["tasks"].items() for metric, value in r["metrics"].items()
                        if isinstance(value, (int, float)) and not metric.endswith("_stderr")})
        if self.harness:
            out.update(self._harness(weights))
        return out

    def _harness(self, weights: dict) -> dict[str, float]:
        """lm-eval's metrics of the harness tasks, named ``eval/TASK/METRIC`` (``METRIC_FILTER`` for a filter
        other than lm-eval's ``none``)."""
        import lm_eval

        from eval.harness import LmzooLM

        m = cast(TrainedModel, self.model)
        lm = LmzooLM(cfg=m.mcfg, params=weights, tokenizer=m.tokenizer, batch_size=self.batch_size, progress=False)
        with _no_environment_report():
            res = lm_eval.simple_evaluate(model=lm, tasks=self.harness, limit=self.limit,
                                          task_manager=self.manager, bootstrap_iters=0, log_samples=False)
        out = {}
        for task, metrics in res["results"].items():
            for key, value in metrics.items():
                metric, _, filt = key.partition(",")
                if filt and isinstance(value, (int, float)) and not metric.endswith("_stderr"):
                    name = metric if filt == "none" else f"{metric}_{filt}"
                    out[f"eval/{task}/{name}"] = float(value)
        return out


@contextlib.contextmanager
def _no_environment_report() -> Iterator[None]:
    """lm-eval's ``simple_evaluate`` without the environment report it adds to its results (torch's collect_env
    runs pip list, nvidia-smi, gcc, lscpu and more: a second or more of subprocesses each call; git describe):
    the hook keeps the metrics alone, every ``eval_every`` steps. The names are restored after the call."""
    import lm_eval.evaluator as evaluator

    saved = {name: getattr(evaluator, name) for name in ("add_env_info", "get_git_commit_hash")
             if hasattr(evaluator, name)}
    for name in saved:
        setattr(evaluator, name, lambda *args: None)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(evaluator, name, f)
