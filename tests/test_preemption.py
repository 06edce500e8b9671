"""Preemption across hosts (issue 61, item 5): SIGTERM to one process of a run stops every process at the same step,
its checkpoint saved, and the rerun resumes to the bits of a run never stopped (pretrain/loop.py, _StopOnSignal)."""

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import zoo
from tests.processes import REPO, ForkServer, devices_env, free_port, main_script
from tests.run_files import read_metrics
from tests.tiny_lm import tiny_run_folder

# The rerun and the reference in the same 2 processes (one distributed runtime, one compilation): the stopped run
# resumed to STEPS steps in RESUMED, then a fresh run of STEPS steps in FRESH. argv: port, process id, STEPS,
# RESUMED, FRESH, then the config's overrides.
RESUME_THEN_FRESH = """
import sys
from argparse import Namespace
from pretrain import distributed
from pretrain.config import load_config
from pretrain.loop import train
port, pid, steps, resumed, fresh, *args = sys.argv[1:]
distributed.initialize(Namespace(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=int(pid)))
for out in (resumed, fresh):
    train(load_config(None, [*args, f"output_dir={out}", f"max_steps={steps}"]), progress=False)
"""

# The stopped run rerun, its notice before the rerun's first step: process 1 signals itself once JAX's preemption
# service holds SIGTERM (after initialize), long before either process reaches a step (the model still to load).
# argv: port, process id, then train's overrides. Exits as the command does: the message, then its exit code.
RESUME_NOTICED_EARLY = """
import os, signal, sys
from argparse import Namespace
from pretrain import distributed
from pretrain.config import load_config
from pretrain.loop import train
from zoo.errors import Interrupted
port, pid, *args = sys.argv[1:]
distributed.initialize(Namespace(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=int(pid)))
if pid == "1":
    os.kill(os.getpid(), signal.SIGTERM)
try:
    train(load_config(None, args), progress=False)
except Interrupted as e:
    print(e, file=sys.stderr)
    sys.exit(e.exit_code)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    return tiny_run_folder(tmp_path_factory, tiny_lm, "preemption")


def _launch(servers, stem: Path, script: str, argv) -> tuple[list[int], list[Path]]:
    """2 processes x 1 CPU device (gloo): process i runs ``script`` with ``argv(i)``, a child of fork server i
    (tests/processes.py ForkServer: each imports once for the test's three launches), its stdout and stderr to
    ``stem``-i.out and .err. Returns (the children's pids, [stdout, stderr files])."""
    files = [stem.with_name(f"{stem.name}-{i}.{kind}") for i in range(2) for kind in ("out", "err")]
    pids = [server.start({"script": script, "argv": argv(i), "out": str(files[2 * i]), "err": str(files[2 * i + 1])})
            for i, server in enumerate(servers)]
    return pids, files


def _ended(servers, files: list[Path]) -> tuple[list[int], list[str]]:
    """Each process's exit code, once both ended, and its stderr."""
    return [server.wait(300) for server in servers], [files[2 * i + 1].read_text() for i in range(2)]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_and_the_rerun_resumes_bit_identical(setup, tmp_path):
    """SIGTERM to process 1 alone, once process 0 has logged step 1: both processes save the same step and exit
    143 with one plain line each; the rerun (max_steps lowered to 2 past it) resumes there and ends with the
    losses and parameters, bit for bit, of a 2-process run never stopped. A notice before a rerun's first step
    (while it loads) stops it after one step, every process at that step.
    Slow (slow lane): three launches of 2 `pretrain train` processes, each compiling (each process's three
    forked from one interpreter that imports once)."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    args = [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=2", "optimizer.learning_rate=0.01", "schedule.name=constant",
            "log_every=1", "checkpoint.every=100000"]  # no checkpoint but step 1's and the one the signal asks for
    env = {**devices_env(1), "PYTHONPATH": str(REPO)}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(ForkServer(cwd=REPO, env=env)) for _ in range(2)]
        _stop_then_rerun(servers, args, out, ref)


def _stop_then_rerun(servers, args, out, ref):
    """The three launches: SIGTERM to process 1 of a run, a rerun stopped early, then its rerun and a fresh run."""
    port = free_port()
    pids, files = _launch(servers, out.parent / "stopped", main_script("pretrain.cli"), lambda i: [
        "train", *args, f"output_dir={out}", "max_steps=100000", "--coordinator", f"127.0.0.1:{port}",
        "--num-processes", "2", "--process-id", str(i)])
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("step ") for line in _text(files[0]).splitlines()):  # process 0 logged step 1
            os.kill(pids[0], 0)  # (raises once it ended)
            assert time.monotonic() < deadline, _text(files[1])[-2000:]
            time.sleep(0.05)
    finally:
        os.kill(pids[1], signal.SIGTERM)
    codes, errs = _ended(servers, files)
    assert codes == [143, 143], [e[-2000:] for e in errs]
    said = [[ln for ln in e.splitlines() if ln.startswith("interrupted")] for e in errs]
    pattern = (r"interrupted by a signal to one of the run's processes \(a preemption notice\): checkpoint saved at "
               rf"step (\d+) in {re.escape(str(out))}; run the same command to resume")
    got = [re.fullmatch(pattern, s[0]) if len(s) == 1 else None for s in said]
    assert all(got) and "Traceback" not in errs[0] + errs[1], said
    step = int(got[0][1])
    assert int(got[1][1]) == step >= 1
    ckpts = out / "checkpoints"
    saved = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert saved[-1] == step and set(saved) <= {1, step}  # Orbax's first save of a fresh run, and the signal's
    assert sorted(f.name for f in (ckpts / str(step) / "data").glob("process_*.json")) == \
        ["process_0-of-2.json", "process_1-of-2.json"]

    # A notice before a rerun's first step stops it one step in (not never: JAX counts from the rerun's start).
    port = free_port()
    _, files = _launch(servers, out.parent / "early", RESUME_NOTICED_EARLY, lambda i: [str(port), str(i), *args,
                                                                           f"output_dir={out}", f"max_steps={step + 3}"])
    codes, errs = _ended(servers, files)
    assert codes == [143, 143], [e[-2000:] for e in errs]
    assert all(f"checkpoint saved at step {step + 1} in" in e for e in errs), [e[-500:] for e in errs]
    step += 1

    port = free_port()
    _, files = _launch(servers, out.parent / "again", RESUME_THEN_FRESH, lambda i: [str(port), str(i), str(step + 2), str(out),
                                                                        str(ref), *args])
    codes = [server.wait(600) for server in servers]
    assert codes == [0, 0], files[3].read_text()[-2000:]
    assert f"Resuming from step {step} " in files[0].read_text()
    resumed, fresh = read_metrics(out), read_metrics(ref)
    assert [r["step"] for r in resumed] == [r["step"] for r in fresh] == list(range(1, step + 3))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in fresh]
    import jax

    for x, y in zip(jax.tree.leaves(zoo.load_params(out / "final")), jax.tree.leaves(zoo.load_params(ref / "final"))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
