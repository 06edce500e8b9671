"""Config values as a schema's keys take them: a YAML value coerced to its key's type, checked against the key's
``choices`` and ``range``, and the dotted keys of a schema (pretrain/config.py reads configs with them)."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, cast

from zoo.errors import UserError


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of dataclass ``cls`` (``data.seq_len``, ...), in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        t = field_type(cls, f.name)
        if dataclasses.is_dataclass(t):
            out += schema_keys(cast(type, t), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def field_type(cls: type, name: str) -> Any:
    """The resolved type of dataclass ``cls``'s field ``name``."""
    return typing.get_type_hints(cls)[name]


def _type_name(t: Any) -> str:
    args = [a for a in typing.get_args(t) if a is not type(None)]
    base = args[0] if args else t
    name = getattr(base, "__name__", str(base))
    return f"{name} or null" if type(None) in typing.get_args(t) else name


def coerce(key: str, value: Any, t: Any) -> Any:
    """``value`` as config key ``key`` of type ``t`` takes it (``"3e-4"`` a float, ``"yes"`` a bool); a UserError
    that names the key and the type where it cannot be."""
    optional = type(None) in typing.get_args(t) or t is Any  # Any: null too (grpo.environment's unset value)
    if value is None:
        if optional:
            return None
        raise UserError(f"config key '{key}' must be {_type_name(t)}, not null")
    base = next((a for a in typing.get_args(t) if a is not type(None)), t) if isinstance(t, types.UnionType) else t
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)  # also "3e-4", which YAML 1.1 reads as a string
            if not math.isfinite(number):  # no key means anything by NaN or infinity: they ruin a run silently
                raise UserError(f"config key '{key}' must be a finite number, got {value!r}")
            return number
        if base is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(.inf)
        raise UserError(f"config key '{key}' must be {_type_name(t)}, got {value!r}") from None
    return value


_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])$")


def check_range(key: str, value: float, interval: str, why: str = "") -> None:
    """A UserError unless ``value`` lies in ``interval`` (``"[0, 1)"``, ``"(0, inf)"``: brackets closed, parentheses
    open); the message names the key, the allowed range (and ``why``, when given) and the value."""
    m = _INTERVAL.match(interval)
    if m is None:
        raise ValueError(f"{key}: bad range {interval!r} in the schema")
    lo, hi = float(m[2]), float(m[3])
    above = lo < value if m[1] == "(" else lo <= value
    below = value < hi if m[4] == ")" else value <= hi
    if not (above and below):
        reason = f" ({why})" if why else ""
        raise UserError(f"config key '{key}' must be {_range_words(m[1], lo, hi, interval)}{reason}, got {value!r}")


def _range_words(opening: str, lo: float, hi: float, interval: str) -> str:
    """An interval as the errors say it: "positive", "at least 1", or "in [0, 1)"."""
    if hi != math.inf:
        return f"in {interval}"
    if opening == "(":
        return "positive" if lo == 0 else f"greater than {lo:g}"
    return f"at least {lo:g}"


def check_field(key: str, value: Any, f: dataclasses.Field[Any]) -> None:
    """The value of field ``f`` (already of its type) among its ``choices`` and in its ``range`` (null passes)."""
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(f"config key '{key}' is {value!r}; choose one of {', '.join(choices)}")
    interval = f.metadata.get("range")
    if interval and isinstance(value, (int, float)) and not isinstance(value, bool):
        check_range(key, value, interval, f.metadata.get("why", ""))
