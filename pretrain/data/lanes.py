"""Cross-process data plumbing: which global-batch rows (lanes) this process feeds, and global arrays from them."""

from __future__ import annotations

from typing import Any, cast

import jax
import numpy as np
from jax.sharding import NamedSharding

from zoo.errors import UserError
from zoo.storage import RunPath


def owned_rows(sharding: NamedSharding, shape: tuple[int, int, int]) -> tuple[list[int], list[int]]:
    """(flat rows of the [accum, micro, seq] global batch this process holds, rows it is the first holder of)."""
    accum, micro = shape[0], shape[1]
    me = jax.process_index()
    first: dict[int, int] = {}
    mine: set[int] = set()
    device: Any
    for device, index in sharding.devices_indices_map(shape).items():
        for m in range(micro)[index[1]]:
            for a in range(accum)[index[0]]:
                r = a * micro + m
                first[r] = min(first.get(r, device.process_index), device.process_index)
                if device.process_index == me:
                    mine.add(r)
    return sorted(mine), sorted(r for r in mine if first[r] == me)


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

        return jax.make_array_from_callback(full, sharding, cast(Any, shard))

    return {k: build(v) for k, v in local.items()}


def check_same_processes(data_dir: RunPath) -> None:
    """A checkpoint's data state is per process: resuming needs the process count that wrote it."""
    n = jax.process_count()
    written = sorted(data_dir.glob("process_*-of-*.json"))
    if written and not (data_dir / f"process_{jax.process_index()}-of-{n}.json").is_file():
        theirs = written[0].stem.rsplit("-of-", 1)[1]
        raise UserError(f"checkpoint {data_dir.parent} was written by {theirs} processes; resume it with "
                        f"{theirs} processes (this run has {n}), or use a new output_dir")
