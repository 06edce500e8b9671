"""Where a row of a data file comes from, as a person finds it: "file, line N" (counted from 1, as editors count).

Errors about one row of training or evaluation data name its file and line
(:func:`row_where`, :func:`bad_row`); :mod:`zoo.data.files` records where each
loaded dataset's rows come from (:func:`remember_origin`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from zoo.errors import UserError

JSON_SPACE = b" \t\r"  # what JSON (and pyarrow's JSONL reader) treats as a blank line's content


class RowOrigin:
    """Names row ``i`` of a loaded dataset as its file and line, for error messages.

    ``datasets`` concatenates the files in the order given (sorted, for a folder).
    A JSONL row is a non-blank line (lines of JSON whitespace only are skipped, as
    pyarrow's reader does); a JSON file holding one array has its items as rows;
    a .txt row is a line, blank ones included; a parquet row has no line, only its
    number. Nothing is read until a row is named (only errors do).
    """

    def __init__(self, label: str, files: Sequence[Path] = (), fmt: str = "", copy_of: tuple[Path, str] | None = None):
        self.label, self.files, self.fmt = label, list(files), fmt
        self.copy_of = copy_of  # (a local copy's root, the URL it copies): files are named by their URL
        self._counts: dict[Path, int] = {}

    def where(self, i: int) -> str:
        """``"file, line N"`` (JSONL, text), ``"file, item N"`` (a JSON array), ``"file, row N"`` (parquet, Hub)."""
        try:
            j = i
            for f in self.files:
                n = self._count(f)
                if j < n:
                    return f"{shown(f, self.copy_of)}, {self._name(f, j)}"
                j -= n
        except (OSError, ValueError):  # changed or unreadable since loading: fall back to the row number
            pass
        return f"{self.label}, row {i + 1}"

    def _count(self, f: Path) -> int:
        if f not in self._counts:
            if self.fmt == "parquet":
                import pyarrow.parquet as pq

                self._counts[f] = pq.ParquetFile(f).metadata.num_rows
            elif self.fmt == "text":
                self._counts[f] = sum(1 for _ in file_lines(f))
            elif is_json_array(f):
                self._counts[f] = len(json.loads(f.read_bytes().decode("utf-8-sig")))
            else:
                self._counts[f] = sum(1 for line in file_lines(f) if line.strip(JSON_SPACE))
        return self._counts[f]

    def _name(self, f: Path, j: int) -> str:
        if self.fmt == "parquet":
            return f"row {j + 1}"
        if self.fmt == "text":
            return f"line {j + 1}"
        if is_json_array(f):
            return f"item {j + 1}"
        k = -1
        for n, line in enumerate(file_lines(f), 1):
            k += bool(line.strip(JSON_SPACE))
            if k == j:
                return f"line {n}"
        raise ValueError(f"{f} has fewer rows than when it was loaded")


# data.path as given -> where its rows come from. Module state on purpose: errors about a row are raised deep in a
# task's tokenization, which gets the path, not the loaded dataset.
_ORIGINS: dict[str, RowOrigin] = {}


def remember_origin(path: str, files: list[Path], fmt: str, copy_of: tuple[Path, str] | None = None) -> None:
    """Record that the dataset loaded from ``path`` (as the user wrote it) is ``files`` read as ``fmt``;
    ``copy_of``: (root, URL) when they are a local copy of the objects under URL (zoo/storage.py local_copy)."""
    _ORIGINS[path] = RowOrigin(path, files, fmt, copy_of)


def shown(f: Path, copy_of: tuple[Path, str] | None) -> str:
    """The file ``f`` as a person finds it: itself, or, in a local copy of a bucket's objects, its object's URL."""
    if copy_of is None:
        return str(f)
    root, url = copy_of
    return url.rstrip("/") + ("/" + f.relative_to(root).as_posix() if f != root else "")


def row_where(path: str, i: int) -> str:
    """Row ``i`` (0-based dataset index) of the data loaded from ``path``, as a person finds it:
    ``"data/b.jsonl, line 3"``; rows not loaded by :func:`zoo.data.files.load_dataset_rows` are ``"{path}, row {i + 1}"``."""
    origin = _ORIGINS.get(path)
    return origin.where(i) if origin else f"{path}, row {i + 1}"


def bad_row(path: str, i: int, cause: object) -> UserError:
    """The error for a bad row: where it is, what is wrong, the two ways out."""
    return UserError(f"{row_where(path, i)}: {cause}; fix the row or set data.skip_bad_rows: true")


def file_lines(f: Path) -> Iterator[bytes]:
    """The lines of ``f`` split at \\n only (as pyarrow and datasets split them), without the \\n."""
    with open(f, "rb") as fh:
        for line in fh:
            yield line[:-1] if line.endswith(b"\n") else line


def is_json_array(f: Path) -> bool:
    """Whether a JSON file holds one array (datasets reads its items as rows) rather than one object per line."""
    with open(f, "rb") as fh:
        head = fh.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"[")
