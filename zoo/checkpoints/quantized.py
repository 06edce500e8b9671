"""Checkpoints stored quantized (``zoo quantize``): NF4 or int8 projection fields on disk, dequantized on load.

A quantized checkpoint keeps the zoo layout (:mod:`zoo.checkpoints.format`). Its model.json ``params`` is the model's
parameter table as the float model has it (what ``zoo.load`` returns, what export writes), and its
``quantized`` section (a :class:`QuantSection`) lists what ``params/`` stores instead: every parameter that
is not a quantized projection under its own name, and for each projection of :func:`zoo.model.quant.quantized_paths`
its fields under ``<path>.<field>`` (``layers.q.packed``, ``layers.q.absmax``, ...), each keeping the weight's
leading ``[layers (, experts)]`` axes, as a :class:`zoo.model.quant.QuantizedWeight` holds them in memory.

Readers: :func:`load_params` (dequantized, sharded: ``zoo.load``), :class:`DequantizedParamReader` (one layer at a
time: ``zoo export``), :func:`load_quantized` (the fields as they are: a QLoRA run's frozen base, no
re-quantization).
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np

from zoo.checkpoints.format import np_dtype
from zoo.checkpoints.readers import load_param_numpy, load_stored_params
from zoo.checkpoints.writer import StoredSection
from zoo.model import quant
from zoo.model.config import ModelConfig
from zoo.model.params import ParamSpec, flatten, nest, param_specs

SECTION = "quantized"


def field_shapes(kind: str, double: bool, shape: tuple[int, ...], contract: int) -> dict[str, tuple[tuple, str]]:
    """Field name -> (shape of one matrix's field, dtype) of a weight whose one matrix has zoo shape ``shape``."""
    k, n = math.prod(shape[:contract]), math.prod(shape[contract:])
    if kind == "int8":
        return {"q": ((n, k), "int8"), "absmax": ((n,), "float32")}
    size = k * n
    blocks = -(-size // quant.NF4_BLOCK)
    if not double:
        return {"packed": ((-(-size // 2),), "uint8"), "absmax": ((blocks,), "float32")}
    return {"packed": ((-(-size // 2),), "uint8"), "qabsmax": ((blocks,), "uint8"),
            "absmax2": ((-(-blocks // quant.ABSMAX_BLOCK),), "float32"), "offset": ((), "float32")}


class QuantSection(StoredSection):
    """model.json's ``quantized`` entry: ``kind``, ``double``, ``bits_per_param`` and the stored-array table."""

    def specs(self, cfg: ModelConfig) -> dict[str, ParamSpec]:
        """Every array a checkpoint of ``cfg`` stored with these settings holds: the float parameters that are
        not quantized, and each projection's fields."""
        qpaths = quant.quantized_paths(cfg)
        out = {}
        for p, spec in param_specs(cfg).items():
            if p not in qpaths:
                out[p] = spec
                continue
            lead, contract = qpaths[p]
            for name, (shape, _) in field_shapes(self["kind"], self["double"], spec.shape[lead:], contract).items():
                out[f"{p}.{name}"] = ParamSpec(spec.shape[:lead] + shape, spec.axes[:lead] + (None,) * len(shape), "zeros")
        return out


def is_quantized(meta: dict[str, Any]) -> bool:
    """Whether a model.json describes a checkpoint stored quantized."""
    return SECTION in meta


def settings(meta: dict[str, Any]) -> tuple[str, bool] | None:
    """(kind, double quantization) of a quantized checkpoint's model.json; None for any other checkpoint."""
    q = meta.get(SECTION)
    return (q["kind"], bool(q["double"])) if q else None


def describe(kind: str, double: bool) -> str:
    """How a quantization reads in messages: ``NF4, double quantization``, ``NF4`` or ``INT8``."""
    return "NF4, double quantization" if kind == "nf4" and double else kind.upper()


def _projections(meta: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return quant.quantized_paths(ModelConfig.from_dict(meta["config"]))


def load_quantized(ckpt: str | os.PathLike, meta: dict[str, Any], path: str, dtype: Any = None
                   ) -> quant.QuantizedWeight:
    """Projection ``path`` of a quantized checkpoint as the stored fields (host arrays, every layer), dequantizing
    to ``dtype`` (default the float model's dtype)."""
    q = meta[SECTION]
    lead, contract = _projections(meta)[path]
    info = meta["params"][path]
    data = {name: np.asarray(load_param_numpy(ckpt, f"{path}.{name}", q["params"][f"{path}.{name}"]))
            for name in field_shapes(q["kind"], q["double"], tuple(info["shape"][lead:]), contract)}
    name = np.dtype(dtype).name if dtype is not None else info["dtype"]
    return quant.QuantizedWeight(data, q["kind"], tuple(info["shape"][lead:]), contract, name)


class DequantizedParamReader:
    """A parameter of a quantized checkpoint, read whole or one leading-axis slice (one layer) at a time, as
    :class:`zoo.checkpoints.readers.ParamReader` reads a float one: projections dequantized per layer, the rest as stored.

    ``dequantized`` tells an adapter merged over this base that its weights are already the dequantized ones.
    """

    dequantized = True

    def __init__(self, ckpt: str | os.PathLike, meta: dict[str, Any], path: str):
        from zoo.checkpoints.readers import ParamReader

        info = meta["params"][path]
        self.shape, self.dtype = tuple(info["shape"]), np_dtype(info["dtype"])
        proj = _projections(meta)
        self.lead = proj[path][0] if path in proj else 0
        # The fields are ~1/8 of the float weight (NF4): read once, whole, then sliced per layer.
        self._fields = load_quantized(ckpt, meta, path) if path in proj else None
        self._plain = None if path in proj else ParamReader(ckpt, path)

    def _dequantize(self, index: tuple) -> np.ndarray:
        qw = self._fields
        assert qw is not None, "a projection's fields (other parameters read through _plain)"
        qw = quant.QuantizedWeight({k: v[index] for k, v in qw.data.items()}, qw.kind, qw.shape, qw.contract, qw.dtype)
        return np.asarray(quant.dequantize_now(qw))

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray:
        """The whole parameter (``index=None``) or its slice ``[index]`` (e.g. ``(layer, expert)``)."""
        if self._plain is not None:
            return self._plain.read(index)
        if index is None:
            return self.read_block(0, None, None)
        return self._dequantize(index if isinstance(index, tuple) else (index,))

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray:
        """``param[..., start:stop, ...]`` along a leading (stacked) ``axis``, dequantized one matrix at a time."""
        if self._plain is not None:
            return self._plain.read_block(axis, start, stop, squeeze)
        if axis >= self.lead:
            raise ValueError("quantized reads slice only the stacked leading axes")
        lead = self.shape[:self.lead]
        rng = range(*slice(start, stop).indices(lead[axis]))
        out = np.empty(lead[:axis] + (len(rng),) + self.shape[axis + 1:], self.dtype)
        for pos in np.ndindex(*lead[:axis], len(rng), *lead[axis + 1:]):
            src = pos[:axis] + (rng[pos[axis]],) + pos[axis + 1:]
            out[pos] = self._dequantize(src)
        return out.squeeze(axis) if squeeze else out


def load_params(ckpt: str | os.PathLike, meta: dict[str, Any], mesh: jax.sharding.Mesh, dtype: Any = None,
                paths: list[str] | None = None) -> dict[str, Any]:
    """A quantized checkpoint's model parameters (nested jax Arrays sharded on ``mesh``), projections
    dequantized (one at a time, layer by layer) into their float dtype or ``dtype``."""
    from zoo.model.sharding import named_sharding

    cfg = ModelConfig.from_dict(meta["config"])
    specs = param_specs(cfg)
    proj = quant.quantized_paths(cfg)
    wanted = paths or list(specs)
    plain = [p for p in wanted if p not in proj]
    flat = flatten(load_stored_params(ckpt, mesh, dtype, paths=plain)) if plain else {}
    for p in wanted:
        if p in proj:
            host = DequantizedParamReader(ckpt, meta, p).read()
            if dtype is not None:
                host = host.astype(dtype)
            sharding = named_sharding(mesh, specs[p].axes, specs[p].shape)
            flat[p] = jax.make_array_from_callback(host.shape, sharding, host.__getitem__)
            del host
    return nest(flat)


def abstract_base(cfg: Any, kind: str, double: bool, dtype: Any, mesh: jax.sharding.Mesh) -> dict[str, quant.QuantizedWeight]:
    """Each projection of :func:`zoo.model.quant.quantized_paths` as the :class:`QuantizedWeight` a QLoRA run would place
    (:func:`zoo.model.quant.place`), its fields ``jax.ShapeDtypeStruct`` s with their shardings: nothing read or quantized
    (``--compile-only``). ``dtype`` is what it dequantizes to (the run's ``dtype.params``)."""
    import jax.numpy as jnp

    specs = param_specs(cfg)
    out = {}
    for path, (lead, contract) in quant.quantized_paths(cfg).items():
        lead_shape, shape = specs[path].shape[:lead], specs[path].shape[lead:]
        data = {}
        for name, (one, dt) in field_shapes(kind, double, shape, contract).items():
            full = tuple(lead_shape) + tuple(one)
            data[name] = jax.ShapeDtypeStruct(full, jnp.dtype(dt),
                                              sharding=quant.field_sharding(full, mesh, 1 if lead == 2 else None))
        out[path] = quant.QuantizedWeight(data, kind, tuple(shape), contract, jnp.dtype(dtype).name)
    return out
