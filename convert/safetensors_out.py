"""Writing safetensors files whose tensors arrive one at a time (the header is planned up front)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

ST_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def encode_header(entries: dict[str, dict[str, Any]]) -> bytes:
    """A safetensors header for ``{name: {dtype, shape, data_offsets}}``: its 8-byte length, then the JSON,
    padded to 8 bytes so the data section is aligned."""
    h: dict[str, Any] = {"__metadata__": {"format": "pt"}, **entries}
    raw = json.dumps(h, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return len(raw).to_bytes(8, "little") + raw


def write_streaming(path: Path, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
                    read: Callable[[str], np.ndarray]) -> int:
    """Write ``tensors`` (name, shape, dtype) to ``path``, reading each with ``read(name)`` only when its turn
    comes, so memory holds one tensor; returns the bytes of tensor data written."""
    entries, offset, plan = {}, 0, []
    for name, shape, dtype in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        entries[name] = {"dtype": ST_NAMES[dtype.name], "shape": list(shape), "data_offsets": [offset, offset + n]}
        plan.append((name, shape, dtype, offset))
        offset += n
    header = encode_header(entries)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        os.ftruncate(fd, len(header) + offset)
        for name, shape, dtype, at in plan:
            x = np.ascontiguousarray(read(name), dtype=dtype)
            if tuple(x.shape) != tuple(shape):
                raise RuntimeError(f"{name}: read {x.shape}, planned {shape}")
            os.pwrite(fd, x.reshape(-1).view(np.uint8).data, len(header) + at)
            del x
    finally:
        os.close(fd)
    return offset
