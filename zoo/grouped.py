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
CHUNK_WEIGHT_ELEMENTS = 1 << 18


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
    # Each row's place in the tiled layout (its group's first tile, then its offset in the group), and each
    # place's row (m: none): the two are inverse, so rows move either way by a gather.
    dest = jnp.where(group < g, (tile_ends[grp] - per_group[grp]) * tile + row - starts[grp], tiles * tile)
    owner = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(tiles, dtype=jnp.int32), side="right"), g - 1)
    first = tile_ends[owner] - per_group[owner]  # each tile's group's first tile
    at = jnp.arange(tiles * tile, dtype=jnp.int32) - jnp.repeat(first, tile) * tile
    src = jnp.where(at < jnp.repeat(sizes[owner], tile), jnp.repeat(starts[owner], tile) + at, m)
    return _tiled(x, w, src, dest, owner)


def _rows(x: jax.Array, index: jax.Array) -> jax.Array:
    return x.at[index].get(mode="fill", fill_value=0)


def _chunk(tiles: int, k: int, n: int) -> int:
    return max(1, min(tiles, CHUNK_WEIGHT_ELEMENTS // max(k * n, 1)))


def _tile_products(xt: jax.Array, w: jax.Array, owner: jax.Array, transposed: bool = False) -> jax.Array:
    """Each tile [tiles, tile, k] times its group's weight ``w[owner]`` [k, n] (``transposed``: w [n, k], times
    its transpose, read in place), a chunk of tiles at a time."""
    chunk = _chunk(xt.shape[0], w.shape[1], w.shape[2])
    contract = int(transposed)  # w[e] is [k, n], or [n, k] read transposed

    def product(a: tuple) -> jax.Array:
        return jax.lax.dot_general(a[0], w[a[1]], (((1,), (contract,)), ((), ())))

    return jax.lax.map(product, (xt, owner), batch_size=chunk)


@jax.custom_vjp
def _tiled(x: jax.Array, w: jax.Array, src: jax.Array, dest: jax.Array, owner: jax.Array) -> jax.Array:
    """The grouped matmul over tiles: rows to tiles (``src``), each tile by its group's weight (``owner``),
    rows back (``dest``). Its backward pass is grouped matmuls too (as Megablox's): the rows' gradient through
    the transposed weights, and each weight's as the sum over its tiles of x_tile^T dy_tile, so autodiff stores
    no gathered weights and XLA drops the weights' part where they are frozen."""
    m, k = x.shape
    tiles = owner.shape[0]
    xt = _rows(x, src).reshape(tiles, -1, k)
    return _rows(_tile_products(xt, w, owner).reshape(-1, w.shape[2]), dest)


def _tiled_fwd(x, w, src, dest, owner):
    return _tiled(x, w, src, dest, owner), (x, w, src, dest, owner)


def _tiled_bwd(res, dy):
    x, w, src, dest, owner = res
    tiles, k, n = owner.shape[0], w.shape[1], w.shape[2]
    dyt = _rows(dy, src).reshape(tiles, -1, n)
    dx = _rows(_tile_products(dyt, w, owner, transposed=True).reshape(-1, k), dest)
    xt = _rows(x, src).reshape(tiles, -1, k)
    chunk = _chunk(tiles, k, n)
    pad = -tiles % chunk  # whole chunks: the padding tiles add zeros to group 0
    xt, dyt = (jnp.pad(a, ((0, pad), (0, 0), (0, 0))) for a in (xt, dyt))
    own = jnp.pad(owner, (0, pad))

    def add(dw: jax.Array, c: tuple) -> tuple[jax.Array, None]:
        xc, dc, oc = c
        return dw.at[oc].add(jnp.einsum("tik,tin->tkn", xc, dc).astype(dw.dtype)), None

    xs = tuple(a.reshape((-1, chunk) + a.shape[1:]) for a in (xt, dyt, own))
    # The first chunk's sum starts the carry, so inside a shard_map (expert parallelism) the carry varies over the
    # mesh axes its inputs vary over, as the sums it takes in do.
    dw, _ = add(jnp.zeros(w.shape, jnp.result_type(x.dtype, dy.dtype)), tuple(a[0] for a in xs))
    dw, _ = jax.lax.scan(add, dw, tuple(a[1:] for a in xs))
    return _like(dx, x), _like(dw, w), None, None, None


def _varying(a: jax.Array) -> frozenset:
    """The shard_map axes ``a`` varies over (none outside one)."""
    mat = getattr(jax.typeof(a), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """The cotangent ``ct`` as ``primal``'s: its dtype, and summed over the shard_map axes it varies over and the
    primal does not (a weight replicated over fsdp gets the sum of every fsdp shard's rows' contributions)."""
    extra = _varying(ct) - _varying(primal)
    if extra:
        ct = jax.lax.psum(ct, tuple(sorted(extra)))
    return ct.astype(primal.dtype)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
