"""The data pipeline: `datasets` source -> tokenize -> grain concat-then-split packing -> batches.

Packed rows carry segment ids and per-document positions, so no token
attends across documents. Each row has seq_len + 1 tokens: inputs are the
first seq_len, targets the last seq_len, and a target counts only when it
continues the same document as its input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from zoo.errors import UserError

SUFFIX_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_rows(path: str, text_field: str) -> tuple[Any, str]:
    """A `datasets` Dataset of the local file(s) at ``path`` and the column that holds the text."""
    import datasets

    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.suffix in SUFFIX_FORMATS) if p.is_dir() else [p]
    if not files or not files[0].exists():
        raise UserError(f"data.path {path}: no such file or folder (or no .jsonl/.json/.parquet/.txt in it)")
    fmts = {SUFFIX_FORMATS.get(f.suffix) for f in files}
    if None in fmts or len(fmts) != 1:
        raise UserError(f"data.path {path}: use one of {', '.join(SUFFIX_FORMATS)} files (one kind per run)")
    fmt = fmts.pop()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises many kinds for unreadable files
        raise UserError(f"data.path {path}: cannot read it ({str(e).splitlines()[0][:200]})") from None
    field = "text" if fmt == "text" else text_field
    if field not in ds.column_names:
        raise UserError(f"data.path {path}: no '{field}' field in its rows (columns: {ds.column_names}); set data.text_field")
    return ds, field


def tokenize_rows(ds: Any, field: str, tokenizer: Any, path: str, skip_bad: bool) -> tuple[list[np.ndarray], int]:
    """Token ids (+ EOS) of every row; bad rows (missing/empty/non-text) raise, or are skipped and counted."""
    docs, bad = [], 0
    eos = tokenizer.eos_token_id
    for i, row in enumerate(ds):
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
        docs.append(np.asarray(ids, np.int32))
    if not docs:
        raise UserError(f"{path}: no usable rows")
    return docs, bad


def packed_batches(docs: list[np.ndarray], seq_len: int, batch: int, seed: int, epochs: int | None):
    """A grain iterator of packed batches: tokens/segment ids/positions of shape [batch, seq_len + 1]."""
    import grain
    import grain.experimental as ge

    ds = grain.MapDataset.source(docs).shuffle(seed=seed).repeat(epochs).map(lambda x: {"tokens": x})
    packed = ge.ConcatThenSplitIterDataset(ds.to_iter_dataset(), length_struct={"tokens": seq_len + 1})
    return iter(packed.batch(batch, drop_remainder=True))


def to_model_batch(b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs, targets and loss weights from a packed batch."""
    tok, seg, pos = b["tokens"], b["tokens_segment_ids"], b["tokens_positions"]
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    return {
        "inputs": tok[:, :-1].astype(np.int32),
        "targets": tok[:, 1:].astype(np.int32),
        "weights": same.astype(np.float32),
        "segment_ids": seg[:, :-1].astype(np.int32),
        "positions": pos[:, :-1].astype(np.int32),
    }
