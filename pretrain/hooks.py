"""What the loop does after each training step, as hooks: each owns its files and trims them on a resume.

The loop (pretrain/loop.py) yields a :class:`StepInfo` per step; a run's
:class:`Hooks` pass it to each :class:`Hook` in the order they were added,
every ``every`` steps and at the last (:meth:`Hooks.add`, the one public call;
``train(hooks=...)`` takes a caller's). The built-in hooks are added through it
in this order: evaluation (every ``eval_every``), the caller's (the training
commands add scored ``eval.tasks``: eval/during_training.py), the task's own,
the metrics log and checkpoints (every step). A hook learns the run's model
once it is loaded (:meth:`Hook.setup`) and opens at the step the run starts from (0, or the
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
from typing import Any, Protocol

from pretrain.batch import Rollout, TokenBatch
from zoo.data.jsonl import read_records
from zoo.lora.params import LoraConfig
from zoo.model.config import ModelConfig
from zoo.storage import RunPath, is_remote


@dataclass
class StepInfo:
    """One training step just taken: its number (1-based), the train state after it, its metrics record (what
    ``metrics.jsonl`` gets, hooks may add to it before the metrics hook writes it) and an online task's
    :class:`Rollout`."""

    step: int
    total: int
    state: dict[str, Any]
    record: dict[str, Any]
    rollout: Rollout[TokenBatch] | None = None
    loss: float = 0.0
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # name -> rows a hook hands the trackers

    @property
    def last(self) -> bool:
        """Whether this is the run's last step."""
        return self.step == self.total


@dataclass(frozen=True)
class RunModel:
    """The model a run trains, as a hook may read it once it is loaded: its config, the tokenizer, the LoRA
    settings (None: full fine-tuning) and the frozen base LoRA's adapters sit on (None without LoRA)."""

    mcfg: ModelConfig
    tokenizer: Any
    lora: LoraConfig | None
    frozen: dict[str, Any] | None


class Hook(Protocol):
    """A step hook: a class that subclasses it gets a no-op for every method it leaves out; one that cannot
    import the loop (eval/'s) is a hook by having the four methods."""

    def setup(self, model: RunModel) -> None:
        """Once the model is loaded, before :meth:`start`."""
        return None

    def start(self, step: int) -> None:
        """The run (re)starts after ``step`` steps: drop what the hook wrote for later steps."""
        return None

    def on_step(self, info: StepInfo) -> None:
        """After each step the hook's period passes it (:meth:`Hooks.add`)."""
        return None

    def close(self) -> None:
        """At the end of the run, however it ends."""
        return None


class Hooks:
    """A run's hooks in the order added, each with its period."""

    def __init__(self) -> None:
        self.added: list[tuple[Hook, int]] = []

    def add(self, hook: Hook, every: int = 1) -> None:
        """Run ``hook`` after every ``every``-th step and after the last (``every=1``: each step; 0: never, though
        it is still set up, started and closed)."""
        if every < 0:
            raise ValueError(f"a hook's period is a step count >= 0, got {every}")
        self.added.append((hook, every))

    def extend(self, other: Hooks) -> None:
        """Add ``other``'s hooks, in their order, with their periods."""
        self.added += other.added

    def setup(self, model: RunModel) -> None:
        """Tell every hook the run's model."""
        for hook, _ in self.added:
            hook.setup(model)

    def start(self, step: int) -> None:
        """Open every hook at the step the run starts from."""
        for hook, _ in self.added:
            hook.start(step)

    def on_step(self, info: StepInfo) -> None:
        """Pass the step to each hook whose period it is (or the last step)."""
        for hook, every in self.added:
            if every and (info.step % every == 0 or info.last):
                hook.on_step(info)

    def close(self) -> None:
        """Close every hook."""
        for hook, _ in self.added:
            hook.close()


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


def trim_jsonl(path: Path | RunPath, step: int) -> list[dict[str, Any]]:
    """Drop every record of the JSONL log ``path`` after ``step`` (and a line torn by a kill); return the records
    kept. The file (if any) is rewritten whole, then renamed over the old one (an object, on object storage, is
    written whole in one call)."""
    records, lines = read_records(path)
    kept = [rec for rec in records if int(rec.get("step", 0)) <= step]
    if len(kept) != lines and is_remote(path):
        path.write_text("".join(json_line(r) for r in kept))
    elif len(kept) != lines:
        tmp = path.with_name(path.name + ".trim")
        tmp.write_text("".join(json_line(r) for r in kept))
        tmp.replace(path)
    return kept


@dataclass
class JsonlLog(Hook):
    """A per-step JSONL log of the run folder: trimmed to the start step, then appended to (flushed per write,
    so a kill loses at most the line being written). On object storage, which has no append, the log is written
    whole at each write (one object, replaced whole: a kill loses at most the last write)."""

    path: Path | RunPath
    kept: list[dict[str, Any]] = field(default_factory=list)  # the records kept at the start
    _file: Any = None
    _lines: list[str] = field(default_factory=list)  # on object storage: every line of the log, rewritten whole

    def start(self, step: int) -> None:
        self.kept = trim_jsonl(self.path, step)
        self._lines = [json_line(r) for r in self.kept]

    def write(self, records: list[dict[str, Any]]) -> None:
        """Append ``records``, each one line of strict JSON (:func:`json_line`)."""
        if is_remote(self.path):
            self._lines += [json_line(r) for r in records]
            self.path.write_text("".join(self._lines))
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        self._file.write("".join(json_line(r) for r in records))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
