"""The grouped matmul of dropless mixture-of-experts: each row through its group's (expert's) weight.

``jax.lax.ragged_dot`` is that operation, and on TPUs it is Mosaic's grouped matmul. Elsewhere XLA lowers it
densely: every row against every group's weight, masked (a [rows, groups * in] operand), so a layer of 128
experts does 128 times the arithmetic of its tokens (a reduced Qwen3-30B-A3B LoRA step ran 9x slower than
PyTorch's loop over experts on a CPU). Off TPUs :func:`grouped_matmul` lays the rows (sorted by group, as
ragged_dot takes them) into tiles of one group each, padding each group to whole tiles, and multiplies the
tiles with their group's weight in chunks: at most ``rows + groups * (tile - 1)`` rows of work, about 1.5x
the tokens' own at the tile size chosen here, instead of ``groups`` times. Autodiff gives its gradients
(gathers and scatters of rows, the weights' as a sum over their tiles).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Chunks of tiles are multiplied together, their weights gathered: at most this many weight elements a chunk.
CHUNK_WEIGHT_ELEMENTS = 1 << 22


def tile_rows(rows: int, groups: int) -> int:
    """The tile height for ``rows`` rows over ``groups`` groups: the power of two nearest the mean group size,
    between 8 and 256 (padding costs up to a tile a group; smaller tiles cost more, thinner matmuls)."""
    mean = max(1.0, rows / max(groups, 1))
    return int(min(256, max(8, 2 ** round(math.log2(mean)))))


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, platform: str | None = None) -> jax.Array:
    """x [M, K] (rows sorted by group: ``sizes`` [G] rows each, in order) times w [G, K, N] -> [M, N], row r
    through its group's weight; rows past ``sizes.sum()`` come out 0. As ``jax.lax.ragged_dot(x, w, sizes)``,
    which runs on TPUs (``platform``, default :func:`zoo.kernels.platform`); tiles of one group elsewhere."""
    if platform is None:
        from zoo.kernels import platform as program_platform

        platform = program_platform()
    if platform == "tpu":
        return jax.lax.ragged_dot(x, w, sizes)
    m, k = x.shape
    g, _, n = w.shape
    tile = tile_rows(m, g)
    tiles = -(-m // tile) + g  # enough for every group padded to whole tiles
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    per_group = -(-sizes // tile)
    tile_ends = jnp.cumsum(per_group)
    row = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, row, side="right")  # G past the last group's rows
    grp = jnp.minimum(group, g - 1)
    # Each row's place in the tiled layout: its group's first tile, then its offset in the group.
    dest = jnp.where(group < g, (tile_ends[grp] - per_group[grp]) * tile + row - starts[grp], tiles * tile)
    xt = jnp.zeros((tiles * tile, k), x.dtype).at[dest].set(x, mode="drop").reshape(tiles, tile, k)
    owner = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(tiles, dtype=jnp.int32), side="right"), g - 1)
    chunk = max(1, min(tiles, CHUNK_WEIGHT_ELEMENTS // max(k * n, 1)))
    yt = jax.lax.map(lambda a: jnp.dot(a[0], w[a[1]]), (xt, owner), batch_size=chunk)
    return yt.reshape(tiles * tile, n).at[dest].get(mode="fill", fill_value=0)
