"""The shared training loop on a tiny model: learning, gradient accumulation, resume."""

import json

import numpy as np
import pytest

import zoo
from pretrain.config import load_config
from pretrain.loop import train
from tests.processes import devices_env, ended, free_port
from tests.tiny_lm import tiny_run_folder
from zoo.cli import main as zoo_main

WORDS = "the a cat dog sat ran on under mat log red blue big small quickly slowly and then".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    return tiny_run_folder(tmp_path_factory, tiny_lm, "train", words=WORDS[:8], rows=300)


def _cfg(setup, out, *overrides):
    # Batch 4 unless a test needs more: each row of a batch is a data lane of its own (a grain pipeline, which
    # prefetches), so a short run's setup grows with the batch.
    base = [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=4", "optimizer.learning_rate=0.01", "schedule.name=constant",
            "log_every=1", "checkpoint.every=2", f"output_dir={out}"]
    return load_config(None, base + list(overrides))


# _cfg's step settings as `pretrain train` arguments: the runs that check something else than training (bad rows,
# a random init, a resume refused) train with the step program _cfg's runs compiled (the persistent cache has it).
SHARED_STEP = ("data.seq_len=32", "batch_size=4", "optimizer.learning_rate=0.01", "schedule.name=constant")


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_loss_decreases_and_final_is_a_zoo_checkpoint(setup, tmp_path):
    """The fast lane's end-to-end pretraining run: over 30 s in the baseline (a training run and its compilations,
    with SmolLM2's vocabulary then)."""
    # _cfg's batch of 4: the step program of the module's other _cfg runs (compiled once, cached for them)
    final = train(_cfg(setup, tmp_path / "run", "max_steps=25"), progress=False)
    losses = _losses(tmp_path / "run")
    assert len(losses) == 25
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"step", "loss", "learning_rate", "grad_norm", "tokens_seen", "tokens_per_sec", "step_time", "mfu"} <= set(rec)
    model = zoo.load(final)  # zoo.load reads the trained model
    assert model.cfg.num_layers == 2
    meta = zoo.checkpoints.format.read_meta(final)
    assert meta["training"]["method"] == "pretrain" and meta["training"]["steps"] == 25
    # The task's card metadata, with the run's settings, recorded for `zoo export`'s card.
    card = meta["training"]["card"]
    assert card["name"] == "pretraining (next-token prediction)" and card["tags"] == ["pretraining"]
    assert ["batch_size", 4] in card["hyperparameters"]
    assert zoo_main(["export", str(final), "--out", str(tmp_path / "hf")]) == 0  # and zoo export too
    assert "**Method:** pretraining (next-token prediction)." in (tmp_path / "hf" / "README.md").read_text()
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and b"train/loss" in events[0].read_bytes()
    assert zoo_main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "c.png")]) == 0
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "c.png")
    assert img.shape[0] > 100 and img.shape[1] > 100 and img[..., :3].std() > 0.05  # drawn, not blank


# SGD keeps the update proportional to the gradient (Adam would amplify fp32 summation-order noise in near-zero
# gradients), so equal trajectories compare the gradients themselves.
SGD = ("batch_size=8", "optimizer.name=sgd", "optimizer.learning_rate=0.5")  # batch 8: a data8 mesh needs 8 rows
SGD_STEPS = 2  # the second step's loss follows the first update; the final weights follow both


@pytest.fixture(scope="module")
def sgd_run(setup, tmp_path_factory):
    """The reference trajectory, trained once: SGD_STEPS plain SGD steps on one device, one process, no
    accumulation, no remat. Gradient accumulation, remat, 8-device meshes and 2 processes must each follow it.
    Returns (run folder, final checkpoint)."""
    out = tmp_path_factory.mktemp("sgd") / "run"
    return out, train(_cfg(setup, out, f"max_steps={SGD_STEPS}", *SGD), progress=False)


@pytest.mark.slow
def test_grad_accum_equals_one_larger_step(setup, sgd_run, tmp_path):
    """Slow (about 40 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    one, a = sgd_run  # grad_accum=1
    b = train(_cfg(setup, tmp_path / "b", f"max_steps={SGD_STEPS}", "grad_accum=4", *SGD), progress=False)
    np.testing.assert_allclose(_losses(one), _losses(tmp_path / "b"), rtol=1e-5)
    pa, pb = zoo.load_params(a), zoo.load_params(b)
    for x, y in zip(jax_leaves(pa), jax_leaves(pb)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_result_and_skips_a_corrupted_checkpoint(setup, tmp_path, monkeypatch,
                                                                                     capsys):
    """A run killed after step 2 was checkpointed resumes from it to the uninterrupted run's losses and final
    weights (bit for bit). Then, its latest checkpoint (step 3) corrupted, the run continued to step 4 falls back
    to the previous one (step 2, said on stderr): each step is logged once (step 3's record replaced) and each
    checkpoint holds its run's config.
    Slow (about 33 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    every = ("checkpoint.every=1", "checkpoint.keep=5")
    full = train(_cfg(setup, tmp_path / "full", "max_steps=3"), progress=False)
    import pretrain.steps as trainer

    real = trainer.to_model_batch
    calls = []

    def crash_at_3(b):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed after step 2 was checkpointed
        return real(b)

    monkeypatch.setattr(trainer, "to_model_batch", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(setup, tmp_path / "resumed", "max_steps=3", *every), progress=False)
    monkeypatch.setattr(trainer, "to_model_batch", real)
    resumed = train(_cfg(setup, tmp_path / "resumed", "max_steps=3", *every), progress=False)
    assert _losses(tmp_path / "resumed")[-2:] == _losses(tmp_path / "full")[-2:]
    for x, y in zip(jax_leaves(zoo.load_params(full)), jax_leaves(zoo.load_params(resumed))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The latest checkpoint corrupted: the next run falls back to the one before.
    ckdir = tmp_path / "resumed" / "checkpoints"
    latest = max(int(p.name) for p in ckdir.iterdir() if p.name.isdigit())
    assert latest == 3
    for f in (ckdir / str(latest)).rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    capsys.readouterr()
    train(_cfg(setup, tmp_path / "resumed", "max_steps=4", *every), progress=False)
    err = capsys.readouterr().err
    assert f"checkpoint {latest}" in err and "falling back" in err
    steps = [json.loads(x)["step"] for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # resumed from step 2: step 3's record replaced, each step once
    saved = json.loads((ckdir / "4" / "config" / "metadata").read_text())  # each checkpoint holds its config
    assert saved["max_steps"] == 4 and saved["checkpoint"]["every"] == 1


MESH_SCRIPT = r"""
import json, sys
import jax
from pretrain.config import load_config
from pretrain.loop import train
assert len(jax.devices()) == 8
base = json.loads(sys.argv[1])
out = {}
for name, mesh in [("data8", ["mesh.data=8", "mesh.fsdp=1"]), ("fsdp8", ["mesh.data=1", "mesh.fsdp=8"]),
                   ("d2f2t2 remat full", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "remat=full"])]:
    d = sys.argv[2] + "/" + name.split()[0]
    train(load_config(None, base + mesh + [f"output_dir={d}"]), progress=False)
    out[name] = [json.loads(l)["loss"] for l in open(d + "/metrics.jsonl")]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_meshes_on_8_devices_match_one_device(setup, sgd_run, tmp_path):
    """Three meshes of 8 devices train like one device: data 8, fsdp 8, and data 2 x fsdp 2 x tensor 2 with
    remat: full (the loop's remat setting trains like none: the reference is unrematerialized; each policy's
    gradients and memory are tests/test_model.py's).
    Slow (slow lane): a subprocess on 8 simulated devices trains three meshes, each compiling its own step."""
    import subprocess
    import sys

    ref = _losses(sgd_run[0])
    base = [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=8", "schedule.name=constant", "log_every=1", f"max_steps={SGD_STEPS}",
            "checkpoint.every=100", *SGD]  # the last step's checkpoint only: orbax's saves cost seconds on 8 devices
    env = devices_env(8)
    p = subprocess.run([sys.executable, "-c", MESH_SCRIPT, json.dumps(base), str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name, losses in got.items():
        assert len(losses) == SGD_STEPS, name
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=name)


def _signal_args(setup, out) -> list[str]:
    """The signal tests' `pretrain train` arguments: _cfg's run (its step compiled once for the module)."""
    return [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=4", "log_every=1", "checkpoint.every=100000",
            "optimizer.learning_rate=0.01", "schedule.name=constant", f"output_dir={out}"]


def _signal_step(name: str, err: str, out) -> int:
    """The step of the checkpoint the interrupted run said it saved (one plain line: no "error:", no traceback,
    nothing went wrong), which is the run's latest (checkpoint.every would never have saved one)."""
    import re

    said = [line for line in err.splitlines() if line.startswith("interrupted")]
    m = re.fullmatch(rf"interrupted by {name}: checkpoint saved at step (\d+) in {re.escape(str(out))}; run the "
                     r"same command to resume", said[0] if len(said) == 1 else "")
    assert m and "error" not in err and "Traceback" not in err, err[-2000:]
    step = int(m[1])
    saved = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert step >= 1 and max(saved) == step
    return step


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_exits_130_and_the_run_resumes(setup, tmp_path, capsys):
    """Ctrl-C (SIGINT) to a `pretrain train` subprocess after its first step: the loop saves a checkpoint at the
    step boundary, says so in one plain line and exits with a shell's 128 + the signal's number, 130. The same
    command, its max_steps lowered to end soon, resumes from that checkpoint and continues the log.
    Slow (slow lane): a `pretrain train` subprocess imports and compiles before the signal."""
    import os
    import signal
    import subprocess
    import sys

    from pretrain.cli import main

    out = tmp_path / "sig"
    args = _signal_args(setup, out)
    with open(tmp_path / "stderr.txt", "w+") as errors:  # a file: a full stderr pipe could block the child
        proc = subprocess.Popen([sys.executable, "-m", "pretrain.cli", "train", *args, "max_steps=100000"],
                                stdout=subprocess.PIPE, stderr=errors, text=True,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        # Off a terminal the loop prints (and flushes) one plain line per logged step: the first one says step 1
        # is done. No polling: the read blocks until then (or until the output ends, if the child fails).
        for line in proc.stdout:
            if line.startswith("step "):
                break
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=300)
        errors.seek(0)
        err = errors.read()
    assert proc.returncode == 130, err[-2000:]
    step = _signal_step("SIGINT", err, out)
    capsys.readouterr()
    assert main(["train", *args, f"max_steps={step + 2}"]) == 0
    assert f"Resuming from step {step} " in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, step + 3))


def test_sigterm_saves_a_checkpoint_and_returns_143(setup, tmp_path, capsys, monkeypatch):
    """SIGTERM (a scheduler's preemption) while step 2 runs: the loop saves a checkpoint at the next step boundary,
    says so in one plain line and `pretrain train` returns 143 (128 + 15), the exit status its process ends with.
    In this process (the signal raised here, as a sender's would arrive: Python's handler runs in the main thread
    either way); the test above sends Ctrl-C to a `pretrain train` subprocess and resumes."""
    import signal
    import threading

    import pretrain.steps as trainer
    from pretrain.cli import main

    # The loop's handlers exist in the main thread only (pytest-xdist runs tests there too): elsewhere the signal
    # would end this test process.
    assert threading.current_thread() is threading.main_thread()
    real, calls = trainer.to_model_batch, []

    def signal_in_step_2(b):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        return real(b)

    monkeypatch.setattr(trainer, "to_model_batch", signal_in_step_2)
    out = tmp_path / "sig"
    before = signal.getsignal(signal.SIGTERM)
    # max_steps 4: a signal the loop ignored would end the run at step 4, returning 0 (not hang the suite)
    assert main(["train", *_signal_args(setup, out), "max_steps=4"]) == 143
    assert _signal_step("SIGTERM", capsys.readouterr().err, out) == 2
    assert signal.getsignal(signal.SIGTERM) is before  # the loop put the previous handler back


@pytest.mark.slow
def test_bad_rows_name_file_and_row_or_are_skipped(setup, tmp_path, capsys):
    from pretrain.cli import main

    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "the cat sat"}\n{"text": ""}\n{"other": 1}\n' + '{"text": "a dog ran"}\n' * 50)
    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={data}",
            *SHARED_STEP, "max_steps=2", f"output_dir={tmp_path / 'o'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl, line 2:" in err[0] and "skip_bad_rows" in err[0]
    assert main(args + ["data.skip_bad_rows=true"]) == 0
    meta = zoo.checkpoints.format.read_meta(tmp_path / "o" / "final")
    assert meta["training"]["skipped_rows"] == 2


@pytest.mark.slow
def test_train_from_scratch_with_random_init(setup, smollm2_tokenizer, tmp_path, capsys):
    """Slow (about 76 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    from pretrain.cli import main

    # The model the run below initializes (so its random initialization compiles once; a registry name as
    # model.config is tests/test_kernels.py's and test_train_config.py's), with SmolLM2's tokenizer:
    tiny = ["model.init=random", f"model.config={setup / 'hf' / 'config.json'}", *SHARED_STEP,
            f"data.path={setup / 'data.jsonl'}", "max_steps=2"]
    assert main(["train", *tiny, f"model.tokenizer={smollm2_tokenizer}", f"output_dir={tmp_path / 'x'}"]) == 2
    assert "vocab_size 512" in capsys.readouterr().err  # its 512-token vocabulary cannot hold SmolLM2's 49152 ids
    final = train(load_config(None, [*tiny, f"model.tokenizer={setup / 'tok'}", f"output_dir={tmp_path / 'scratch'}"]),
                  progress=False)
    assert zoo.read_config(final).family == "llama"
    assert zoo.checkpoints.format.read_meta(final)["training"]["steps"] == 2
    assert "from a random initialization" in zoo.checkpoints.format.read_meta(final)["training"]["card"]["name"]


def test_missing_tokenizer_is_a_clear_error(setup, tmp_path, capsys):
    from pretrain.cli import main

    args = ["train", f"model.path={setup / 'zoo'}", f"data.path={setup / 'data.jsonl'}", "max_steps=1",
            f"output_dir={tmp_path / 'o'}"]
    assert main(args) == 2  # this checkpoint has no tokenizer and none was given
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tokenizer" in err[0] and "model.tokenizer" in err[0]
    assert not (tmp_path / "o").exists()


def test_unpacked_rows_hold_one_document_each(setup, tmp_path):
    from pretrain.data.pipeline import lane_dataset
    from zoo.data.batching import to_model_batch

    docs = [np.arange(1, 6, dtype=np.int32), np.arange(10, 30, dtype=np.int32)]
    rows = [next(it) for it in [lane_dataset(docs, 8, 0, packing=False)] for _ in range(4)]
    for r in rows:
        n = int(r["tokens_segment_ids"].sum())
        doc = next(d for d in docs if d[0] == r["tokens"][0])
        assert n == min(len(doc), 9) and (r["tokens"][:n] == doc[:n]).all()  # truncated to seq_len + 1
        assert (r["tokens_segment_ids"][n:] == 0).all() and (r["tokens_positions"][:n] == np.arange(n)).all()
    b = to_model_batch({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    short = int(np.argmax([r["tokens"][0] == 1 for r in rows]))
    assert b["weights"][short].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]  # no loss on padding
    out = tmp_path / "unpacked"
    final = train(_cfg(setup, out, "max_steps=3", "data.packing=false"), progress=False)
    assert len(_losses(out)) == 3 and zoo.read_config(final).num_layers == 2


def test_hub_dataset_name_offline_is_a_clear_error(setup, tmp_path, capsys, monkeypatch):
    import datasets
    import huggingface_hub

    from pretrain.cli import main

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}",
            "data.path=no-such-org/no-such-dataset", "max_steps=1", f"output_dir={tmp_path / 'o'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-org/no-such-dataset" in err[0] and "Hub dataset" in err[0]


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(setup, tmp_path, capsys):
    from pretrain.cli import main

    out = tmp_path / "nan"
    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}",
            f"data.path={setup / 'data.jsonl'}", "data.seq_len=16", "batch_size=2", "max_steps=50",
            "optimizer.name=sgd", "optimizer.learning_rate=1e30", "optimizer.grad_clip=0",
            "checkpoint.every=1", "schedule.name=constant", f"output_dir={out}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "loss became" in err and "last good checkpoint" in err
    assert not (out / "final").exists()
    steps = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps  # the last good one is kept


def test_resuming_with_another_process_count_is_a_clear_error(setup, tmp_path, capsys):
    from pretrain.cli import main

    out = tmp_path / "pc"
    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}",
            f"data.path={setup / 'data.jsonl'}", *SHARED_STEP, "max_steps=2", "checkpoint.every=1", f"output_dir={out}"]
    assert main(args) == 0
    for f in (out / "checkpoints").glob("*/data/process_0-of-1.json"):  # as if 2 processes had written it
        f.rename(f.with_name("process_0-of-2.json"))
        f.with_name("process_1-of-2.json").write_text(f.with_name("process_0-of-2.json").read_text())
    capsys.readouterr()
    assert main(args[:-3] + ["max_steps=3", "checkpoint.every=1", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "written by 2 processes" in err[0] and "this run has 1" in err[0]


def test_mesh_larger_than_the_machine_is_a_clear_error(setup, tmp_path, capsys):
    from pretrain.cli import main

    args = ["train", f"model.path={setup / 'zoo'}", f"data.path={setup / 'data.jsonl'}", "max_steps=1",
            "mesh.data=4", "mesh.fsdp=1", f"output_dir={tmp_path / 'o'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 4 devices" in err[0]


@pytest.mark.slow
def test_eval_loss_and_mfu_are_logged(setup, tmp_path):
    cfg = _cfg(setup, tmp_path / "ev", "max_steps=4", "data.eval_fraction=0.2", "eval_every=2", "peak_tflops=1.0")
    train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert all(np.isfinite(evals)) and evals[-1] < rows[0]["loss"] + 1.0
    assert all(0 < r["mfu"] < 1 for r in rows)  # against the configured 1 TFLOP/s peak


# `pretrain train ARGS` (what `python -m pretrain.cli` runs), then whether the process ever imported torch.
TRAIN_THEN_TELL_TORCH = ("import sys; from pretrain.cli import main; rc = main(['train', *sys.argv[1:]]); "
                         "print('TORCH', 'torch' in sys.modules); sys.exit(rc)")


@pytest.fixture(scope="module")
def two_processes(setup, tmp_path_factory):
    """`pretrain train` as 2 processes x 2 CPU devices (gloo), SGD_STEPS steps like ``sgd_run`` (grad_accum 2), each
    process saying at exit whether it imported torch. Returns (run folder, [(returncode, stdout, stderr)] by process)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("two") / "run"
    args = [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=8", "grad_accum=2", "schedule.name=constant", "log_every=1",
            f"checkpoint.every={SGD_STEPS}", f"output_dir={out}", f"max_steps={SGD_STEPS}", *SGD]
    env = devices_env(2)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TRAIN_THEN_TELL_TORCH, *args, "--coordinator",
                               f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    return out, ended(procs)


@pytest.mark.slow
def test_two_processes_follow_the_one_process_trajectory(sgd_run, two_processes):
    """2 processes x 2 CPU devices (gloo), each reading only its own rows, train like 1 process on 1 device.
    Slow (slow lane): two `pretrain train` processes (fixture two_processes) each import, compile and train."""
    one, ref = sgd_run
    out, results = two_processes
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    assert "final model:" in results[0][1] and "final model:" not in results[1][1]  # process 0 reports
    np.testing.assert_allclose(_losses(out), _losses(one), rtol=1e-5)  # one metrics file, SGD_STEPS rows
    saved = out / "checkpoints" / str(SGD_STEPS) / "data"
    assert sorted(f.name for f in saved.glob("process_*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]
    meta = zoo.checkpoints.format.read_meta(out / "final")
    assert meta["training"]["processes"] == 2 and meta["training"]["devices"] == 4
    for x, y in zip(jax_leaves(zoo.load_params(ref)), jax_leaves(zoo.load_params(out / "final"))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


@pytest.mark.slow
def test_a_training_process_never_imports_torch(two_processes):
    """torch is installed here (a test oracle), but the loop needs none of it: neither the tokenizer nor
    the TensorBoard writer may pull it in (0.25 GB of RSS in every training process). The processes: the
    two of ``two_processes``, each a whole `pretrain train` run to its final checkpoint.
    Slow (slow lane): it reads the runs of the two_processes fixture."""
    out, results = two_processes
    for rc, stdout, err in results:
        assert rc == 0, err[-2000:]
        assert "TORCH False" in stdout
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))  # the writer still writes
    import torch  # and torch still imports normally afterwards, in a process that wants it

    assert torch.zeros(1).item() == 0


def test_steps_compile_ahead_once_per_shape_then_trim(monkeypatch):
    """make_step's functions compile each new argument shape before running it (with XLA:CPU's memory-optimized
    scheduler) and hand the compiler's freed memory back in between (so it is not under the first step's
    peak); later calls with that shape run the executable compiled then."""
    import jax
    import jax.numpy as jnp

    import pretrain.jit_step as step_mod
    from zoo.compiled import compiler

    events = []
    monkeypatch.setattr(step_mod, "release_free_memory", lambda: events.append("trim"))

    class Executable:
        def __init__(self, compiled):
            self.compiled = compiled

        def __call__(self, *args):
            events.append("run")
            return self.compiled(*args)

    class Lowered:
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self, compiler_options=None):
            events.append(("compile", compiler_options))
            return Executable(self.lowered.compile(compiler_options=compiler_options))

    class Recorder:
        def __init__(self, fn):
            self.fn = jax.jit(fn)

        def lower(self, *args):
            return Lowered(self.fn.lower(*args))

    f = step_mod.compile_then_trim(Recorder(lambda x, y: x * 2 + (0 if y is None else y)))
    a, b = jnp.ones(3), jnp.ones(5)
    assert float(f(a, None).sum()) == 6 and float(f(a, None).sum()) == 6 and float(f(b, a[0]).sum()) == 15
    opts = compiler.CPU_COMPILER_OPTIONS
    assert opts == {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    assert events == [("compile", opts), "trim", "run", "run", ("compile", opts), "trim", "run"]


def test_steps_still_compile_where_xla_does_not_know_the_scheduler_option(monkeypatch):
    """The memory-optimized scheduler is an optimization: an XLA that rejects the option compiles plainly."""
    import jax
    import jax.numpy as jnp

    import pretrain.jit_step as step_mod
    from zoo.compiled import compiler

    monkeypatch.setattr(compiler, "CPU_COMPILER_OPTIONS", {"xla_cpu_no_such_option_here": 1})
    f = step_mod.compile_then_trim(jax.jit(lambda x: x * 3))
    assert float(f(jnp.ones(4)).sum()) == 12
