"""What the loop does after each training step, as hooks: each owns its files and trims them on a resume.

The loop (pretrain/loop.py) yields a :class:`StepInfo` per step; every
:class:`Hook` sees it. A hook opens at the step the run starts from (0, or the
restored checkpoint's), and a hook that writes a per-step JSONL log trims it
there with :func:`trim_jsonl`, the one atomic trim: every record after that
step, and any line torn by a kill, is dropped, and the file is rewritten whole
to a temporary file, then renamed over the old one. So every step appears once
however often the run was stopped, killed or resumed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.batch import Rollout
from zoo.data.jsonl import read_records


@dataclass
class StepInfo:
    """One training step just taken: its number (1-based), the train state after it, its metrics record (what
    ``metrics.jsonl`` gets, hooks may add to it before the metrics hook writes it) and an online task's
    :class:`Rollout`."""

    step: int
    total: int
    state: dict
    record: dict[str, Any]
    rollout: Rollout | None = None
    loss: float = 0.0

    @property
    def last(self) -> bool:
        """Whether this is the run's last step."""
        return self.step == self.total


class Hook:
    """A step hook; every method is a no-op by default."""

    def start(self, step: int) -> None:
        """The run (re)starts after ``step`` steps: drop what the hook wrote for later steps."""

    def on_step(self, info: StepInfo) -> None:
        """After each step."""

    def close(self) -> None:
        """At the end of the run, however it ends."""


def json_line(record: Any) -> str:
    """``record`` as one line of strict JSON: a non-finite float (NaN, a metric over nothing; inf) is written
    null, since NaN and Infinity are no JSON and strict readers reject the line."""
    return json.dumps(_finite(record)) + "\n"


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def trim_jsonl(path: Path, step: int) -> list[dict[str, Any]]:
    """Drop every record of the JSONL log ``path`` after ``step`` (and a line torn by a kill); return the records
    kept. The file (if any) is rewritten whole, then renamed over the old one."""
    records, lines = read_records(path)
    kept = [rec for rec in records if int(rec.get("step", 0)) <= step]
    if len(kept) != lines:
        tmp = path.with_name(path.name + ".trim")
        tmp.write_text("".join(json_line(r) for r in kept))
        tmp.replace(path)
    return kept


@dataclass
class JsonlLog(Hook):
    """A per-step JSONL log of the run folder: trimmed to the start step, then appended to (flushed per write,
    so a kill loses at most the line being written)."""

    path: Path
    kept: list[dict[str, Any]] = field(default_factory=list)  # the records kept at the start
    _file: Any = None

    def start(self, step: int) -> None:
        self.kept = trim_jsonl(self.path, step)

    def write(self, records: list[dict[str, Any]]) -> None:
        """Append ``records``, each one line of strict JSON (:func:`json_line`)."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        self._file.write("".join(json_line(r) for r in records))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
