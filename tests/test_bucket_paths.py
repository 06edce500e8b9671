"""Every path of a run as a URL, against real servers on loopback (tests/object_stores.py: the GCS emulator and
moto's S3): data files, eval files, mixture sources and the tokenizer read from buckets; ``zoo convert --out``
and ``zoo export --out`` written to buckets; ``zoo export`` and ``zoo generate`` reading a checkpoint by its URL.

The chain test runs the same pipeline twice, once on local paths and once on buckets, and asks for the same
numbers: what the bucket paths read and write is what the local ones do.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from pretrain.cli import main as pretrain_main
from tests.tiny_lm import copy_tiny_lm
from zoo import storage
from zoo.cli import main as zoo_main


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    """The tiny model (tok, hf, zoo) and three small data files: two mixture sources and an eval set."""
    root = tmp_path_factory.mktemp("bucket_paths")
    copy_tiny_lm(tiny_lm, root)
    rng = np.random.RandomState(0)
    words = "the a cat dog sat ran on under mat log".split()
    for name, n in (("colours.jsonl", 40), ("shapes.jsonl", 40), ("held.jsonl", 8)):
        with open(root / name, "w") as f:
            for _ in range(n):
                f.write(json.dumps({"text": " ".join(rng.choice(words, rng.randint(5, 20)))}) + "\n")
    return root


# `zoo ARGS` that SIGKILLs itself once the converter has written its second whole parameter (the tiny model has
# three, then its stacked layers): a kill -9 in the middle of the checkpoint's writing, exactly there.
_KILL_AFTER_TWO_ARRAYS = r"""
import os, signal, sys
from zoo.checkpoints.writer import CheckpointWriter
real, done = CheckpointWriter.add, []

def add(self, *a, **k):
    real(self, *a, **k)
    done.append(a[0])
    if len(done) == 2:
        os.kill(os.getpid(), signal.SIGKILL)

CheckpointWriter.add = add
from zoo.cli import main
sys.exit(main(sys.argv[1:]))
"""


# Writes one 128 MiB parameter into the checkpoint ARGV[1] and prints the process's peak memory above what it held
# with the parameter made (MiB).
_PEAK_OF_A_WRITE = r"""
import resource, sys, numpy as np
from zoo.checkpoints.writer import CheckpointWriter, checkpoint_output
a = np.random.default_rng(0).standard_normal(32 << 20, dtype=np.float32).reshape(4096, -1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with checkpoint_output(sys.argv[1]) as folder:
    CheckpointWriter(folder, {"w": (a.shape, a.dtype)}).add("w", a)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def _objects(url: str) -> dict[str, bytes]:
    """The objects under ``url`` (``gs://bucket/prefix``) as the emulator's own client lists and reads them:
    name relative to the prefix -> content."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs_client

    bucket, _, prefix = url.removeprefix("gs://").partition("/")
    client = gcs_client.Client(project="test", credentials=AnonymousCredentials())
    return {b.name[len(prefix) + 1:]: b.download_as_bytes() for b in client.list_blobs(bucket, prefix=prefix + "/")}


def _same_model(a, b) -> None:
    import jax
    from flax import nnx

    assert a.cfg == b.cfg
    leaves = jax.tree.leaves(nnx.state(a))
    assert len(leaves) > 5
    for x, y in zip(leaves, jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_writing_into_a_bucket_stages_no_copy_of_the_array(gcs):
    """A parameter written into a bucket goes from the caller's buffer (as Orbax writes it): the writer's peak
    memory grows by under half the array (measured: by nothing for this 128 MiB one, 0.93x when TensorStore
    staged a copy; a 256 MiB one grows it by 0.38x, as much as Orbax's own save of it to the bucket)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _PEAK_OF_A_WRITE, gcs.bucket() + "/w"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) < 64, run.stdout


@pytest.mark.slow
def test_convert_killed_mid_write_leaves_no_checkpoint_and_a_rerun_writes_one(setup, gcs, tmp_path, monkeypatch,
                                                                             capsys):
    """A convert to a bucket killed with SIGKILL in the middle of its arrays: what it left (some arrays, no
    model.json) is no checkpoint to any reader; a convert that then fails is one line and leaves the prefix empty;
    the same command run again writes the whole checkpoint, and once more is refused, the checkpoint kept.

    ``zoo convert --out gs://`` (the rerun): the arrays go from memory into the bucket through Orbax and TensorStore
    (no local folder of the checkpoint: the temporary folders it used held a few small files, no params/); the
    bucket holds Orbax's checkpoint (its tree metadata, OCDBT manifest and commit file, read with the emulator's
    client) and model.json, nothing of the writer's; ``zoo.load(url)`` reads the arrays there, the same bits as the
    local conversion, and ``zoo info`` the same chunk table, with no params/ copied into lmzoo's cache. ``zoo init
    --out`` writes a bucket the same way."""
    import subprocess
    import sys
    import tempfile

    import zoo
    from zoo.checkpoints.format import read_meta
    from zoo.checkpoints.verify import verify_complete
    from zoo.errors import UserError

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "cache"))
    url = gcs.bucket() + "/zoo"
    command = ["convert", str(setup / "hf"), "--out", url]
    killed = subprocess.run([sys.executable, "-c", _KILL_AFTER_TWO_ARRAYS, *command], capture_output=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    left = _objects(url)
    assert any(k.startswith("params/state/d/") for k in left) and "model.json" not in left, sorted(left)
    for read in (zoo.load, read_meta, storage.fetched):
        with pytest.raises(UserError, match="no checkpoint there|not a zoo checkpoint"):
            read(url) if read is not storage.fetched else read(url, "model.json", "model.path")
    with pytest.raises(RuntimeError, match="unreadable model.json"):
        verify_complete(url)

    from zoo.checkpoints.writer import CheckpointWriter

    real = CheckpointWriter.add

    def failing(self, path, *a, **k):
        if path == "final_norm":
            raise UserError("disk full (simulated)")
        return real(self, path, *a, **k)

    with monkeypatch.context() as m:  # a writer that fails: one line, and it leaves nothing, nor what the killed one left
        m.setattr(CheckpointWriter, "add", failing)
        assert zoo_main(command) == 2
    assert _said(capsys) == ["error: disk full (simulated)"] and _objects(url) == {}
    used: list[dict[str, int]] = []

    class Recorded(tempfile.TemporaryDirectory):  # each temporary folder's files, as they were before removal
        def cleanup(self):
            used.append({str(p.relative_to(self.name)): p.stat().st_size for p in Path(self.name).rglob("*")
                         if p.is_file()})
            super().cleanup()

    with monkeypatch.context() as m:
        m.setattr(tempfile, "TemporaryDirectory", Recorded)
        assert zoo_main(command) == 0
    objects = _objects(url)
    arrays = sum(len(v) for k, v in objects.items() if k.startswith("params/"))
    assert arrays > 100_000  # the tiny model's weights
    assert not any("params/" in f for files in used for f in files), used
    assert sum(sum(files.values()) for files in used) < arrays / 10, used
    assert {"model.json", "params/commit_success.txt", "params/state/manifest.ocdbt"} <= set(objects)
    assert not any(".lmzoo-incomplete" in k or "partial_save" in k for k in objects), sorted(objects)
    here = json.loads((setup / "zoo" / "model.json").read_text())
    assert json.loads(objects["model.json"])["params"] == here["params"]
    tree = json.loads(objects["params/state/_METADATA"])["tree_metadata"]
    assert sorted(tree) == sorted(str(tuple(p.split("."))) for p in here["params"])
    verify_complete(url)

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "reader"))  # a cache the killed convert's readers never saw
    _same_model(zoo.load(url), zoo.load(setup / "zoo"))
    capsys.readouterr()
    tables = []
    for ckpt in (url, str(setup / "zoo")):  # `zoo info`: the chunk table read from the arrays where they are
        assert zoo_main(["info", ckpt]) == 0
        said = capsys.readouterr().out
        assert " 0 files" not in said
        tables.append(said.split("\n\n", 1)[1])
    assert tables[0] == tables[1] and "?" not in tables[0]
    cached = [p.relative_to(tmp_path / "reader") for p in (tmp_path / "reader").rglob("*")]
    assert any(p.name == "model.json" for p in cached) and not any("params" in p.parts for p in cached), cached

    config = str(setup / "hf" / "config.json")  # `zoo init --out URL` writes the same way
    assert zoo_main(["init", config, "--out", url + "-init"]) == 0
    assert zoo_main(["init", config, "--out", str(tmp_path / "init")]) == 0
    assert ".lmzoo-incomplete" not in _objects(url + "-init")
    _same_model(zoo.load(url + "-init"), zoo.load(tmp_path / "init"))
    capsys.readouterr()
    assert zoo_main(command) == 2  # a whole checkpoint there: refused, kept
    assert _said(capsys) == [f"error: --out {url} exists and is not empty; choose a new prefix or remove it"]
    assert "model.json" in _objects(url)


def _train(model: str, tok: str, colours: str, shapes: str, held: str, out: str) -> list[str]:
    return ["train", f"model.path={model}", f"model.tokenizer={tok}",
            f"data.path=[{{path: {colours}, weight: 0.7}}, {{path: {shapes}, weight: 0.3}}]", f"data.eval_path={held}",
            "data.seq_len=16", "batch_size=2", "log_every=1", "eval_every=2", "max_steps=2", f"output_dir={out}"]


def _said(capsys) -> list[str]:
    """The command's stderr lines, without the emulator's: its server thread, in this process, prints a
    traceback between two dashed lines when a client closes a connection before reading the whole answer."""
    lines, inside = [], False
    for line in capsys.readouterr().err.strip().splitlines():
        if line == "-" * 40:
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def _card(folder) -> list[str]:
    """The export's model card, less the data table's paths and row counts (a bucket's files are not counted)."""
    return [line for line in (folder / "README.md").read_text().splitlines()
            if line and ".jsonl`" not in line and not line.startswith("Rows `?`")]


def _logits(folder) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.arange(1, 13).reshape(2, 6)).logits.numpy()


@pytest.mark.slow
def test_convert_train_export_through_buckets(setup, gcs, s3, tmp_path, monkeypatch, capsys):
    """convert --out s3:// (test_convert_killed_... converts to gs://); train from it into an s3:// output_dir
    with the tokenizer, both mixture sources and the eval set on buckets (gs:// and s3://); export the run's final
    checkpoint by its URL to gs://; transformers loads the export with
    the same logits as the local pipeline's export, the run logged the same losses and eval losses, and
    ``zoo generate`` and ``zoo eval`` on the checkpoint URL, their --out on a bucket, say what they say on the
    local one."""
    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "cache"))
    s, g = s3.bucket(), gcs.bucket()  # s: the model and the run, g: the export
    assert zoo_main(["convert", str(setup / "hf"), "--out", f"{s}/zoo"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {s}/zoo"
    from pretrain.setup import model_config_of
    from zoo.checkpoints.format import read_config

    assert model_config_of(f"{s}/zoo", "model.path") == read_config(setup / "zoo")  # as --compile-only reads it
    storage.upload_tree(setup / "tok", storage.run_path(f"{g}/tok"))
    for name, there in (("colours.jsonl", s), ("shapes.jsonl", g), ("held.jsonl", s)):
        storage.run_path(f"{there}/data/{name}").write_bytes((setup / name).read_bytes())
    local = tmp_path / "local"
    assert pretrain_main(_train(str(setup / "zoo"), str(setup / "tok"), str(setup / "colours.jsonl"),
                                str(setup / "shapes.jsonl"), str(setup / "held.jsonl"), str(local))) == 0
    on_buckets = _train(f"{s}/zoo", f"{g}/tok", f"{s}/data/colours.jsonl", f"{g}/data/shapes.jsonl",
                        f"{s}/data/held.jsonl", f"{s}/run")
    assert pretrain_main(on_buckets) == 0
    here = (local / "metrics.jsonl").read_text().splitlines()
    there = storage.run_path(f"{s}/run/metrics.jsonl").read_text().splitlines()
    drop = ("time", "seconds", "tokens_per_s", "step_s")
    for a, b in zip(here, there, strict=True):
        ra, rb = json.loads(a), json.loads(b)
        assert {k: v for k, v in ra.items() if not any(d in k for d in drop)} == \
            {k: v for k, v in rb.items() if not any(d in k for d in drop)}
    assert any("eval" in k for line in here for k in json.loads(line))
    from pretrain.config import load_config
    from pretrain.setup import tokenizer_folder

    tok = tokenizer_folder(load_config(None, [*on_buckets[1:], f"model.tokenizer={s}/run/final"]))
    assert sorted(p.name for p in tok.iterdir()) == sorted(p.name for p in (local / "final" / "tokenizer").iterdir())
    assert not (tok.parent / "params").exists()  # a checkpoint as model.tokenizer: its tokenizer/ only is fetched

    assert zoo_main(["export", str(local / "final"), "--out", str(tmp_path / "export")]) == 0
    assert zoo_main(["export", f"{s}/run/final", "--out", f"{g}/export"]) == 0
    fetched = storage.local_copy(f"{g}/export", "export")
    assert sorted(p.name for p in fetched.iterdir() if not p.name.startswith(".")) == \
        sorted(p.name for p in (tmp_path / "export").iterdir())
    np.testing.assert_array_equal(_logits(fetched), _logits(tmp_path / "export"))
    card = _card(fetched)  # the run's records came with its final/: config, metrics
    assert any(f"from `{s}/zoo`" in line for line in card), card  # the starting checkpoint by URL, not a cache path
    assert [line.replace(f"`{s}/zoo`", "`zoo`") for line in card] == _card(tmp_path / "export")

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "the cat"}\n{"prompt": "a dog"}\n')
    args = ["--prompts-file", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "4", "--temperature", "0"]
    assert zoo_main(["generate", str(local / "final"), *args, "--out", str(tmp_path / "said.jsonl")]) == 0
    assert zoo_main(["generate", f"{s}/run/final", *args, "--out", f"{g}/said.jsonl"]) == 0
    said = (tmp_path / "said.jsonl").read_text()
    assert storage.run_path(f"{g}/said.jsonl").read_text() == said and said.count("completion") == 2
    reports = []
    for ckpt, out in ((str(local / "final"), str(tmp_path / "here.json")), (f"{s}/run/final", f"{g}/there.json")):
        assert zoo_main(["eval", ckpt, "--tasks", "prose", "--limit", "2", "--out", out]) == 0
        reports.append(json.loads(storage.run_path(out).read_text()))
    assert reports[1]["checkpoint"] == f"{s}/run/final"  # as given, not its copy in the cache
    for here_, there_ in zip(*(r["tasks"].values() for r in reports), strict=True):
        assert {k: v for k, v in there_.items() if k != "seconds"} == {k: v for k, v in here_.items() if k != "seconds"}


def test_bucket_inputs_and_outputs_that_cannot_work_are_one_line(setup, gcs, s3, tmp_path, monkeypatch, capsys):
    """Before the model loads (model.path names nothing: it is never reached), each one line and exit 2: a data
    file that is not in its bucket, a tokenizer folder that is not, an s3:// data file without s3fs installed;
    ``zoo export --out`` to a bucket that does not exist or to a prefix that holds objects, nothing written;
    ``zoo quantize --out`` to a bucket; a GRPO reward model (``rm:URL``) that is not there."""
    import importlib.util

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path / "cache"))
    g = gcs.bucket()
    storage.run_path(f"{g}/data/colours.jsonl").write_bytes((setup / "colours.jsonl").read_bytes())
    plain = ["train", f"model.path={setup / 'no-model'}", f"model.tokenizer={setup / 'tok'}",
             f"data.path={g}/data/colours.jsonl", "data.seq_len=16", "batch_size=2", "max_steps=1",
             f"output_dir={tmp_path / 'run'}"]
    find = importlib.util.find_spec
    for change, says in [({3: f"data.path={g}/data/nothing.jsonl"},
                          f"data.path {g}/data/nothing.jsonl: no such file or folder"),
                         ({2: f"model.tokenizer={g}/no-tok"}, f"model.tokenizer {g}/no-tok: no such file or folder"),
                         ({3: "data.path=s3://b/x.jsonl"}, "data.path s3://b/x.jsonl: s3:// needs s3fs; "
                                                           "pip install 'lmzoo[s3]'")]:
        args = [change.get(i, a) for i, a in enumerate(plain)]
        with monkeypatch.context() as m:
            m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "s3fs" else find(name, *a))
            assert pretrain_main(args) == 2
        err = _said(capsys)
        assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "run").exists()
    from grpo.reward_model import reward_model
    from zoo.errors import UserError

    with pytest.raises(UserError, match=rf"'rm:{g}/rm' {g}/rm: no checkpoint there"):  # the URL reaches the reader
        reward_model(f"rm:{g}/rm")

    taken = s3.bucket() + "/export"
    storage.run_path(f"{taken}/config.json").write_text("{}")
    for out, says in [("s3://no-such-bucket/export", "--out s3://no-such-bucket/export: cannot write there"),
                      (taken, f"--out {taken} exists and is not empty; choose a new prefix or add --overwrite")]:
        assert zoo_main(["export", str(setup / "zoo"), "--out", out]) == 2
        err = _said(capsys)
        assert len(err) == 1 and says in err[0], err
    assert [p.name for p in storage.run_path(taken).iterdir()] == ["config.json"]
    assert zoo_main(["quantize", str(setup / "zoo"), "--out", f"{taken}-q"]) == 2  # a local folder only
    err = _said(capsys)
    assert len(err) == 1 and f"--out {taken}-q: zoo quantize writes a local folder only" in err[0], err
    assert zoo_main(["eval", str(setup / "zoo"), "--tasks", "prose", "--out", "gs://no-such-bucket/r.json"]) == 2
    err = _said(capsys)
    says = "--out gs://no-such-bucket/r.json: its prefix gs://no-such-bucket: cannot write there"
    assert len(err) == 1 and says in err[0], err


def test_data_errors_name_the_objects_not_their_copy(gcs, tmp_path, monkeypatch):
    """A bad row or an unreadable file of a data folder or file on a bucket is named by its object's URL (the
    file read is its copy in lmzoo's cache)."""
    import re

    from zoo.data.files import load_dataset_rows
    from zoo.data.row_origin import row_where
    from zoo.errors import UserError

    monkeypatch.setenv("LMZOO_CACHE", str(tmp_path))
    g = gcs.bucket()
    storage.run_path(f"{g}/data/a.jsonl").write_text('{"text": "x"}\n\n{"text": "y"}\n')
    storage.run_path(f"{g}/bad.jsonl").write_bytes(b'{"text": "x"}\n{"text": "\xff"}\n')
    load_dataset_rows(f"{g}/data")
    assert row_where(f"{g}/data", 1) == f"{g}/data/a.jsonl, line 3"
    with pytest.raises(UserError, match=rf"^{re.escape(g)}/bad.jsonl, line 2: not valid UTF-8"):
        load_dataset_rows(f"{g}/bad.jsonl")
