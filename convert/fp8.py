"""FP8 block-scaled checkpoints (``quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}``).

DeepSeek-V3/R1's Hub weights, and the FP8 releases of other families, store every linear
projection as float8_e4m3fn with a float32 ``<name>_scale_inv`` holding one scale per
128 x 128 block; embeddings, the head, norms and the router stay in bf16. A
:class:`DequantizingReader` (convert/dequantizing.py) stands in front of the safetensors reader and hands the
converter each FP8 weight already dequantized, one tensor at a time, by DeepSeek's own
formula ``out[i, j] = dtype(float32(w[i, j]) * scale_inv[i // 128, j // 128])``: the
converter never sees a scale, and memory stays bounded by the largest tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from convert import dequantizing
from convert.readers import TensorReader
from zoo.errors import UserError

FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
SCALE_SUFFIX = "_scale_inv"
# What DeepSeek's fp8_cast_bf16.py produces, and what the unquantized tensors of these checkpoints are stored in.
DEFAULT_DTYPE = np.dtype(ml_dtypes.bfloat16)
SUPPORTED = "quant_method fp8, fmt e4m3, weight_block_size [rows, cols]"


@dataclass(frozen=True)
class BlockScaling:
    """The block grid of an FP8 checkpoint's scales."""

    rows: int
    cols: int


def block_scaling(hf_config: dict[str, Any], where: str) -> BlockScaling | None:
    """The block scaling a config's ``quantization_config`` declares; None for an unquantized checkpoint."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise UserError(f"{where}: quantization_config quant_method {method!r} is not supported "
                        f"(supported: {SUPPORTED}); convert an unquantized copy")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UserError(f"{where}: FP8 format {fmt!r} is not supported (supported: {SUPPORTED})")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{where}: quantization_config weight_block_size {block!r} is not a [rows, cols] pair "
                        f"of positive integers (per-tensor FP8 is not supported; supported: {SUPPORTED})")
    return BlockScaling(*block)


def scale_grid(shape: tuple[int, ...], block: BlockScaling) -> tuple[int, int]:
    """The shape of a weight's scale grid: one scale per block, the last row/column of blocks maybe partial."""
    return math.ceil(shape[0] / block.rows), math.ceil(shape[1] / block.cols)


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: BlockScaling, dtype: np.dtype) -> np.ndarray:
    """DeepSeek's ``weight_dequant``: ``dtype(float32(w) * float32(scale_inv)[i // rows, j // cols])``.

    One product, rounded once to ``dtype`` (round to nearest even, as torch casts); computed one row of
    blocks at a time, so the float32 temporaries are one block row, not the tensor.
    """
    rows, cols = w.shape
    s = scale_inv.astype(np.float32)
    out = np.empty(w.shape, dtype)
    for r in range(0, rows, block.rows):
        row_scales = np.repeat(s[r // block.rows], block.cols)[:cols]
        out[r:r + block.rows] = (w[r:r + block.rows].astype(np.float32) * row_scales).astype(dtype)
    return out


class DequantizingReader(dequantizing.DequantizingReader):
    """A safetensors reader whose FP8 weights read as dequantized tensors and whose scales are hidden
    (:class:`convert.dequantizing.DequantizingReader`, by :func:`dequantize` with ``block``'s grid).

    ``out_dtype`` is what the dequantized weights come out as (the conversion's ``--dtype``, else bf16).
    """

    def __init__(self, reader: TensorReader, block: BlockScaling, out_dtype: np.dtype, where: str):
        self.block = block
        super().__init__(reader, out_dtype, where)

    def _find(self) -> None:
        have = set(self.reader.names())
        scales: dict[str, str] = {}  # weight -> its scale tensor
        for name in self.reader.names():
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in have:
                    raise UserError(f"{self.where}: scale {name!r} has no weight {weight!r} beside it")
                scales[weight] = name
        for name in self.reader.names():
            fp8 = self.reader.dtype(name) in FP8_DTYPES
            if fp8 and name not in scales:
                raise UserError(f"{self.where}: FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r} beside it")
            if name in scales:
                if not fp8:
                    raise UserError(f"{self.where}: tensor {name!r} has a scale but is stored as "
                                    f"{self.reader.dtype(name)}, not FP8")
                shape, grid = self.reader.shape(name), self.reader.shape(scales[name])
                if len(shape) != 2 or tuple(grid) != scale_grid(shape, self.block):
                    want = scale_grid(shape, self.block) if len(shape) == 2 else "a 2-D weight"
                    raise UserError(f"{self.where}: {scales[name]!r} has shape {tuple(grid)}, but weight "
                                    f"{tuple(shape)} in {self.block.rows}x{self.block.cols} blocks needs {want}")
        self.quantized = {w: (w, s) for w, s in scales.items()}

    def _dequantize(self, *stored: np.ndarray) -> np.ndarray:
        w, scale_inv = stored
        return dequantize(w, scale_inv, self.block, self.out_dtype)

    def summary(self) -> str:
        """One line: what was dequantized, bytes in and out."""
        return self._summary(f"fp8: dequantized {self.dequantized} of {len(self.quantized)} FP8 tensors "
                             f"({self.block.rows}x{self.block.cols} blocks)", "weights + scales")


def refuse_unscaled_fp8(reader: TensorReader, where: str) -> None:
    """An FP8 tensor in a checkpoint whose config declares no FP8 quantization: nothing says how to scale it."""
    for name in reader.names():
        if reader.dtype(name) in FP8_DTYPES:
            raise UserError(f"{where}: tensor {name!r} is FP8 ({reader.dtype(name).name}) but config.json has no "
                            f"quantization_config ({SUPPORTED}); add it, or convert a bf16 copy")
