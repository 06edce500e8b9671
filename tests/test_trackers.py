"""report_to: every tracker gets metrics.jsonl's floats at their steps, the config, GRPO's completions as a table,
and a resumed run's tracker run continues; each read back with the tracker's own reader (pretrain/trackers.py).
Of two processes only process 0 reports: tests/test_launch.py's 2-process run (srun's variables) reports to
trackio too."""

import json
import math
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from pretrain.batch import Rollout
from pretrain.cli import main as pretrain_main
from pretrain.config import load_config
from pretrain.hooks import StepInfo
from pretrain.loop import train
from pretrain.runlog import TIMING_FIELDS
from pretrain.trackers import STATE_FILE, TrackerHook, chosen
from tests.processes import REPO, free_port
from tests.run_files import read_metrics
from tests.tiny_lm import tiny_run_folder
from zoo.errors import UserError


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    return tiny_run_folder(tmp_path_factory, tiny_lm, "trackers")


def _args(setup, out, *overrides):
    return [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=4", "optimizer.learning_rate=0.01", "schedule.name=constant",
            "log_every=1", "checkpoint.every=2", "max_steps=3", f"output_dir={out}", *overrides]


def _expected(out, timing=True):
    """metrics.jsonl's records as the trackers name them: step -> {train/<name> or eval/...: float}."""
    return {r["step"]: {k if k.startswith("eval/") else f"train/{k}": v for k, v in r.items()
                        if k != "step" and isinstance(v, (int, float)) and (timing or k not in TIMING_FIELDS)}
            for r in read_metrics(out)}


def test_report_to_names_trackers_and_an_unknown_one_is_an_error(setup, tmp_path):
    assert load_config(None, _args(setup, tmp_path)).report_to == ["tensorboard"]  # today's default
    assert chosen("wandb,mlflow") == ["wandb", "mlflow"] and chosen("none") == [] and "tensorboard" in chosen("all")
    with pytest.raises(UserError, match="report_to: unknown tracker 'wandbb'; choose from tensorboard, wandb"):
        load_config(None, _args(setup, tmp_path, "report_to=[wandbb]"))


@pytest.mark.parametrize("extra", ["wandb", "mlflow", "trackio"])
def test_a_missing_tracker_is_one_line_naming_its_extra_before_anything_is_written(setup, tmp_path, capsys,
                                                                                   monkeypatch, extra):
    monkeypatch.setitem(sys.modules, extra, None)  # as if not installed: import raises, find_spec answers None
    out = tmp_path / "run"
    assert pretrain_main(["train", *_args(setup, out, f"report_to=[tensorboard,{extra}]")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pip install 'lmzoo[{extra}]'" in err[0], err
    assert not out.exists()


@pytest.mark.slow
def test_a_tracker_that_cannot_start_is_one_line_and_nothing_is_written(setup, tmp_path, capsys, monkeypatch):
    """MLflow's server unreachable (a closed loopback port), with MLflow's own retries as they are (about 4
    minutes for a refused connection): the run stops in well under a minute with the reason in one line, exit
    2, and the run folder is not left behind: no config.yaml, no metrics.jsonl (the trackers start before the
    run writes its files), nor what set-up wrote there first (a DPO run's reference log-probabilities, scored
    once and cached in the run folder).
    Slow (slow lane): the run loads its model and scores its pairs before the trackers start."""
    from dpo.cli import main as dpo_main
    from tests.preference_data import dpo_pairs
    from tests.run_files import write_jsonl

    write_jsonl(tmp_path / "prefs.jsonl", dpo_pairs(8))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    out = tmp_path / "run"
    began = time.monotonic()
    assert dpo_main(["train", *_args(setup, out, f"data.path={tmp_path / 'prefs.jsonl'}", "dpo.reference=precomputed",
                                     "report_to=[tensorboard,mlflow]")]) == 2
    assert time.monotonic() - began < 60
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "reference log-prob" not in line]
    assert len(err) == 1 and err[0].startswith("error: report_to: mlflow could not start its run (no answer from "
                                               "http://127.0.0.1:"), err[-3:]
    assert not out.exists()


def _wandb_records(path):
    """The records of a W&B run file (``run-<id>.wandb``): LevelDB's log format (32 KiB blocks of chunks, each
    crc32c, length, type, data) after W&B's 7-byte header, each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    records, data, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", raw[pos + 4:pos + 7])
        data += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST: a record is complete
            rec = pb.Record()
            rec.ParseFromString(data)
            records.append(rec)
            data = b""
        elif kind == 0:
            break
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_the_config_and_the_logs_floats(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(load_config(None, _args(setup, out, "report_to=[wandb]")), progress=False)
    run_id = json.loads((out / STATE_FILE).read_text())["wandb"]["id"]
    [path] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = _wandb_records(path)
    history = {}
    config = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
        if rec.WhichOneof("record_type") in ("run", "config"):
            update = rec.run.config.update if rec.HasField("run") else rec.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
    assert history == _expected(out)  # every metric, the same float, at the same step; nothing else
    assert config["batch_size"] == 4 and config["data"]["seq_len"] == 32 and config["report_to"] == ["wandb"]
    assert not list((out / "tensorboard").glob("events.*"))  # report_to without tensorboard: none drawn


def _trackio_logs(project, name):
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, name)


@pytest.mark.slow
def test_trackio_local_run_holds_the_logs_floats_and_the_completions_table(setup, tmp_path, monkeypatch,
                                                                             trackio_dir):
    monkeypatch.setenv("TRACKIO_PROJECT", "lmzoo-test")
    out = tmp_path / "run"
    train(load_config(None, _args(setup, out, "report_to=[tensorboard,trackio]")), progress=False)
    name = json.loads((out / STATE_FILE).read_text())["trackio"]["id"]
    logs = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "timestamp")}
            for r in _trackio_logs("lmzoo-test", name)}
    assert logs == _expected(out)
    assert list((out / "tensorboard").glob("events.*"))  # and TensorBoard as before
    default = tmp_path / "default"
    train(load_config(None, _args(setup, default, "max_steps=1")), progress=False)
    assert list((default / "tensorboard").glob("events.*")) and not (default / STATE_FILE).exists()
    # GRPO's completions: its log hook hands them over as a table the same step (grpo/completions_log.py).
    from grpo.completions_log import CompletionsLog, completion_records

    recs = completion_records(4, [[{"role": "user", "content": "2+2?"}], "1+1?"], ["4", "two"], [[1], [2]],
                              ["exact"], np.array([[1.0], [np.nan]]), np.array([1.0, 0.0]), np.array([0.5, -0.5]))
    info = StepInfo(4, 4, {}, {"step": 4, "loss": 1.5}, Rollout(None, {}, log=recs))
    CompletionsLog(out / "completions.jsonl").on_step(info)
    hook = TrackerHook(out, ["trackio"], load_config(None, _args(setup, out)), every=1)
    hook.open()
    hook.start(3)
    hook.on_step(info)
    hook.close()
    [table] = [r["completions"]["_value"] for r in _trackio_logs("lmzoo-test", name) if "completions" in r]
    assert table == [{"step": 4, "prompt": '[{"role": "user", "content": "2+2?"}]', "completion": "4",
                      "rewards/exact": 1.0, "reward": 1.0, "advantage": 0.5},
                     {"step": 4, "prompt": "1+1?", "completion": "two", "rewards/exact": None, "reward": 0.0,
                      "advantage": -0.5}]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on loopback (SQLite store, artifacts served from a folder), for the session, without
    its job runner (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false)."""
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}", "--artifacts-destination",
                               str(root / "artifacts"), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=open(root / "log", "w"),
                              # no job runner: by default the server starts one and seven Huey consumer processes
                              # (each importing MLflow) for server-side jobs the tracking API never uses
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.time() < deadline, (root / "log").read_text()[-2000:]
            time.sleep(0.5)
    yield url
    server.terminate()
    server.wait(30)


# `pretrain train ARGS` that SIGKILLs itself when the loop asks for step ARGV[1]'s checkpoint, before saving it:
# that step's metrics are logged and reported, the checkpoint before it is the one a rerun resumes from.
_KILL_AT_SAVE = r"""
import os, signal, sys
import orbax.checkpoint as ocp
at, real = int(sys.argv[1]), ocp.CheckpointManager.save

def save(self, step, *a, **k):
    if step == at:
        self.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, step, *a, **k)

ocp.CheckpointManager.save = save
from pretrain.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_mlflow_run_resumed_after_a_kill_continues_without_a_step_twice(setup, tmp_path, mlflow_server,
                                                                         monkeypatch):
    """Killed after step 3 was reported (its checkpoint not saved; step 2's is), the rerun resumes from step 2 in
    the same MLflow run: each step once, with metrics.jsonl's floats; the config as params."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lmzoo-resume")
    out = tmp_path / "run"
    args = _args(setup, out, "max_steps=4", "report_to=[tensorboard,mlflow]")
    killed = subprocess.run([sys.executable, "-c", _KILL_AT_SAVE, "3", "train", *args], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    first = json.loads((out / STATE_FILE).read_text())["mlflow"]
    assert first["step"] == 3 and [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    train(load_config(None, args), progress=False)
    assert json.loads((out / STATE_FILE).read_text())["mlflow"] == {"id": first["id"], "step": 4}
    client = MlflowClient(mlflow_server)
    [run] = client.search_runs([client.get_experiment_by_name("lmzoo-resume").experiment_id])
    assert run.info.run_id == first["id"]
    expected = _expected(out)
    logged: dict[int, dict[str, float]] = {}
    for key in expected[1]:
        for m in client.get_metric_history(run.info.run_id, key):
            assert key not in logged.setdefault(m.step, {}), f"{key} at step {m.step} twice"
            logged[m.step][key] = m.value
    assert sorted(logged) == [1, 2, 3, 4]
    for step, rec in expected.items():
        for key, value in rec.items():  # step 3's timing is the killed run's: it was reported then
            if step != 3 or key.removeprefix("train/") not in TIMING_FIELDS:
                assert logged[step][key] == value or (math.isnan(value) and math.isnan(logged[step][key])), key
    params = run.data.params
    assert params["batch_size"] == "4" and params["data.seq_len"] == "32" and params["max_steps"] == "4"
