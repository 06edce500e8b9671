"""Config overrides (``key.sub=value``) put into a config tree before it is read: mappings made on the way,
``name[N]`` an item of a list the tree already holds (``data.path[1].weight=0.5``); ``~key.sub`` removes a key or a
whole section the file sets (Hydra's spelling), so a file's LoRA run trains in full with ``~lora``."""

from __future__ import annotations

import re
from typing import Any

from zoo.errors import UserError

_PART = re.compile(r"([^\[\]]+)(?:\[(\d+)\])?")  # `weight`, or `path[1]`: a list item


def set_override(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Put an override's ``value`` at ``dotted`` in ``tree``, making mappings on the way; ``name[N]`` is item N of
    a list the tree already holds (``data.path[1].weight``: the weight of a mixture's second source)."""
    parts = dotted.split(".")
    node = tree
    for n, part in enumerate(parts):
        m = _PART.fullmatch(part)
        if m is None:
            raise UserError(f"override {dotted!r}: write a list item as name[N] (N = 0, 1, ...), e.g. "
                            "data.path[1].weight=0.5")
        name, index = m[1], m[2]
        key = ".".join([*parts[:n], name])
        last = n == len(parts) - 1
        if not last and index is None and parts[n + 1].isdigit():  # `data.path.1.weight`
            raise UserError(f"override {dotted!r}: index a list as {key}[{parts[n + 1]}], e.g. "
                            f"{key}[{parts[n + 1]}]{''.join('.' + q for q in parts[n + 2:])}=...")
        if index is not None:
            items, i = _list_of(node, name, int(index), key, dotted), int(index)
            if last:
                items[i] = value
                return
            if isinstance(items[i], str) and key == "data.path":  # a source given as a plain path
                items[i] = {"path": items[i]}
            if not isinstance(items[i], dict):
                raise UserError(f"override {dotted!r}: {key}[{i}] is {items[i]!r}, not a mapping of keys")
            node = items[i]
            continue
        if last:
            node[name] = value
            return
        nxt = node.get(name)
        if isinstance(nxt, str) and key == "model":
            nxt = {"path": nxt}
        if isinstance(nxt, list):
            raise UserError(f"override {dotted!r}: {key} is a list; name one of its {len(nxt)} items as {key}[N], "
                            f"e.g. {key}[0].{parts[n + 1]}=...")
        if not isinstance(nxt, dict):
            nxt = {}
        node[name] = nxt
        node = nxt


def remove_override(tree: dict[str, Any], dotted: str) -> None:
    """Remove ``dotted`` (a key or a whole section, ``lora``) from ``tree``, so the run reads its default; a key
    the tree does not set is a UserError (a misspelt removal would otherwise pass unnoticed)."""
    *parents, last = dotted.split(".")
    node: Any = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        raise UserError(f"override '~{dotted}': the config sets no {dotted} to remove")
    del node[last]


def _list_of(node: dict[str, Any], name: str, index: int, key: str, dotted: str) -> list[Any]:
    """The list ``node[name]`` that an override's ``key[index]`` names, checked to hold item ``index``."""
    items = node.get(name)
    if not isinstance(items, list):
        raise UserError(f"override {dotted!r}: {key} is {'unset' if items is None else repr(items)}, not a list; "
                        "[N] names an item of a list that the config file (or an earlier override) sets")
    if not 0 <= index < len(items):
        span = f" (index 0 to {len(items) - 1})" if items else ""
        raise UserError(f"override {dotted!r}: {key} has {len(items)} items{span}, no item {index}")
    return items
