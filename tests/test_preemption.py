"""Preemption across hosts (issue 61, item 5): SIGTERM to one process of a run stops every process at the same step,
its checkpoint saved, and the rerun resumes to the bits of a run never stopped (pretrain/loop.py, _StopOnSignal)."""

import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import zoo
from tests.processes import REPO, devices_env, free_port
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


def _two(argv, outputs: list) -> list[subprocess.Popen]:
    """2 processes x 1 CPU device (gloo): process i runs ``python *argv(i)``; process 0's stdout a pipe, the rest
    to ``outputs``' files."""
    env = {**devices_env(1), "PYTHONPATH": str(REPO)}
    return [subprocess.Popen([sys.executable, *argv(i)], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE if i == 0 else outputs[i][0], stderr=outputs[i][1])
            for i in range(2)]


def _ended(procs: list[subprocess.Popen], files: list) -> list[str]:
    """Each process waited for (then killed, if it is still there), and its stderr."""
    try:
        procs[0].communicate(timeout=300)
        procs[1].wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    errs = []
    for _, err in files:
        err.seek(0)
        errs.append(err.read())
    return errs


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_and_the_rerun_resumes_bit_identical(setup, tmp_path):
    """SIGTERM to process 1 alone, once process 0 has logged step 1: both processes save the same step and exit
    143 with one plain line each; the rerun (max_steps lowered to 2 past it) resumes there and ends with the
    losses and parameters, bit for bit, of a 2-process run never stopped. A notice before a rerun's first step
    (while it loads) stops it after one step, every process at that step.
    Slow (slow lane): three launches of 2 `pretrain train` processes, each importing and compiling."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    args = [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=2", "optimizer.learning_rate=0.01", "schedule.name=constant",
            "log_every=1", "checkpoint.every=100000"]  # no checkpoint but step 1's and the one the signal asks for
    files = [(open(tmp_path / f"out{i}.txt", "w+"), open(tmp_path / f"err{i}.txt", "w+")) for i in range(2)]
    port = free_port()
    procs = _two(lambda i: ["-m", "pretrain.cli", "train", *args, f"output_dir={out}", "max_steps=100000",
                            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                 files)
    try:
        for line in procs[0].stdout:  # blocks until process 0 has logged step 1 (or ended)
            if line.startswith("step "):
                break
        procs[1].send_signal(signal.SIGTERM)
    finally:
        errs = _ended(procs, files)
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for e in errs]
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
    files = [(open(tmp_path / f"early{i}.txt", "w+"), open(tmp_path / f"early_err{i}.txt", "w+")) for i in range(2)]
    port = free_port()
    procs = _two(lambda i: ["-c", RESUME_NOTICED_EARLY, str(port), str(i), *args, f"output_dir={out}",
                            f"max_steps={step + 3}"], files)
    errs = _ended(procs, files)
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for e in errs]
    assert all(f"checkpoint saved at step {step + 1} in" in e for e in errs), [e[-500:] for e in errs]
    step += 1

    files = [(open(tmp_path / f"again{i}.txt", "w+"), open(tmp_path / f"again_err{i}.txt", "w+")) for i in range(2)]
    port = free_port()
    procs = _two(lambda i: ["-c", RESUME_THEN_FRESH, str(port), str(i), str(step + 2), str(out), str(ref), *args],
                 files)
    try:
        said0 = procs[0].communicate(timeout=600)[0]
        procs[1].wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    files[1][1].seek(0)
    assert [p.returncode for p in procs] == [0, 0], files[1][1].read()[-2000:]
    assert f"Resuming from step {step} " in said0
    resumed, fresh = read_metrics(out), read_metrics(ref)
    assert [r["step"] for r in resumed] == [r["step"] for r in fresh] == list(range(1, step + 3))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in fresh]
    import jax

    for x, y in zip(jax.tree.leaves(zoo.load_params(out / "final")), jax.tree.leaves(zoo.load_params(ref / "final"))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
