"""The data pipeline: `datasets` source -> tokenize -> grain packing lanes -> batches -> this process's rows.

Each row of the global batch comes from its own *lane*: lane ``r`` of ``B``
packs (concat-then-split, grain) the shuffled documents ``r, r + B, ...``.
A process reads and tokenizes only the documents of the lanes whose rows its
devices hold, yet the global batch is the same whatever the number of
processes or devices, so a run on 2 hosts follows the 1-host trajectory.

Packed rows carry segment ids and per-document positions, so no token
attends across documents. Each row has seq_len + 1 tokens: inputs are the
first seq_len, targets the last seq_len, and a target counts only when it
continues the same document as its input. Without packing, each document is
one row, truncated or padded (segment id 0) to seq_len + 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np

from zoo.errors import UserError

SUFFIX_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_rows(path: str, text_field: str, split: str = "train") -> tuple[Any, str]:
    """A `datasets` Dataset of the local file(s) at ``path`` (or of a Hub dataset) and its text column."""
    ds, kind = load_dataset_rows(path, split)
    return ds, _field(ds, "text" if kind == "text" else text_field, path)


def load_dataset_rows(path: str, split: str = "train") -> tuple[Any, str]:
    """(the `datasets` Dataset of the local file(s) at ``path`` or of a Hub dataset, its file kind)."""
    import datasets

    datasets.disable_progress_bars()
    p = Path(path).expanduser()
    if not p.exists() and _looks_like_hub_name(path):
        return _hub_rows(path, split), "hub"
    files = sorted(f for f in p.rglob("*") if f.suffix in SUFFIX_FORMATS) if p.is_dir() else [p]
    if not files or not files[0].exists():
        raise UserError(f"data.path {path}: no such file or folder (or no .jsonl/.json/.parquet/.txt in it)")
    fmts = {SUFFIX_FORMATS.get(f.suffix) for f in files}
    if None in fmts or len(fmts) != 1:
        raise UserError(f"data.path {path}: use one of {', '.join(SUFFIX_FORMATS)} files (one kind per run)")
    fmt = fmts.pop()
    if fmt in ("json", "text"):  # pyarrow may take bytes that are not UTF-8, and fail on reading the row later
        bad = _utf8_problem(files)
        if bad:
            raise UserError(bad)
    import logging

    ds_log = logging.getLogger("datasets")
    level = ds_log.level
    ds_log.setLevel(logging.CRITICAL)  # its "Failed to load JSON ..." log line: the error below says it better
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises many kinds for unreadable files: find the cause ourselves
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UserError(_unreadable(path, files, fmt) or f"data.path {path}: cannot read it ({first})") from None
    finally:
        ds_log.setLevel(level)
    _ORIGINS[path] = RowOrigin(path, files, fmt)
    return ds, fmt


# ---- where a row comes from: "file, line N" (counted from 1, as editors count) ------------------------------

class RowOrigin:
    """Names row ``i`` of a loaded dataset as its file and line, for error messages.

    ``datasets`` concatenates the files in the order given (sorted, for a folder).
    A JSONL row is a non-blank line (lines of JSON whitespace only are skipped, as
    pyarrow's reader does); a JSON file holding one array has its items as rows;
    a .txt row is a line, blank ones included; a parquet row has no line, only its
    number. Nothing is read until a row is named (only errors do).
    """

    def __init__(self, label: str, files: list[Path] = (), fmt: str = ""):
        self.label, self.files, self.fmt = label, list(files), fmt
        self._counts: dict[Path, int] = {}

    def where(self, i: int) -> str:
        """``"file, line N"`` (JSONL, text), ``"file, item N"`` (a JSON array), ``"file, row N"`` (parquet, Hub)."""
        try:
            j = i
            for f in self.files:
                n = self._count(f)
                if j < n:
                    return f"{f}, {self._name(f, j)}"
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
                self._counts[f] = sum(1 for _ in _lines(f))
            elif _is_json_array(f):
                self._counts[f] = len(json.loads(f.read_bytes().decode("utf-8-sig")))
            else:
                self._counts[f] = sum(1 for line in _lines(f) if line.strip(_JSON_SPACE))
        return self._counts[f]

    def _name(self, f: Path, j: int) -> str:
        if self.fmt == "parquet":
            return f"row {j + 1}"
        if self.fmt == "text":
            return f"line {j + 1}"
        if _is_json_array(f):
            return f"item {j + 1}"
        k = -1
        for n, line in enumerate(_lines(f), 1):
            k += bool(line.strip(_JSON_SPACE))
            if k == j:
                return f"line {n}"
        raise ValueError(f"{f} has fewer rows than when it was loaded")


_ORIGINS: dict[str, RowOrigin] = {}  # data.path as given -> where its rows come from (set by load_dataset_rows)
_JSON_SPACE = b" \t\r"


def row_where(path: str, i: int) -> str:
    """Row ``i`` (0-based dataset index) of the data loaded from ``path``, as a person finds it:
    ``"data/b.jsonl, line 3"``; rows not loaded by :func:`load_dataset_rows` are ``"{path}, row {i + 1}"``."""
    origin = _ORIGINS.get(path)
    return origin.where(i) if origin else f"{path}, row {i + 1}"


def bad_row(path: str, i: int, cause: object) -> UserError:
    """The error for a bad row: where it is, what is wrong, the two ways out."""
    return UserError(f"{row_where(path, i)}: {cause}; fix the row or set data.skip_bad_rows: true")


def _lines(f: Path) -> Iterator[bytes]:
    """The lines of ``f`` split at \\n only (as pyarrow and datasets split them), without the \\n."""
    with open(f, "rb") as fh:
        for line in fh:
            yield line[:-1] if line.endswith(b"\n") else line


def _is_json_array(f: Path) -> bool:
    """Whether a JSON file holds one array (datasets reads its items as rows) rather than one object per line."""
    with open(f, "rb") as fh:
        head = fh.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"[")


# ---- why datasets could not read the files ---------------------------------------------------------------------

_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
          bool: "true/false", type(None): "null"}


def _unreadable(path: str, files: list[Path], fmt: str) -> str | None:
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
    if _is_json_array(f):
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
        for n, raw in enumerate(_lines(f), 1):
            if n == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            s = raw.strip(_JSON_SPACE)
            if not s:
                continue
            lead = len(raw) - len(raw.lstrip(_JSON_SPACE))
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

    def cols(c: tuple[str, ...]) -> str:
        return ", ".join(_ordered(c)) or "no columns"

    parts = "; ".join(f"{files(fs)} has {cols(c)}" for c, fs in groups.items())
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
    return _utf8_problem(files)


def _utf8_problem(files: list[Path], chunk: int = 1 << 24) -> str | None:
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


def _looks_like_hub_name(path: str) -> bool:
    parts = path.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not path.startswith((".", "~")) and Path(path).suffix == ""


def _hub_rows(name: str, split: str) -> Any:
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


def _field(ds: Any, field: str, path: str) -> str:
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


def tokenize_rows(ds: Any, field: str, tokenizer: Any, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> tuple[dict[int, np.ndarray], int]:
    """Token ids (+ EOS) of the rows at ``indices`` (default all), by row index.

    Bad rows (missing, empty or non-text field) raise an error naming the file
    and line (:func:`bad_row`), or are skipped and counted. Rows are read in index order, so the
    error names the first bad row.
    """
    docs, bad = {}, 0
    eos = tokenizer.eos_token_id
    for i, row in indexed_rows(ds, indices):
        text = row.get(field)
        if not isinstance(text, str) or not text.strip():
            if skip_bad:
                bad += 1
                continue
            what = "missing" if text is None else "empty" if isinstance(text, str) else f"not text ({type(text).__name__})"
            raise bad_row(path, i, f"field '{field}' is {what}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids = ids + [eos]
        docs[i] = np.asarray(ids, np.int32)
    return docs, bad


def split_rows(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train row order, eval rows): one seeded shuffle of all rows, the first ``eval_fraction`` held out."""
    order = np.random.RandomState(seed).permutation(n)
    cut = max(1, int(n * eval_fraction)) if eval_fraction > 0 else 0
    return order[cut:], np.sort(order[:cut])


def lane_rows(train_order: np.ndarray, lanes: int, lane: int) -> list[int]:
    """The row indices that feed lane ``lane`` of ``lanes`` (every lanes-th row of the shuffled order)."""
    return [int(i) for i in train_order[lane::lanes]]


def tokens_of(doc: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
    """The token ids of a document (plain ids, or a dict with ``tokens`` and a ``loss_mask``)."""
    return doc["tokens"] if isinstance(doc, dict) else doc


def _features(doc: np.ndarray | dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(doc) if isinstance(doc, dict) else {"tokens": doc}


# How documents become rows: "concat" (concatenate, then split into rows: no padding, documents may be cut;
# pretraining), "best_fit" (whole documents into the row they fit best: little padding, none cut; SFT),
# "none" (one document per row, truncated or padded).
PACKING = ("concat", "best_fit", "none")
PACKING_BINS = 32  # open rows best-fit chooses among: more fit tighter, at the cost of buffered documents


def _mode(packing: bool | str) -> str:
    return packing if isinstance(packing, str) else ("concat" if packing else "none")


def _stream(docs: list, seed: int, epochs: int | None) -> grain.MapDataset:
    """``docs`` as features, shuffled (reshuffled each pass), ``epochs`` passes (None: endless)."""
    return grain.MapDataset.source(docs).shuffle(seed=seed).repeat(epochs).map(_features)


def _pack(ds: grain.MapDataset, example: dict[str, np.ndarray], seq_len: int, seed: int, packing: bool | str):
    """A grain dataset of rows {tokens, segment ids, positions[, loss_mask]} of seq_len + 1 tokens from the
    documents of ``ds`` (features like ``example``), packed as ``packing`` says (see PACKING)."""
    import grain.experimental as ge

    mode = _mode(packing)
    if mode == "none":
        return ds.map(lambda x: _padded(x, seq_len + 1)).to_iter_dataset()
    lengths = {k: seq_len + 1 for k in example}
    if mode == "best_fit":
        return ge.BestFitPackIterDataset(ds.to_iter_dataset(), length_struct=lengths, num_packing_bins=PACKING_BINS,
                                         seed=seed, shuffle_bins=False)
    return ge.ConcatThenSplitIterDataset(ds.to_iter_dataset(), length_struct=lengths)


def _rows(docs: list, seq_len: int, seed: int, packing: bool | str, epochs: int | None):
    """A grain dataset of packed rows of seq_len + 1 tokens from shuffled ``docs`` (see _pack)."""
    return _pack(_stream(docs, seed, epochs), _features(docs[0]), seq_len, seed, packing)


def lane_dataset(docs: list, seq_len: int, seed: int, packing: bool | str):
    """One lane: an endless grain iterator of rows from ``docs`` (reshuffled each pass)."""
    return iter(_rows(docs, seq_len, seed, packing, None))


# A mixture lane tags each token with its source: SOURCE is -(s + 1) on a document's first token, s + 1 on the
# others, 0 on padding. Packing carries it (and its own segment ids and positions) like the tokens, so every
# batch row says which source each of its tokens and documents came from; LaneBatches counts and removes it.
SOURCE = "mixture_source"


def _tag(source: int, doc: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    tag = np.full(len(doc["tokens"]), source + 1, np.int32)
    tag[:1] = -(source + 1)
    return {**doc, SOURCE: tag}


def source_seed(seed: int, source: int) -> int:
    """The shuffle seed of ``source`` in the lane of seed ``seed`` (source 0: the lane's own)."""
    return (seed + 104_729 * source) % 2**32


def mixed_lane_dataset(sources: list[list], weights: list[float], seq_len: int, seed: int, packing: bool | str):
    """One lane of a mixture: an endless grain iterator of packed rows from grain's mix of the sources' document
    streams (each shuffled, reshuffled each pass) in proportion to ``weights``.

    ``grain.MapDataset.mix`` interleaves the endless streams deterministically by weight (element k of the mix is
    a fixed element of a fixed source), so a lane's state stays one index and resumes exactly. Every token keeps
    its source (SOURCE) through packing.
    """
    import functools

    streams = [_stream(docs, source_seed(seed, s), None).map(functools.partial(_tag, s))
               for s, docs in enumerate(sources)]
    mixed = grain.MapDataset.mix(streams, weights)
    return iter(_pack(mixed, _tag(0, _features(sources[0][0])), seq_len, seed, packing))


def fit_documents(docs: dict[int, Any], max_len: int, long: str) -> tuple[dict[int, Any], set[int]]:
    """(documents, the row indices that were too long): documents longer than ``max_len`` tokens are cut to
    it (``long="truncate"``) or left out (``long="drop"``)."""
    out, too_long = {}, set()
    for i, d in docs.items():
        if len(tokens_of(d)) <= max_len:
            out[i] = d
            continue
        too_long.add(i)
        if long == "truncate":
            out[i] = {k: v[:max_len] for k, v in d.items()} if isinstance(d, dict) else d[:max_len]
    return out, too_long


def _padded(doc: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    n = min(len(doc["tokens"]), length)
    out = {}
    for k, v in doc.items():
        out[k] = np.zeros(length, v.dtype)
        out[k][:n] = v[:n]
    if "tokens_segment_ids" in out:  # a document that lays out its own segments (a DPO pair): keep them
        return out
    seg = np.zeros(length, np.int32)
    seg[:n] = 1
    pos = np.where(seg > 0, np.arange(length, dtype=np.int32), 0).astype(np.int32)
    return {**out, "tokens_segment_ids": seg, "tokens_positions": pos}


class LaneBatches(grain.DatasetIterator):
    """Stacks one row from each lane into a batch; its state is every lane's state (checkpointable).

    With ``sources`` (a mixture of that many sources; lanes from mixed_lane_dataset) it also counts, per
    source, the documents that start and the tokens that lie in the rows of the ``counted`` lanes (default
    all), and keeps the counts in its state, so they survive a resume exactly.
    """

    def __init__(self, lanes: list[grain.DatasetIterator], sources: int = 0, counted: list[bool] | None = None):
        super().__init__(lanes)
        self._lanes = lanes
        self._sources = sources
        self._counted = list(counted) if counted is not None else [True] * len(lanes)
        self._documents = [0] * sources
        self._tokens = [0] * sources

    def __next__(self) -> dict[str, np.ndarray]:
        rows = [next(lane) for lane in self._lanes]
        if self._sources:
            rows = [self._tally(r, c) for r, c in zip(rows, self._counted)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def _tally(self, row: dict[str, np.ndarray], counted: bool) -> dict[str, np.ndarray]:
        if counted:
            tag = row[SOURCE]
            starts = np.bincount(-tag[tag < 0] - 1, minlength=self._sources)
            tokens = np.bincount(np.abs(tag[tag != 0]) - 1, minlength=self._sources)
            for s in range(self._sources):
                self._documents[s] += int(starts[s])
                self._tokens[s] += int(tokens[s])
        return {k: v for k, v in row.items() if not (k == SOURCE or k.startswith(SOURCE + "_"))}

    def mixture_counts(self) -> tuple[list[int], list[int]]:
        """(documents, tokens) per source drawn so far into this process's counted rows (a mixture only)."""
        return list(self._documents), list(self._tokens)

    def get_state(self) -> dict[str, Any]:
        """Every lane's grain state (and, for a mixture, the counts per source)."""
        state: dict[str, Any] = {"lanes": [lane.get_state() for lane in self._lanes]}
        if self._sources:
            state["mixture"] = {"documents": list(self._documents), "tokens": list(self._tokens)}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore every lane (JSON round trips turn grain's tuples into lists: undo that)."""
        lanes = state["lanes"]
        if len(lanes) != len(self._lanes):
            raise UserError(f"the checkpointed data state has {len(lanes)} lanes, this run reads {len(self._lanes)}; "
                            "resume with the same batch_size, grad_accum and mesh")
        counts = state.get("mixture")
        if self._sources and (counts is None or len(counts["documents"]) != self._sources):
            had = len(counts["documents"]) if counts else "no mixture of"
            raise UserError(f"the checkpointed data state has {had} sources, this run mixes {self._sources}; "
                            "resume with the same data.path")
        if not self._sources and counts is not None:
            raise UserError("the checkpoint was written by a run with a data mixture (data.path a list); resume "
                            "it with the same data.path")
        for lane, s in zip(self._lanes, lanes):
            lane.set_state(_tuples(s))
        if self._sources:
            self._documents = [int(x) for x in counts["documents"]]
            self._tokens = [int(x) for x in counts["tokens"]]


def _tuples(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x


def packed_batches(docs: list, seq_len: int, batch: int, seed: int, epochs: int | None,
                   packing: bool | str = True):
    """A grain iterator of whole batches from one stream of ``docs`` (used for the small eval set)."""
    return iter(_rows(docs, seq_len, seed, packing, epochs).batch(batch, drop_remainder=True))


def to_model_batch(b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs, targets and loss weights from a packed batch.

    A target counts when it continues its input's document and, where the
    documents carry a ``loss_mask``, when the mask marks it as trained. Other
    per-token features come along aligned with the targets.
    """
    tok, seg, pos = b["tokens"], b["tokens_segment_ids"], b["tokens_positions"]
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    if "loss_mask" in b:
        same &= b["loss_mask"][:, 1:].astype(bool)
    out = {
        "inputs": tok[:, :-1].astype(np.int32),
        "targets": tok[:, 1:].astype(np.int32),
        "weights": same.astype(np.float32),
        "segment_ids": seg[:, :-1].astype(np.int32),
        "positions": pos[:, :-1].astype(np.int32),
    }
    if "tokens_prefix_ids" in b:  # a shared prefix per token (a DPO pair's prompt), like the segment ids
        out["prefix_ids"] = b["tokens_prefix_ids"][:, :-1].astype(np.int32)
    # Any other per-token feature (DPO's cached reference log-probabilities) describes a token as a target.
    for k in b.keys() - {"tokens", "tokens_segment_ids", "tokens_positions", "tokens_prefix_ids", "loss_mask"}:
        out[k] = b[k][:, 1:]
    return out
