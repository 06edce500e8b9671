"""Asynchronous checkpoints (pretrain/checkpoints.py): a save returns while its step is still being written, only
committed steps are listed or restored, and a run killed with SIGKILL in the middle of a save, on local disk and
on a bucket (the GCS emulator, moto's S3), resumes from the last committed step bit-identical to a run never
killed, a bucket run's files all in its bucket."""

import json
import threading

import numpy as np
import pytest

from pretrain.checkpoints import Checkpoints
from pretrain.cli import main as pretrain_main
from pretrain.config import TrainConfig
from pretrain.runfolder import checkpoint_steps
from tests.processes import forked_codes
from tests.tiny_lm import tiny_run_folder
from zoo import storage


def test_a_save_returns_while_its_step_is_written(tmp_path, monkeypatch):
    """The hook's save returns while the step's data position is still being written (its write held back here),
    the position is the one at the save, not the iterator's later one, and the step is neither listed nor
    restored until Orbax commits it."""
    import grain
    import jax.numpy as jnp
    from etils import epath

    gate, path_type = threading.Event(), type(epath.Path(tmp_path))
    real = path_type.write_text

    def held(self, *args, **kwargs):
        if self.name.startswith("process_"):  # the data position's file
            assert gate.wait(60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(path_type, "write_text", held)
    out = storage.run_path(str(tmp_path / "run"))
    batches = iter(grain.MapDataset.range(10).to_iter_dataset())
    next(batches)
    state = {"w": jnp.arange(4.0)}
    checkpoints = Checkpoints(out, TrainConfig(), batches)
    saving = threading.Thread(target=checkpoints.save, args=(1, state, True))
    saving.start()
    saving.join(30)
    try:
        assert not saving.is_alive(), "the save waited for its data position to be written"
        next(batches)  # the next step moves the iterator while the save is in flight
        assert checkpoint_steps(out) == []
        fresh = iter(grain.MapDataset.range(10).to_iter_dataset())
        assert Checkpoints(out, TrainConfig(), fresh).restore(state)[1] == 0
    finally:
        gate.set()
        checkpoints.close()
    assert checkpoint_steps(out) == [1]
    fresh = iter(grain.MapDataset.range(10).to_iter_dataset())
    restored, step, _ = Checkpoints(out, TrainConfig(), fresh).restore({"w": jnp.zeros(4)})
    assert step == 1 and next(fresh) == 1
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4.0))


# `pretrain ARGS` that SIGKILLs itself when Orbax starts to commit the checkpoint of step ARGV[1]: the step's
# arrays, data position and config are written (in the background, while the run goes on), the step is not yet
# committed (a local step folder not yet renamed into place, a bucket's step without its commit file). The items'
# own commits (state/, data/, config/) pass. Run as `python -c KILL_MID_SAVE STEP ARGS...` (here forked: see
# tests/processes.py forked).
KILL_MID_SAVE = r"""
import os, signal, sys
from orbax.checkpoint._src.path import atomicity
at = sys.argv[1]
for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    def finalize(self, *a, _real=cls.finalize, **k):
        if self.get_final().name == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(self, *a, **k)
    cls.finalize = finalize
from pretrain.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    return tiny_run_folder(tmp_path_factory, tiny_lm, "async")


def _args(setup, out, model=None):
    # The step of tests/test_train.py's _cfg (and test_trackers.py's, test_run_integrity.py's): one compilation
    # for all of them in the session's compilation cache (a constant schedule: max_steps is no part of it).
    return ["train", f"model.path={model or setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}",
            f"data.path={setup / 'data.jsonl'}", "data.seq_len=32", "batch_size=4", "optimizer.learning_rate=0.01",
            "schedule.name=constant", "log_every=1", "checkpoint.every=2", "max_steps=3", f"output_dir={out}"]


def _log(out):
    """Each step's record of the run in ``out``, less what depends on the clock."""
    return [{k: v for k, v in json.loads(x).items() if k not in ("step_time", "tokens_per_sec", "mfu")}
            for x in (out / "metrics.jsonl").read_text().splitlines()]


def _all_in_the_bucket(out, setup) -> None:
    """A run whose output_dir is on a bucket: its checkpoints (Orbax through TensorStore's GCS or S3 driver),
    metrics.jsonl, TensorBoard, config and final model are there, nothing locally."""
    assert checkpoint_steps(out)[-2:] == [2, 3]  # (Orbax also keeps the first step it saw)
    assert json.loads((out / "final" / "model.json").read_text())["training"]["steps"] == 3
    events = [p for p in (out / "tensorboard").iterdir() if p.name.startswith("events.out.tfevents")]
    assert events and all(b"train/loss" in p.read_bytes() for p in events)
    scheme = str(out).split(":")[0]
    assert (out / "config.yaml").is_file() and not (setup / f"{scheme}:").exists()


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_save_resumes_bit_identical(setup, gcs, s3, tmp_path, capsys, monkeypatch):
    """A run killed with SIGKILL while Orbax saves step 3, its last (its items written, the step not committed),
    once on local disk, once on the GCS emulator and once on moto's S3 (``output_dir: gs://...``, ``s3://...``, the
    starting checkpoint model.path on the bucket too): the uncommitted step is left behind but never listed; the
    same command resumes from step 2 (a checkpoint written while step 3 ran) and ends bit-identical to a run never
    killed, every step logged once. On a bucket the run's checkpoints, metrics.jsonl, TensorBoard, config and
    final model land in the bucket, nothing locally, and the final model is read back by its URL.
    (tests/test_object_storage.py's run on a bucket, its kill -9 and resume, is this test's: one reference run, one
    killed run a store.) Slow: three killed `pretrain train` runs (children forked from one interpreter that
    imports once: tests/processes.py forked) and four runs in this process."""
    import jax
    from flax import nnx

    import zoo

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "cache"))
    assert pretrain_main(_args(setup, tmp_path / "full")) == 0
    full = storage.run_path(str(tmp_path / "full"))
    assert [r["step"] for r in _log(full)] == [1, 2, 3]
    reference = zoo.load(str(full / "final"))
    assert reference.cfg.num_layers == 2
    runs = [(storage.run_path(str(tmp_path / "killed")), None)]
    for store in (gcs, s3):
        bucket = store.bucket()
        storage.upload_tree(setup / "zoo", storage.run_path(bucket + "/base"), last=("model.json",))
        runs.append((storage.run_path(bucket + "/killed"), bucket + "/base"))
    jobs = [{"script": KILL_MID_SAVE, "argv": ["3", *_args(setup, out, model)], "out": str(tmp_path / f"out{i}"),
             "err": str(tmp_path / f"err{i}")}
            for i, (out, model) in enumerate(runs)]
    codes = forked_codes(jobs)
    for i, (out, model) in enumerate(runs):
        args = _args(setup, out, model)
        assert codes[i] == -9, (tmp_path / f"err{i}").read_text()[-2000:]
        left = [p.name for p in (out / "checkpoints").iterdir()]
        assert any(name.startswith("3") for name in left), left  # the save of step 3 was under way ...
        assert checkpoint_steps(out)[-1] == 2 and not (out / "final" / "model.json").exists()  # ... uncommitted
        assert [r["step"] for r in _log(out)] == [1, 2, 3]
        capsys.readouterr()
        assert pretrain_main(args) == 0
        assert "Resuming from step 2" in capsys.readouterr().out
        assert _log(out) == _log(full)  # each step once, the same floats
        if model:
            _all_in_the_bucket(out, setup)
        again = zoo.load(str(out / "final"))  # on a bucket: by its URL
        for x, y in zip(jax.tree.leaves(nnx.state(reference)), jax.tree.leaves(nnx.state(again)), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
