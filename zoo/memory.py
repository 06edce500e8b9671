"""Give freed heap memory back to the operating system between large steps."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def release_free_memory() -> None:
    """glibc's malloc_trim(0): TensorStore's worker threads free large buffers into
    per-thread arenas that glibc keeps by default, so peak RSS would otherwise grow
    with every parameter streamed. A no-op where glibc is not the allocator."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
