"""Runs that never lie: runs that cannot train fail before step 1, finished reruns are no-ops, logs hold every step
once after kills and resumes, run folders are protected from config drift, and non-terminal logs are plain lines."""

import json
import random
import signal
import struct

import jax
import numpy as np
import pytest

import zoo
from pretrain.cli import main as pretrain_main
from pretrain.config import load_config
from pretrain.loop import train
from pretrain.runfolder import checkpoint_steps
from pretrain.runlog import TIMING_FIELDS
from tests.processes import forked_codes
from tests.tiny_lm import copy_tiny_lm

WORDS = "the a cat dog sat ran on under mat log red blue big small quickly slowly and then".split()
COLORS = "red blue green yellow black white".split()
SYSTEM = "You are a careful assistant. Read the user's colour and repeat it twice, nothing else."


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    root = tmp_path_factory.mktemp("integrity")
    copy_tiny_lm(tiny_lm, root)
    rng = np.random.RandomState(0)
    lines = [{"text": " ".join(rng.choice(WORDS[:8], rng.randint(5, 30)))} for _ in range(200)]
    (root / "text.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    chats, pairs = [], []
    for _ in range(48):
        c, o = rng.choice(COLORS, 2, replace=False)
        chats.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"colour {c}"},
                                   {"role": "assistant", "content": f"{c} {c}"}]})
        pairs.append({"prompt": [{"role": "user", "content": f"colour {c}"}],
                      "chosen": [{"role": "assistant", "content": f"{c} {c}"}],
                      "rejected": [{"role": "assistant", "content": f"{o} {o}"}]})
    (root / "chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in chats))
    (root / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
    return root


def _args(root, out, data="text.jsonl", *overrides):
    return [f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}", f"data.path={root / data}",
            "data.seq_len=32", "batch_size=4", "optimizer.learning_rate=0.01", "schedule.name=constant",
            f"output_dir={out}", *overrides]


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _board_steps(out, tag="train/loss"):
    """The steps of ``tag`` in the run's TensorBoard event files (TFRecord framing, read without TensorFlow)."""
    from tensorboardX.proto import event_pb2

    steps = []
    for f in sorted((out / "tensorboard").glob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i < len(data):
            n = struct.unpack("<Q", data[i:i + 8])[0]
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12:i + 12 + n])
            steps += [ev.step for v in ev.summary.value if v.tag == tag]
            i += 12 + n + 4
    return steps


# ---- 1. a run that cannot train is an error before step 1 --------------------------------------------------------

@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_seq_len_too_short_fails_before_step_one_and_writes_nothing(setup, tmp_path, capsys, command):
    from dpo.cli import main as dpo_main
    from sft.cli import main as sft_main

    out = tmp_path / "run"
    data, extra = ("chat.jsonl", ()) if command == "sft" else ("pairs.jsonl", ("lora.rank=4",))
    args = _args(setup, out, data, "data.seq_len=8", "max_steps=3", *extra)
    rc = (sft_main if command == "sft" else dpo_main)(["train", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "48 of 48 examples (100%) keep no trained token" in err and "data.seq_len + 1 = 9 tokens" in err
    assert "raise data.seq_len" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_untrainable_threshold_is_configurable_and_examples_cut_to_nothing_are_left_out(setup, tmp_path, capsys):
    from sft.cli import main as sft_main

    out = tmp_path / "run"
    args = _args(setup, out, "chat.jsonl", "data.seq_len=8", "max_steps=3", "data.max_untrainable_fraction=1.0")
    assert sft_main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "48 of 48 training examples keep no trained token once cut to data.seq_len + 1 = 9 tokens and are " \
           "left out" in err and "raise data.seq_len" in err
    assert not out.exists()


def test_a_first_batch_that_trains_no_token_is_an_error(setup):
    from pretrain.preflight import check_first_batch
    from zoo.errors import UserError

    class Rows:  # one batch whose targets are all padding (segment 0), as a lane of cut examples would give
        def __init__(self):
            self.state = 0

        def get_state(self):
            return self.state

        def set_state(self, s):
            self.state = s

        def __next__(self):
            self.state += 1
            zeros = np.zeros((2, 9), np.int32)
            return {"tokens": zeros, "tokens_segment_ids": zeros, "tokens_positions": zeros}

    rows = Rows()
    cfg = load_config(None, _args(setup, setup / "unused", "chat.jsonl", "data.seq_len=8", "max_steps=1"))
    with pytest.raises(UserError, match="the first batch of data.path .* trains no token"):
        check_first_batch(rows, cfg)
    assert rows.state == 0  # the iterator is put back where it was


def test_eval_set_that_cannot_fill_a_batch_fails_before_step_one(setup, tmp_path, capsys):
    from sft.cli import main as sft_main

    out = tmp_path / "run"
    (tmp_path / "eval.jsonl").write_text((setup / "chat.jsonl").read_text().splitlines()[0] + "\n")
    args = _args(setup, out, "chat.jsonl", "data.seq_len=64", "max_steps=3", "data.packing=false",
                 f"data.eval_path={tmp_path / 'eval.jsonl'}", "eval_every=2")
    assert sft_main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "cannot fill one eval batch of batch_size / grad_accum = 4 examples" in err and "1 examples" in err
    assert "lower data.seq_len" not in err and not out.exists()


def test_inspect_shows_rows_as_they_will_be_trained(setup, capsys):
    from sft.cli import main as sft_main

    assert sft_main(["inspect", *_args(setup, setup / "unused", "chat.jsonl", "data.seq_len=8", "max_steps=1"), "-n", "1",
                     "--no-color"]) == 0
    shown = capsys.readouterr().out
    assert "cut to 9 tokens (data.seq_len + 1)" in shown and "0 trained" in shown and "[[" not in shown


# ---- 2-5. exact reruns, protected run folders, plain logs -------------------------------------------------------

@pytest.mark.slow
def test_finished_rerun_config_drift_resume_with_changes_and_fresh(setup, tmp_path, capsys):
    """Slow (about 41 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    out = tmp_path / "run"
    base = _args(setup, out, "text.jsonl", "checkpoint.every=2", "log_every=2")
    train(load_config(None, [*base, "max_steps=5"]), progress=False)
    first = capsys.readouterr().out
    # Off a terminal: one plain line every log_every steps (and at the last step).
    lines = [x for x in first.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["2/5", "4/5", "5/5"]
    assert all(" loss " in x and " lr " in x and " tok/s " in x and " eta " in x for x in lines)
    assert (out / "checkpoints" / "5").is_dir()  # the last step is checkpointed, not only multiples of every
    stamp = (out / "final" / "model.json").stat().st_mtime_ns

    # A rerun of the finished run: complete, nothing trained, nothing rewritten.
    assert pretrain_main(["train", *base, "max_steps=5"]) == 0
    said = capsys.readouterr().out
    assert "the run is complete (step 5 of 5" in said and not [x for x in said.splitlines() if x.startswith("step ")]
    assert [r["step"] for r in _records(out)] == [2, 4, 5]
    assert (out / "final" / "model.json").stat().st_mtime_ns == stamp

    # A changed learning rate and seq_len: an error listing both, the folder untouched.
    saved = (out / "config.yaml").read_text()
    assert pretrain_main(["train", *base, "max_steps=6", "optimizer.learning_rate=0.02", "data.seq_len=16"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.learning_rate: 0.01 -> 0.02" in err and "data.seq_len: 32 -> 16" in err
    assert "--resume-with-changes data.seq_len,optimizer.learning_rate" in err or \
        "--resume-with-changes optimizer.learning_rate,data.seq_len" in err
    assert (out / "config.yaml").read_text() == saved and len(err.strip().splitlines()) == 1
    assert pretrain_main(["train", *base, "max_steps=6", "--resume-with-changes", "optimizer.learnig_rate"]) == 2
    assert "did you mean 'optimizer.learning_rate'" in capsys.readouterr().err

    # Knowingly: continues from step 5 with the new rate; max_steps and log cadence change freely.
    assert pretrain_main(["train", *base, "max_steps=6", "log_every=1", "optimizer.learning_rate=0.02",
                          "--resume-with-changes", "optimizer"]) == 0
    cap = capsys.readouterr()
    assert f"Resuming from step 5 (checkpoint {out / 'checkpoints' / '5'})" in cap.out
    assert "optimizer.learning_rate" in cap.err
    assert [r["step"] for r in _records(out)] == [2, 4, 5, 6]
    assert load_config(out / "config.yaml").optimizer.learning_rate == 0.02

    # --fresh moves the old run aside (never deleting it) and starts over.
    assert pretrain_main(["train", *base, "max_steps=2", "--fresh"]) == 0
    cap = capsys.readouterr()
    old = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(old) == 1 and f"moved the old run in {out} to {old[0]}" in cap.err
    assert [r["step"] for r in _records(old[0])] == [2, 4, 5, 6]
    assert [r["step"] for r in _records(out)] == [2] and "Resuming" not in cap.out


def test_the_metrics_log_is_strict_json_with_non_finite_values_as_null(tmp_path):
    """A NaN metric (a mean over nothing: a reward that applied to no completion) or an infinite one becomes null
    in metrics.jsonl, which strict JSON readers parse (NaN and Infinity are no JSON), and stays out of
    TensorBoard; a resume that trims a file an older version wrote with NaN rewrites it strict too."""
    from pretrain.runlog import RunLog

    scalars = []

    class Board:
        def __init__(self, folder):
            pass

        def add_scalar(self, tag, value, step):
            scalars.append(tag)

        def close(self):
            pass

    def strict(line):
        return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))

    log = RunLog(tmp_path, 2, False, None, Board)
    log.start(0)
    for step in (1, 2):
        log.record({"step": step, "loss": 0.5, "rewards/f/mean": float("nan"), "x": [float("inf"), 1.0],
                    "y": {"z": -float("inf")}})
    log.close()
    want = {"step": 1, "loss": 0.5, "rewards/f/mean": None, "x": [None, 1.0], "y": {"z": None}}
    assert [strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [want, {**want, "step": 2}]
    assert scalars == ["train/loss"] * 2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": float("nan")}) + "\n"
                                                    for s in (1, 2)))  # NaN: json.dumps' default
    log = RunLog(tmp_path, 2, False, None, Board)
    log.start(1)  # a resume at step 1 trims the file
    log.close()
    assert [strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"step": 1, "loss": None}]


def test_time_left_leaves_out_the_compiling_step_after_any_start(tmp_path):
    """The plain line's time left counts from the end of the first step after a start, fresh or resumed (that
    step compiles: 60 s here, against 2 s a step after it): `eta ?` until a second step is done, then 2 s a step
    left; a resume at step 5 starts over, its first step's compile left out again. A clock of the test's own."""
    import io

    from pretrain.hooks import StepInfo
    from pretrain.runlog import RunLog

    class Board:
        def __init__(self, folder):
            pass

        def add_scalar(self, tag, value, step):
            pass

        def close(self):
            pass

    now = [0.0]
    for start, first in ((0, 1), (5, 6)):  # a fresh run, then one resumed at step 5
        stream = io.StringIO()
        log = RunLog(tmp_path, 10, True, [], Board, stream=stream, clock=lambda: now[0])
        log.start(start)
        for step in range(first, first + 3):
            now[0] += 60.0 if step == first else 2.0
            log.on_step(StepInfo(step, 10, {}, {"step": step, "loss": 1.0, "learning_rate": 0.1,
                                                "tokens_per_sec": 1.0, "step_time": 60.0 if step == first else 2.0}))
        log.close()
        etas = [line.split("  ")[4] for line in stream.getvalue().splitlines()]
        left = [10 - step for step in range(first + 1, first + 3)]
        assert etas == ["eta ?", *(f"eta 0:{2 * n // 60:02d}:{2 * n % 60:02d}" for n in left)], (start, etas)


KILLER = r"""
import os, signal, sys
import orbax.checkpoint as ocp
from pretrain import runlog
what, n, when = sys.argv[1].split(":")
n, calls = int(n), [0]

def wrap(cls, name, count_if=lambda r: True, will=lambda self, a, k: True):
    real = getattr(cls, name)
    def patched(self, *a, **k):
        if what == name and when == "before" and calls[0] + 1 == n and will(self, a, k):
            os.kill(os.getpid(), signal.SIGKILL)
        r = real(self, *a, **k)
        if what == name and count_if(r):
            calls[0] += 1
            if when == "after" and calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return r
    setattr(cls, name, patched)

wrap(runlog.RunLog, "record")
# Count the steps actually saved (save is called every step; the manager keeps its interval).
wrap(ocp.CheckpointManager, "save", lambda saved: bool(saved), lambda m, a, k: k.get("force") or m.should_save(a[0]))
from pretrain.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_random_kills_then_resume_equal_an_uninterrupted_run(setup, tmp_path, capsys):
    """kill -9 at random points (before/after a metrics record, before/after a checkpoint save, i.e. between
    checkpoint and metrics writes too), resume each time: every log line and the final parameters equal an
    uninterrupted run's, and TensorBoard holds each step once.
    Slow (slow lane): training runs SIGKILLed at random points (forked from one interpreter: tests/processes.py
    forked) and resumed, each compiling."""
    rng = random.Random()
    extra = ("max_steps=8", "checkpoint.every=3", "log_every=1")
    full = train(load_config(None, _args(setup, tmp_path / "full", "text.jsonl", *extra)), progress=False)
    out = tmp_path / "killed"
    args = ["train", *_args(setup, out, "text.jsonl", *extra)]
    # The first kill anywhere in the first run; the second at the resumed run's first record or save (always
    # reached: a resumed run has a step left to run, and its last step is always checkpointed).
    kills = [f"{rng.choice(['record:' + str(rng.randint(1, 5)), 'save:' + str(rng.randint(1, 2))])}:"
             f"{rng.choice(['before', 'after'])}", f"{rng.choice(['record', 'save'])}:1:{rng.choice(['before', 'after'])}"]
    jobs = [{"script": KILLER, "argv": [kill, *args], "out": str(tmp_path / f"out{i}"), "err": str(tmp_path / f"err{i}"),
             "env": {"JAX_PLATFORMS": "cpu"}} for i, kill in enumerate(kills)]
    for i, code in enumerate(forked_codes(jobs)):  # one after the other, forked from one interpreter (imports once)
        assert code == -signal.SIGKILL, (kills[i], (tmp_path / f"err{i}").read_text()[-2000:])
    assert not (out / "final").exists()
    saved = checkpoint_steps(out)  # none when both kills came before the first checkpoint: a run from scratch
    capsys.readouterr()
    rc = pretrain_main(args)  # the last, uninterrupted rerun: in this process (the kills needed their own)
    said = capsys.readouterr()
    assert rc == 0, said.err[-2000:]
    assert (f"Resuming from step {saved[-1]} " in said.out) if saved else ("Resuming" not in said.out), \
        (kills, saved, said.out)

    def steady(recs):
        return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in recs]

    assert steady(_records(out)) == steady(_records(tmp_path / "full")), kills
    assert _board_steps(out) == list(range(1, 9)), kills
    for x, y in zip(jax.tree.leaves(zoo.load_params(full)), jax.tree.leaves(zoo.load_params(out / "final"))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
