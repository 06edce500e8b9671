"""Logical axis names -> mesh axes: one rule table for every parameter and activation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")

# The one table. A logical name maps to a mesh axis, a tuple of mesh axes, or
# None (replicated). FSDP shards the embedding dimension of every weight;
# tensor parallelism splits heads / mlp / vocab, Megatron style. Context
# parallelism splits the sequence (zoo.model.context); its devices also share the
# weights' embedding dimension, as FSDP's do, since they hold the same rows.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "sequence": "context",
    "vocab": "tensor",
    "embed": ("fsdp", "context"),
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "expert": "expert",
}

# Decoding's table: a token step reads every weight once for a few rows, so gathering FSDP's embed-split weights at
# every token (a layer's worth of temporaries, and its bytes over the links, per token) costs far more than the
# step. Decoding lays the weights out tensor-parallel over the fsdp axis as well (heads / mlp / vocab split, embed
# whole): each chip keeps its slice resident and a step moves only activations (all-reduces of [rows, embed]).
# The KV cache follows its heads (split like the k/v weights where they divide), its rows over data.
DECODE_RULES: dict[str, str | tuple[str, ...] | None] = {
    **LOGICAL_RULES,
    "batch": "data",
    "embed": None,
    "vocab": ("tensor", "fsdp"),
    "mlp": ("tensor", "fsdp"),
    "heads": ("tensor", "fsdp"),
    "kv_heads": ("tensor", "fsdp"),
}


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, expert: int = 1, devices: Sequence | None = None,
    context: int = 1,
) -> Mesh:
    """A (data, fsdp, context, tensor, expert) mesh; one size may be -1 for 'all remaining devices'."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, context, tensor, expert]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh sizes {sizes} do not divide {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, {len(devices)} exist")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def mesh_context(mesh: Mesh | AbstractMesh | None) -> contextlib.AbstractContextManager[Any]:
    """``jax.set_mesh(mesh)`` for a concrete mesh (else nothing): functions traced under it see the mesh (and its
    platform), so splash attention shards itself over it (:mod:`zoo.kernels.splash`, :func:`zoo.kernels.choice.platform`)."""
    return jax.set_mesh(mesh) if isinstance(mesh, Mesh) else contextlib.nullcontext()


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int] | None = None, mesh: Mesh | AbstractMesh | None = None,
    rules: dict[str, str | tuple[str, ...] | None] | None = None,
) -> PartitionSpec:
    """PartitionSpec for ``logical_axes`` under the rule table (``rules``; default :data:`LOGICAL_RULES`).

    With ``shape`` and ``mesh`` given, a mesh axis that does not divide its
    dimension (or is already used by an earlier dimension) is dropped, so any
    model loads on any mesh: that dimension is replicated instead.
    """
    rules = LOGICAL_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical_axes):
        rule = rules.get(name) if name else None
        axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
        keep: list[str] = []
        for ax in axes:
            if ax in used:
                continue
            if mesh is not None and shape is not None:
                size = mesh.shape[ax] * math.prod(mesh.shape[a] for a in keep)
                if mesh.shape[ax] == 1 or shape[i] % size:  # an axis of one device splits nothing: left out
                    continue
            keep.append(ax)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int],
                   rules: dict[str, str | tuple[str, ...] | None] | None = None) -> NamedSharding:
    """NamedSharding of an array with these logical axes on ``mesh`` (under ``rules``, default the training table)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def batch_sharded(x: jax.Array, sequence: bool = True) -> jax.Array:
    """``x`` [batch, seq, ...] with its batch axis split over the (data, fsdp) axes of the mesh in context
    (:func:`mesh_context`, set while the train step is lowered), its sequence over ``context`` (context
    parallelism, :mod:`zoo.model.context`) and its other axes left to the compiler; x as it is without a mesh.

    Without it the SPMD partitioner may lay activations out replicated: FSDP splits the weights' embedding axis
    over the same mesh axis that splits the batch, and for x @ W it chose to gather x. Llama-3.1-8B on 8 TPU
    chips then kept the scan's gate and up for the global batch on every chip (two 14 GiB buffers a chip). A vision
    tower's patches (``sequence`` False) keep their rows split alone: a row's patches are not a sequence that
    context parallelism splits."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or x.ndim == 0:
        return x
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    rows = axes if axes and not x.shape[0] % math.prod(mesh.shape[a] for a in axes) else None
    context = mesh.shape.get("context", 1)
    seq = "context" if sequence and context > 1 and x.ndim > 1 and not x.shape[1] % context else None
    if rows is None and seq is None:
        return x
    rest = [PartitionSpec.UNCONSTRAINED] * (x.ndim - 1 - (seq is not None))
    return jax.lax.with_sharding_constraint(x, PartitionSpec(rows or PartitionSpec.UNCONSTRAINED,
                                                             *((seq,) if seq else ()), *rest))
