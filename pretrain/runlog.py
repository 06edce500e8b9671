"""A run's logs: ``metrics.jsonl`` (the record), TensorBoard (drawn from it), and plain lines where no bar is shown.

``metrics.jsonl`` is the one source of truth. :class:`RunLog` is the loop's
metrics hook: started at the step a run restored, it trims the file to it
(:func:`pretrain.hooks.trim_jsonl`) and draws ``tensorboard/`` again from
what is kept, so every step appears once however often the run was stopped,
killed or resumed. Other per-step logs belong to their own hooks.
"""

from __future__ import annotations

import io
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from pretrain.hooks import Hook, JsonlLog, StepInfo
from zoo.storage import RunPath, is_remote, remove_tree, run_path, scheme_of

METRICS_FILE = "metrics.jsonl"
BOARD_DIR = "tensorboard"
# Fields of a record that measure the machine, not the run: they differ between two runs of the same config.
TIMING_FIELDS = ("tokens_per_sec", "step_time", "mfu")


def add_scalars(board: Any, rec: dict[str, Any]) -> None:
    """One metrics record into TensorBoard (``train/<name>``, or ``eval/...`` as named); a non-finite value is
    left out, as metrics.jsonl writes it null (TensorBoard is drawn again from that file on a resume)."""
    for k, v in rec.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
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


class _EventFile:
    """A TensorBoard event file on object storage: kept in memory and written whole at each flush (an object
    store has no append), through the one file-system layer (:mod:`zoo.storage`)."""

    def __init__(self, path: str):
        self.path, self.buffer = run_path(path), io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        self.path.write_bytes(self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _EventFiles:
    """tensorboardX's writer factory for a URL scheme: :class:`_EventFile`s, no folders to make."""

    def open(self, path: str) -> _EventFile:
        return _EventFile(path)

    def directory_check(self, path: str) -> None:
        pass


def _event_files_through_storage(scheme: str) -> None:
    """TensorBoard's event files under ``scheme://`` go through :mod:`zoo.storage` (tensorboardX's own writers
    for gs:// and s3:// read other variables and credentials than gcsfs and s3fs)."""
    from tensorboardX import record_writer

    record_writer.register_writer_factory(scheme, _EventFiles())


class RunLog(Hook):
    """The metrics hook of the primary process: metrics.jsonl, TensorBoard and, off a terminal, a plain line,
    every ``every`` steps and at the last.

    Starting it at a step trims the logs to that step and redraws TensorBoard
    from the records kept (see the module docstring); ``last`` is then the
    restored step's record, if it was logged.

    The plain line's time left is the rate since the end of the first step after the start (fresh or resumed),
    which compiles the step: ``?`` until a second step is done. ``clock``: seconds (a test's own).
    """

    def __init__(self, out: RunPath, total: int, plain: bool, key_metrics: list[str] | None, writer_cls: type,
                 every: int = 1, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.out, self.writer_cls, self.every = out, writer_cls, every
        self.log = JsonlLog(out / METRICS_FILE)
        self.board: Any = None
        self.last: dict[str, Any] = {}
        self.total, self.plain, self.keys = total, plain, key_metrics
        self.stream, self.clock = stream or sys.stdout, clock
        self._base: tuple[float, int] | None = None  # (time, step) at the end of the first step after the start

    def start(self, step: int) -> None:
        self.log.start(step)
        records = self.log.kept
        # TensorBoard holds whatever steps a killed run wrote; drawing it again from the record drops them.
        remove_tree(self.out / BOARD_DIR)
        if is_remote(self.out):
            _event_files_through_storage(scheme_of(self.out) or "")
        self.board = self.writer_cls(str(self.out / BOARD_DIR))
        for rec in records:
            add_scalars(self.board, rec)
        self.last = records[-1] if records else {}
        self.log.write([])  # the file exists from the start, if empty
        self._base = None

    def on_step(self, info: StepInfo) -> None:
        if self._base is None:  # the first step after the start compiled: the rate counts from its end
            self._base = (self.clock(), info.step)
        if info.step % self.every == 0 or info.last:
            self.record(info.record)

    def record(self, rec: dict[str, Any]) -> None:
        """Append one step's record (flushed: a kill loses at most the line being written; strict JSON, a
        non-finite value written null: :func:`pretrain.hooks.json_line`)."""
        self.log.write([rec])
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
        """Seconds left at the rate since the first step after the start (its time is the compile's), None while
        that step is the only one taken."""
        step: int = rec["step"]
        left = self.total - step
        if self._base is None:  # a record written without on_step
            self._base = (self.clock(), step)
        t0, s0 = self._base
        if left <= 0:
            return 0.0
        if step <= s0:
            return None
        return (self.clock() - t0) / (step - s0) * left

    def close(self) -> None:
        """Flush and close the files."""
        self.log.close()
        if self.board is not None:
            self.board.close()
