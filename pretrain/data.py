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
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises many kinds for unreadable files
        raise UserError(f"data.path {path}: cannot read it ({str(e).splitlines()[0][:200]})") from None
    return ds, fmt


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
    and row, or are skipped and counted. Rows are read in index order, so the
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
            raise UserError(f"{path}, row {i}: field '{field}' is {what}; fix the row or set data.skip_bad_rows: true")
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


def _rows(docs: list, seq_len: int, seed: int, packing: bool | str, epochs: int | None):
    """A grain dataset of rows {tokens, segment ids, positions[, loss_mask]} of seq_len + 1 tokens from
    shuffled ``docs``, packed as ``packing`` says (see PACKING)."""
    import grain.experimental as ge

    mode = _mode(packing)
    ds = grain.MapDataset.source(docs).shuffle(seed=seed).repeat(epochs).map(_features)
    if mode == "none":
        return ds.map(lambda x: _padded(x, seq_len + 1)).to_iter_dataset()
    lengths = {k: seq_len + 1 for k in _features(docs[0])}
    if mode == "best_fit":
        return ge.BestFitPackIterDataset(ds.to_iter_dataset(), length_struct=lengths, num_packing_bins=PACKING_BINS,
                                         seed=seed, shuffle_bins=False)
    return ge.ConcatThenSplitIterDataset(ds.to_iter_dataset(), length_struct=lengths)


def lane_dataset(docs: list, seq_len: int, seed: int, packing: bool | str):
    """One lane: an endless grain iterator of rows from ``docs`` (reshuffled each pass)."""
    return iter(_rows(docs, seq_len, seed, packing, None))


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
    """Stacks one row from each lane into a batch; its state is every lane's state (checkpointable)."""

    def __init__(self, lanes: list[grain.DatasetIterator]):
        super().__init__(lanes)
        self._lanes = lanes

    def __next__(self) -> dict[str, np.ndarray]:
        rows = [next(lane) for lane in self._lanes]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict[str, Any]:
        """Every lane's grain state."""
        return {"lanes": [lane.get_state() for lane in self._lanes]}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore every lane (JSON round trips turn grain's tuples into lists: undo that)."""
        lanes = state["lanes"]
        if len(lanes) != len(self._lanes):
            raise UserError(f"the checkpointed data state has {len(lanes)} lanes, this run reads {len(self._lanes)}; "
                            "resume with the same batch_size, grad_accum and mesh")
        for lane, s in zip(self._lanes, lanes):
            lane.set_state(_tuples(s))


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
