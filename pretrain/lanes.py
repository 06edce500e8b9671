"""Cross-process data plumbing: which global-batch rows (lanes) this process feeds, and global arrays from them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zoo.errors import UserError

from pretrain import distributed
from pretrain.config import DataSource, TrainConfig
from pretrain.data import LaneBatches, fit_documents, lane_dataset, lane_rows, split_rows, tokens_of
from pretrain.preflight import check_untrainable, keeps_a_target
from pretrain.task import Document, Task


@dataclasses.dataclass
class RunData:
    """This process's view of the run's data."""

    batches: LaneBatches  # this process's rows of every global batch
    rows: list[int]  # the flat global-batch rows (lanes) this process feeds, in its local order
    packing: str  # how documents become rows (pretrain.data.PACKING)
    too_long: int  # training documents longer than seq_len + 1 (truncated or dropped, data.long_examples)
    eval_docs: list[Document]
    total_steps: int
    skipped: int  # bad rows skipped over the whole run (all processes)
    sources: list[DataSource] = dataclasses.field(default_factory=list)  # a mixture's sources; [] for one data.path
    # A mixture's eval documents by source name (and "eval" for data.eval_path); eval_docs holds them all.
    eval_sets: dict[str, list[Document]] = dataclasses.field(default_factory=dict)

    def mixture_report(self) -> dict[str, dict[str, Any]]:
        """{source name: {path, weight, documents, tokens, realized_fraction, token_fraction}}: what the batches
        drawn so far took from each source of a mixture ({} for one data.path). In a multi-process run every
        process must call it (it sums the processes' counts)."""
        if not self.sources:
            return {}
        from pretrain.mixture import mixture_report

        return mixture_report(self.sources, *self.batches.mixture_counts())


def owned_rows(sharding: NamedSharding, shape: tuple[int, int, int]) -> tuple[list[int], list[int]]:
    """(flat rows of the [accum, micro, seq] global batch this process holds, rows it is the first holder of)."""
    accum, micro = shape[0], shape[1]
    me = jax.process_index()
    first: dict[int, int] = {}
    mine: set[int] = set()
    for device, index in sharding.devices_indices_map(shape).items():
        for m in range(micro)[index[1]]:
            for a in range(accum)[index[0]]:
                r = a * micro + m
                first[r] = min(first.get(r, device.process_index), device.process_index)
                if device.process_index == me:
                    mine.add(r)
    return sorted(mine), sorted(r for r in mine if first[r] == me)


def run_data(cfg: TrainConfig, task: Task, tokenizer: Any, vocab: int, sharding: NamedSharding,
             micro: int) -> RunData:
    """Read, tokenize and lane-pack this process's share of the data (and the whole, small, eval set).

    A list ``data.path`` is a mixture (pretrain/mixture.py): each source is read, split into lanes and held out
    like a single path, and lane ``r`` mixes the sources' lane-``r`` documents with grain before packing.
    """
    d = cfg.data
    mine, counted = owned_rows(sharding, (cfg.grad_accum, micro, d.seq_len))
    packing = task.packing if d.packing else "none"
    if isinstance(d.path, list):
        from pretrain.mixture import mixture_data  # (it builds on read_source below)

        return mixture_data(cfg, task, tokenizer, vocab, mine, counted, packing)
    share = read_source(cfg, task, tokenizer, vocab, mine, counted, packing, "data.path", d.eval_fraction)
    total = cfg.max_steps or max(1, share.per_epoch // _epoch_unit(cfg, packing)) * cfg.epochs
    batches = LaneBatches([lane_dataset(share.lane_docs[r], d.seq_len, cfg.seed * 1_000_003 + r, packing)
                           for r in mine])
    return RunData(batches, mine, packing, share.n_long, share.eval_docs, total, share.skipped)


def _epoch_unit(cfg: TrainConfig, packing: str) -> int:
    """What one step consumes of ``SourceShare.per_epoch``: tokens (packed rows) or documents (one per row)."""
    return cfg.batch_size * (cfg.data.seq_len + 1) if packing != "none" else cfg.batch_size


@dataclasses.dataclass
class SourceShare:
    """One source's share of this process's lanes, and its eval documents."""

    lane_docs: dict[int, list[Document]]  # lane -> its training documents, in the source's shuffled order
    n_long: int  # training documents longer than seq_len + 1 (all processes)
    skipped: int  # bad rows skipped, training and eval (all processes)
    per_epoch: int  # training tokens (packed rows) or documents (one per row) of all lanes (all processes)
    eval_docs: list[Document]


def read_source(cfg: TrainConfig, task: Task, tokenizer: Any, vocab: int, mine: list[int], counted: list[int],
                packing: str, where: str, eval_fraction: float, seed: int | None = None) -> SourceShare:
    """Read ``cfg.data.path`` (one source; ``where`` names it in errors), tokenize this process's lanes' rows
    and the eval rows (``cfg.data.eval_path``, else ``eval_fraction`` held out, split with ``seed``)."""
    d = cfg.data
    rows = task.load(d.path, cfg)
    order, eval_rows = split_rows(len(rows), 0.0 if d.eval_path else eval_fraction,
                                  cfg.seed if seed is None else seed)
    if len(order) < cfg.batch_size:
        raise UserError(f"{where} {d.path}: {len(order)} training rows, fewer than batch_size={cfg.batch_size} "
                        "(each row of a batch reads its own share of the documents); add data or lower batch_size")
    lanes = {r: lane_rows(order, cfg.batch_size, r) for r in mine}
    failed: UserError | None = None
    docs: dict[int, Document] = {}
    try:
        docs, _ = task.documents(rows, tokenizer, d.path, d.skip_bad_rows, [i for r in mine for i in lanes[r]])
    except UserError as e:  # a bad row in this process's share: every process must stop, not just this one
        failed = e
    if distributed.any_process(failed is not None):
        raise failed or UserError(f"{d.path}: another process found a bad row (its error names it)")
    too_long: set[int] = set(getattr(task, "too_long", ()))  # tasks that fit their own rows (DPO pairs)
    whole = docs  # before cutting (the lengths an error names)
    if packing == "best_fit":  # whole documents only: a longer one must be cut or left out first
        docs, too_long = fit_documents(docs, d.seq_len + 1, d.long_examples)
    lane_docs = {r: [docs[i] for i in lanes[r] if i in docs] for r in mine}
    # Before step 1: a seq_len that cuts most examples down to nothing trained is an error, not a silent no-op;
    # below the limit, an example that trains nothing is left out (it would only fill a row with padding).
    trainable = getattr(task, "trainable", None) or keeps_a_target
    counted_docs = [i for r in counted for i in lanes[r] if i in docs]
    bad = [i for i in counted_docs if not trainable(docs[i], d.seq_len)]
    n_cut = distributed.total(len(bad))
    check_untrainable(distributed.total(len(counted_docs)), n_cut, [len(tokens_of(whole[i])) for i in bad], cfg,
                      f"{where} {d.path}")
    if n_cut:
        lane_docs = {r: [x for x in v if trainable(x, d.seq_len)] for r, v in lane_docs.items()}
    empty = distributed.any_process(any(not v for v in lane_docs.values()))
    too_big = distributed.any_process(any(int(tokens_of(x).max()) >= vocab for x in docs.values()))
    n_long = distributed.total(sum(i in too_long for r in counted for i in lanes[r]))
    if empty and d.long_examples == "drop" and n_long:
        raise UserError(f"{where} {d.path}: data.long_examples: drop left out {n_long} of {len(order)} training "
                        f"examples, longer than data.seq_len + 1 = {d.seq_len + 1} tokens, and too few remain for "
                        f"batch_size={cfg.batch_size} (each row of a batch reads its own share); raise data.seq_len "
                        f"or set data.long_examples: truncate")
    if empty and n_cut:
        raise UserError(f"{where} {d.path}: {n_cut} of {len(order)} training examples keep no trained token once cut "
                        f"to data.seq_len + 1 = {d.seq_len + 1} tokens and are left out, and too few remain for "
                        f"batch_size={cfg.batch_size} (each row of a batch reads its own share); raise data.seq_len")
    if empty:
        raise UserError(f"{where} {d.path}: too few usable rows for batch_size={cfg.batch_size}; add data")
    if too_big:
        raise UserError(f"the tokenizer at {cfg.model.tokenizer or 'the checkpoint'} produces ids beyond the "
                        f"model's vocab_size {vocab}")
    skipped = distributed.total(sum(len(lanes[r]) - len(lane_docs[r]) for r in counted))
    skipped -= n_cut  # cut to nothing: counted as too long (truncated), not as bad
    if d.long_examples == "drop":
        skipped -= n_long  # counted as too long, not as bad
    if packing != "none":
        per_epoch = distributed.total(sum(len(tokens_of(x)) for r in counted for x in lane_docs[r]))
    else:
        per_epoch = distributed.total(sum(len(lane_docs[r]) for r in counted))
    eval_docs: list[Document] = []
    if d.eval_path:
        edocs, ebad = task.documents(task.load(d.eval_path, cfg), tokenizer, d.eval_path, d.skip_bad_rows)
        eval_docs = list(edocs.values())
        skipped += ebad
    elif len(eval_rows):
        edocs, ebad = task.documents(rows, tokenizer, d.path, d.skip_bad_rows, list(eval_rows))
        eval_docs = [edocs[i] for i in sorted(edocs)]
        skipped += ebad
    if packing == "best_fit":
        eval_docs = list(fit_documents(dict(enumerate(eval_docs)), d.seq_len + 1, d.long_examples)[0].values())
    return SourceShare(lane_docs, n_long, skipped, per_epoch, eval_docs)


def global_batch(local: dict[str, np.ndarray], rows: list[int], sharding: NamedSharding,
                  shape: tuple[int, int, int]) -> dict[str, jax.Array]:
    """Global [accum, micro, seq] arrays from this process's rows (no process ever holds the whole batch)."""
    where = {r: i for i, r in enumerate(rows)}
    micro = shape[1]

    def build(x: np.ndarray) -> jax.Array:
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            a_range, m_range = range(shape[0])[index[0]], range(micro)[index[1]]
            picked = x[[where[a * micro + m] for a in a_range for m in m_range]]
            return picked.reshape(len(a_range), len(m_range), -1)[..., index[2]]

        return jax.make_array_from_callback(shape, sharding, shard)

    return {k: build(v) for k, v in local.items()}


def replicated_batch(b: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays from a batch every process holds whole (the eval set)."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in b.items()}


def check_same_processes(data_dir: Path) -> None:
    """A checkpoint's data state is per process: resuming needs the process count that wrote it."""
    n = jax.process_count()
    written = sorted(data_dir.glob("process_*-of-*.json"))
    if written and not (data_dir / f"process_{jax.process_index()}-of-{n}.json").is_file():
        theirs = written[0].stem.rsplit("-of-", 1)[1]
        raise UserError(f"checkpoint {data_dir.parent} was written by {theirs} processes; resume it with "
                        f"{theirs} processes (this run has {n}), or use a new output_dir")
