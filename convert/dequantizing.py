"""The reader that quantized checkpoints are converted through: quantized weights read dequantized.

A :class:`DequantizingReader` stands in front of a checkpoint's tensor reader and shows each quantized weight
under its own name, already dequantized, one tensor at a time, with the pieces it is stored as (scales, blocks)
hidden; it counts what it dequantized for the converter's summary line. A format (convert/fp8.py's block-scaled
FP8, convert/mxfp4.py's MXFP4) says which weights it holds, how large they read and how one is dequantized.
"""

from __future__ import annotations

import numpy as np

from convert.readers import TensorReader


class DequantizingReader:
    """A tensor reader (:class:`convert.readers.TensorReader`) whose quantized weights read dequantized.

    ``quantized``: weight -> the stored tensors it is made of, in the order :meth:`_dequantize` takes them (the
    weight itself among them where it is stored under its own name); a subclass fills it in :meth:`_find`,
    raising a one-line UserError for anything it cannot read. ``out_dtype`` is what the dequantized weights come
    out as. The counts (reads dequantized, bytes read, bytes produced) feed :meth:`summary`.
    """

    def __init__(self, reader: TensorReader, out_dtype: np.dtype, where: str):
        self.reader, self.out_dtype, self.where = reader, out_dtype, where
        self.quantized: dict[str, tuple[str, ...]] = {}
        self.dequantized = self.bytes_in = self.bytes_out = 0
        self._find()

    def _find(self) -> None:
        """Fill :attr:`quantized` from the inner reader's tensors (checking them)."""
        raise NotImplementedError

    def _shape(self, weight: str) -> tuple[int, ...]:
        """A quantized weight's shape once dequantized (default: its first stored tensor's)."""
        return tuple(self.reader.shape(self.quantized[weight][0]))

    def _dequantize(self, *stored: np.ndarray) -> np.ndarray:
        """A weight, as ``out_dtype``, from its stored tensors."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """Every tensor, quantized weights by their own name, the pieces they are stored as hidden."""
        stored = self.reader.names()
        hidden = {n for pieces in self.quantized.values() for n in pieces} - set(self.quantized)
        have = set(stored)
        return [n for n in stored if n not in hidden] + [w for w in self.quantized if w not in have]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor (a quantized weight's once dequantized) without reading it."""
        return self._shape(name) if name in self.quantized else tuple(self.reader.shape(name))

    def dtype(self, name: str) -> np.dtype:
        """The dtype a tensor reads as: ``out_dtype`` for quantized weights, the stored one otherwise."""
        return self.out_dtype if name in self.quantized else self.reader.dtype(name)

    def get(self, name: str) -> np.ndarray:
        """One tensor; a quantized weight dequantized from its stored tensors."""
        if name not in self.quantized:
            return self.reader.get(name)
        stored = [self.reader.get(n) for n in self.quantized[name]]
        out = self._dequantize(*stored)
        self.dequantized += 1
        self.bytes_in += sum(x.nbytes for x in stored)
        self.bytes_out += out.nbytes
        return out

    def _summary(self, what: str, stored: str) -> str:
        """The summary line: ``what`` was dequantized, then bytes in (as ``stored``) and out."""
        from zoo.console import human_bytes

        return (f"{what} to {self.out_dtype.name}: {human_bytes(self.bytes_in)} in ({stored}), "
                f"{human_bytes(self.bytes_out)} out")

    def summary(self) -> str:
        """One line: what was dequantized, bytes in and out."""
        raise NotImplementedError
