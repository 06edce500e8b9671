"""Context parallelism: the sequence of the activations split over the mesh's ``context`` axis.

Everything but attention is per token, so GSPMD partitions it from the activations' shardings
(:func:`zoo.model.sharding.batch_sharded` puts the sequence on ``context``); so too a vision-language model's image
features scattered over its image tokens (:func:`zoo.model.multimodal.merge_features`: a cumulative count and a
gather along the sharded sequence). Attention needs every earlier key: it runs under :func:`jax.shard_map` over
the mesh, where each device keeps its block of queries, all-gathers the keys, values and the keys' segment ids
(and image block ids: Gemma 3's and 4's bidirectional image blocks) over ``context``, and attends with its
queries' global row indices (``offset = axis_index * t_local``: :class:`zoo.model.masks.Visibility`), so packed
documents, padding, windows, shared prefixes and image blocks straddling two shards mean what they mean
unsharded. The backward pass is the kernel's own (the blockwise custom VJP); the all-gather's transpose is a
reduce-scatter, so each device gets back the key and value gradients of its own block.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.masks import Visibility
from zoo.model.sharding import logical_to_spec

AXIS = "context"


def context_size() -> int:
    """How many devices split the sequence: the ``context`` axis of the mesh in context (``jax.set_mesh``), else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[AXIS])


def check_layers_split(kinds: tuple[str, ...] = (), size: int | None = None) -> None:
    """A UserError when the sequence is split over ``context`` (``size`` devices; None: the mesh in context's)
    and the model has linear-attention layers (Qwen3-Next's Gated DeltaNet: a state carried from token to token,
    which a split sequence would need passed from shard to shard)."""
    size = context_size() if size is None else size
    if "linear" in kinds and size > 1:
        layers = ", ".join(str(i) for i, k in enumerate(kinds) if k == "linear")
        raise UserError(f"mesh.context: {size} splits the sequence, but the linear-attention layers "
                        f"({layers}) carry a state along it and cannot run split; set mesh.context to 1")


def check_context(cfg: ModelConfig, size: int) -> None:
    """A UserError, before anything compiles, where ``size`` devices of ``context`` would split a model whose
    attention cannot be split: DeepSeek-V3.2's sparse attention picks each query's keys among the whole prefix,
    and linear-attention layers carry a state along it (:func:`check_layers_split`)."""
    if size > 1 and cfg.sparse:
        raise UserError(f"mesh.context {size}: {cfg.family}'s sparse attention (index_topk) has no context "
                        "parallelism; set mesh.context: 1 (split over fsdp or data instead)")
    check_layers_split(cfg.kinds, size)


Attend = Callable[[jax.Array, jax.Array, jax.Array, Visibility], jax.Array]


def context_attention(attend: Attend, qg: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility) -> jax.Array:
    """``attend(qg, k, v, vis)`` (head-major q [b, kv, g, t, d], k [b, kv, t, d], v [b, kv, t, dv] ->
    [b, t, kv * g * dv]) with the sequence split over the mesh's ``context`` axis: each device attends its queries
    to all keys (gathered), rows over (data, fsdp) and key/value heads over ``tensor`` where they divide."""
    mesh = jax.sharding.get_abstract_mesh()
    b, hk, _, t, _ = qg.shape
    n = context_size()
    if t % n:
        raise ValueError(f"context_attention: sequence length {t} does not split over mesh.context = {n}")
    rows, heads = logical_to_spec(("batch", "kv_heads"), (b, hk), mesh)
    seq = P(rows, AXIS)
    # The per-token ids beside the segment ids that are there: shared prefixes (queries' only) and image blocks.
    extra = {name: x for name, x in (("prefix", vis.prefix_ids), ("blocks", vis.block_ids),
                                     ("chunks", vis.chunk_ids)) if x is not None}

    def local(qg: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, extra: dict[str, jax.Array]) -> jax.Array:
        offset = jax.lax.axis_index(AXIS) * qg.shape[3]
        k, v = (jax.lax.all_gather(x, AXIS, axis=2, tiled=True) for x in (k, v))
        keys = jax.lax.all_gather(seg, AXIS, axis=1, tiled=True)
        blocks = extra.get("blocks")  # the queries' block ids local, the keys' gathered, as the segment ids
        key_blocks = None if blocks is None else jax.lax.all_gather(blocks, AXIS, axis=1, tiled=True)
        chunks = extra.get("chunks")  # Llama 4's chunk ids, likewise
        key_chunks = None if chunks is None else jax.lax.all_gather(chunks, AXIS, axis=1, tiled=True)
        return attend(qg, k, v, Visibility(seg, keys, extra.get("prefix"), offset, vis.window, vis.segments, blocks,
                                           vis.lookahead, key_blocks, chunks, key_chunks))

    kv = P(rows, heads, AXIS, None)
    in_specs = (P(rows, heads, None, AXIS, None), kv, kv, seq, {name: seq for name in extra})
    # check_vma off: Pallas kernels (splash) declare no varying manual axes on their outputs.
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(rows, AXIS, heads),
                         check_vma=False)(qg, k, v, vis.segment_ids, extra)
