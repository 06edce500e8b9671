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
from pretrain.config import TrainConfig
from pretrain.data import LaneBatches, fit_documents, lane_dataset, lane_rows, split_rows, tokens_of
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
    """Read, tokenize and lane-pack this process's share of the data (and the whole, small, eval set)."""
    d = cfg.data
    rows = task.load(d.path, cfg)
    order, eval_rows = split_rows(len(rows), 0.0 if d.eval_path else d.eval_fraction, cfg.seed)
    if len(order) < cfg.batch_size:
        raise UserError(f"data.path {d.path}: {len(order)} training rows, fewer than batch_size={cfg.batch_size} "
                        "(each row of a batch reads its own share of the documents); add data or lower batch_size")
    mine, counted = owned_rows(sharding, (cfg.grad_accum, micro, d.seq_len))
    lanes = {r: lane_rows(order, cfg.batch_size, r) for r in mine}
    failed: UserError | None = None
    docs: dict[int, Document] = {}
    try:
        docs, _ = task.documents(rows, tokenizer, d.path, d.skip_bad_rows, [i for r in mine for i in lanes[r]])
    except UserError as e:  # a bad row in this process's share: every process must stop, not just this one
        failed = e
    if distributed.any_process(failed is not None):
        raise failed or UserError(f"{d.path}: another process found a bad row (its error names it)")
    packing = task.packing if d.packing else "none"
    too_long: set[int] = set(getattr(task, "too_long", ()))  # tasks that fit their own rows (DPO pairs)
    if packing == "best_fit":  # whole documents only: a longer one must be cut or left out first
        docs, too_long = fit_documents(docs, d.seq_len + 1, d.long_examples)
    lane_docs = {r: [docs[i] for i in lanes[r] if i in docs] for r in mine}
    empty = distributed.any_process(any(not v for v in lane_docs.values()))
    too_big = distributed.any_process(any(int(tokens_of(x).max()) >= vocab for x in docs.values()))
    if empty:
        raise UserError(f"data.path {d.path}: too few usable rows for batch_size={cfg.batch_size}; add data")
    if too_big:
        raise UserError(f"the tokenizer at {cfg.model.tokenizer or 'the checkpoint'} produces ids beyond the "
                        f"model's vocab_size {vocab}")
    n_long = distributed.total(sum(i in too_long for r in counted for i in lanes[r]))
    skipped = distributed.total(sum(len(lanes[r]) - len(lane_docs[r]) for r in counted))
    if d.long_examples == "drop":
        skipped -= n_long  # counted as too long, not as bad
    if packing != "none":
        tokens = distributed.total(sum(len(tokens_of(x)) for r in counted for x in lane_docs[r]))
        per_epoch = tokens // (cfg.batch_size * (d.seq_len + 1))
    else:
        per_epoch = distributed.total(sum(len(lane_docs[r]) for r in counted)) // cfg.batch_size
    total = cfg.max_steps or max(1, per_epoch) * cfg.epochs
    batches = LaneBatches([lane_dataset(lane_docs[r], d.seq_len, cfg.seed * 1_000_003 + r, packing) for r in mine])
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
    return RunData(batches, mine, packing, n_long, eval_docs, total, skipped)


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
