"""GRPO's completions log (``completions.jsonl`` of the run folder): each logged step's prompts, completions,
rewards and advantages, one record per completion."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pretrain.hooks import JsonlLog, StepInfo

COMPLETIONS_FILE = "completions.jsonl"


def completion_records(step: int, prompts: list, texts: list[str], ids: list[list[int]], names: list[str],
                       per_fn: np.ndarray, total: np.ndarray, adv: np.ndarray) -> list[dict[str, Any]]:
    """One ``completions.jsonl`` record per completion of loop step ``step`` (1-based): its prompt, text, ids,
    weighted total ``reward``, ``advantage``, and each function's value (None: did not apply) under
    ``rewards`` by function name, a namespace of their own, so that no function's name (``reward``, ``step``)
    can overwrite a field of the record."""
    out = []
    for r in range(len(texts)):
        out.append({"step": step, "prompt": prompts[r], "completion": texts[r], "completion_ids": ids[r],
                    "reward": float(total[r]), "advantage": float(adv[r]),
                    "rewards": {name: None if np.isnan(v) else float(v) for name, v in zip(names, per_fn[r])}})
    return out


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``completions.jsonl`` records as the trackers' ``completions`` table (``report_to``): TRL's columns,
    step, prompt (a conversation as its JSON), completion, each reward function's value (``rewards/<name>``, a
    namespace of their own, as in the record), reward and advantage."""
    return [{"step": r["step"], "prompt": r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"]),
             "completion": r["completion"],
             **{f"rewards/{k}": v for k, v in r["rewards"].items()}, "reward": r["reward"], "advantage": r["advantage"]}
            for r in records]


class CompletionsLog(JsonlLog):
    """GRPO's completions log: what each rollout gave to log, appended after its step (and handed to the trackers
    as a table)."""

    def on_step(self, info: StepInfo) -> None:
        """Append the records the step's rollout gave (none on most steps: ``grpo.log_completions_every``)."""
        if info.rollout is not None and info.rollout.log:
            self.write(info.rollout.log)
            info.tables["completions"] = table_rows(info.rollout.log)
