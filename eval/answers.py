"""Generated answers as text: cut at stop strings, the part a task compares, and whether it matches the reference.

Plain string work with no JAX, so ``zoo generate`` trims its output with the
same :func:`cut_at_stop` that `generation` tasks score with.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: eval.tasks reads task files and data, which `zoo generate` never needs
    from eval.task_files import Task


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (not including) the first occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def extract(answer: str, pattern: str) -> str:
    """The last match of ``pattern`` in ``answer`` (its first group if it has one), or "" without a match."""
    matches = list(re.finditer(pattern, answer))
    if not matches:
        return ""
    m = matches[-1]
    return m.group(1) if m.re.groups else m.group(0)


def scored_answer(answer: str, task: Task) -> str:
    """The part of a generated answer that is compared: cut at the first stop string, then the regex's pick."""
    answer = cut_at_stop(answer, task.opt("stop", []))
    if task.opt("scorer", "exact_match") == "regex":
        answer = extract(answer, task.opt("regex"))
    return answer.strip() if task.opt("strip_whitespace", False) else answer


def is_correct(answer: str, reference: str, task: Task) -> bool:
    """Whether one generated answer matches its reference under the task's scorer: exactly, as
    lm-evaluation-harness's exact_match compares, or with ``strip_whitespace: true`` without the whitespace
    around both."""
    a = scored_answer(answer, task)
    r = reference.strip() if task.opt("strip_whitespace", False) else reference
    if task.opt("ignore_case", False):
        a, r = a.lower(), r.lower()
    return a == r
