"""Subprocess and process helpers: the repository root and the packages only tests install (for runs without
them), the environment of a simulated multi-device run, and `zoo` commands killed midway or right after a
checkpoint, and a fork server that imports a run's modules once and forks each run from it."""

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


# A fork server: one interpreter that imports the modules ARGV[1] names (comma-separated) once, then, for each job
# it reads from stdin (a JSON line: {"script": python source, run as `python -c` runs it, "argv": its
# sys.argv[1:], "env": variables set in the child, "out"/"err": files for the child's stdout/stderr (else its stdout
# goes to this process's stderr)}), runs it in a child forked from it, printing {"pid": ...} once the child runs
# and {"exit": ...} once it ended (-9: SIGKILLed). The fork comes before JAX starts a backend (importing starts
# none), so each child starts its own, with its own environment (XLA_FLAGS' device count, say): runs that each need
# a process of their own (killed with SIGKILL, or on another device count) pay the imports, most of a run's start,
# once.
_FORK_SERVER = r"""
import importlib, json, os, sys, traceback
for name in sys.argv[1].split(","):
    importlib.import_module(name)
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND) if job.get("out") else 2, 1)
            if job.get("err"):
                os.dup2(os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
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
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""

# What a `pretrain train` run imports (jax, orbax, grain, transformers, datasets, tensorboardX, ... through these).
TRAIN_IMPORTS = ("pretrain.cli", "pretrain.task", "pretrain.loop", "pretrain.checkpoints", "pretrain.data.pipeline",
                 "zoo.data.tokenizer", "zoo.data.files")


class ForkServer:
    """A :data:`_FORK_SERVER` process (started with ``popen``'s cwd, env, ...): :meth:`start` a job in a child
    forked from it (one at a time), :meth:`wait` for its exit code; a context manager that ends the server."""

    def __init__(self, imports=TRAIN_IMPORTS, **popen):
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, ",".join(imports)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, **popen)
        self.child: int | None = None

    def _said(self, key: str, timeout: float) -> int:
        """The value of the server's next line (``{key: value}``), read within ``timeout`` seconds."""
        import json
        import select
        import time

        line, deadline = b"", time.monotonic() + timeout
        while not line.endswith(b"\n"):
            fd = self.proc.stdout.fileno()
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(f"no {key} from the fork server in {timeout} s")
            byte = os.read(fd, 1)
            if not byte:
                raise RuntimeError(f"the fork server ended (exit {self.proc.wait()}) before its {key}")
            line += byte
        return int(json.loads(line)[key])

    def start(self, job: dict, timeout: float = 300) -> int:
        """Run ``job`` in a child of the server (once the previous one ended); its pid."""
        import json

        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.child = self._said("pid", timeout)
        return self.child

    def wait(self, timeout: float = 600) -> int:
        """The exit code of the job started last (-9: SIGKILLed), once it ended."""
        code = self._said("exit", timeout)
        self.child = None
        return code

    def run(self, job: dict, timeout: float = 600) -> int:
        """``job``'s exit code: :meth:`start`, then :meth:`wait`."""
        self.start(job, timeout)
        return self.wait(timeout)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        if self.child is not None:  # a job still running (a failure or timeout above): it goes too
            try:
                os.kill(self.child, 9)
            except ProcessLookupError:
                pass
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()


def main_script(cli_module: str) -> str:
    """The script (for ``python -c`` or a :class:`ForkServer` job) that runs ``cli_module``'s ``main`` on its
    arguments and exits with its code, as the console script does."""
    return f"import sys\nfrom {cli_module} import main\nsys.exit(main(sys.argv[1:]))\n"


def forked_codes(jobs: list[dict], imports=TRAIN_IMPORTS, **popen) -> list[int]:
    """The exit codes of ``jobs`` run one after the other by a :class:`ForkServer`."""
    with ForkServer(imports, **popen) as server:
        return [server.run(job) for job in jobs]
