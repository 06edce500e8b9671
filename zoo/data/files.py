"""Reading data files, folders and Hub datasets into `datasets` rows, shared by training and evaluation.

Local .jsonl/.json/.parquet/.txt files (or a folder of one kind) are read with
`datasets`, and so are such files on object storage (``gs://``, ``s3://``), from a
local copy (zoo/storage.py ``local_copy``); a name like ``user/set`` that is not a local path is a Hub dataset.
Unreadable files raise a UserError that names the file and line
(:mod:`zoo.data.problems`), and each loaded dataset remembers where its
rows come from, for later errors about one row (:mod:`zoo.data.row_origin`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zoo.data.problems import no_rows, unreadable, utf8_problem
from zoo.data.row_origin import remember_origin, shown
from zoo.errors import UserError
from zoo.storage import is_remote, local_copy

SUFFIX_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_rows(path: str, text_field: str, split: str = "train") -> tuple[Any, str]:
    """A `datasets` Dataset of the local file(s) at ``path`` (or of a Hub dataset) and its text column."""
    ds, kind = load_dataset_rows(path, split)
    return ds, text_column(ds, "text" if kind == "text" else text_field, path)


def load_dataset_rows(path: str, split: str = "train") -> tuple[Any, str]:
    """(the `datasets` Dataset of the local file(s) at ``path`` or of a Hub dataset, its file kind)."""
    import datasets

    datasets.disable_progress_bars()
    p = local_copy(path, "data.path")  # a gs:// or s3:// file or folder: read from a copy in lmzoo's cache
    copy_of = (p, path) if is_remote(path) else None  # errors name the objects, not the copy
    if not p.exists() and looks_like_hub_name(path):
        return hub_rows(path, split), "hub"
    files = sorted(f for f in p.rglob("*") if f.suffix in SUFFIX_FORMATS) if p.is_dir() else [p]
    if not files or not files[0].exists():
        raise UserError(f"data.path {path}: no such file or folder (or no .jsonl/.json/.parquet/.txt in it)")
    fmts = {SUFFIX_FORMATS.get(f.suffix) for f in files}
    fmt = fmts.pop() if len(fmts) == 1 else None
    if fmt is None:
        raise UserError(f"data.path {path}: use one of {', '.join(SUFFIX_FORMATS)} files (one kind per run)")
    if fmt in ("json", "text"):  # pyarrow may take bytes that are not UTF-8, and fail on reading the row later
        bad = utf8_problem(files)
        if bad:
            raise UserError(_named(bad, copy_of))
    import logging

    ds_log = logging.getLogger("datasets")
    level = ds_log.level
    ds_log.setLevel(logging.CRITICAL)  # its "Failed to load JSON ..." log line: the error below says it better
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises many kinds for unreadable files: find the cause ourselves
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UserError(_named(unreadable(path, files, fmt) or no_rows(path, files, fmt)
                               or f"data.path {path}: cannot read it ({first})", copy_of)) from None
    finally:
        ds_log.setLevel(level)
    if len(ds) == 0:  # read, but no rows (a parquet file without any): say so here, not as a failure downstream
        raise UserError(_named(no_rows(path, files, fmt)
                               or f"data.path {path}: no rows in it; add rows, or point data.path at another file",
                               copy_of))
    remember_origin(path, files, fmt, copy_of)
    return ds, fmt


def _named(message: str, copy_of: tuple[Path, str] | None) -> str:
    """``message`` with the files of a local copy named by their objects' URLs (zoo.data.row_origin.shown)."""
    return message if copy_of is None else message.replace(str(copy_of[0]), shown(copy_of[0], copy_of))



def looks_like_hub_name(path: str) -> bool:
    """Whether ``path`` (not a local file) reads as a Hub dataset name: ``name`` or ``user/name``, no suffix."""
    parts = path.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not path.startswith((".", "~")) and Path(path).suffix == ""


def hub_rows(name: str, split: str) -> Any:
    """A Hugging Face Hub dataset (through the `datasets` cache), when online or cached."""
    import logging

    import datasets

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # offline, every retry would log a warning: the error below says it once
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, no such dataset, gated, no such split: all one user-facing answer
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UserError(f"data.path {name}: not a local file or folder, and the Hub dataset could not be loaded "
                        f"({first}); check the name and data.split, or go online once to cache it") from None
    finally:
        hub_log.setLevel(level)
    return ds


def text_column(ds: Any, field: str, path: str) -> str:
    """``field``, checked to be a column of ``ds`` (else a UserError that names the columns and data.text_field)."""
    if field not in ds.column_names:
        raise UserError(f"data.path {path}: no '{field}' field in its rows (columns: {ds.column_names}); "
                        "set data.text_field")
    return field


def indexed_rows(ds: Any, indices: list[int] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index, row) of the rows at ``indices`` (default all), in index order."""
    if indices is None:
        return enumerate(ds)
    order = sorted(indices)
    return zip(order, ds.select(order))

