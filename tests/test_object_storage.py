"""Run paths on object storage (zoo/storage.py), against real servers on loopback: the GCS emulator and moto's S3.

A run path that cannot work is one line before the model loads. A training run with ``output_dir: gs://...`` or
``s3://...`` that trains, checkpoints, resumes after a kill -9 and leaves its logs and final model in the bucket:
tests/test_checkpoint_async.py (its kill in the middle of a save, on each store).
"""

import json

import numpy as np
import pytest

from pretrain.cli import main as pretrain_main
from tests.object_stores import Store
from tests.tiny_lm import tiny_run_folder
from zoo import storage
from zoo.errors import UserError


@pytest.fixture(params=["gcs", "s3"])
def store(request) -> Store:
    return request.getfixturevalue(request.param)


def test_files_round_trip_and_probe(store):
    """The file layer on each store: write, read, list, a missing folder is none, the writability probe leaves
    nothing behind."""
    run = storage.run_path(store.bucket() + "/runs/one")
    (run / "logs" / "a.jsonl").write_text('{"step": 1}\n')
    assert (run / "logs" / "a.jsonl").read_text() == '{"step": 1}\n'
    assert [p.name for p in run.iterdir()] == ["logs"] and run.is_dir() and not (run / "nothing").is_dir()
    storage.check_writable(run)
    assert sorted(p.name for p in run.iterdir()) == ["logs"]  # the probe object is gone
    storage.remove_tree(run / "logs")
    assert not (run / "logs" / "a.jsonl").exists()


def test_fresh_moves_a_run_aside_on_a_bucket(store):
    """``--fresh`` on a bucket: the old run's objects move to a sibling prefix, none deleted."""
    from pretrain.runfolder import move_aside

    run = storage.run_path(store.bucket() + "/runs/one")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "final" / "model.json").write_text("{}")
    moved = move_aside(run)
    assert moved is not None and moved.name.startswith("one.old-") and not run.exists()
    assert (moved / "final" / "model.json").read_text() == "{}" and (moved / "metrics.jsonl").is_file()


def test_emulator_gives_tensorstore_generations(gcs):
    """TensorStore's read-then-conditional-write (how OCDBT commits its manifest) works on the emulator: a read
    returns the object's generation, and a write conditional on it succeeds (tests/object_stores.py adds the
    generation headers the emulator leaves out; without them this write fails, "Malformed StorageGeneration")."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "gcs", "bucket": gcs.bucket().removeprefix("gs://")}).result()
    kv.write("manifest", b"one").result()
    read = kv.read("manifest").result()
    kv.write("manifest", b"two", if_equal=read.stamp.generation).result()
    assert kv.read("manifest").result().value == b"two"


def test_orbax_writes_and_reads_a_pytree_on_a_bucket(store):
    """Orbax's arrays through TensorStore's own driver for each store (gcs as Orbax has it; s3 through
    zoo/orbax_s3.py, which run_path installs): a pytree saved and restored, and the step listed as committed
    (Orbax's commit file; a step folder without it is not listed)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from pretrain.runfolder import COMMIT_FILE, checkpoint_steps
    from zoo.orbax_s3 import BUCKET_ATOMICITY

    out = storage.run_path(store.bucket() + "/run")
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    options = ocp.CheckpointManagerOptions(atomicity_options=BUCKET_ATOMICITY)
    with ocp.CheckpointManager(out / "checkpoints", options=options) as manager:
        manager.save(1, args=ocp.args.StandardSave(tree))
    (out / "checkpoints" / "2" / "state" / "x").write_text("a step killed mid-save")  # no commit file
    assert (out / "checkpoints" / "1" / COMMIT_FILE).exists()
    assert checkpoint_steps(out) == [1]
    with ocp.CheckpointManager(out / "checkpoints", options=options) as manager:
        assert manager.all_steps() == [1]  # what the run restores from: committed steps only
        back = manager.restore(1, args=ocp.args.StandardRestore(tree))
    assert back["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(6.0).reshape(2, 3))
    if store.scheme == "s3":  # the arrays are S3 objects, written by TensorStore's s3 driver
        import boto3

        listed = boto3.client("s3").list_objects_v2(Bucket=str(out).split("/")[2])["Contents"]
        data = [o["Key"] for o in listed if "/checkpoints/1/default/" in o["Key"] and "/d/" in o["Key"]]
        assert data, [o["Key"] for o in listed]  # OCDBT's data files


def test_unknown_scheme_and_missing_extra_are_one_line(monkeypatch):
    with pytest.raises(UserError, match=r"output_dir ftp://h/x: unknown scheme ftp://; use a local path, gs://"):
        storage.run_path("ftp://h/x")
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else find(name, *a))
    with pytest.raises(UserError, match=r"gs://b/x: gs:// needs gcsfs; pip install 'lmzoo\[gcs\]'"):
        storage.run_path("gs://b/x")


def test_probe_names_a_missing_bucket(store):
    url = f"{store.scheme}://no-such-bucket-{store.scheme}/run"
    with pytest.raises(UserError, match=rf"output_dir {url}: cannot write there \(.*\); check that the bucket exists"):
        storage.check_writable(storage.run_path(url))


def _new_clients() -> None:
    """Forget the S3 clients made so far (etils keeps one file system per scheme, s3fs one per settings), so the
    next request reads the credentials again."""
    import s3fs
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
    s3fs.S3FileSystem.clear_instance_cache()


def test_probe_names_unknown_credentials_and_an_unwritable_prefix(s3, monkeypatch):
    """With moto checking requests against its IAM: keys it does not know, a user whose policy lets it write
    under ``ok/`` only (elsewhere), and no credentials at all, each one line naming the URL and the credentials
    to set; the writable prefix passes."""
    import boto3
    import moto.settings

    bucket = s3.bucket()
    iam = boto3.client("iam", region_name="us-east-1")
    iam.create_user(UserName="writer")
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:PutObject", "s3:DeleteObject", "s3:GetObject", "s3:ListBucket"],
         "Resource": [f"arn:aws:s3:::{bucket[5:]}/ok/*", f"arn:aws:s3:::{bucket[5:]}"]}]}
    iam.put_user_policy(UserName="writer", PolicyName="ok-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="writer")["AccessKey"]
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # from now on, requests are checked
    _new_clients()
    try:
        with pytest.raises(UserError, match=rf"{bucket}/run: cannot write there .*AWS_ACCESS_KEY_ID"):
            storage.check_writable(storage.run_path(bucket + "/run"))
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        _new_clients()
        storage.check_writable(storage.run_path(bucket + "/ok/run"))
        with pytest.raises(UserError, match=rf"{bucket}/no/run: cannot write there \(PermissionError"):
            storage.check_writable(storage.run_path(bucket + "/no/run"))
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # no credentials at all
            monkeypatch.delenv(var)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        _new_clients()
        with pytest.raises(UserError, match=rf"{bucket}/ok/run: cannot write there .*AWS_ACCESS_KEY_ID"):
            storage.check_writable(storage.run_path(bucket + "/ok/run"))
    finally:
        _new_clients()


def test_fetched_copies_a_folder_and_keeps_it_up_to_date(store, tmp_path, monkeypatch):
    """A checkpoint folder on a bucket read from a local copy: fetched whole, a changed object fetched again, a
    removed one removed; a folder without its marker is one line."""
    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path))
    url = store.bucket() + "/ckpt"
    remote = storage.run_path(url)
    (remote / "model.json").write_text("{}")
    (remote / "params" / "x").write_text("1")
    (remote / "params" / "y").write_text("1")
    copy = storage.fetched(url, "model.json", "model.path")
    assert (copy / "params" / "x").read_text() == "1" and (copy / "model.json").read_text() == "{}"
    (remote / "params" / "x").write_text("2")
    (remote / "params" / "y").unlink()
    assert storage.fetched(url, "model.json", "model.path") == copy
    assert (copy / "params" / "x").read_text() == "2" and not (copy / "params" / "y").exists()
    with pytest.raises(UserError, match=r"model.path .*/nothing: no checkpoint there \(no model.json"):
        storage.fetched(store.bucket() + "/nothing", "model.json", "model.path")


def test_zoo_load_reads_a_checkpoint_from_s3(s3, setup, tmp_path, monkeypatch):
    """``zoo.load(url)``: the same parameters as the local checkpoint it was copied from."""
    import jax
    from flax import nnx

    import zoo

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path))
    url = s3.bucket() + "/models/tiny"
    storage.upload_tree(setup / "zoo", storage.run_path(url), last=("model.json",))
    here, there = zoo.load(setup / "zoo"), zoo.load(url)
    assert there.cfg == here.cfg
    leaves = jax.tree.leaves(nnx.state(here))
    assert len(leaves) > 5
    for a, b in zip(leaves, jax.tree.leaves(nnx.state(there)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dpo_reference_cache_lives_in_a_bucket_run(gcs, setup):
    """DPO's cached reference log-probabilities beside a run on a bucket: written there once, read back there."""
    from dpo.reference import CACHE_DIR, cached_reference_logps

    out = storage.run_path(gcs.bucket() + "/run")
    docs = {"d.jsonl": {0: {"tokens": np.arange(4)}, 1: {"tokens": np.arange(3)}}}
    calls = []

    def score(batch):
        calls.append(len(batch))
        return [np.full(len(d["tokens"]), 0.5 * len(d["tokens"]), np.float32) for d in batch]

    cached_reference_logps(out, docs, setup / "zoo", "float32", score)
    again = cached_reference_logps(out, docs, setup / "zoo", "float32", score)
    assert calls == [2] and len(list((out / CACHE_DIR).iterdir())) == 1
    np.testing.assert_array_equal(again["d.jsonl"][1], np.full(3, 1.5, np.float32))


def test_dpo_reference_digest_of_a_bucket_checkpoint_follows_its_arrays(gcs, setup, tmp_path, monkeypatch):
    """A reference checkpoint on a bucket is read from a local copy of its small files (its arrays where they
    are): DPO's cache key, the weights' digest, is the same while nothing changes and changes with an array."""
    from dpo.reference import checkpoint_digest
    from zoo.checkpoints.paths import checkpoint_dir

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path))
    url = gcs.bucket() + "/ref"
    storage.upload_tree(setup / "zoo", storage.run_path(url), last=("model.json",))
    first = checkpoint_digest(checkpoint_dir(url))
    assert checkpoint_digest(checkpoint_dir(url)) == first
    data = next((storage.run_path(url) / "params" / "state" / "d").iterdir())
    data.write_bytes(data.read_bytes()[::-1])
    assert not (checkpoint_dir(url) / "params").exists()
    assert checkpoint_digest(checkpoint_dir(url)) != first


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    return tiny_run_folder(tmp_path_factory, tiny_lm, "buckets")


def _args(setup, out, *more):
    return ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}",
            f"data.path={setup / 'data.jsonl'}", "data.seq_len=16", "batch_size=2", "log_every=1",
            "checkpoint.every=2", f"output_dir={out}", *more]


def test_bad_output_dirs_fail_before_the_model_loads(setup, gcs, s3, capsys):
    """Through the command: each one line and exit 2, before the model loads (model.path names nothing: it is
    never reached), and nothing written."""
    missing = setup / "no-model"
    for url, says in [("ftp://h/run", "unknown scheme ftp://"),
                      ("gs://no-such-bucket/run", "gs://no-such-bucket/run: cannot write there"),
                      ("s3://no-such-bucket/run", "s3://no-such-bucket/run: cannot write there")]:
        args = _args(setup, url, "max_steps=1")
        args[1] = f"model.path={missing}"
        assert pretrain_main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not (setup / "gs:").exists() and not (setup / "ftp:").exists()


def test_s3_kvstore_follows_the_environment_and_other_paths_stay_orbaxs(monkeypatch):
    """zoo/orbax_s3.py: an s3:// URL becomes TensorStore's s3 spec with the endpoint and region boto3 would use;
    gs:// and local paths get exactly what Orbax builds for them."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

    from zoo.checkpoints.format import kvstore_base
    from zoo.orbax_s3 import install, s3_kvstore

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:10")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    install()
    assert s3_kvstore("s3://bk/runs/one/") == {"driver": "s3", "bucket": "bk", "path": "runs/one/",
                                                "endpoint": "http://127.0.0.1:10", "aws_region": "eu-west-3"}
    assert kvstore_base(storage.run_path("s3://bk/runs"))["path"] == "runs/"  # what verify and the writer open
    spec = tsu.build_kvstore_tspec("s3://bk/runs//one/", "w", use_ocdbt=False)
    assert spec == {"driver": "s3", "bucket": "bk", "path": "runs/one/w", "endpoint": "http://127.0.0.1:10",
                    "aws_region": "eu-west-3"}
    assert tsu.build_kvstore_tspec("gs://bk/runs/", "w", use_ocdbt=False) == \
        {"driver": "gcs", "bucket": "bk", "path": "runs/w"}
    assert tsu.build_kvstore_tspec("/tmp/runs", "w", use_ocdbt=False) == {"driver": "file", "path": "/tmp/runs/w"}
