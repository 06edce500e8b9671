"""Scored `zoo eval` tasks during training (config ``eval.tasks``), run every ``eval_every`` steps."""

from __future__ import annotations

from typing import Any

import jax

from zoo.config import ModelConfig
from zoo.errors import UserError
from zoo.lora import LoraConfig, merge_lora

from pretrain.config import TrainConfig


class TrainingEval:
    """The run's eval tasks, read and checked once before the first step, then scored on the live weights."""

    def __init__(self, cfg: TrainConfig, mcfg: ModelConfig, tokenizer: Any, lora_cfg: LoraConfig | None):
        from eval.tasks import resolve_tasks

        spec = cfg.eval.tasks
        self.tasks = resolve_tasks(spec) if spec else []
        if self.tasks and jax.process_count() > 1:
            raise UserError("eval.tasks runs in single-process training only; score the run's checkpoints "
                            "with `zoo eval` instead")
        self.cfg, self.mcfg, self.tokenizer, self.lora_cfg = cfg, mcfg, tokenizer, lora_cfg

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def __call__(self, params: dict, frozen: dict | None) -> dict[str, float]:
        """``{"eval/TASK/METRIC": value}`` for the current weights (LoRA adapters merged into a temporary copy)."""
        from eval.scoring import evaluate

        weights = merge_lora(self.mcfg, frozen, params, self.lora_cfg) if self.lora_cfg else params
        res = evaluate(self.mcfg, weights, self.tokenizer, self.tasks, limit=self.cfg.eval.limit,
                       batch_size=self.cfg.eval.batch_size, progress=False)
        return {f"eval/{name}/{metric}": float(value)
                for name, r in res["tasks"].items() for metric, value in r["metrics"].items()
                if isinstance(value, (int, float)) and not metric.endswith("_stderr")}
