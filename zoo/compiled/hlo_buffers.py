"""The largest buffers of a compiled (or refused) TPU program, named by where the code makes them.

XLA's dump of a program (``xla_dump_to``) holds three files read here: the memory-usage report (the
temporaries' buffers by size and offset, with the shapes that share each), the buffer assignment (which
instruction's value sits at each offset) and the optimized HLO (each instruction's ``stack_frame_id``, and the
tables that turn it into files, functions and lines). The TPU compiler writes them even when it refuses a program
for want of memory, so ``--compile-only`` can say which of the step's arrays are the large ones, and from which
line of the model, rather than only "the activations".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
# lmzoo's packages: a frame's file is named from its package folder down.
PACKAGES = ("zoo", "convert", "eval", "pretrain", "sft", "dpo", "rm", "grpo", "distill", "demo")
_ROW = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*(\d+);\s*\d+;\s*(.*)$")
_VALUE = re.compile(r"^ value: <\d+ ([^ {]+)(?:\{[^}]*\})? @\d+> \(size=(\d+),offset=(\d+)\)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass
class Buffer:
    """One buffer of the program's temporaries: its bytes, the shapes that share it and where the code makes it."""

    size: int
    shapes: str
    where: str
    count: int = 1  # buffers of this size, shapes and place

    def line(self) -> str:
        """``"2 x 896 MiB: f32[4,2,2048,14336] (normed_dense, zoo/layers/blocks.py:159)"``."""
        times = f"{self.count} x " if self.count > 1 else ""
        return f"{times}{self.size / MIB:,.0f} MiB: {self.shapes}" + (f" ({self.where})" if self.where else "")


def _report_rows(text: str) -> list[tuple[int, int, str]]:
    """(bytes, offset, shapes) of the default memory space's rows in XLA's memory-usage report (a section per
    allocation: the parameters', the outputs', the temporaries'), largest first."""
    rows = []
    for line in text.split("Memory Space:")[1].splitlines() if "Memory Space:" in text else []:
        m = _ROW.match(line)
        if m:
            rows.append((int(float(m[1]) * _UNITS[m[2]]), int(m[3]), m[4].strip()))
    return sorted(rows, key=lambda r: -r[0])


def _temp_values(text: str) -> dict[tuple[int, int], list[str]]:
    """Instruction names by (size, offset) of the values in the default memory space's temporary allocations."""
    out: dict[tuple[int, int], list[str]] = {}
    keep = False
    for line in text.splitlines():
        if line.startswith("allocation "):
            # the default memory space has no "color" (or color 0); the temporaries are "preallocated-temp"
            keep = "preallocated-temp" in line and ("color" not in line or ", color 0," in line)
        elif keep:
            m = _VALUE.match(line)
            if m:
                out.setdefault((int(m[2]), int(m[3])), []).append(m[1])
    return out


def _frames(hlo: str) -> tuple[dict[str, int], dict[int, str]]:
    """Each instruction's stack frame id, and each frame's innermost own-code place ("function, file:line")."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo.splitlines()[:20000]:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
        elif current is not None and (m := re.match(r"^(\d+) (.*)$", line)):
            current[int(m[1])] = m[2]
        elif current is not None and line.strip() and not line[0].isdigit():
            current = None
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    places = {}
    for k, v in sections.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", v)
        if f:
            places[k] = (files.get(int(f[1]), "?"), funcs.get(int(f[2]), "?"), int(f[3]))
    frames = {}
    for k, v in sections.get("StackFrames", {}).items():
        f = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v)
        if f:
            frames[k] = (int(f[1]), int(f[2]) - 1)  # a parent of 0 is none (ids count from 1)
    named: dict[int, str] = {}
    for k in frames:
        frame, hops = k, 0
        while frame in frames and hops < 200:  # the innermost frame in the project's code, not a library's
            path, func, line_no = places.get(frames[frame][0], ("?", "?", 0))
            if "site-packages" not in path and "/jax/" not in path:
                named[k] = f"{func}, {_short(path)}:{line_no}"
                break
            frame, hops = frames[frame][1], hops + 1
    ids = {m[1]: int(m[2]) for m in re.finditer(r"%([\w.\-]+) = [^\n]*?stack_frame_id=(\d+)", hlo)}
    return ids, named


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


def _full_size(shapes: str, size: int) -> str:
    """Of a report row's shapes ("f32[4,2], 5×bf16[8]"), those that fill its ``size`` bytes (the buffer's own
    shape, not the smaller values that reuse it later); all of them when none does."""
    keep = []
    for item in (x.split("×")[-1] for x in shapes.split(", ")):  # "5×f32[..]": five values reuse it in turn
        m = re.match(r"^(\w+)\[([\d,]*)\]$", item)
        if m:
            n = 1
            for d in filter(None, m[2].split(",")):
                n *= int(d)
            if n * _BYTES.get(m[1], 0) == size:
                keep.append(item)
    return ", ".join(keep) or shapes


def _short(path: str) -> str:
    """``/x/y/zoo/layers/mlp.py`` -> ``zoo/layers/mlp.py``: the path from the package folder down."""
    parts = Path(path).parts
    for i, p in enumerate(parts):
        if p in PACKAGES:
            return "/".join(parts[i:])
    return Path(path).name


def largest_buffers(dump: str | Path, count: int = 3) -> list[Buffer]:
    """The ``count`` largest temporary buffers of the one program XLA dumped into folder ``dump``, each with the
    shapes that share it and the line of our code whose operation produces it (empty where the dump does not say).
    An empty list when the dump lacks the files (another XLA, a program with no temporaries)."""
    folder = Path(dump)
    report = next(iter(sorted(folder.glob("*after_optimizations-memory-usage-report.txt"))), None)
    assignment = next(iter(sorted(folder.glob("*after_optimizations-buffer-assignment.txt"))), None)
    hlo = next(iter(sorted(folder.glob("*after_optimizations.txt"))), None)
    if report is None or assignment is None or hlo is None:
        return []
    values = _temp_values(assignment.read_text())
    ids, named = _frames(hlo.read_text())
    out: list[Buffer] = []
    for size, offset, shapes in _report_rows(report.read_text()):
        if (size, offset) not in values:  # a row of another allocation (a parameter's, an output's)
            continue
        where = ""
        for name in values.get((size, offset), []):
            if ids.get(name) in named:
                where = named[ids[name]]
                break
        buf = Buffer(size, _full_size(shapes, size), where)
        same = next((b for b in out if (b.size, b.shapes, b.where) == (buf.size, buf.shapes, buf.where)), None)
        if same is not None:
            same.count += 1
        elif len(out) == count:
            break
        else:
            out.append(buf)
    return out
