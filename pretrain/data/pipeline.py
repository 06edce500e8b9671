"""The data pipeline: rows (zoo.data.files) -> tokenize -> grain packing lanes -> batches -> this process's rows.

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

from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from zoo.data.batching import features, padded
from zoo.data.files import indexed_rows
from zoo.data.row_origin import bad_row
from zoo.errors import UserError


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
    order = np.random.RandomState(seed % SEEDS).permutation(n)
    cut = max(1, int(n * eval_fraction)) if eval_fraction > 0 else 0
    return order[cut:], np.sort(order[:cut])


def lane_rows(train_order: np.ndarray, lanes: int, lane: int) -> list[int]:
    """The row indices that feed lane ``lane`` of ``lanes`` (every lanes-th row of the shuffled order)."""
    return [int(i) for i in train_order[lane::lanes]]


def tokens_of(doc: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
    """The token ids of a document (plain ids, or a dict with ``tokens`` and a ``loss_mask``)."""
    return doc["tokens"] if isinstance(doc, dict) else doc


# How documents become rows: "concat" (concatenate, then split into rows: no padding, documents may be cut;
# plain text), "best_fit" (whole documents into the row they fit best: little padding, none cut; examples),
# "none" (one document per row, truncated or padded).
PACKING = ("concat", "best_fit", "none")
# numpy's and grain's seeds are 32-bit: a lane's seed (the run's seed * 1_000_003 + the lane) is taken modulo this
SEEDS = 2**32
PACKING_BINS = 32  # open rows best-fit chooses among: more fit tighter, at the cost of buffered documents


def _mode(packing: bool | str) -> str:
    return packing if isinstance(packing, str) else ("concat" if packing else "none")


def _stream(docs: list[Any], seed: int, epochs: int | None) -> grain.MapDataset:
    """``docs`` as features, shuffled (reshuffled each pass), ``epochs`` passes (None: endless)."""
    return grain.MapDataset.source(docs).shuffle(seed=seed % SEEDS).repeat(epochs).map(features)


# Lanes read documents already in memory, so grain's prefetch threads only cost: its default (16 threads and a
# 500-element buffer per iterator) made the first batch of a 64-lane run wait ~6 s on 2 idle cores (~60 s on
# busy ones), starting threads to fill 64 buffers. Without prefetch each row is made when it is read; the
# iterator state (the next index) is the same.
NO_PREFETCH = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _pack(ds: grain.MapDataset, example: dict[str, np.ndarray], seq_len: int, seed: int, packing: bool | str,
          max_segments: int | None = None, budgets: dict[str, int] | None = None) -> grain.IterDataset:
    """A grain dataset of rows {tokens, segment ids, positions[, loss_mask]} of seq_len + 1 tokens from the
    documents of ``ds`` (features like ``example``), packed as ``packing`` says (see PACKING); best-fit rows hold
    at most ``max_segments`` documents (None: as many as fit), and of each feature named in ``budgets`` (one not
    per token: a document's image patches) at most that many entries."""
    import grain.experimental as ge

    mode = _mode(packing)
    if mode == "none":
        return ds.map(lambda x: padded(x, seq_len + 1)).to_iter_dataset(NO_PREFETCH)
    lengths = {k: (budgets or {}).get(k, seq_len + 1) for k in example}
    if mode == "best_fit":
        return ge.BestFitPackIterDataset(ds.to_iter_dataset(NO_PREFETCH), length_struct=lengths,
                                         num_packing_bins=PACKING_BINS, seed=seed % SEEDS, shuffle_bins=False,
                                         max_sequences_per_bin=max_segments)
    return ge.ConcatThenSplitIterDataset(ds.to_iter_dataset(NO_PREFETCH), length_struct=lengths)


def _rows(docs: list[Any], seq_len: int, seed: int, packing: bool | str, epochs: int | None,
          max_segments: int | None = None, budgets: dict[str, int] | None = None) -> grain.IterDataset:
    """A grain dataset of packed rows of seq_len + 1 tokens from shuffled ``docs`` (see _pack)."""
    return _pack(_stream(docs, seed, epochs), features(docs[0]), seq_len, seed, packing, max_segments, budgets)


def lane_dataset(docs: list[Any], seq_len: int, seed: int, packing: bool | str,
                 max_segments: int | None = None, budgets: dict[str, int] | None = None) -> grain.DatasetIterator:
    """One lane: an endless grain iterator of rows from ``docs`` (reshuffled each pass; best-fit rows of at most
    ``max_segments`` documents, within ``budgets``: see _pack)."""
    return iter(_rows(docs, seq_len, seed, packing, None, max_segments, budgets))


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
    return (seed + 104_729 * source) % SEEDS


def mixed_lane_dataset(sources: list[list[Any]], weights: list[float], seq_len: int, seed: int,
                       packing: bool | str, max_segments: int | None = None,
                       budgets: dict[str, int] | None = None) -> grain.DatasetIterator:
    """One lane of a mixture: an endless grain iterator of packed rows from grain's mix of the sources' document
    streams (each shuffled, reshuffled each pass) in proportion to ``weights`` (``budgets``: see _pack).

    ``grain.MapDataset.mix`` interleaves the endless streams deterministically by weight (element k of the mix is
    a fixed element of a fixed source), so a lane's state stays one index and resumes exactly. Every token keeps
    its source (SOURCE) through packing.
    """
    import functools

    streams = [_stream(docs, source_seed(seed, s), None).map(functools.partial(_tag, s))
               for s, docs in enumerate(sources)]
    mixed = grain.MapDataset.mix(streams, weights)
    return iter(_pack(mixed, _tag(0, features(sources[0][0])), seq_len, seed, packing, max_segments, budgets))


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


class LaneBatches(grain.DatasetIterator):  # type: ignore[misc]  # grain ships no types: its base is Any
    """Stacks one row from each lane into a batch (then ``finish`` makes what it will of it, where given); its state
    is every lane's state (checkpointable).

    With ``sources`` (a mixture of that many sources; lanes from mixed_lane_dataset) it also counts, per
    source, the documents that start and the tokens that lie in the rows of the ``counted`` lanes (default
    all), and keeps the counts in its state, so they survive a resume exactly.
    """

    def __init__(self, lanes: list[grain.DatasetIterator], sources: int = 0, counted: list[bool] | None = None,
                 finish: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None):
        super().__init__(lanes)
        self._finish = finish  # applied to each stacked batch (pretrain.task.Task.finish_rows)
        self._lanes = lanes
        self._sources = sources
        self._counted = list(counted) if counted is not None else [True] * len(lanes)
        self._documents = [0] * sources
        self._tokens = [0] * sources

    def __next__(self) -> dict[str, np.ndarray]:
        rows = [next(lane) for lane in self._lanes]
        if self._sources:
            rows = [self._tally(r, c) for r, c in zip(rows, self._counted)]
        stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        return stacked if self._finish is None else self._finish(stacked)

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
            assert counts is not None  # checked above
            self._documents = [int(x) for x in counts["documents"]]
            self._tokens = [int(x) for x in counts["tokens"]]


def _tuples(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x


def packed_batches(docs: list[Any], seq_len: int, batch: int, seed: int, epochs: int | None,
                   packing: bool | str = True, max_segments: int | None = None,
                   budgets: dict[str, int] | None = None) -> grain.DatasetIterator:
    """A grain iterator of whole batches from one stream of ``docs`` (used for the small eval set; ``budgets``:
    see _pack)."""
    return iter(_rows(docs, seq_len, seed, packing, epochs, max_segments, budgets).batch(batch, drop_remainder=True))
