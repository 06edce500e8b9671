"""Hosts that share nothing but a bucket (issue 61 item 3): every process has its own local scratch (HOME, TMPDIR,
LMZOO_CACHE, working directory); the run's checkpoints and final model go straight into the bucket through Orbax,
process 0 alone writes the logs and metadata; a checkpoint on a bucket is fetched by each process into its own
cache. Against the GCS emulator on loopback (tests/object_stores.py).
"""

import contextlib
import json
import shutil

import numpy as np
import pytest

from pretrain.config import load_config
from pretrain.loop import train
from pretrain.runfolder import checkpoint_steps
from tests.processes import ForkServer, devices_env, free_port, kill_after_checkpoint, main_script
from tests.run_files import TEN_WORDS, read_metrics
from tests.tiny_lm import tiny_run_folder
from zoo import storage
from zoo.checkpoints.format import MODEL_FILE

# The 2-process runs of tests/test_train.py: plain SGD, batch 8 (2 processes x 2 devices, 2 micro-batches). 3 steps:
# killed once step 2's checkpoint is committed, the rerun's step 3 resumes from it.
SGD = ("data.seq_len=32", "batch_size=8", "optimizer.name=sgd", "optimizer.learning_rate=0.5",
       "schedule.name=constant", "log_every=1", "checkpoint.every=2", "max_steps=3")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    return tiny_run_folder(tmp_path_factory, tiny_lm, "hosts", words=(*TEN_WORDS, "red", "blue"), rows=200)


def test_verify_reads_a_checkpoint_on_a_bucket(gcs, setup):
    """The completeness check every writer runs, on a checkpoint in a bucket (TensorStore reads its arrays'
    metadata and chunks there): a whole one passes, one whose manifest disagrees with a stored array fails naming
    the parameter."""
    from zoo.checkpoints.verify import verify_complete

    url = gcs.bucket() + "/ckpt"
    remote = storage.run_path(url)
    storage.upload_tree(setup / "zoo", remote, last=(MODEL_FILE,))
    verify_complete(url)
    meta = json.loads((remote / MODEL_FILE).read_text())
    name = sorted(meta["params"])[0]
    meta["params"][name]["dtype"] = "float16" if meta["params"][name]["dtype"] != "float16" else "float32"
    (remote / MODEL_FILE).write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match=rf"parameter '{name}' is stored as"):
        verify_complete(url)


def test_fetched_never_leaves_a_half_downloaded_file(gcs, tmp_path, monkeypatch):
    """A download cut off midway leaves nothing at its name (processes sharing a cache never read half a file);
    the next fetch brings the whole file."""
    import fsspec

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path))
    url = gcs.bucket() + "/ckpt"
    remote = storage.run_path(url)
    (remote / "params" / "x").write_bytes(b"0123456789")
    (remote / MODEL_FILE).write_text("{}")
    fs, _ = fsspec.core.url_to_fs(url)
    whole = fs.get_file

    def cut_off(rpath, lpath, **kw):
        with open(lpath, "wb") as f:
            f.write(b"01234")
        raise ConnectionError("cut off")

    monkeypatch.setattr(fs, "get_file", cut_off)
    with pytest.raises(ConnectionError):
        storage.fetched(url, MODEL_FILE, "model.path")
    copy = tmp_path / "objects" / "gs" / url.removeprefix("gs://")
    assert [p.name for p in copy.rglob("*") if p.is_file()] == []
    monkeypatch.setattr(fs, "get_file", whole)
    assert (storage.fetched(url, MODEL_FILE, "model.path") / "params" / "x").read_bytes() == b"0123456789"


def test_final_on_a_bucket_goes_straight_there(gcs, setup, tmp_path, monkeypatch):
    """The final model on a bucket is written there by Orbax (no copy of it on the local disk first, which on
    several hosts would hold one host's shards only): no temporary folder is made; the checkpoint loads
    with the same parameters and names its bucket starting checkpoint by URL."""
    import jax

    import zoo
    from pretrain.final import write_final
    from zoo.model.config import ModelConfig

    def no_local_copy(*args, **kwargs):
        raise AssertionError("a temporary folder on the local disk")

    monkeypatch.setattr("tempfile.mkdtemp", no_local_copy)
    params = zoo.load_params(setup / "zoo")
    mcfg = ModelConfig.from_dict(json.loads((setup / "zoo" / MODEL_FILE).read_text())["config"])
    bucket = gcs.bucket()
    cfg = load_config(None, [f"model.path={bucket}/base", f"data.path={setup / 'data.jsonl'}",
                             f"output_dir={bucket}/run", "max_steps=3"])
    out = storage.run_path(cfg.output_dir)
    final = write_final(out, cfg, mcfg, params, setup / "zoo", setup / "tok", {"step": 3, "loss": 1.0}, {})
    meta = json.loads((final / MODEL_FILE).read_text())
    assert meta["source"] == f"{bucket}/base" and meta["training"]["steps"] == 3
    assert (final / "tokenizer" / "tokenizer.json").is_file()
    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "cache"))
    back = zoo.load_params(storage.fetched(final, MODEL_FILE, "final"))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_an_adapter_run_names_its_bucket_base_by_url(gcs, setup, tmp_path, monkeypatch):
    """A LoRA run whose base (model.path) is on a bucket records the base by its URL, not by this host's cached
    copy of it: another host (another cache, the first one gone) loads the adapter checkpoint merged onto it,
    equal to the base merged with the adapters here.
    Slow (slow lane; 4-5 s on the 2-core machine): the base's 92 files uploaded to the emulator, the adapters
    made and merged (eager JAX), two checkpoints loaded."""
    import jax
    import jax.numpy as jnp

    import zoo
    from pretrain.final import write_final
    from zoo.lora.params import LoraConfig, init_lora, merge_lora
    from zoo.model.config import ModelConfig

    bucket = gcs.bucket()
    storage.upload_tree(setup / "zoo", storage.run_path(bucket + "/base"), last=(MODEL_FILE,))
    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "host0"))
    src = storage.fetched(f"{bucket}/base", MODEL_FILE, "model.path")  # as the run reads its base
    mcfg = ModelConfig.from_dict(json.loads((setup / "zoo" / MODEL_FILE).read_text())["config"])
    lora_cfg = LoraConfig(rank=2, alpha=4)
    adapters = jax.tree.map(lambda x: x + 0.01, init_lora(mcfg, lora_cfg, jax.random.key(0)))  # B != 0
    cfg = load_config(None, [f"model.path={bucket}/base", f"data.path={setup / 'data.jsonl'}",
                             f"output_dir={tmp_path / 'run'}", "lora.rank=2", "lora.alpha=4", "max_steps=1"])
    (tmp_path / "run").mkdir()
    final = write_final(storage.run_path(cfg.output_dir), cfg, mcfg, adapters, src, setup / "tok", {"step": 1}, {},
                        lora=lora_cfg)
    assert json.loads((final / MODEL_FILE).read_text())["lora"]["base"] == f"{bucket}/base"
    shutil.rmtree(tmp_path / "host0")
    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "host1"))
    want = merge_lora(mcfg, zoo.load_params(setup / "zoo"), adapters, lora_cfg)
    got = zoo.load_params(final)
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(jnp.asarray(x), np.float32), atol=1e-6)


def _launch(servers, outputs, args, script):
    """``script`` (``python -c``) with ARGS as 2 processes x 2 CPU devices, each a child of its host's fork server
    (tests/processes.py ForkServer: its own scratch folder as HOME, TMPDIR, LMZOO_CACHE and working directory: a
    host of its own), its stdout and stderr to ``outputs``-N.out and .err. Returns [(returncode, stdout, stderr)]
    by process."""
    port = free_port()
    files = [(outputs.with_name(f"{outputs.name}-{i}.out"), outputs.with_name(f"{outputs.name}-{i}.err"))
             for i in range(2)]
    for i, server in enumerate(servers):
        server.start({"script": script, "out": str(files[i][0]), "err": str(files[i][1]),
                      "argv": [*args, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id",
                               str(i)]})
    codes = [server.wait() for server in servers]
    return [(code, out.read_text(), err.read_text()) for code, (out, err) in zip(codes, files, strict=True)]


def _python_error(err: str) -> str:
    """A process's stderr as a failure shows it: from its first Python traceback (JAX's abort trace of the
    coordinator's loss, which follows it, is long and says less), at most 4000 characters."""
    start = err.find("Traceback (most recent call last)")
    return err[start:][:4000] if start >= 0 else err[-2000:]


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_two_hosts_sharing_only_a_bucket(gcs, setup, tmp_path, monkeypatch):
    """2 processes x 2 CPU devices, each with its own scratch and its own copy of the tokenizer and data, the
    starting checkpoint and output_dir on the bucket: killed with SIGKILL once the step-2 checkpoint is committed,
    then rerun, the run resumes from the bucket and follows the 1-process trajectory (1e-5) to the same final
    parameters. Process 0 alone writes the logs and metadata; each process's scratch holds only its inputs and
    its own fetched copy of the starting checkpoint.
    Slow (slow lane): a 1-process run in this process, and two launches of 2 `pretrain train` processes (each
    host's two forked from one interpreter that imports once)."""
    import jax

    import zoo

    bucket = gcs.bucket()
    storage.upload_tree(setup / "zoo", storage.run_path(bucket + "/base"), last=(MODEL_FILE,))
    one = tmp_path / "one"
    ref = train(load_config(None, [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}",
                                   f"data.path={setup / 'data.jsonl'}", f"output_dir={one}", *SGD]), progress=False)

    scratch = [tmp_path / f"host{i}" for i in range(2)]
    for home in scratch:
        for d in ("home", "tmp", "cache"):
            (home / d).mkdir(parents=True)
        shutil.copytree(setup / "tok", home / "work" / "tok")
        shutil.copy(setup / "data.jsonl", home / "work" / "data.jsonl")
    url = f"{bucket}/runs/two"
    args = ["train", f"model.path={bucket}/base", "model.tokenizer=tok", "data.path=data.jsonl", f"output_dir={url}",
            "grad_accum=2", *SGD]
    with contextlib.ExitStack() as stack:  # a fork server a host: each imports once for both launches
        servers = [stack.enter_context(ForkServer(cwd=home / "work", env={
            **devices_env(2), "HOME": str(home / "home"), "TMPDIR": str(home / "tmp"),
            "LMZOO_CACHE": str(home / "cache")})) for home in scratch]
        killed = _launch(servers, tmp_path / "killed", ["2", *args], kill_after_checkpoint("pretrain.cli"))
        # Each kills itself once step 2 is committed (a commit every process waits for). Process 1 may still be in
        # Orbax's last barrier when process 0, JAX's coordinator, is gone: JAX then aborts it (SIGABRT) first.
        rcs = [rc for rc, _, _ in killed]
        assert rcs[0] == -9 and rcs[1] in (-9, -6), (rcs, [_python_error(err) for _, _, err in killed])
        out = storage.run_path(url)
        assert checkpoint_steps(out)[-1] == 2 and not (out / "final" / MODEL_FILE).exists()

        results = _launch(servers, tmp_path / "resumed", args, main_script("pretrain.cli"))
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    (_, out0, _), (_, out1, _) = results
    assert "Resuming from step 2" in out0 and "final model:" in out0
    assert "Resuming" not in out1 and "final model:" not in out1  # process 0 reports
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # every step logged once, by one process
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in read_metrics(one)], rtol=1e-5)
    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "reader"))
    final = zoo.load_params(storage.fetched(f"{url}/final", MODEL_FILE, "final"))
    for x, y in zip(jax.tree.leaves(zoo.load_params(ref)), jax.tree.leaves(final), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)

    # The bucket: what one process writes, once; both processes' data positions in each checkpoint.
    meta = json.loads((out / "final" / MODEL_FILE).read_text())
    assert (meta["training"]["processes"], meta["training"]["devices"], meta["source"]) == (2, 4, f"{bucket}/base")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml", "final", "metrics.jsonl",
                                                     "tensorboard"]
    assert sorted(p.name for p in (out / "final").iterdir()) == sorted(p.name for p in ref.iterdir())
    events = list((out / "tensorboard").iterdir())  # redrawn whole by the resumed process 0
    assert len(events) == 1 and b"train/loss" in events[0].read_bytes()
    saved = out / "checkpoints" / "3" / "data"
    assert sorted(p.name for p in saved.glob("process_*")) == ["process_0-of-2.json", "process_1-of-2.json"]
    # Each host's scratch: its inputs, the datasets library's cache of reading them, and its own copy of the
    # starting checkpoint's small files (its arrays are read in the bucket); nothing of the run.
    base = f"cache/objects/gs/{bucket.removeprefix('gs://')}/base/"
    inputs = ("work/tok/", "work/data.jsonl", "home/.cache/huggingface/datasets/", base,
              base.replace("/base/", "/.base.lmzoo-fetched.json"),  # what the copy was fetched from, beside it
              base.replace("/base/", "/.base.lmzoo-origin"))  # and the URL it was fetched from
    for home in scratch:
        left = [f for f in _files(home) if not f.startswith(inputs)]
        assert left == [], left
        assert (home / base / MODEL_FILE).is_file() and not (home / base / "params").exists()
