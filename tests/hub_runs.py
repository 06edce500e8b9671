"""`zoo` against the Hugging Face Hub: exports pushed to a fake Hub with a token that must not leak, and
offline runs against a laid-out Hub cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

TOKEN = "hf_fake_secret_token_123"


def zoo_export(tmp_path: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """Run `zoo export ARGS` in a fresh interpreter pointed at ``endpoint``; TMPDIR is tmp_path/'tmp'."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_")) and k != "TRANSFORMERS_OFFLINE"}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update(
        HF_ENDPOINT=endpoint, HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf_home"), JAX_PLATFORMS="cpu",
        TMPDIR=str(tmp_path / "tmp"), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
    )
    return subprocess.run(
        [sys.executable, "-m", "zoo.cli", "export", *args], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )


def zoo_export_here(tmp_path: Path, endpoint: str, monkeypatch, capfd, *args: str) -> subprocess.CompletedProcess:
    """`zoo export ARGS` in this process, as :func:`zoo_export` runs it in a fresh interpreter (no start-up, no
    imports, no compilations of its own): huggingface_hub's settings that it reads from the environment when
    imported (HF_ENDPOINT, HF_HUB_OFFLINE, HF_HUB_DISABLE_XET) set on it, the token in HF_TOKEN and no other HF_*
    variable, TMPDIR tmp_path/'tmp', the working directory tmp_path; ``monkeypatch`` undoes it all after the test.
    Returns the command's exit code and what it wrote to stdout and stderr (``capfd``) as a CompletedProcess."""
    import tempfile

    from huggingface_hub import constants

    from zoo.cli import main

    (tmp_path / "tmp").mkdir(exist_ok=True)
    for key in list(os.environ):
        if key.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_")) or key == "TRANSFORMERS_OFFLINE":
            monkeypatch.delenv(key)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code = main(["export", *args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["zoo", "export", *args], code, out, err)


def assert_token_not_leaked(proc: subprocess.CompletedProcess) -> None:
    """The Hub token appears in neither of the command's outputs."""
    assert TOKEN not in proc.stdout
    assert TOKEN not in proc.stderr


def lay_out_hf_cache(cache: Path, repo_id: str, files_dir: Path, revision: str = "0" * 40) -> None:
    """Write the layout huggingface_hub's cache uses: blobs by hash, snapshot symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in files_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def zoo_offline(args, cache: Path):
    """Run `zoo ARGS` in a fresh interpreter, offline, with ``cache`` as its Hugging Face Hub cache."""
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("HF_HOME", None)
    return subprocess.run([sys.executable, "-m", "zoo.cli", *args], capture_output=True, text=True, env=env, timeout=300)
