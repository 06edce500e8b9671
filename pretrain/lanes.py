"""Cross-process data plumbing: which global-batch rows (lanes) this process feeds, and global arrays from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from pretrain.config import TrainConfig
from pretrain.data import LaneBatches, lane_dataset
from pretrain.mixture import mixture_data
from pretrain.sources import RunData, epoch_unit, read_source
from pretrain.task import Task
from zoo.errors import UserError


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
        return mixture_data(cfg, task, tokenizer, vocab, mine, counted, packing)
    share = read_source(cfg, task, tokenizer, vocab, mine, counted, packing, "data.path", d.eval_fraction)
    g = task.group_size
    total = cfg.max_steps or max(1, share.per_epoch // epoch_unit(cfg, packing, g)) * cfg.epochs
    # The rows of one group (task.group_size) read the same lane with the same seed: the same documents.
    batches = LaneBatches([lane_dataset(share.lane_docs[r], d.seq_len, cfg.seed * 1_000_003 + r // g, packing)
                           for r in mine])
    return RunData(batches, mine, packing, share.n_long, share.eval_docs, total, share.skipped)


def global_batch(local: dict[str, np.ndarray], rows: list[int], sharding: NamedSharding,
                  shape: tuple[int, int, int]) -> dict[str, jax.Array]:
    """Global [accum, micro, length] arrays from this process's rows (no process ever holds the whole batch);
    ``shape`` gives accum and micro (each array keeps its own length)."""
    where = {r: i for i, r in enumerate(rows)}
    micro = shape[1]

    def build(x: np.ndarray) -> jax.Array:
        full = shape[:2] + (x.shape[-1],)

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            a_range, m_range = range(shape[0])[index[0]], range(micro)[index[1]]
            picked = x[[where[a * micro + m] for a in a_range for m in m_range]]
            return picked.reshape(len(a_range), len(m_range), -1)[..., index[2]]

        return jax.make_array_from_callback(full, sharding, shard)

    return {k: build(v) for k, v in local.items()}


def check_same_processes(data_dir: Path) -> None:
    """A checkpoint's data state is per process: resuming needs the process count that wrote it."""
    n = jax.process_count()
    written = sorted(data_dir.glob("process_*-of-*.json"))
    if written and not (data_dir / f"process_{jax.process_index()}-of-{n}.json").is_file():
        theirs = written[0].stem.rsplit("-of-", 1)[1]
        raise UserError(f"checkpoint {data_dir.parent} was written by {theirs} processes; resume it with "
                        f"{theirs} processes (this run has {n}), or use a new output_dir")
