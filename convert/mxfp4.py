"""MXFP4 checkpoints (``quantization_config: {quant_method: mxfp4}``): gpt-oss's Hub releases.

gpt-oss ships its experts' weights (``gate_up_proj``, ``down_proj``) as ``<name>_blocks`` (uint8, two E2M1
values a byte, low nibble first, 32 values a block: [experts, rows, blocks, 16]) and ``<name>_scales`` (uint8
E8M0, one power of two ``2^(s - 127)`` a block: [experts, rows, blocks]); everything else is bf16. A
:class:`DequantizingReader` (convert/dequantizing.py) stands in front of the safetensors reader, as for FP8, and hands
the converter each such weight dequantized, one tensor at a time (one expert at a time inside it), in
transformers' layout [experts, blocks * 32, rows] and by transformers' own formula
(``transformers.integrations.mxfp4.convert_moe_packed_tensors``): ``dtype(ldexp(float32(lut[code]), s - 127))``. The converter never sees a block or a scale.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from convert import dequantizing
from convert.readers import TensorReader
from zoo.errors import UserError

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK_BYTES = 16  # 32 four-bit values
# E2M1 codes 0..15: sign bit 3, then two exponent bits and one mantissa bit (transformers' FP4_VALUES).
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
DEFAULT_DTYPE = np.dtype(ml_dtypes.bfloat16)  # what transformers dequantizes gpt-oss's experts to


def declared(hf_config: dict[str, Any]) -> bool:
    """Whether a config's ``quantization_config`` declares MXFP4 (gpt-oss's releases)."""
    q = hf_config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def dequantized_shape(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The weight's shape for ``_blocks`` of shape [experts, rows, blocks, 16]: [experts, blocks * 32, rows]."""
    e, rows, g, _ = blocks
    return e, g * 2 * BLOCK_BYTES, rows


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """transformers' ``convert_moe_packed_tensors`` in NumPy: blocks [E, R, G, 16] and scales [E, R, G] ->
    [E, G * 32, R] in ``dtype``, each value ``dtype(ldexp(float32(FP4_VALUES[code]), scale - 127))``, rounded once
    (to nearest even, as torch casts). Computed one expert at a time: the float32 temporaries are one expert's."""
    e, rows, g, _ = blocks.shape
    out = np.empty(dequantized_shape(blocks.shape), dtype)
    for x in range(e):
        blk = blocks[x]
        vals = np.empty((rows, g, 2 * BLOCK_BYTES), np.float32)
        vals[..., 0::2] = FP4_VALUES[blk & 0x0F]
        vals[..., 1::2] = FP4_VALUES[blk >> 4]
        # ldexp, as torch.ldexp: exact (0.5 * 2^128 is finite, 0 * 2^128 is 0), overflow only past float32's range
        with np.errstate(over="ignore"):  # E8M0 255 (NaN in the spec) overflows as in torch: inf
            vals = np.ldexp(vals, (scales[x].astype(np.int32) - 127)[..., None])
        out[x] = vals.reshape(rows, g * 2 * BLOCK_BYTES).T.astype(dtype)
    return out


class DequantizingReader(dequantizing.DequantizingReader):
    """A safetensors reader whose MXFP4 weights read as dequantized tensors (under their name without
    ``_blocks``) and whose blocks and scales are hidden (:class:`convert.dequantizing.DequantizingReader`, by
    :func:`dequantize`). ``out_dtype`` is what the dequantized weights come out as (the conversion's ``--dtype``,
    else bf16)."""

    def _find(self) -> None:
        have = set(self.reader.names())
        for name in self.reader.names():
            if name.endswith(SCALES) and name[: -len(SCALES)] + BLOCKS not in have:
                raise UserError(f"{self.where}: scales {name!r} have no {name[: -len(SCALES)] + BLOCKS!r} beside them")
            if not name.endswith(BLOCKS):
                continue
            weight = name[: -len(BLOCKS)]
            scales = weight + SCALES
            if scales not in have:
                raise UserError(f"{self.where}: MXFP4 blocks {name!r} have no {scales!r} beside them")
            shape, grid = tuple(self.reader.shape(name)), tuple(self.reader.shape(scales))
            if len(shape) != 4 or shape[-1] != BLOCK_BYTES or self.reader.dtype(name) != np.uint8:
                raise UserError(f"{self.where}: MXFP4 blocks {name!r} are {self.reader.dtype(name)} {shape}, not uint8 "
                                f"[experts, rows, blocks, {BLOCK_BYTES}]")
            if grid != shape[:-1] or self.reader.dtype(scales) != np.uint8:
                raise UserError(f"{self.where}: {scales!r} are {self.reader.dtype(scales)} {grid}, but blocks "
                                f"{shape} need uint8 {shape[:-1]} (one E8M0 scale a block of 32)")
            self.quantized[weight] = (name, scales)

    def _shape(self, weight: str) -> tuple[int, ...]:
        return dequantized_shape(tuple(self.reader.shape(self.quantized[weight][0])))

    def _dequantize(self, *stored: np.ndarray) -> np.ndarray:
        blocks, scales = stored
        return dequantize(blocks, scales, self.out_dtype)

    def summary(self) -> str:
        """One line: what was dequantized, bytes in and out."""
        return self._summary(f"mxfp4: dequantized {self.dequantized} reads of {len(self.quantized)} MXFP4 tensors",
                             "blocks + scales")


def refuse_undeclared(reader: TensorReader, where: str) -> None:
    """MXFP4 blocks in a checkpoint whose config declares no MXFP4 quantization: nothing says how to read them."""
    for name in reader.names():
        if name.endswith(BLOCKS) and reader.dtype(name) == np.uint8:
            raise UserError(f"{where}: tensor {name!r} holds MXFP4 blocks but config.json has no quantization_config "
                            "with quant_method mxfp4; add it, or convert a bf16 copy")
