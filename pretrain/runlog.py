"""A run's logs: ``metrics.jsonl`` (the record), TensorBoard (drawn from it), and plain lines where no bar is shown.

``metrics.jsonl`` is the one source of truth. A resumed run trims it (and any
other per-step JSONL log, e.g. ``completions*.jsonl``) to the step it restored,
and draws ``tensorboard/`` again from what is kept, so every step appears once
however often the run was stopped, killed or resumed.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

METRICS_FILE = "metrics.jsonl"
STEP_LOGS = (METRICS_FILE, "completions*.jsonl")  # per-step JSONL logs of a run folder, each record with a "step"
BOARD_DIR = "tensorboard"
# Fields of a record that measure the machine, not the run: they differ between two runs of the same config.
TIMING_FIELDS = ("tokens_per_sec", "step_time", "mfu")


def trim_step_logs(out: Path, step: int) -> list[dict[str, Any]]:
    """Drop every record after ``step`` (and a line torn by a kill) from the run's per-step logs; return the
    metrics records kept. Each file is rewritten whole, then renamed over the old one."""
    kept_metrics: list[dict[str, Any]] = []
    for pattern in STEP_LOGS:
        for f in sorted(out.glob(pattern)):
            kept, lines = [], f.read_text(errors="replace").splitlines()
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill -9: never complete, so never part of the record
                if isinstance(rec, dict) and int(rec.get("step", 0)) <= step:
                    kept.append(rec)
            if len(kept) != len(lines):
                tmp = f.with_name(f.name + ".trim")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                tmp.replace(f)
            if f.name == METRICS_FILE:
                kept_metrics = kept
    return kept_metrics


def add_scalars(board: Any, rec: dict[str, Any]) -> None:
    """One metrics record into TensorBoard (``train/<name>``, or ``eval/...`` as named)."""
    for k, v in rec.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            board.add_scalar(k if k.startswith("eval/") else f"train/{k}", v, rec["step"])


def format_line(rec: dict[str, Any], total: int, eta_s: float | None, keys: list[str]) -> str:
    """One plain log line: step, loss, lr, tokens/s, eta, then ``keys`` (the task's key metrics, eval)."""
    parts = [f"step {rec['step']}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['learning_rate']:.3g}",
             f"tok/s {rec['tokens_per_sec']:,.0f}", f"eta {_duration(eta_s)}"]
    parts += [f"{k} {_num(rec[k])}" for k in keys if rec.get(k) is not None]
    return "  ".join(parts)


def _num(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _duration(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RunLog:
    """The per-step logs of the primary process: metrics.jsonl, TensorBoard and, off a terminal, a plain line.

    Opening it at ``start`` trims the logs to that step and redraws TensorBoard
    from the records kept (see the module docstring).
    """

    def __init__(self, out: Path, start: int, total: int, plain: bool, key_metrics: list[str] | None,
                 writer_cls: type, stream: TextIO | None = None):
        records = trim_step_logs(out, start)
        # TensorBoard holds whatever steps a killed run wrote; drawing it again from the record drops them.
        shutil.rmtree(out / BOARD_DIR, ignore_errors=True)
        self.board = writer_cls(str(out / BOARD_DIR))
        for rec in records:
            add_scalars(self.board, rec)
        self.last: dict[str, Any] = records[-1] if records else {}  # the restored step's record, if it was logged
        self.file = open(out / METRICS_FILE, "a")
        self.total, self.plain, self.keys = total, plain, key_metrics
        self.stream = stream or sys.stdout
        self._first: tuple[float, int] | None = None  # (time, step) of the first record: the eta's baseline

    def record(self, rec: dict[str, Any]) -> None:
        """Append one step's record (flushed: a kill loses at most the line being written)."""
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        add_scalars(self.board, rec)
        if self.plain:
            print(format_line(rec, self.total, self._eta(rec), self._keys(rec)), file=self.stream, flush=True)

    def _keys(self, rec: dict[str, Any]) -> list[str]:
        evals = [k for k in rec if k.startswith("eval")]
        if self.keys is not None:
            return [k for k in self.keys if k in rec] + evals
        known = {"step", "loss", "learning_rate", "tokens_per_sec", "tokens_seen", "grad_norm", "padding_fraction",
                 *TIMING_FIELDS}
        return [k for k in rec if k not in known and not k.startswith("eval")] + evals

    def _eta(self, rec: dict[str, Any]) -> float | None:
        now, step = time.monotonic(), rec["step"]
        left = self.total - step
        if self._first is None:  # the first step compiles: its time says little about the others
            self._first = (now, step)
            return rec.get("step_time", 0.0) * left
        t0, s0 = self._first
        return (now - t0) / max(1, step - s0) * left

    def close(self) -> None:
        """Flush and close the files."""
        self.file.close()
        self.board.close()
