"""Why `datasets` could not read a data file: the first problem found, named by file and line.

`datasets` raises many kinds of errors for unreadable files, most of them
pyarrow's and none naming a line; :func:`unreadable` looks for the cause itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from zoo.data.row_origin import JSON_SPACE, file_lines, is_json_array

_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
          bool: "true/false", type(None): "null"}


def unreadable(path: str, files: list[Path], fmt: str) -> str | None:
    """One line saying why ``files`` cannot be read (a bad line, files of different formats), or None."""
    try:
        if fmt == "json":
            return _json_problem(path, files)
        if fmt == "parquet":
            return _parquet_problem(path, files)
        if fmt == "text":
            return _text_problem(files)
    except OSError as e:
        return f"data.path {path}: cannot read it ({e})"
    return None


def no_rows(path: str, files: list[Path], fmt: str) -> str | None:
    """When no file of ``files`` holds a row (empty, only blank lines, an empty JSON array): one line saying so
    (`datasets` says ``StopIteration`` or "corresponds to no data"), else None."""
    how = [_why_empty(f, fmt) for f in files]
    if not how or None in how:
        return None
    what = f"the file {how[0]}" if len(files) == 1 else f"each of its {len(files)} files is empty"
    return f"data.path {path}: no rows in it ({what}); add rows, or point data.path at another file"


def _why_empty(f: Path, fmt: str) -> str | None:
    """How ``f`` holds no rows ("is empty", ...), or None when it may hold some."""
    if f.stat().st_size == 0:
        return "is empty"
    if fmt == "json" and is_json_array(f):
        try:
            return "is an empty JSON array" if json.loads(f.read_bytes().decode("utf-8-sig")) == [] else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
    if fmt in ("json", "text") and not any(line.strip(JSON_SPACE) for line in file_lines(f)):
        return "holds only blank lines"
    return None


def _json_problem(path: str, files: list[Path]) -> str | None:
    """The first bad line of the JSON files, else how their columns differ."""
    shapes = {}
    for f in files:
        shape = _json_file_shape(f)
        if isinstance(shape, str):
            return shape
        shapes[f] = shape
    return _columns_differ(path, {f: sorted(s) for f, s in shapes.items()}) or _kinds_differ(path, shapes)


def _json_file_shape(f: Path) -> str | dict[str, tuple[str, str]]:
    """A message naming the first bad line of ``f``, or {column: (kind of its first value, where it is)}."""
    shape: dict[str, tuple[str, str]] = {}
    if is_json_array(f):
        data = f.read_bytes().removeprefix(b"\xef\xbb\xbf")
        try:
            items = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            return f"{f}, line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x}); save the file as UTF-8"
        except json.JSONDecodeError as e:
            return f"{f}, line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
        rows = [(f"item {k}", x) for k, x in enumerate(items, 1)]
        if all(isinstance(x, str) for x in items):
            return {"text": ("a string", f"{f}, item 1")}
    else:
        rows = []
        for n, raw in enumerate(file_lines(f), 1):
            if n == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            s = raw.strip(JSON_SPACE)
            if not s:
                continue
            lead = len(raw) - len(raw.lstrip(JSON_SPACE))
            try:
                text = s.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{f}, line {n}: not valid UTF-8 (byte 0x{s[e.start]:02x} at byte {lead + e.start + 1}); "
                        "save the file as UTF-8")
            try:
                rows.append((f"line {n}", json.loads(text)))
            except json.JSONDecodeError as e:
                return ((not rows and _one_document(f))
                        or f"{f}, line {n}: not valid JSON ({e.msg} at column {lead + e.colno})")
    for where, row in rows:
        if not isinstance(row, dict):
            return (f"{f}, {where}: {_KINDS.get(type(row), type(row).__name__)}, not an object; each row must be "
                    'one JSON object such as {"text": "..."}')
        for k, v in row.items():
            kind = _KINDS.get(type(v), type(v).__name__)
            if v is None:
                continue
            if k in shape and shape[k][0] != kind:
                return (f"{f}, {where}: field '{k}' is {kind}, but {shape[k][0]} on {shape[k][1].split(', ')[-1]}; "
                        "give a field the same type in every row")
            shape.setdefault(k, (kind, f"{f}, {where}"))
    return shape


def _one_document(f: Path) -> str | None:
    """When ``f`` is one JSON document written over several lines: what is wrong with it, else None."""
    try:
        doc = json.loads(f.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        if isinstance(e, json.JSONDecodeError) and e.lineno > 1:
            return f"{f}, line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
        return None
    return (f"{f}: one JSON {_KINDS.get(type(doc), 'value').split()[-1]} over several lines; write one object per line "
            "(JSONL) or an array of objects")


def _columns_differ(path: str, columns: dict[Path, list[str]]) -> str | None:
    """How the files' columns differ (with the way out), or None when they all have the same."""
    groups: dict[tuple[str, ...], list[Path]] = {}
    for f, cols in columns.items():
        groups.setdefault(tuple(cols), []).append(f)
    if len(groups) < 2:
        return None

    def files(fs: list[Path]) -> str:
        return ", ".join(str(f) for f in fs[:2]) + (f" (+{len(fs) - 2} more)" if len(fs) > 2 else "")

    def named(c: tuple[str, ...]) -> str:
        return ", ".join(_ordered(c)) or "no columns"

    parts = "; ".join(f"{files(fs)} has {named(c)}" for c, fs in groups.items())
    sources = ", ".join(f"{{path: {fs[0]}}}" for fs in groups.values())
    return (f"data.path {path}: its files have different columns ({parts}); put one format per folder, or list "
            f"each format as its own source: data.path: [{sources}]")


def _ordered(cols: tuple[str, ...]) -> list[str]:
    """Columns in the order a format names them (prompt before completion), the rest sorted."""
    first = ("text", "messages", "conversations", "prompt", "completion", "instruction", "input", "output",
             "chosen", "rejected")
    return [c for c in first if c in cols] + sorted(c for c in cols if c not in first)


def _kinds_differ(path: str, shapes: dict[Path, dict[str, tuple[str, str]]]) -> str | None:
    seen: dict[str, tuple[str, str]] = {}
    for shape in shapes.values():
        for k, (kind, where) in shape.items():
            if k in seen and seen[k][0] != kind:
                return (f"{where}: field '{k}' is {kind}, but {seen[k][0]} in {seen[k][1]}; give a field the same "
                        "type in every file (or list the files as separate sources: data.path: [{path: ...}, ...])")
            seen.setdefault(k, (kind, where))
    return None


def _parquet_problem(path: str, files: list[Path]) -> str | None:
    import pyarrow.parquet as pq

    schemas = {}
    for f in files:
        try:
            schemas[f] = pq.read_schema(f)
        except Exception as e:  # pyarrow raises several kinds for a file that is not parquet
            return f"{f}: not a readable parquet file ({str(e).splitlines()[0][:200]})"
    diff = _columns_differ(path, {f: sorted(s.names) for f, s in schemas.items()})
    if diff:
        return diff
    first, schema = next(iter(schemas.items()))
    for f, s in schemas.items():
        for name in s.names:
            if s.field(name).type != schema.field(name).type:
                return (f"{f}: column '{name}' is {s.field(name).type}, but {schema.field(name).type} in {first}; "
                        "give a column the same type in every file")
    return None


def _text_problem(files: list[Path]) -> str | None:
    return utf8_problem(files)


def utf8_problem(files: list[Path], chunk: int = 1 << 24) -> str | None:
    """The first line of ``files`` that is not UTF-8, as a message; None when all are (one read, in chunks
    cut at line ends: a UTF-8 character never holds the byte of a line end)."""
    for f in files:
        line, rest = 1, b""
        with open(f, "rb") as fh:
            while True:
                block = fh.read(chunk)
                data = rest + block
                cut = len(data) if not block else data.rfind(b"\n") + 1
                part, rest = data[:cut], data[cut:]
                try:
                    part.decode("utf-8")
                except UnicodeDecodeError as e:
                    n = line + part.count(b"\n", 0, e.start)
                    col = e.start - (part.rfind(b"\n", 0, e.start) + 1) + 1
                    return (f"{f}, line {n}: not valid UTF-8 (byte 0x{part[e.start]:02x} at byte {col} of the line); "
                            "save the file as UTF-8")
                line += part.count(b"\n")
                if not block:
                    break
    return None
