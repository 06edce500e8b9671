"""What one chip holds of a compiled program: its arguments, temporaries, outputs and code
(``memory_analysis()``), the shards of abstract arrays, and the TPU compiler's figure when it refuses a program
for want of HBM."""

from __future__ import annotations

import math
from typing import Any

DOES_NOT_FIT = 3  # --compile-only's exit code when the program does not fit a chip


def shard_bytes(tree: Any) -> int:
    """Bytes one chip holds of ``tree``'s arrays (``jax.ShapeDtypeStruct`` s with shardings): the largest shard."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


def compiled_bytes(compiled: Any) -> tuple[int, int, int, int]:
    """(arguments, temporaries, outputs not aliased to a donated argument, code) bytes a chip of a compiled
    program (``memory_analysis()``)."""
    mem = compiled.memory_analysis()
    outputs = max(0, int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes))  # donated state is reused
    return (int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes), outputs,
            int(mem.generated_code_size_in_bytes))


def host_bytes(compiled: Any) -> int:
    """Bytes of a chip's host's memory the compiled program uses (``memory_analysis()``'s host_* fields: what
    ``remat: offload`` keeps there); 0 when nothing is offloaded."""
    mem = compiled.memory_analysis()
    field = lambda name: int(getattr(mem, f"host_{name}_size_in_bytes", 0) or 0)  # noqa: E731
    return (field("argument") + field("temp") + max(0, field("output") - field("alias"))
            + field("generated_code"))


def compiler_refusal(message: str) -> tuple[int, int, str] | None:
    """(temporaries' bytes, the HBM the compiler had, its line) of the TPU compiler's out-of-memory refusal
    ("the total memory required for HLO temporaries (19.30G) exceeds available HBM (15.75G)"), else None."""
    import re

    m = re.search(r"temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", message)
    if "RESOURCE_EXHAUSTED" not in message or m is None:
        return None
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    line = next(x for x in message.splitlines() if "exceeds available HBM" in x)
    return (int(float(m[1]) * scale[m[2]]), int(float(m[3]) * scale[m[4]]),
            line.split("E1000: ")[-1].strip())
