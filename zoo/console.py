"""Console helpers shared by every command line (`zoo`, `pretrain`, `sft`, `dpo`): the error boundary, tables,
byte sizes and the terminal check.

On the ground floor, so that each package's CLI can use them without importing another package's CLI.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from zoo.errors import Interrupted, UserError


def skip_absent_tpus() -> None:
    """On a machine with the libtpu wheel (the ``tpu`` extra, for ``--compile-only``) but no TPU and no GPU
    plugin, JAX would start its TPU plugin anyway and libtpu prints lines about the host it is not on to stderr
    (TPU_ACCELERATOR_TYPE, worker hostnames, an INVALID_ARGUMENT) above the command's own output: JAX is told
    to use the CPU (JAX_PLATFORMS=cpu) there. A JAX_PLATFORMS the user set is left as it is; ``--compile-only``
    compiles for TPUs under it all the same."""
    import glob
    import importlib.metadata
    import importlib.util

    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):  # TPU chips (v4/v5e: accel; v5p/v6e: vfio)
        return
    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
    if any(n.startswith(("jax-cuda", "jax-rocm")) for n in names):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: JAX read the variable then; backends start on first use
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def run_cli(fn: Callable[[], int | None]) -> int:
    """Run a command body: UserError -> 'error: ...' on stderr and exit code 2; a reader that went away early
    (``zoo info CKPT | head``) -> a quiet exit."""
    # transformers warns at import that PyTorch is missing; lmzoo never needs it, so users need not read that.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    skip_absent_tpus()
    try:
        code = fn() or 0
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return code
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:  # a run stopped at a step boundary, its checkpoint saved: it says where
        print(e, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The end of a command whose stdout reader closed the pipe: what is left unwritten goes nowhere (Python's
    own flush at exit would fail again, with a traceback), and the exit code is a shell's for SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns with a rule under the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def human_bytes(n: float) -> str:
    """A byte count for people: 512 -> '512 B', 3 * 2**20 -> '3.0 MiB' (GiB is the largest unit)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (a bar can redraw itself there)."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def use_color(stream: TextIO) -> bool:
    """Whether to write ANSI colours to ``stream``: on a terminal, unless NO_COLOR is set (https://no-color.org)."""
    return is_terminal(stream) and not os.environ.get("NO_COLOR")


def add_dtype_flag(parser: Any) -> None:
    """``--dtype float32|bfloat16``: the dtype a command loads the weights in (and decodes's KV cache), shared by
    `zoo generate`, `zoo eval` and `zoo serve`; ``jnp.dtype(args.dtype)`` is what `zoo.load` takes."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the weights' (and the KV cache's) dtype (default float32; bfloat16 halves them, as "
                             "accelerators run)")


def add_topology_flags(group: Any) -> None:
    """``--topology``, ``--report`` and ``--num-slices``: the flags every ``--compile-only`` shares (train commands'
    and ``zoo generate``'s), added to argparse ``group``."""
    group.add_argument("--topology", metavar="NAME",
                       help="the TPU slice, e.g. v5e:2x4, v5p:2x2x2, v6e:16x16 (with --compile-only)")
    group.add_argument("--report", metavar="FILE.json", help="also write the report as JSON (with --compile-only)")
    group.add_argument("--num-slices", type=int, default=1, metavar="N",
                       help="slices of --topology joined over the data-center network (default 1)")
