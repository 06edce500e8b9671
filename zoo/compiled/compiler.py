"""How lmzoo compiles a lowered program for its platform: the CPU's scheduler, a TPU's scoped VMEM, and XLA's
dump of the buffers for :mod:`zoo.compiled.hlo_buffers`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax

# XLA:CPU's memory-optimized instruction scheduler: the default (concurrency-optimized) one starts independent
# work early, so more of a step's temporaries are alive at once. Measured on SmolLM2-135M, remat full: a LoRA
# fine-tuning step's temporaries 0.59 -> 0.55 GiB, full fine-tuning's 1.07 -> 1.03, a LoRA preference step's
# 0.91 -> 0.82 (8 pairs of 768 tokens), with step times the same within the machine's noise.
CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def tpu_compiler_options(kind: str) -> dict[str, str]:
    """Compiler options for a TPU of device kind ``kind``: Mosaic kernels' scoped VMEM raised to 64 MiB on v5 and
    v6 chips (128 MiB of VMEM a core on v5e and v6e; compiled on v5p too), as MaxText raises it for its larger
    models. At libtpu's default, the expert-parallel grouped matmul of DeepSeek-V3's LoRA adapters (its backward,
    f32[64, 7168, 16]) was refused: "Ran out of memory in memory space vmem". Nothing on other kinds."""
    k = kind.lower()
    return {"xla_tpu_scoped_vmem_limit_kib": "65536"} if k.startswith(("tpu v5", "tpu v6", "tpu7")) else {}


@contextlib.contextmanager
def flags_libtpu_knows() -> Iterator[None]:
    """XLA_FLAGS without the CPU backend's own flags (``--xla_cpu_*``) while libtpu starts or compiles: libtpu
    reads the variable once a process, at its first topology or compilation, and aborts the process on a flag
    its XLA does not define (CPU-only ones of this jaxlib among them, such as ``--xla_cpu_use_fusion_emitters``),
    so a CPU setting meant for this machine's JAX would kill ``--compile-only``. This process's CPU backend read
    the variable when it started; its setting is unchanged."""
    flags = os.environ.get("XLA_FLAGS")
    if flags is None:
        yield
        return
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags.split() if not f.startswith("--xla_cpu_"))
    try:
        yield
    finally:
        os.environ["XLA_FLAGS"] = flags


def compile_lowered(lowered: Any, platform: str | None = None, options: dict[str, Any] | None = None,
                    device_kind: str | None = None) -> Any:
    """``lowered.compile()``, with :data:`CPU_COMPILER_OPTIONS` for a CPU program (plainly where this jaxlib's
    XLA does not know them). ``platform`` is the program's (its mesh's devices'; default JAX's default backend):
    a program for another platform gets no CPU options, but :func:`tpu_compiler_options` for its ``device_kind``
    (default: this host's first device's) and ``options`` (XLA debug options, such as ``xla_dump_to``)."""
    if (platform or jax.default_backend()) != "cpu":
        options = {**tpu_compiler_options(device_kind or jax.devices()[0].device_kind), **(options or {})}
        with flags_libtpu_knows():
            return lowered.compile(compiler_options=options) if options else lowered.compile()
    try:
        return lowered.compile(compiler_options=CPU_COMPILER_OPTIONS)
    except Exception as e:  # an unknown option or enum value: the scheduler is an optimization, not a need
        if not any(k in str(e) for k in CPU_COMPILER_OPTIONS):
            raise
        return lowered.compile()


def dump_options(folder: str) -> dict[str, Any]:
    """XLA options that write the optimized program's buffer assignment and memory report into ``folder`` (and no
    pass-by-pass dumps): what :func:`zoo.compiled.hlo_buffers.largest_buffers` reads, written even when the compiler
    refuses the program for want of HBM."""
    return {"xla_dump_to": folder, "xla_dump_hlo_pass_re": "NONE"}
