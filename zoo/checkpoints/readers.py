"""Reading the arrays a plain checkpoint stores: all at once onto a mesh (:func:`load_stored_params`) or one
parameter, one layer at a time on the host (:class:`ParamReader`, :func:`load_param_numpy`).

These read a checkpoint's stored arrays as they are; :mod:`zoo.checkpoints.loading` reads any checkpoint as
the model it describes (an adapter checkpoint's merged onto its base).
"""

from __future__ import annotations

import gc
import os
from typing import Any, Protocol

import jax
import numpy as np

from zoo.checkpoints.format import STATE_DIR, kvstore_base, np_dtype, orbax_v1, params_dir, read_meta
from zoo.errors import UserError
from zoo.memory import release_free_memory
from zoo.model.config import ModelConfig
from zoo.model.params import flatten, nest, param_specs


def load_stored_params(
    ckpt: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = None,
    paths: list[str] | None = None,
) -> dict[str, Any]:
    """Restore the parameters a checkpoint stores (nested dict of jax Arrays), sharded on ``mesh`` by the
    logical-axis rules, in their stored dtype or ``dtype``.

    ``paths`` restores only those dotted parameters (Orbax partial load), which
    is how streaming readers take one parameter at a time. This reads a plain
    checkpoint only; :func:`zoo.checkpoints.loading.load_params` (``zoo.load_params``) reads
    any checkpoint as its model, an adapter checkpoint's merged onto its base.
    """
    from zoo.model.sharding import make_mesh, named_sharding

    ocp = orbax_v1()
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"])
    mesh = mesh or make_mesh()
    specs = param_specs(cfg)
    stored = meta["params"]
    wanted = paths or list(specs)
    abstract = {}
    for p in wanted:
        if p not in stored:
            raise UserError(f"{ckpt}: parameter '{p}' is missing from the checkpoint; it is damaged, convert it again")
        shape = tuple(stored[p]["shape"])
        if shape != specs[p].shape:
            raise UserError(f"{ckpt}: parameter '{p}' has shape {shape}, the config implies {specs[p].shape}")
        dt = np.dtype(dtype) if dtype is not None else np_dtype(stored[p]["dtype"])
        abstract[p] = jax.ShapeDtypeStruct(shape, dt, sharding=named_sharding(mesh, specs[p].axes, shape))
    # Parameters restored in groups of at most max(the largest one, 64 MiB) bytes: each group's staging buffers (the
    # host copy Orbax reads into before the device array exists) are freed and handed back before the next,
    # so the load peaks at the weights plus about the largest parameter, not at twice the weights (measured
    # on SmolLM2-135M: 0.63 GB above the weights restoring all at once, of which 0.4 GB could stay resident).
    # A model that fits in one group (tests' tiny ones) restores in one call, without a collection (a full
    # gc.collect() takes 0.25 s with transformers imported).
    groups = restore_groups(abstract)
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = paths is not None or len(groups) > 1
    flat = {}
    # The objects alive before the load cannot be part of a group's garbage: frozen, a collection skips them
    # (with transformers imported, a full collection otherwise scans millions of them: 0.25 s a group, 0.84 -> 0.40 s
    # a SmolLM2 load). A caller's own freeze (a server about to fork) is left as it is.
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    try:
        with ctx:
            for group in groups:
                loaded = flatten(ocp.load(params_dir(ckpt), nest({p: abstract[p] for p in group})))
                # The copies into device arrays finish asynchronously and hold their host staging buffers until
                # then: wait, so that the trim below hands those buffers back (without it the memory a load
                # leaves resident depended on the timing).
                jax.block_until_ready(loaded)
                flat.update(loaded)
                if len(groups) > 1:
                    gc.collect()  # the staging buffers of this group, some held in reference cycles
                release_free_memory()
    finally:
        if ours:
            gc.unfreeze()
    return nest(flat)


def restore_groups(abstract: dict[str, jax.ShapeDtypeStruct], floor: int = 64 << 20) -> list[list[str]]:
    """``abstract``'s parameter names in consecutive groups of at most max(largest parameter, ``floor``) bytes."""
    size = {p: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for p, a in abstract.items()}
    budget = max([floor, *size.values()])
    groups: list[list[str]] = []
    used = budget
    for p in abstract:
        if used + size[p] > budget:
            groups.append([])
            used = 0
        groups[-1].append(p)
        used += size[p]
    return groups


def load_param_numpy(ckpt: str | os.PathLike, path: str, info: dict[str, Any] | None = None) -> np.ndarray:
    """One stored parameter as a host NumPy array in its stored dtype (for streaming readers).

    Restoring into NumPy rather than a device array avoids an extra
    device-to-host copy, keeping peak memory near the parameter's own size.
    ``info`` (shape, dtype) defaults to the parameter's entry in model.json.
    """
    ocp = orbax_v1()
    info = info or read_meta(ckpt)["params"].get(path)
    if info is None:
        raise UserError(f"{ckpt}: parameter '{path}' is missing from the checkpoint; it is damaged, convert it again")
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = True
    with ctx:
        tree = ocp.load(params_dir(ckpt), nest({path: np.empty(info["shape"], np_dtype(info["dtype"]))}))
    for part in path.split("."):
        tree = tree[part]
    return tree


class ParamSource(Protocol):
    """What streams one parameter: :class:`ParamReader`, :class:`zoo.checkpoints.adapter.MergedParamReader` (adapters merged
    in) and :class:`zoo.checkpoints.quantized.DequantizedParamReader` (a quantized checkpoint's, dequantized)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray: ...

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray: ...


class ParamReader:
    """Reads one stored parameter whole or one leading-axis slice (one layer) at a time.

    Fast path: open the parameter's zarr3 array in the OCDBT store directly with
    TensorStore, with a cache large enough for one stored chunk, so per-layer
    reads decode the chunk once and peak memory stays near 1x the parameter
    (Orbax's restore peaks at 2x: a decode buffer plus the result). Checkpoints
    laid out differently fall back to :func:`load_param_numpy`.
    """

    def __init__(self, ckpt: str | os.PathLike, path: str):
        self.ckpt, self.path = ckpt, path
        info = read_meta(ckpt)["params"].get(path)
        if info is None:
            raise UserError(f"{ckpt}: parameter '{path}' is missing from the checkpoint; it is damaged, convert it again")
        self.shape, self.dtype = tuple(info["shape"]), np_dtype(info["dtype"])
        self._store = self._open_store()
        self._array: np.ndarray | None = None

    def _open_store(self):
        import tensorstore as ts

        state = params_dir(self.ckpt) / STATE_DIR  # on object storage: read there, through TensorStore's driver
        if not (state / "manifest.ocdbt").is_file():
            return None
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": kvstore_base(state), "path": self.path}}
        try:
            probe = ts.open(spec, read=True).result()
            chunk = probe.chunk_layout.read_chunk.shape or probe.shape
            # Room for one stored chunk, so slices of it are decoded once.
            limit = int(np.prod(chunk, dtype=np.int64)) * self.dtype.itemsize + 2**26
            store = ts.open(spec, read=True, context=ts.Context({"cache_pool": {"total_bytes_limit": limit}})).result()
        except Exception:  # not this layout: use Orbax's own restore
            return None
        if tuple(store.shape) != self.shape or store.dtype.numpy_dtype != self.dtype:
            return None
        return store

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray:
        """The whole parameter (``index=None``) or its slice ``[index]`` (e.g. ``(layer, expert)``)."""
        if index is None:
            return self.read_block(0, None, None)
        if self._store is not None:
            return np.asarray(self._store[index].read().result())
        if self._array is None:
            self._array = load_param_numpy(self.ckpt, self.path)
        return self._array[index]

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray:
        """``param[..., start:stop, ...]`` along ``axis`` (``squeeze`` drops that axis when it has length 1)."""
        idx = (slice(None),) * axis + (slice(start, stop),)
        if self._store is not None:
            out = np.asarray(self._store[idx].read().result())
        else:
            if self._array is None:
                self._array = load_param_numpy(self.ckpt, self.path)
            out = self._array[idx]
        return out.squeeze(axis) if squeeze else out

