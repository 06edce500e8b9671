"""Subprocess and process helpers: the repository root and the packages only tests install (for runs without
them), the environment of a simulated multi-device run, and `zoo` commands killed midway or right after a
checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

# The repository root: the working directory of the tests' subprocesses.
REPO = Path(__file__).resolve().parent.parent
# What only the tests install: a run without them blocks these (tests/test_runtime_without_test_extras.py).
TEST_ONLY = ("torch", "peft", "trl", "accelerate", "bitsandbytes")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (a coordinator's, a server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ended(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each of ``procs`` (started with pipes), once all have ended; any still
    running after ``timeout`` seconds (or after another's failure to end) killed."""
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, *r) for p, r in zip(procs, results)]


def devices_env(n: int) -> dict[str, str]:
    """The environment of a subprocess that simulates ``n`` CPU devices, keeping the suite's other XLA flags."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={n}"]),
            "JAX_PLATFORMS": "cpu"}


def kill_midway(args: list[str], folder: Path, pattern: str, timeout: float = 120) -> bool:
    """Run `zoo ARGS` and SIGKILL it as soon as ``folder.glob(pattern)`` matches.

    Returns whether the match was seen (i.e. the command had started writing).
    """
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    # Polled (the files appear in another process; 20 ms apart), and no longer than the command runs.
    while time.time() < deadline and not list(folder.glob(pattern)) and proc.poll() is None:
        time.sleep(0.02)
    seen = bool(list(folder.glob(pattern)))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return seen


# `<command> ARGS` (the console script of CLI_MODULE) that SIGKILLs itself once the checkpoint of step ARGV[1] is
# complete on disk (orbax saves asynchronously: it waits for that one first), as `kill -9` from outside would,
# but exactly then (no polling). Run it as `python -c kill_after_checkpoint("dpo.cli") STEP ARGS...`.
_KILL_AFTER_CHECKPOINT = r"""
import os, signal, sys
import orbax.checkpoint as ocp
at, real = int(sys.argv[1]), ocp.CheckpointManager.save

def save(self, step, *a, **k):
    saved = real(self, step, *a, **k)
    if saved and step == at:
        self.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
    return saved

ocp.CheckpointManager.save = save
from {module} import main
sys.exit(main(sys.argv[2:]))
"""


def kill_after_checkpoint(cli_module: str) -> str:
    """The script (for ``python -c``) that runs ``cli_module``'s ``main`` and SIGKILLs itself after the checkpoint
    of the step given as its first argument is on disk."""
    return _KILL_AFTER_CHECKPOINT.format(module=cli_module)
