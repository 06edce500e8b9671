"""The shipped reward functions (``grpo.rewards: [exact_match, final_number, format, length_penalty]``).

Each has TRL's reward-function signature, ``f(prompts, completions, completion_ids, **columns)``:
``prompts`` and ``completions`` are lists of strings, or (conversational data) lists of message lists (a
completion's text is then its last message's content); ``completion_ids`` the completions' token ids;
``columns`` the dataset's other columns, one value per completion. A function returns one reward per
completion, or None where it does not apply (TRL's convention: such rewards drop out of the weighted sum).

The options a ``grpo.rewards`` mapping may give each function are in :data:`OPTIONS`, checked when the
rewards are loaded (:func:`check_options`) so that a typo fails before the model loads, not at step 1. The
data columns each needs (:func:`needed_columns`: exact_match's and final_number's answers, the ``answer``
column or the one their ``answer_field`` names) are checked against the rows before step 1.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

from zoo.errors import UserError

Reward = float | None
ANSWER = "answer"  # the column exact_match and final_number read by default (their option answer_field: another)

# --------------------------------------------------------------------------------------------- completion text


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as it is; a message list's last message's content (a list of
    content parts: its text parts joined; no content, e.g. a tool call only: ''); a single message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        return completion_text(completion[-1]) if len(completion) else ""
    return str(completion)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _column(values: Sequence[Any] | None, n: int) -> Sequence[Any]:
    """A column's values, or n Nones when the dataset lacks the column (the reward then does not apply)."""
    return [None] * n if values is None else values


def _answers(answer: Sequence[Any] | None, answer_field: str, columns: dict[str, Any], n: int) -> Sequence[Any]:
    """The reference answers: the ``answer`` column, or the column ``answer_field`` names (n Nones when the
    dataset lacks it; `grpo train` stops before step 1 instead: :func:`needed_columns`)."""
    return _column(answer if answer_field == ANSWER else columns.get(answer_field), n)


# ------------------------------------------------------------------------------------------------ exact_match


def exact_match(prompts: list, completions: list, completion_ids: list, answer: Sequence[Any] | None = None,
                ignore_case: bool = False, answer_field: str = ANSWER, **columns: Any) -> list[Reward]:
    """1.0 when the completion's text, stripped of surrounding whitespace, equals the row's ``answer`` (``str()``
    of it, stripped), else 0.0; with ``ignore_case`` both are case-folded first. An answer that is a list or
    tuple holds several accepted answers (any one matches). ``answer_field`` names another column that holds
    the answers (e.g. ``target``). None where the answer is None or the dataset has no such column."""
    out: list[Reward] = []
    fold = str.casefold if ignore_case else (lambda s: s)
    for completion, a in zip(completions, _answers(answer, answer_field, columns, len(completions)), strict=True):
        if a is None:
            out.append(None)
            continue
        accepted = {fold(str(x).strip()) for x in (a if isinstance(a, (list, tuple)) else [a]) if x is not None}
        out.append(float(fold(completion_text(completion).strip()) in accepted))
    return out


# ----------------------------------------------------------------------------------------------- final_number

# A number as people write it: an optional sign, digits with or without thousands separators (1,234,567), an
# optional decimal part. A '-' is a sign only where it cannot be a minus between two terms ("3-5" is 3 and 5),
# and digits glued to a letter or a dot (step2, x2, v1.2.3's 3) are not a number of their own. The look-behinds
# name ASCII letters only, so a number right after non-Latin text (答案是42) still counts.
_NUMBER = re.compile(r"""
    (?: (?<![A-Za-z0-9_.)\]}]) [-\u2212] )?      # a sign: '-' or the Unicode minus
    (?<![A-Za-z0-9_.])
    ( [0-9]{1,3} (?:,[0-9]{3})+ (?![0-9]) | [0-9]+ )
    (?: \.[0-9]+ )?
""", re.VERBOSE)
_FRACTION = re.compile(r"(-?)\\[dt]?frac\{(-?[0-9]+(?:\.[0-9]+)?)\}\{(-?[0-9]+(?:\.[0-9]+)?)\}")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces inside it balanced), or None when there is none (or it
    never closes)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _parse_number(s: str) -> float:
    return float(s.replace(",", "").replace("\u2212", "-"))


def last_number(text: str) -> float | None:
    """The number a completion ends on: the last number in its last ``\\boxed{...}`` when it has one (a boxed
    ``\\frac{a}{b}`` is a/b), else the last number in the whole text; None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        # LaTeX's ways of writing 1,234 and 1 234 inside math, and $...$ around it
        text = boxed.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("$", "").strip()
        frac = _FRACTION.fullmatch(text.replace(" ", ""))
        if frac:
            num, den = float(frac[2]), float(frac[3])
            if den:
                return (-1 if frac[1] else 1) * num / den
    last = None
    for match in _NUMBER.finditer(text):
        last = match
    return None if last is None else _parse_number(last[0])


_ANSWER_THOUSANDS = re.compile(r"[-\u2212+]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")


def _answer_number(a: Any) -> float | None:
    """A row's reference answer as a number: a number, or a string that is one (1,234 and -0.5 included);
    None when it is missing, not a number, or not finite."""
    if a is None or isinstance(a, bool):
        return None
    if isinstance(a, numbers.Real):
        x = float(a)
    elif isinstance(a, str):
        s = a.strip()
        if _ANSWER_THOUSANDS.fullmatch(s):
            s = s.replace(",", "")
        try:
            x = float(s.replace("\u2212", "-"))
        except ValueError:
            return None
    else:
        return None
    return x if math.isfinite(x) else None


def final_number(prompts: list, completions: list, completion_ids: list, answer: Sequence[Any] | None = None,
                 tolerance: float = 1e-6, answer_field: str = ANSWER, **columns: Any) -> list[Reward]:
    """1.0 when the completion's final number x is the row's ``answer`` a, |x - a| <= tolerance * max(1, |a|),
    else 0.0 (also 0.0 when the completion has no number).

    The final number is the last number in the completion's last ``\\boxed{...}`` when it has one (it takes
    precedence over the text; a boxed ``\\frac{a}{b}`` is a/b), else the last number in its text: integers and
    decimals, a leading minus sign, thousands separators removed (1,234 is 1234). None where the answer is
    missing, or not a number (a string such as "1,234" or "-0.5" is one; GSM8K's "... #### 72" is not: put
    the number in a column of its own). ``answer_field`` names another column that holds the answers."""
    _check_tolerance(tolerance)
    out: list[Reward] = []
    for completion, a in zip(completions, _answers(answer, answer_field, columns, len(completions)), strict=True):
        ref = _answer_number(a)
        if ref is None:
            out.append(None)
            continue
        x = last_number(completion_text(completion))
        out.append(float(x is not None and abs(x - ref) <= tolerance * max(1.0, abs(ref))))
    return out


def _check_tolerance(tolerance: Any) -> None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not float(tolerance) >= 0:
        raise UserError(f"the final_number reward's tolerance must be a number >= 0 (relative: |x - answer| <= "
                        f"tolerance * max(1, |answer|)), got {tolerance!r}")


# ----------------------------------------------------------------------------------------------------- format

FORMAT_MODES = ("fullmatch", "search")


def _compiled(pattern: Any, mode: Any) -> re.Pattern:
    """The format reward's pattern compiled (DOTALL: '.' spans lines), or a UserError naming what to fix."""
    if mode not in FORMAT_MODES:
        raise UserError(f"the format reward's mode must be one of {', '.join(FORMAT_MODES)}, got {mode!r}")
    if pattern is None:
        raise UserError("the format reward needs a pattern: grpo.rewards: [{function: format, pattern: "
                        "'<think>.*</think>\\s*<answer>.*</answer>'}] (a Python regular expression)")
    if not isinstance(pattern, str):
        raise UserError(f"the format reward's pattern must be a string (a Python regular expression), "
                        f"got {pattern!r}")
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise UserError(f"the format reward's pattern {pattern!r} is not a valid regular expression ({e}); "
                        f"fix it in grpo.rewards") from None


def format(prompts: list, completions: list, completion_ids: list, pattern: str | None = None,
           mode: str = "fullmatch", **_: Any) -> list[Reward]:
    """1.0 when the regular expression ``pattern`` matches the completion's text stripped of surrounding
    whitespace, else 0.0: the whole text (``re.fullmatch``) by default, anywhere in it with ``mode: search``
    (``re.search``). The pattern is compiled with re.DOTALL ('.' matches newlines too). Never None."""
    regex = _compiled(pattern, mode)
    match = regex.fullmatch if mode == "fullmatch" else regex.search
    return [float(match(completion_text(c).strip()) is not None) for c in completions]


# --------------------------------------------------------------------------------------------- length_penalty


def _length_limits(max_length: Any, cache: Any) -> tuple[int, int]:
    """(max_length, cache) checked, cache defaulting to max_length // 4."""
    if max_length is None:
        raise UserError("the length_penalty reward needs max_length (tokens; usually grpo.max_completion_length): "
                        "grpo.rewards: [{function: length_penalty, max_length: 512}]")
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < 1:
        raise UserError(f"the length_penalty reward's max_length must be a whole number of tokens >= 1, "
                        f"got {max_length!r}")
    if cache is None:
        cache = max_length // 4
    if isinstance(cache, bool) or not isinstance(cache, numbers.Integral) or not 0 <= int(cache) <= int(max_length):
        raise UserError(f"the length_penalty reward's cache must be a whole number of tokens from 0 to max_length="
                        f"{max_length}, got {cache!r}")
    return int(max_length), int(cache)


def length_penalty(prompts: list, completions: list, completion_ids: list, max_length: int | None = None,
                   cache: int | None = None, **_: Any) -> list[Reward]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of a completion of L tokens (``completion_ids``):
    0 when L <= max_length - cache; (max_length - cache - L) / cache, falling linearly from 0 to -1, when
    max_length - cache < L <= max_length; -1 when L > max_length. ``max_length`` is required; ``cache`` (the
    length of the linear stretch) defaults to max_length // 4. Never None."""
    max_length, cache = _length_limits(max_length, cache)
    soft = max_length - cache
    out: list[Reward] = []
    for ids in completion_ids:
        n = len(ids)
        # cache == 0 leaves the middle stretch empty (a hard cut at max_length), so the division never runs
        out.append(0.0 if n <= soft else (soft - n) / cache if n <= max_length else -1.0)
    return out


# ------------------------------------------------------------------------------------------------- the catalog

SHIPPED: dict[str, Callable[..., list[Reward]]] = {
    "exact_match": exact_match, "final_number": final_number, "format": format, "length_penalty": length_penalty}
# The keys a grpo.rewards mapping may give each (the rest of a function's keyword arguments are data columns).
OPTIONS: dict[str, tuple[str, ...]] = {
    "exact_match": ("ignore_case", "answer_field"), "final_number": ("tolerance", "answer_field"),
    "format": ("pattern", "mode"), "length_penalty": ("max_length", "cache")}


def shipped_name(fn: Callable) -> str | None:
    """The catalog name of a shipped reward function, None for any other function."""
    return next((n for n, f in SHIPPED.items() if f is fn), None)


def needed_columns(name: str, options: dict[str, Any]) -> tuple[str, ...]:
    """The data columns shipped function ``name`` reads with its grpo.rewards ``options``: the answers' column
    (``answer``, or its ``answer_field``) for exact_match and final_number, none for the others. Without it
    every reward would be None (nothing learned), so `grpo train` checks the rows have it before step 1."""
    return (options.get("answer_field", ANSWER),) if "answer_field" in OPTIONS[name] else ()


def check_options(name: str, options: dict[str, Any]) -> None:
    """A UserError unless ``options`` (a grpo.rewards mapping's keyword arguments) suit shipped function ``name``:
    known keys only (the functions take ``**columns``, so a misspelt key would otherwise be ignored silently),
    and values in range."""
    unknown = sorted(set(options) - set(OPTIONS[name]))
    if unknown:
        raise UserError(f"the {name} reward has no option {', '.join(map(repr, unknown))}; its options: "
                        f"{', '.join(OPTIONS[name])}")
    field = options.get("answer_field", ANSWER)
    if "answer_field" in OPTIONS[name] and (not isinstance(field, str) or not field.strip()):
        raise UserError(f"the {name} reward's answer_field must be a data column's name, got {field!r}")
    if name == "exact_match" and not isinstance(options.get("ignore_case", False), bool):
        raise UserError(f"the exact_match reward's ignore_case must be true or false, got {options['ignore_case']!r}")
    if name == "final_number":
        _check_tolerance(options.get("tolerance", 1e-6))
    if name == "format":
        _compiled(options.get("pattern"), options.get("mode", "fullmatch"))
    if name == "length_penalty":
        _length_limits(options.get("max_length"), options.get("cache"))
