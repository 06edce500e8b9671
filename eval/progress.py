"""The progress every `zoo eval` scorer shows while it works through a task: a bar on a terminal, plain lines
elsewhere (a log file or a pipe never holds carriage-return redraws; the training loop does the same)."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm

from zoo.console import is_terminal

LINE_EVERY_S = 30.0  # off a terminal: one line at most this often while a task runs, and one when it ends


def progress_bar(total: int, desc: str, unit: str, progress: bool) -> tqdm:
    """Progress through ``total`` ``unit``s named ``desc`` on stderr (stdout carries results); silent unless
    ``progress``. On a terminal a bar (``leave=False``: it disappears when its task is done, leaving the results
    table readable); elsewhere :class:`ProgressLines`."""
    if progress and not is_terminal(sys.stderr):
        return ProgressLines(total, desc, unit)
    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, file=sys.stderr, leave=False)


class ProgressLines(tqdm):
    """A bar's counting written as plain lines on stderr, ``desc: n/total units (p%), s s``: one every
    ``every_s`` seconds at most, and one at the end. A tqdm (switched off) to its callers: ``update`` and ``close``
    are all they use."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float = LINE_EVERY_S):
        super().__init__(total=total, disable=True)  # tqdm draws nothing; the lines are written here
        self.what, self.unit_name, self.every_s = desc, unit, every_s
        self.started = self.last_line = time.monotonic()
        self.ended = False

    def update(self, n: Any = 1) -> bool | None:
        """Count ``n`` more units; a line if ``every_s`` has passed since the last."""
        self.n += n
        if time.monotonic() - self.last_line >= self.every_s:
            self._line()
        return None

    def close(self) -> None:
        """The last line (once)."""
        if not self.ended:
            self.ended = True
            self._line()

    def _line(self) -> None:
        self.last_line = now = time.monotonic()
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        print(f"{self.what}: {self.n}/{self.total} {self.unit_name}{share}, {now - self.started:.1f} s",
              file=sys.stderr, flush=True)
