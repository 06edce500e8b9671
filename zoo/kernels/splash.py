"""Splash attention: JAX's Pallas TPU kernel (:mod:`jax.experimental.pallas.ops.tpu.splash_attention`) as the
training forward's attention on TPUs (``model.attention: splash``, and ``auto`` on a TPU: :mod:`zoo.kernels.choice`).

The kernel never sees a [seq, seq] mask: causality (and a sliding window) is a lazy mask object whose
per-block summary (which key blocks each query block needs, computed once per shape from NumPy while
tracing) lets the kernel skip the hidden blocks, and packed documents come as per-token segment ids
(:class:`SegmentIds`; padding's id 0 is one more segment, as in :func:`zoo.model.masks.attention_mask`). Both give
exactly the blockwise path's mask: causal by row index, the window ``0 <= q - k < W``, nothing across
documents. Gemma 2's logit soft-cap is the kernel's ``attn_logits_soft_cap``; the kernel has no scale, so q
is scaled first (``cap * tanh(q k^T * scale / cap)``, as :mod:`zoo.kernels.blockwise`). Grouped-query heads run in
the kernel itself (its MHA form takes fewer key/value heads than query heads: query head n reads key/value
head n // group, the order of :func:`zoo.layers.attention.head_major`), mapped over the batch. Query/key heads of
another size than value heads (DeepSeek's latent attention) are fine for it too.

Under a mesh (``jax.set_mesh``: :func:`zoo.model.sharding.mesh_context`, entered where a sharded train step, the
scoring of :func:`zoo.data.batching.score_documents` and GRPO's log-probabilities are traced) the kernel runs in
:func:`jax.shard_map` over the batch axes (data, fsdp), and over ``tensor`` on the heads when it divides the
key/value heads, so each chip attends its own rows and heads; without one it runs on the whole arrays as XLA
places them. Off a TPU it runs in Pallas's interpret mode (slow: for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    BlockSizes,
    CausalMask,
    LocalMask,
    MultiHeadMask,
    SegmentIds,
    make_splash_mha_single_device,
)
from jax.sharding import PartitionSpec

from zoo.model.masks import Visibility
from zoo.model.sharding import logical_to_spec

LANES = 128  # the kernel's blocks are multiples of a TPU vreg's 128 lanes, so the sequence must be too
BLOCKS = (512, 256, 128)


def block_sizes(t: int) -> BlockSizes:
    """Tiles for a sequence of ``t`` tokens (a multiple of 128): the largest of 512, 256, 128 dividing t, for the
    query and key blocks of the forward pass and of both backward kernels (dq, dk/dv).

    512 is MaxText's default splash tiling for every TPU generation (v4, v5e, v5p, v6e): a 512 x 512 float32
    score tile is 1 MiB of VMEM, well inside the 16 MiB (v4/v5e) to 32 MiB (v6e) of every chip, and long enough
    that the per-block overhead of the kernel's grid is small. Shorter or odd multiples of 128 take the largest
    tile that divides them (the kernel needs whole blocks). Not tuned on a TPU here: one choice for all chips.
    """
    b = next(s for s in BLOCKS if t % s == 0)
    return BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                      block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)


def _kernel(t: int, heads: int, window: int | None, cap: float | None, interpret: bool, keys: int | None = None,
            offset: int = 0):
    """The splash kernel (one row: q [heads, t, d], k and v [kv_heads, keys, .]; keys default t) for a causal
    mask, windowed with ``window`` (``0 <= q - k < window``), soft-capped by ``cap``, query i being key row
    ``offset + i`` (a context shard's). Made at each trace (its block summary becomes the program's constants);
    the NumPy work behind it is cached by JAX's splash module."""
    shape = (t, keys or t)
    mask = CausalMask(shape, offset) if window is None else LocalMask(shape, (window - 1, 0), offset)
    return make_splash_mha_single_device(MultiHeadMask([mask] * heads), block_sizes=block_sizes(t),
                                         attn_logits_soft_cap=cap, interpret=interpret)


def _row_head_spec(mesh: jax.sharding.AbstractMesh, b: int, hk: int) -> PartitionSpec:
    """How the kernel's rows and heads split over ``mesh`` (the context's; empty: not at all): rows over the
    zoo's batch axes (data, fsdp) and key/value heads over ``tensor`` where the mesh has them and they divide
    (:func:`zoo.model.sharding.logical_to_spec`'s rules); a query head group goes with its key/value head."""
    if mesh.empty or not {"data", "fsdp", "tensor"} <= set(mesh.axis_names):
        return PartitionSpec(None, None)
    return logical_to_spec(("batch", "kv_heads"), (b, hk), mesh)


def splash_attention(qg: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float,
                     cap: float | None = None, window: int | None = None, interpret: bool = False) -> jax.Array:
    """Causal attention of head-major q [b, kv, group, t, d] and k [b, kv, t, d], v [b, kv, t, dv] within the
    documents of ``segment_ids`` [b, t] (int; 0 = padding), windowed by ``window``, logits soft-capped by
    ``cap``; returns [b, t, kv * group * dv] in v's dtype, the layout of :func:`zoo.kernels.blockwise.blockwise_attention`.
    ``interpret``: Pallas's interpret mode (any platform)."""
    b, hk, g, t, d = qg.shape
    if t % LANES:
        raise ValueError(f"splash_attention: sequence length {t} is not a multiple of {LANES}")
    q = (qg * jnp.asarray(scale, qg.dtype)).reshape(b, hk * g, t, d)
    seg = segment_ids.astype(jnp.int32)

    def rows(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        kernel = _kernel(t, q.shape[1], window, cap, interpret)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(s, s)))(q, k, v, seg)

    mesh = jax.sharding.get_abstract_mesh()
    spec = _row_head_spec(mesh, b, hk)
    # Any mesh of several devices: Mosaic kernels cannot be partitioned automatically, so the kernel runs in a
    # shard_map even where nothing splits (rows and heads then repeated on each device of the axes that cannot
    # split them: an expert-only mesh, heads that do not divide over tensor).
    if not mesh.empty and mesh.size > 1:
        heads = PartitionSpec(*spec, None, None)
        rows = jax.shard_map(rows, mesh=mesh, in_specs=(heads, heads, heads, PartitionSpec(spec[0], None)),
                             out_specs=heads, check_vma=False)
    out = rows(q, k, v, seg)  # [b, heads, t, dv]
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1)


def splash_shard(qg: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility, scale: float, cap: float | None = None,
                 interpret: bool = False) -> jax.Array:
    """:func:`splash_attention` of one context shard, inside :func:`zoo.model.context.context_attention`'s shard_map:
    this device's queries qg [b, kv, g, t, d] against the gathered keys k [b, kv, n * t, d] and values, the
    queries' and keys' segment ids and the queries' offset from ``vis``. The kernel's mask is static, so there is
    one kernel per shard (its offset i * t: each skips its own hidden key blocks), and the device runs its own
    through :func:`jax.lax.switch`."""
    b, hk, g, t, d = qg.shape
    keys = k.shape[2]
    if t % LANES:
        raise ValueError(f"splash_shard: a context shard's {t} tokens are not a multiple of {LANES}")
    q = (qg * jnp.asarray(scale, qg.dtype)).reshape(b, hk * g, t, d)

    def shard(i: int):
        kernel = _kernel(t, hk * g, vis.window, cap, interpret, keys, i * t)
        return lambda *a: jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=SegmentIds(qs, ks)))(*a)

    branches = [shard(i) for i in range(keys // t)]
    out = jax.lax.switch(vis.offset // t, branches, q, k, v, vis.segment_ids.astype(jnp.int32),
                         vis.key_segment_ids.astype(jnp.int32))
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1)
