"""Quantized frozen base weights for QLoRA: NF4 (bit-compatible with bitsandbytes) and int8.

A projection weight, stored by the zoo as ``[*lead, *in, *out]``, is quantized as the Hugging Face /
bitsandbytes layout sees it: each ``[out, in]`` matrix (one per layer, and per expert) flattened row by
row. That is what makes the packed bytes, the absmax and the double-quantization fields equal to what
``bitsandbytes.functional.quantize_4bit(W_hf, blocksize=64, quant_type="nf4")`` gives for the same weight.

- **NF4:** blocks of 64 values with a float32 absmax each; ``x * (1 / absmax)`` rounded to the nearest of
  the 16 NF4 codes (midpoints between neighbouring codes, computed in float32, a value on a midpoint
  going to the lower code); two codes per byte, the first in the high nibble (an odd count's last low
  nibble holds the code of 0.0). An all-zero block has absmax 0 and codes 7 (the code of 0.0).
- **Double quantization:** the absmax vector minus its mean (``offset``) is itself quantized 8-bit
  blockwise (blocks of 256, bitsandbytes' signed dynamic code map, the nearest code, ties to the lower, as its
  CUDA kernel picks; its CPU kernel's table search picks the next code in rare cases) with a
  float32 absmax per 256 blocks: 8 + 32/256 bits per 64 values instead of 32 — 4.127 bits a parameter.
- **int8:** one float32 absmax per output row, ``round(x * 127 / absmax)``, as bitsandbytes' LLM.int8()
  stores weights.

A :class:`QuantizedWeight` is a pytree whose leaves keep the weight's leading ``[layers (, experts)]`` axes,
so a layer scan slices it like the float weight, and :func:`dequantize` runs on one layer's slice inside
the scanned matmul (:mod:`zoo.layers.blocks`): the base is never materialized whole in float.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# bitsandbytes' NF4 table (functional.get_4bit_type("nf4")): float32 values, ascending.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)
NF4_BLOCK = 64
NF4_ZERO = 7  # the code of 0.0
ABSMAX_BLOCK = 256  # double quantization's block over the absmax vector
KINDS = ("nf4", "int8")


def _torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps, dtype=float32), exactly: a float32 step, each value
    ``start + step * i`` (first half) or ``end - step * (steps - 1 - i)`` rounded once."""
    f = np.float32
    a, b = f(start), f(end)
    step = f((b - a) / f(steps - 1))
    i = np.arange(steps)
    lo = (np.float64(a) + np.float64(step) * i).astype(f)
    hi = (np.float64(b) - np.float64(step) * (steps - 1 - i)).astype(f)
    return np.where(i < steps // 2, lo, hi).astype(f)


def dynamic_code() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic code map (``create_dynamic_map(signed=True)``), 256 values ascending."""
    data: list[float] = []
    for i in range(7):  # max_exponent_bits 7, total_bits 8: the exponent shrinks the fraction
        b = _torch_linspace(0.1, 1.0, 2 ** i + 1)
        means = (b[:-1] + b[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (-6 + i))
        data += list((scale * means).astype(np.float32)) + list((-scale * means).astype(np.float32))
    data += [0.0, 1.0]
    return np.sort(np.array(data, np.float32))


DYNAMIC_CODE = dynamic_code()


def _midpoints(code: np.ndarray) -> np.ndarray:
    return ((code[:-1] + code[1:]) / np.float32(2.0)).astype(np.float32)


def _nearest(x: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Index of the nearest code for each float32 x: the midpoints it exceeds (a tie stays low)."""
    return np.searchsorted(_midpoints(code), x, side="left").astype(np.uint8)


def _blockwise(flat: np.ndarray, block: int, code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(code indices, float32 absmax per block) of a flat float32 vector; the last block may be partial."""
    n = flat.size
    nb = -(-n // block)
    padded = np.zeros(nb * block, np.float32)
    padded[:n] = flat
    blocks = padded.reshape(nb, block)
    absmax = np.abs(blocks).max(axis=1).astype(np.float32)
    inv = (np.float32(1.0) / np.maximum(absmax, np.float32(1e-38))).astype(np.float32)
    scaled = np.clip(blocks * inv[:, None], -1, 1).astype(np.float32)
    return _nearest(scaled.reshape(-1)[:n], code), absmax


@dataclass(frozen=True)
class NF4Fields:
    """The stored fields of one NF4 matrix, as bitsandbytes names them."""

    packed: np.ndarray  # uint8 [ceil(n / 2)]
    absmax: np.ndarray  # float32 [blocks], or uint8 [blocks] with double quantization
    absmax2: np.ndarray | None = None  # float32 [ceil(blocks / 256)]
    offset: float | None = None  # float32 mean of the absmax


def nf4_quantize(flat: np.ndarray, double: bool = False) -> NF4Fields:
    """NF4 fields of a flat weight (bitsandbytes' ``quantize_4bit(..., quant_type="nf4")`` of the [out, in]
    matrix, ``compress_statistics=double``)."""
    idx, absmax = _blockwise(np.asarray(flat, np.float32).reshape(-1), NF4_BLOCK, NF4_CODE)
    if idx.size % 2:  # bitsandbytes pads the scaled values with a 0.0: its code fills the last low nibble
        idx = np.concatenate([idx, np.full(1, NF4_ZERO, np.uint8)])
    packed = ((idx[0::2] << 4) | idx[1::2]).astype(np.uint8)
    if not double:
        return NF4Fields(packed, absmax)
    offset = np.float32(absmax.mean(dtype=np.float32))
    q, absmax2 = _blockwise((absmax - offset).astype(np.float32), ABSMAX_BLOCK, DYNAMIC_CODE)
    return NF4Fields(packed, q, absmax2, float(offset))


# --- the pytree the model reads ------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """A frozen projection weight stored quantized; leaves keep the float weight's leading axes.

    ``data``: nf4 — {"packed": uint8 [*lead, ceil(n/2)], "absmax": float32 [*lead, blocks]} or, with double
    quantization, {"packed", "qabsmax": uint8 [*lead, blocks], "absmax2": float32 [*lead, groups],
    "offset": float32 [*lead]}; int8 — {"q": int8 [*lead, out, in], "absmax": float32 [*lead, out]}.
    ``shape`` is one matrix's zoo shape (``w.shape[len(lead):]``), ``contract`` how many of its axes are the
    input (see :func:`zoo.layers.blocks.dense`), ``dtype`` what it dequantizes to.
    """

    data: dict[str, Any]
    kind: str = field(metadata=dict(static=True))
    shape: tuple[int, ...] = field(metadata=dict(static=True))
    contract: int = field(metadata=dict(static=True))
    dtype: str = field(metadata=dict(static=True))

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading (layer, expert) axes the leaves carry now (none inside a layer scan)."""
        return tuple(self.data["absmax" if "absmax" in self.data else "qabsmax"].shape[:-1])

    @property
    def ndim(self) -> int:
        """Rank of the float weight this stands for."""
        return len(self.lead) + len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its stored fields."""
        return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in self.data.values())


def _matrix_dims(shape: tuple[int, ...], contract: int) -> tuple[int, int]:
    return math.prod(shape[:contract]), math.prod(shape[contract:])


def _quantize_matrix(hf: np.ndarray, kind: str, double: bool) -> dict[str, np.ndarray]:
    """One float32 matrix in HF's [out, in] layout as its stored fields."""
    if kind == "int8":
        absmax = np.abs(hf).max(axis=1).astype(np.float32)
        scale = (np.float32(127.0) / np.maximum(absmax, np.float32(1e-38))).astype(np.float32)
        return {"q": np.round(hf * scale[:, None]).astype(np.int8), "absmax": absmax}
    f = nf4_quantize(hf.reshape(-1), double)
    if f.absmax2 is not None:  # double quantization
        return {"packed": f.packed, "qabsmax": f.absmax, "absmax2": f.absmax2, "offset": np.asarray(f.offset, np.float32)}
    return {"packed": f.packed, "absmax": f.absmax}


def quantize_matrices(read: Callable[[tuple[int, ...]], np.ndarray], lead_shape: tuple[int, ...], contract: int,
                      kind: str = "nf4", double: bool = False, dtype: Any = None) -> QuantizedWeight:
    """Quantize a stacked weight one matrix at a time: ``read(index)`` gives the [*in, *out] matrix at each
    ``lead_shape`` index (a layer, an expert), so memory holds one float matrix besides the fields. Each matrix is
    first cast to ``dtype`` (default its own), the dtype it dequantizes to."""
    if kind not in KINDS:
        raise ValueError(f"quantize: kind must be one of {KINDS}, got {kind!r}")
    parts: dict[str, list] = {}
    shape: tuple[int, ...] = ()
    name = ""  # set by the first matrix
    for index in np.ndindex(*lead_shape):
        m = np.asarray(read(index))
        m = m.astype(dtype) if dtype is not None else m
        shape, name = m.shape, np.dtype(m.dtype).name
        k, n = _matrix_dims(shape, contract)
        for key, v in _quantize_matrix(np.ascontiguousarray(m.reshape(k, n).astype(np.float32).T), kind, double).items():
            parts.setdefault(key, []).append(np.asarray(v))
        del m
    data = {key: np.stack(vs).reshape(tuple(lead_shape) + vs[0].shape) for key, vs in parts.items()}
    return QuantizedWeight(data, kind, tuple(shape), contract, name)


def quantize(w: np.ndarray, lead: int, contract: int, kind: str = "nf4", double: bool = False) -> QuantizedWeight:
    """Quantize a zoo weight ``w`` [*lead, *in, *out] matrix by matrix (each as its HF [out, in])."""
    w = np.asarray(w)
    return quantize_matrices(lambda index: w[index], w.shape[:lead], contract, kind, double)


def dequantize(qw: QuantizedWeight, dtype: Any = None) -> jax.Array:
    """The float weight [*lead, *shape] (in ``dtype``, default the original's), computed in float32 as
    bitsandbytes does (code * absmax, then cast)."""
    return _scaled(qw, block_scales(qw), dtype)


def block_scales(qw: QuantizedWeight) -> jax.Array:
    """Each block's float32 scale: int8's absmax / 127 a row; NF4's absmax a block of 64, double quantization's
    decoded from its 8-bit codes, groups' scales and offset."""
    d = qw.data
    if qw.kind == "int8":
        return d["absmax"] / 127.0
    if "qabsmax" not in d:
        return d["absmax"]
    k, n = _matrix_dims(qw.shape, qw.contract)
    nb = -(-(k * n) // NF4_BLOCK)
    a2 = jnp.repeat(d["absmax2"], ABSMAX_BLOCK, axis=-1)[..., :nb]
    return jnp.asarray(DYNAMIC_CODE)[d["qabsmax"].astype(jnp.int32)] * a2 + d["offset"][..., None]


def _scaled(qw: QuantizedWeight, scales: jax.Array, dtype: Any = None) -> jax.Array:
    """The weight from its codes and :func:`block_scales` (each value one float32 multiply)."""
    k, n = _matrix_dims(qw.shape, qw.contract)
    d = qw.data
    lead = qw.lead
    if qw.kind == "int8":
        hf = d["q"].astype(jnp.float32) * scales[..., None]
    else:
        size = k * n
        packed = d["packed"]
        idx = jnp.stack([packed >> 4, packed & 15], axis=-1).reshape(lead + (-1,))
        nb = -(-size // NF4_BLOCK)
        pad = nb * NF4_BLOCK - idx.shape[-1]
        if pad > 0:
            idx = jnp.pad(idx, [(0, 0)] * len(lead) + [(0, pad)])
        idx = idx[..., : nb * NF4_BLOCK]
        vals = jnp.asarray(NF4_CODE)[idx.astype(jnp.int32)].reshape(lead + (nb, NF4_BLOCK)) * scales[..., None]
        hf = vals.reshape(lead + (-1,))[..., :size].reshape(lead + (n, k))
    w = jnp.swapaxes(hf, -1, -2).reshape(lead + qw.shape)
    return w.astype(dtype or qw.dtype)


def dequantize_now(qw: QuantizedWeight, dtype: Any = None) -> jax.Array:
    """:func:`dequantize` outside any traced program (loading a QLoRA base, merging, exporting): the weight in one
    compiled program per kind and shape, where eagerly each of its dozen operations compiled a program of its own.
    The block scales stay eager, as they were: in one program XLA would rewrite int8's division by 127 and fuse
    double quantization's multiply-add, a last bit away from bitsandbytes' (and the eager) values."""
    return _scaled_program()(qw, block_scales(qw), dtype)


@cache
def _scaled_program() -> Any:
    return jax.jit(_scaled, static_argnums=2)


def materialize(w: Any) -> jax.Array:
    """A weight as a float array: dequantized when it is a :class:`QuantizedWeight`, else as it is."""
    return dequantize(w) if isinstance(w, QuantizedWeight) else w


def zero_cotangent(qw: QuantizedWeight) -> QuantizedWeight:
    """The (zero) gradient of a frozen quantized weight, in the pytree's own structure (float0 for integers)."""
    def zero(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.integer):
            return np.zeros(x.shape, jax.dtypes.float0)
        return jnp.zeros_like(x)

    return jax.tree.map(zero, qw)


# --- which weights a QLoRA base quantizes ------------------------------------------------------------------

# The layers' linear projections (zoo.lora.projections.ADAPTABLE), and how many axes of each are its input.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down",
               "shared_gate", "shared_up", "shared_down",
               # Gemma 4's full layers' attention (zoo.model.layer_layout's global_*) and its experts' fused gate/up stack
               "global_q", "global_k", "global_v", "global_o", "expert_gate_up",
               # Qwen3-Next's attention output gate and linear layers' projections (not the conv's taps)
               "attn_gate", "lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a", "lin_out")
_CONTRACT = {"o": 2, "global_o": 2, "lin_out": 2}


def quantized_paths(cfg: Any) -> dict[str, tuple[int, int]]:
    """Dotted paths of the weights a QLoRA base stores quantized -> (leading axes, input axes): every
    layer's attention, MLP and expert projections (bitsandbytes' QLoRA), not MLA's latent projections,
    which the model reads with its own einsums. Embeddings, head, norms, biases and routers stay float."""
    from zoo.model.params import param_specs

    out = {}
    for path, spec in param_specs(cfg).items():
        prefix, _, name = path.rpartition(".")
        if name not in PROJECTIONS or "." in prefix or (cfg.mla and name in ("q", "o")):
            continue
        lead = 2 if "expert" in spec.axes[:2] else 1
        out[path] = (lead, _CONTRACT.get(name, 1))
    return out


def cast_params(params: Any, dtype: Any) -> Any:
    """Every float parameter cast to ``dtype``; a :class:`QuantizedWeight` keeps its fields and dequantizes to
    ``dtype`` instead (the compute dtype of a step)."""
    import dataclasses

    def cast(x):
        if isinstance(x, QuantizedWeight):
            return dataclasses.replace(x, dtype=jnp.dtype(dtype).name)
        return x.astype(dtype)

    return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def as_trained(cfg: Any, params: dict[str, Any], kind: str, double: bool = False) -> dict[str, Any]:
    """Nested ``params`` with each quantizable weight replaced by its quantize-dequantize round trip (same
    dtype and sharding): the base that QLoRA adapters were trained beside, which they merge into."""
    from zoo.model.params import flatten, nest

    flat = flatten(params)
    for path, (lead, contract) in quantized_paths(cfg).items():
        if path in flat:
            x = flat[path]
            w = dequantize_now(quantize(np.asarray(jax.device_get(x)), lead, contract, kind, double), x.dtype)
            flat[path] = jax.device_put(w, x.sharding) if hasattr(x, "sharding") else w
    return nest(flat)


def field_sharding(shape: tuple[int, ...], mesh: jax.sharding.Mesh,
                   expert_axis: int | None = None) -> jax.sharding.NamedSharding:
    """The sharding of one quantized field of ``shape`` on ``mesh``: its last axis (the flattened blocks of one
    matrix) split over the ``fsdp`` axis where it divides, as FSDP splits the float weight; replicated otherwise.
    ``expert_axis`` (an expert stack's fields: axis 1, after the layers) is split over the ``expert`` axis where
    it divides, as the float stack's is, so expert parallelism finds each device's experts in place."""
    from jax.sharding import NamedSharding, PartitionSpec

    fsdp, expert = mesh.shape.get("fsdp", 1), mesh.shape.get("expert", 1)
    axes: list[str | None] = [None] * len(shape)
    if expert_axis is not None and expert_axis < len(shape) and expert > 1 and shape[expert_axis] % expert == 0:
        axes[expert_axis] = "expert"
    if len(shape) >= 1 and axes[-1] is None and fsdp > 1 and shape[-1] % fsdp == 0 and shape[-1] >= fsdp:
        axes[-1] = "fsdp"
    return NamedSharding(mesh, PartitionSpec(*axes) if any(axes) else PartitionSpec())


def place(qw: QuantizedWeight, mesh: jax.sharding.Mesh) -> QuantizedWeight:
    """``qw``'s fields as global arrays on ``mesh``, each sharded by :func:`field_sharding` (an expert stack's
    over the ``expert`` axis too). Every process holds the same host copy, so each takes its own shards from it."""
    expert_axis = 1 if len(qw.lead) == 2 else None  # [layers, experts, ...]

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, field_sharding(x.shape, mesh, expert_axis), lambda idx: x[idx])

    return jax.tree.map(put, qw)

