"""Scored tasks during training (config ``eval.tasks``), run every ``eval_every`` steps: `zoo eval`'s own tasks
and lm-evaluation-harness's (a name that is neither a shipped task nor a YAML file, scored through
eval/harness.py when the eval extra is installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import jax

from pretrain.config import TrainConfig
from zoo.errors import UserError
from zoo.lora.adapters import LoraConfig, merge_lora
from zoo.model.config import ModelConfig


def read_eval_tasks(cfg: TrainConfig) -> tuple[list[Any], list[str], Any]:
    """``eval.tasks`` read and checked: (`zoo eval`'s tasks, lm-eval task names, lm-eval's TaskManager or None).
    Task files and lm-eval names are checked here; the trainer calls it before the model loads, so a bad name is
    said at once (reading it again is cheap: lm-eval's index is built once per process)."""
    from eval.task_files import resolve_tasks, shipped_tasks

    spec = cfg.eval.tasks
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
        manager = task_manager(cfg.eval.include_path)
        check_task_names(harness, manager, "eval.tasks")
    return tasks, harness, manager


class TrainingEval:
    """The run's eval tasks, read and checked once before the first step, then scored on the live weights."""

    def __init__(self, cfg: TrainConfig, mcfg: ModelConfig, tokenizer: Any, lora_cfg: LoraConfig | None):
        self.tasks, self.harness, self.manager = read_eval_tasks(cfg)
        if (self.tasks or self.harness) and jax.process_count() > 1:
            raise UserError("eval.tasks runs in single-process training only; score the run's checkpoints "
                            "with `zoo eval` instead")
        self.cfg, self.mcfg, self.tokenizer, self.lora_cfg = cfg, mcfg, tokenizer, lora_cfg

    def __bool__(self) -> bool:
        return bool(self.tasks or self.harness)

    def __call__(self, params: dict, frozen: dict | None) -> dict[str, float]:
        """``{"eval/TASK/METRIC": value}`` for the current weights (LoRA adapters merged into a temporary copy)."""
        from eval.scoring import evaluate

        weights = merge_lora(self.mcfg, cast(dict, frozen), params, self.lora_cfg) if self.lora_cfg else params
        out: dict[str, float] = {}
        if self.tasks:
            res = evaluate(self.mcfg, weights, self.tokenizer, self.tasks, limit=self.cfg.eval.limit,
                           batch_size=self.cfg.eval.batch_size, progress=False)
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

        lm = LmzooLM(cfg=self.mcfg, params=weights, tokenizer=self.tokenizer, batch_size=self.cfg.eval.batch_size,
                     progress=False)
        res = lm_eval.simple_evaluate(model=lm, tasks=self.harness, limit=self.cfg.eval.limit,
                                      task_manager=self.manager, bootstrap_iters=0, log_samples=False)
        out = {}
        for task, metrics in res["results"].items():
            for key, value in metrics.items():
                metric, _, filt = key.partition(",")
                if filt and isinstance(value, (int, float)) and not metric.endswith("_stderr"):
                    name = metric if filt == "none" else f"{metric}_{filt}"
                    out[f"eval/{task}/{name}"] = float(value)
        return out
