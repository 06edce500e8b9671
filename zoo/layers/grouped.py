"""The grouped matmul of dropless mixture-of-experts: each row through its group's (expert's) weight.

``jax.lax.ragged_dot`` is that operation, and on TPUs it is Mosaic's grouped matmul. Elsewhere XLA lowers it
densely: every row against every group's weight, masked (a [rows, groups * in] operand), so a layer of 128
experts does 128 times the arithmetic of its tokens (a reduced Qwen3-30B-A3B LoRA step ran 9x slower than
PyTorch's loop over experts on a CPU). Off TPUs :func:`grouped_matmul` loops over blocks of rows read in place
from the sorted rows: each group's rows in blocks of ``tile`` rows starting at its first row, each block times
its group's weight, only the group's rows of the block written back. The work is ``rows + groups * (tile - 1)``
rows at most (a group's last block reads past its rows), with no gather or scatter of rows and each group's
weight read in place; blocks past the groups' total are not run (the loop's trip count is the blocks in use).
The backward pass is the same loop with the weights transposed, and the weights' gradient a sum over each
group's blocks (dropped by XLA where the weights are frozen).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def tile_rows(rows: int, groups: int) -> int:
    """The block height for ``rows`` rows over ``groups`` groups: the power of two nearest the mean group size,
    between 8 and 256 (a group's last block reads up to a block past its rows; smaller blocks make thinner
    matmuls and more loop steps)."""
    mean = max(1.0, rows / max(groups, 1))
    return int(min(256, max(8, 2 ** round(math.log2(mean)))))


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, platform: str | None = None) -> jax.Array:
    """x [M, K] (rows sorted by group: ``sizes`` [G] rows each, in order) times w [G, K, N] -> [M, N], row r
    through its group's weight; rows past ``sizes.sum()`` come out 0. As ``jax.lax.ragged_dot(x, w, sizes)``,
    which runs on TPUs (``platform``, default :func:`zoo.kernels.choice.platform`); blocks of one group elsewhere."""
    if platform is None:
        from zoo.kernels.choice import platform as program_platform

        platform = program_platform()
    if platform == "tpu":
        return jax.lax.ragged_dot(x, w, sizes)
    return _blocked(x, w, sizes.astype(jnp.int32), tile_rows(x.shape[0], w.shape[0]))


def _plan(sizes: jax.Array, rows: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(each block's group, first row and rows of its group in it, the blocks in use) for groups of ``sizes``
    rows in blocks of ``tile``: at most ``rows // tile + groups`` blocks, group by group."""
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    per_group = -(-sizes // tile)
    block_ends = jnp.cumsum(per_group)
    i = jnp.arange(rows // tile + g, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(block_ends, i, side="right"), g - 1).astype(jnp.int32)
    first = ends[group] - sizes[group] + (i - block_ends[group] + per_group[group]) * tile
    return group, first, jnp.clip(ends[group] - first, 0, tile), block_ends[-1]


def _varying(a: jax.Array) -> frozenset:
    """The shard_map axes ``a`` varies over (none outside one)."""
    mat = getattr(jax.typeof(a), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _zeros(shape: tuple, dtype, *like: jax.Array) -> jax.Array:
    """Zeros that vary over the shard_map axes ``like`` vary over: a loop's carry must vary as what the loop
    adds into it does (expert parallelism runs the loops inside a shard_map)."""
    z = jnp.zeros(shape, dtype)
    axes = tuple(sorted(frozenset().union(*(_varying(a) for a in like))))
    return jax.lax.pcast(z, axes, to="varying") if axes else z


def _loop(x: jax.Array, w: jax.Array, sizes: jax.Array, tile: int, transposed: bool = False) -> jax.Array:
    """Each block of x's rows times its group's weight (``transposed``: w [G, N, K] read transposed), the group's
    rows of each block written to the output [M, N] (rows in no group stay 0)."""
    m, k = x.shape
    n = w.shape[1] if transposed else w.shape[2]
    group, first, count, used = _plan(sizes, m, tile)
    xp = jnp.pad(x, ((0, tile), (0, 0)))  # a last block may read past the rows
    lane = jnp.arange(tile, dtype=jnp.int32)[:, None]
    dtype = jnp.result_type(x.dtype, w.dtype)

    def block(i: jax.Array, y: jax.Array) -> jax.Array:
        xb = jax.lax.dynamic_slice(xp, (first[i], 0), (tile, k))
        yb = jax.lax.dot_general(xb, w[group[i]], (((1,), (int(transposed),)), ((), ())))
        keep = jax.lax.dynamic_slice(y, (first[i], 0), (tile, n))  # the next group's rows, past this group's
        return jax.lax.dynamic_update_slice(y, jnp.where(lane < count[i], yb.astype(dtype), keep), (first[i], 0))

    return jax.lax.fori_loop(0, used, block, _zeros((m + tile, n), dtype, x, w, sizes))[:m]


def _weight_grad(x: jax.Array, dy: jax.Array, w: jax.Array, sizes: jax.Array, tile: int) -> jax.Array:
    """Each group's weight gradient [G, K, N]: the sum over its blocks of x_block^T dy_block (its rows only)."""
    m, k = x.shape
    n = dy.shape[1]
    group, first, count, used = _plan(sizes, m, tile)
    xp, dp = (jnp.pad(a, ((0, tile), (0, 0))) for a in (x, dy))
    lane = jnp.arange(tile, dtype=jnp.int32)[:, None]
    dtype = jnp.result_type(x.dtype, dy.dtype)

    def block(i: jax.Array, dw: jax.Array) -> jax.Array:
        xb = jnp.where(lane < count[i], jax.lax.dynamic_slice(xp, (first[i], 0), (tile, k)), 0)
        db = jax.lax.dynamic_slice(dp, (first[i], 0), (tile, n))
        return dw.at[group[i]].add(jax.lax.dot_general(xb, db, (((0,), (0,)), ((), ()))).astype(dtype))

    return jax.lax.fori_loop(0, used, block, _zeros(w.shape, dtype, x, dy, sizes))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked(x: jax.Array, w: jax.Array, sizes: jax.Array, tile: int) -> jax.Array:
    """The grouped matmul as a loop over blocks (:func:`_loop`). Its backward pass is grouped matmuls too (as
    Megablox's): the rows' gradient through the transposed weights, each weight's a sum over its blocks, so
    autodiff stores nothing but the inputs and XLA drops the weights' part where they are frozen."""
    return _loop(x, w, sizes, tile)


def _blocked_fwd(x, w, sizes, tile):
    return _loop(x, w, sizes, tile), (x, w, sizes)


def _blocked_bwd(tile, res, dy):
    x, w, sizes = res
    dx = _loop(dy, w, sizes, tile, transposed=True)
    dw = _weight_grad(x, dy, w, sizes, tile)
    return _like(dx, x), _like(dw, w), np.zeros(sizes.shape, jax.dtypes.float0)


def _like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """The cotangent ``ct`` as ``primal``'s: its dtype, and summed over the shard_map axes it varies over and the
    primal does not (a weight replicated over fsdp gets the sum of every fsdp shard's rows' contributions)."""
    extra = _varying(ct) - _varying(primal)
    if extra:
        ct = jax.lax.psum(ct, tuple(sorted(extra)))
    return ct.astype(primal.dtype)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def grouped_matmul_lora(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float | jax.Array,
                        sizes: jax.Array, platform: str | None = None) -> jax.Array:
    """Each row through its group's weight plus the group's LoRA adapter: ``grouped_matmul(x, w) + scale *
    grouped_matmul(grouped_matmul(x, a), b)`` (a [G, K, r], b [G, r, N]; the adapter's path in a's dtype, its
    result cast to the base's). Three ragged_dots on TPUs (``platform``); elsewhere one loop over the blocks
    forward and one backward, the adapter's products inside the base's blocks (the rows read once, no [M, r]
    intermediate and no loops of their own; a LoRA step's experts spent a fifth of its time in them)."""
    if platform is None:
        from zoo.kernels.choice import platform as program_platform

        platform = program_platform()
    b = b.astype(a.dtype)
    if platform == "tpu":
        y = jax.lax.ragged_dot(x, w, sizes)
        u = jax.lax.ragged_dot(x.astype(a.dtype), a, sizes)
        return y + (scale * jax.lax.ragged_dot(u, b, sizes)).astype(y.dtype)
    return _blocked_lora(x, w, a, b, jnp.asarray(scale), sizes.astype(jnp.int32),
                         tile_rows(x.shape[0], w.shape[0]))


def _lora_loop(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array, sizes: jax.Array,
               tile: int) -> jax.Array:
    """:func:`_loop` with each block's adapter product added: x_b w_g + scale * (x_b a_g) b_g."""
    m, k = x.shape
    n = w.shape[2]
    group, first, count, used = _plan(sizes, m, tile)
    xp = jnp.pad(x, ((0, tile), (0, 0)))
    lane = jnp.arange(tile, dtype=jnp.int32)[:, None]
    dtype = jnp.result_type(x.dtype, w.dtype)

    def block(i: jax.Array, y: jax.Array) -> jax.Array:
        g = group[i]
        xb = jax.lax.dynamic_slice(xp, (first[i], 0), (tile, k))
        yb = (xb @ w[g]).astype(dtype)
        yb = yb + (scale * ((xb.astype(a.dtype) @ a[g]) @ b[g])).astype(dtype)
        keep = jax.lax.dynamic_slice(y, (first[i], 0), (tile, n))
        return jax.lax.dynamic_update_slice(y, jnp.where(lane < count[i], yb, keep), (first[i], 0))

    return jax.lax.fori_loop(0, used, block, _zeros((m + tile, n), dtype, x, w, a, b, sizes))[:m]


def _lora_grads(x: jax.Array, dy: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array,
                sizes: jax.Array, tile: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(dx, da, db, dscale) of :func:`_lora_loop` for the output's gradient dy, in one loop over the blocks:
    dx_b = dy_b w_g^T + (scale dy_b b_g^T) a_g^T, and each group's da, db summed over its blocks (its rows)."""
    m, k = x.shape
    n = dy.shape[1]
    group, first, count, used = _plan(sizes, m, tile)
    xp, dp = (jnp.pad(v, ((0, tile), (0, 0))) for v in (x, dy))
    lane = jnp.arange(tile, dtype=jnp.int32)[:, None]
    t = (((1,), (1,)), ((), ()))  # contract the last axes: times the transpose, read in place
    dx_dtype = jnp.result_type(dy.dtype, w.dtype)

    def block(i: jax.Array, carry: tuple) -> tuple:
        dx, da, db, ds = carry
        g = group[i]
        mine = lane < count[i]
        xb = jax.lax.dynamic_slice(xp, (first[i], 0), (tile, k))
        xa = jnp.where(mine, xb, 0).astype(a.dtype)  # the group's rows only, for the adapter's sums
        dyb = jax.lax.dynamic_slice(dp, (first[i], 0), (tile, n))
        dv = (scale * dyb).astype(a.dtype)
        du = jax.lax.dot_general(dv, b[g], t)
        dxb = jax.lax.dot_general(dyb, w[g], t).astype(dx_dtype) + jax.lax.dot_general(du, a[g], t).astype(dx_dtype)
        keep = jax.lax.dynamic_slice(dx, (first[i], 0), (tile, k))
        dx = jax.lax.dynamic_update_slice(dx, jnp.where(mine, dxb, keep), (first[i], 0))
        u = xa @ a[g]
        da = da.at[g].add(jax.lax.dot_general(xa, du, (((0,), (0,)), ((), ()))))
        db = db.at[g].add(jax.lax.dot_general(u, dv, (((0,), (0,)), ((), ()))))
        ds = ds + jnp.sum(dyb.astype(jnp.float32) * (u @ b[g]).astype(jnp.float32))
        return dx, da, db, ds

    init = (_zeros((m + tile, k), dx_dtype, x, dy, w, a, b, sizes), _zeros(a.shape, a.dtype, x, dy, a, b, sizes),
            _zeros(b.shape, b.dtype, x, dy, a, b, sizes), _zeros((), jnp.float32, x, dy, a, b, sizes))
    dx, da, db, ds = jax.lax.fori_loop(0, used, block, init)
    return dx[:m], da, db, ds


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _blocked_lora(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array, sizes: jax.Array,
                  tile: int) -> jax.Array:
    """:func:`grouped_matmul_lora` off TPUs (:func:`_lora_loop`); the backward pass's base weight gradient is a
    loop of its own (:func:`_weight_grad`), which XLA drops where the base is frozen."""
    return _lora_loop(x, w, a, b, scale, sizes, tile)


def _blocked_lora_fwd(x, w, a, b, scale, sizes, tile):
    return _lora_loop(x, w, a, b, scale, sizes, tile), (x, w, a, b, scale, sizes)


def _blocked_lora_bwd(tile, res, dy):
    x, w, a, b, scale, sizes = res
    dx, da, db, ds = _lora_grads(x, dy, w, a, b, scale, sizes, tile)
    dw = _weight_grad(x, dy, w, sizes, tile)
    return (_like(dx, x), _like(dw, w), _like(da, a), _like(db, b), _like(ds, scale),
            np.zeros(sizes.shape, jax.dtypes.float0))


_blocked_lora.defvjp(_blocked_lora_fwd, _blocked_lora_bwd)
