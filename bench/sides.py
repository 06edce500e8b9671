"""What the side-by-side benchmarks share: one side per child process (its own peak RSS), rounds merged,
target checks printed, the result written."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_child(cmd: list[str], name: str, width: int = 14) -> dict:
    """Run one side's child process; its last stdout line (JSON) plus ``peak_rss_bytes`` (``ru_maxrss``, or the
    child's ``load_peak_rss_bytes`` if larger: a child that resets its VmHWM after loading reports it)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, ru = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            tail = "".join(err.readlines()[-25:])
            raise SystemExit(f"{name} child failed (exit {os.waitstatus_to_exitcode(status)}):\n{tail}")
    res = json.loads(out.strip().splitlines()[-1])
    # A child that resets its VmHWM (lora_step.py, after loading: clear_refs) reports the peak before the reset.
    res["peak_rss_bytes"] = max(ru.ru_maxrss * 1024, res.get("load_peak_rss_bytes", 0))
    print(f"  {name:{width}} median {statistics.median(res['times']):.2f} s, "
          f"peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB, compile+first step {(res['warmup_s'] or res['times'])[0]:.1f} s",
          file=sys.stderr, flush=True)
    return res


def merge_rounds(rounds: list[dict]) -> dict:
    """One side's rounds as one result: every timed step, the first round's losses, the largest peak RSS."""
    out = dict(rounds[0])
    out["times"] = [t for r in rounds for t in r["times"]]
    out["warmup_s"] = [t for r in rounds for t in r["warmup_s"]]
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    out["peak_rss_bytes_per_round"] = [r["peak_rss_bytes"] for r in rounds]
    return out


def check_targets(checks: list[tuple[str, float, str, float, list[float]]]) -> dict:
    """Print each (name, value, "<=" or ">=", target, per-round values) as PASS/FAIL; the checks as a dict."""
    results = {}
    for name, value, op, target, rounds in checks:
        ok = value <= target if op == "<=" else value >= target
        results[name] = {"value": value, "target": f"{op} {target}", "pass": ok, "per_round": rounds}
        print(f"{name}: {value:.2f}x (target {op} {target}x) {'PASS' if ok else 'FAIL'}; "
              f"per round: {', '.join(f'{x:.2f}x' for x in rounds)}")
    return results


def emit(result: dict, out: Path | None) -> None:
    """Print the result as one JSON line and, with ``out``, write it there too."""
    print(json.dumps(result))
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")


def adapter_params(final: Path) -> int | None:
    """The number of adapter parameters in a final adapter checkpoint (from its model.json), or None."""
    try:
        meta = json.loads((final / "model.json").read_text())
        return sum(_size(v["shape"]) for v in _leaves(meta["lora"]["params"]))
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _size(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _leaves(tree):
    if isinstance(tree, dict) and "shape" in tree:
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)


def status_bytes(key: str = "VmHWM") -> int:
    """A ``/proc/self/status`` figure of this process in bytes: ``VmRSS`` (now) or ``VmHWM`` (the peak since exec or
    the last :func:`reset_peak`); 0 where there is no such file."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak() -> None:
    """Reset this process's VmHWM to its current RSS (Linux's ``clear_refs`` 5), so that a later peak is the step's
    own; also what ``ru_maxrss`` reports at exit."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def nbytes(tree) -> int:
    """The bytes of every array of a pytree."""
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
