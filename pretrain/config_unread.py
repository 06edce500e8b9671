"""Keys a run will not read, one rule for every command: a key that the config file or an override sets to a
value other than its default, and that the run will not read under the rest of the config, is an error naming why
(one line, exit 2, before anything is read or written).

Each config schema lists such keys in its ``UNREAD`` table: each :class:`Unread` a key, the condition under which
the run does not read it and why; :func:`check_unread` checks a config against its schema's table
(:func:`pretrain.config.load_config`, after the schema's own checks). A key set to its default passes: the run is
then exactly what it would be without it, and a config that ``--print-config`` printed (every key, defaults
included) reads back as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zoo.errors import UserError


@dataclass(frozen=True)
class Unread:
    """A key (``grpo.loss_type``) that the run does not read when ``when(cfg)`` holds; ``why`` continues the
    message after the key (``str.format`` ed with ``cfg``: ``{cfg.grpo.advantage}``) and says what to do."""

    key: str
    when: Callable[[Any], bool]
    why: str


def keys_unread(keys: Iterable[str], when: Callable[[Any], bool], why: str) -> tuple[Unread, ...]:
    """One :class:`Unread` for each of ``keys``, all under the same condition and reason."""
    return tuple(Unread(k, when, why) for k in keys)


def value_at(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` in config ``cfg`` (``data.eval_path``)."""
    return functools.reduce(getattr, key.split("."), cfg)


def check_unread(cfg: Any, rules: Iterable[Unread]) -> None:
    """A UserError for the first of ``rules`` whose key ``cfg`` sets to other than its default while the run
    will not read it."""
    default = type(cfg)()  # every schema builds with its defaults alone
    for rule in rules:
        if value_at(cfg, rule.key) != value_at(default, rule.key) and rule.when(cfg):
            raise UserError(f"{rule.key} {rule.why.format(cfg=cfg)}")
