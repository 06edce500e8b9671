"""The progress bar every `zoo eval` scorer shows while it works through a task."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(total: int, desc: str, unit: str, progress: bool) -> tqdm:
    """A bar of ``total`` ``unit``s named ``desc`` on stderr (stdout carries results); silent unless ``progress``.

    ``leave=False``: the bar disappears when its task is done, leaving the results table readable.
    """
    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, file=sys.stderr, leave=False)
