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


# One interpreter that imports the modules ARGV[1] names (comma-separated) once, then runs each job of ARGV[2:] in
# a child forked from it, one after the other: a job is JSON {"script": python source run as `python -c` runs it,
# "argv": its sys.argv[1:], "env": variables set in the child, "out"/"err": files for its stdout/stderr, "pid": a
# file to write the child's pid to}. It prints the children's exit codes (JSON; -9: SIGKILLed). The fork comes
# before JAX starts a backend (importing starts none), so each child starts its own, with its own environment
# (XLA_FLAGS' device count, say): runs that each need a process of their own (killed with SIGKILL, or on another
# device count) pay the imports, most of a run's start, once.
_FORKED = r"""
import importlib, json, os, sys, traceback
for name in sys.argv[1].split(","):
    importlib.import_module(name)
codes = []
for job in map(json.loads, sys.argv[2:]):
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, name in ((1, "out"), (2, "err")):
                if job.get(name):
                    os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
            os.environ.update(job.get("env", {}))
            sys.argv = ["-c", *job["argv"]]
            exec(compile(job["script"], "<forked>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    if job.get("pid"):
        with open(job["pid"], "w") as f:
            f.write(str(pid))
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""

# What a `pretrain train` run imports (jax, orbax, grain, transformers, datasets, tensorboardX, ... through these).
TRAIN_IMPORTS = ("pretrain.cli", "pretrain.task", "pretrain.loop", "pretrain.checkpoints", "pretrain.data.pipeline",
                 "zoo.data.tokenizer", "zoo.data.files")


def forked(jobs: list[dict], imports=TRAIN_IMPORTS, **popen) -> subprocess.Popen:
    """Start one interpreter that imports ``imports`` once and runs ``jobs`` (see _FORKED: script, argv, env,
    out, err, pid) each in a process forked from it, in turn; its stdout ends with their exit codes (JSON)."""
    import json
    import sys

    return subprocess.Popen([sys.executable, "-c", _FORKED, ",".join(imports), *map(json.dumps, jobs)], **popen)


def forked_codes(jobs: list[dict], imports=TRAIN_IMPORTS, timeout: float = 600, **popen) -> list[int]:
    """The exit codes of ``jobs`` run by :func:`forked` (each child's output to its out/err files, else this
    process's)."""
    import json

    proc = forked(jobs, imports, stdout=subprocess.PIPE, text=True, **popen)
    try:
        said, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, said[-2000:]
    return json.loads(said.splitlines()[-1])
