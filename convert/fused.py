"""Fused Hugging Face tensors (Phi-3/Phi-4's ``qkv_proj`` and ``gate_up_proj``): split while converting, fused
back bit for bit while exporting.

A fused Linear weight is its parts' rows one after another ([q; k; v], [gate; up]), so a part is a row block
of it and, row-major, a contiguous byte range. Converting, :class:`SplitReader` stands in front of the
checkpoint's reader and shows each fused tensor as its parts under the names the shared decoder table reads
(``q_proj``, ``gate_proj``, ...). Exporting, :func:`fuse_planned` replaces the planned part tensors by their
fused tensor in the files' headers, and :func:`place_parts` writes each part at its byte offset inside it,
one zoo parameter at a time as for any other tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from zoo.config import ModelConfig
from zoo.errors import UserError


@dataclass(frozen=True)
class Fusion:
    """One fused tensor of a layer: its name and its parts' names (suffixes after the layer's prefix)."""

    fused: str
    parts: tuple[str, ...]
    rows: str  # "qkv": q, k, v heads * head_dim; "gate_up": the MLP width twice

    def part_rows(self, cfg: ModelConfig) -> tuple[int, ...]:
        """Rows of each part, in order."""
        if self.rows == "qkv":
            d = cfg.head_dim
            return cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d
        return cfg.intermediate_size, cfg.intermediate_size


FUSIONS: dict[str, tuple[Fusion, ...]] = {
    "phi3": (
        Fusion("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"), "qkv"),
        Fusion("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    ),
}


class SplitReader:
    """A tensor reader (:class:`convert.readers.TensorReader`) showing each fused tensor as its parts."""

    def __init__(self, inner: Any, cfg: ModelConfig, description: str):
        self.inner, self.cfg, self.description = inner, cfg, description
        # part name -> (fused name, first row, end row)
        self.parts: dict[str, tuple[str, int, int]] = {}
        for name in inner.names():
            for f in FUSIONS.get(cfg.family, ()):
                if name.endswith("." + f.fused) or name == f.fused:
                    self._split(name, f)

    def _split(self, name: str, f: Fusion) -> None:
        prefix = name[: len(name) - len(f.fused)]
        rows = f.part_rows(self.cfg)
        have = self.inner.shape(name)
        if len(have) != 2 or have[0] != sum(rows):
            raise UserError(f"{self.description}: tensor {name!r} has shape {tuple(have)} but the config implies "
                            f"{sum(rows)} rows ({' + '.join(map(str, rows))})")
        start = 0
        for part, n in zip(f.parts, rows):
            self.parts[prefix + part] = (name, start, start + n)
            start += n

    def names(self) -> list[str]:
        """The inner reader's tensors, each fused one replaced by its parts."""
        fused = {v[0] for v in self.parts.values()}
        return [n for n in self.inner.names() if n not in fused] + list(self.parts)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape (a part's: its rows of the fused tensor)."""
        if name not in self.parts:
            return tuple(self.inner.shape(name))
        fused, a, b = self.parts[name]
        return (b - a, *self.inner.shape(fused)[1:])

    def dtype(self, name: str) -> np.dtype:
        """A tensor's dtype (a part's: the fused tensor's)."""
        return self.inner.dtype(self.parts[name][0] if name in self.parts else name)

    def get(self, name: str) -> np.ndarray:
        """A tensor (a part: its rows of the fused tensor, copied)."""
        if name not in self.parts:
            return self.inner.get(name)
        fused, a, b = self.parts[name]
        return np.ascontiguousarray(self.inner.get(fused)[a:b])


def fused_module(cfg: ModelConfig, hf_name: str) -> str | None:
    """The fused tensor (``...qkv_proj.weight``) that HF tensor ``hf_name`` is a part of in ``cfg``'s family, or
    None when it is a tensor of its own."""
    for f in FUSIONS.get(cfg.family, ()):
        for part in f.parts:
            if hf_name.endswith("." + part):
                return hf_name[: len(hf_name) - len(part)] + f.fused
    return None


def split_fused(reader: Any, cfg: ModelConfig, description: str) -> Any:
    """``reader`` as the conversion tables read it: a :class:`SplitReader` for families with fused tensors."""
    return SplitReader(reader, cfg, description) if cfg.family in FUSIONS else reader


def fuse_planned(cfg: ModelConfig, planned: list) -> tuple[list, dict[str, list]]:
    """(the export's file tensors: each fused tensor's parts replaced by it, in its first part's place; fused
    name -> its parts in row order). ``planned`` are :class:`convert.export.PlannedTensor`."""
    by_name = {t.name: t for t in planned}
    parts: dict[str, list] = {}
    first: dict[str, str] = {}  # first part's name -> fused name
    taken: set[str] = set()
    for t in planned:
        for f in FUSIONS.get(cfg.family, ()):
            if not t.name.endswith("." + f.parts[0]):
                continue
            prefix = t.name[: len(t.name) - len(f.parts[0])]
            group = [by_name[prefix + p] for p in f.parts]
            if len({g.dtype for g in group}) != 1:
                raise UserError(f"cannot fuse {prefix + f.fused}: its parts have dtypes "
                                f"{sorted({g.dtype for g in group})}; export with --dtype")
            parts[prefix + f.fused] = group
            first[t.name] = prefix + f.fused
            taken.update(g.name for g in group)
    out = []
    for t in planned:
        if t.name in first:
            group = parts[first[t.name]]
            rows = sum(g.shape[0] for g in group)
            out.append(dataclasses.replace(t, name=first[t.name], shape=(rows, *t.shape[1:])))
        elif t.name not in taken:
            out.append(t)
    return out, parts


def place_parts(tensors: list, parts: dict[str, list]) -> list:
    """The tensors to write: ``tensors`` (placed in their shards) with each fused one replaced by its parts,
    each at its byte offset inside the fused tensor."""
    out = []
    for t in tensors:
        if t.name not in parts:
            out.append(t)
            continue
        at = t.offset
        for p in parts[t.name]:
            out.append(dataclasses.replace(p, shard=t.shard, offset=at))
            at += p.nbytes
    return out
