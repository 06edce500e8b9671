"""`zoo export --push-to-hub` against a local fake Hub (tests/fake_hub.py).

huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE when it is imported: the
first push runs `zoo` in a subprocess with its own environment (the fake Hub's
URL, a fake token, no saved login: HF_HOME in tmp, online), as a user runs it;
the others run it in this process with those settings set on huggingface_hub
(tests/hub_runs.py: zoo_export_here), which spares each a fresh interpreter's
start-up, imports and compilations.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.fake_hub import FakeHub
from tests.hub_runs import TOKEN, assert_token_not_leaked, zoo_export, zoo_export_here
from tests.processes import free_port

COMMIT_MESSAGE = "Upload model exported with lmzoo"
CORE_FILES = {"config.json", "model.safetensors", "generation_config.json", "README.md"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny HF folder, its zoo checkpoint), made once for the module."""
    from tests.hf_models import make_llama
    from zoo.cli import main

    root = tmp_path_factory.mktemp("hub_push")
    make_llama(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root / "hf", root / "ckpt"


@pytest.fixture
def ckpt(models) -> Path:
    return models[1]


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_push_with_out_and_private(tmp_path, ckpt):
    out = tmp_path / "out"
    with FakeHub(token=TOKEN) as hub:
        proc = zoo_export(tmp_path, hub.url, str(ckpt), "--out", str(out), "--push-to-hub", "me/tiny-private", "--private")
    assert proc.returncode == 0, proc.stderr
    assert_token_not_leaked(proc)
    assert f"pushed: {hub.url}/me/tiny-private/commit/" in proc.stdout

    assert hub.unexpected == []
    assert hub.routes[0] == "create_repo" and hub.routes[-1] == "commit"
    assert "create_branch" not in hub.routes
    (create,) = hub.calls("create_repo")
    assert create.json()["organization"] == "me" and create.json()["name"] == "tiny-private"
    assert create.json()["visibility"] == "private"
    assert hub.repos["me/tiny-private"].private is True
    for req in hub.requests:
        assert req.headers.get("authorization") == f"Bearer {TOKEN}", (req.method, req.path)

    (commit,) = hub.commits
    assert (commit.repo_id, commit.branch, commit.message) == ("me/tiny-private", "main", COMMIT_MESSAGE)
    exported = folder_files(out)
    assert CORE_FILES <= set(exported)
    assert sorted(commit.files) == sorted(exported)
    for name, data in exported.items():
        assert commit.files[name] == data, name
        assert TOKEN.encode() not in data, name


@pytest.mark.slow
def test_push_without_out_to_branch(tmp_path, models, monkeypatch, capfd):
    from safetensors.numpy import load, load_file

    hf, ckpt = models
    # Like the real Hub, which stores *.safetensors with LFS: big files take the LFS batch path.
    with FakeHub(token=TOKEN, lfs_min_size=100_000) as hub:
        proc = zoo_export_here(tmp_path, hub.url, monkeypatch, capfd, str(ckpt), "--push-to-hub", "me/tiny-branch",
                               "--revision", "mybranch")
    assert proc.returncode == 0, proc.stderr
    assert_token_not_leaked(proc)
    assert f"{hub.url}/me/tiny-branch/commit/" in proc.stdout

    assert hub.unexpected == []
    routes = [r for r in hub.routes if r in ("create_repo", "create_branch", "commit")]
    assert routes == ["create_repo", "create_branch", "commit"]
    (branch,) = hub.calls("create_branch")
    assert branch.path == "/api/models/me/tiny-branch/branch/mybranch"
    repo = hub.repos["me/tiny-branch"]
    assert repo.private is False
    assert set(repo.branches) == {"main", "mybranch"}

    (commit,) = hub.commits
    assert (commit.repo_id, commit.branch, commit.message) == ("me/tiny-branch", "mybranch", COMMIT_MESSAGE)
    assert repo.branches["mybranch"] == commit.oid
    assert CORE_FILES <= set(commit.files)
    assert "model.safetensors" in commit.lfs_paths
    assert json.loads(commit.files["config.json"])["model_type"] == "llama"

    tensors = load(commit.files["model.safetensors"])
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" in tensors
    original = load_file(str(hf / "model.safetensors"))
    assert sorted(tensors) == sorted(original)
    for name, arr in original.items():
        np.testing.assert_array_equal(tensors[name], arr, err_msg=name)

    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary export folder is gone


def test_dry_run_sends_nothing(tmp_path, ckpt, monkeypatch, capfd):
    with FakeHub(token=TOKEN) as hub:
        proc = zoo_export_here(tmp_path, hub.url, monkeypatch, capfd, str(ckpt), "--push-to-hub", "me/tiny-dry",
                               "--revision", "drybranch", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert_token_not_leaked(proc)
    assert hub.requests == []

    assert "me/tiny-dry" in proc.stdout and "drybranch" in proc.stdout
    lines = proc.stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    listed = {line.split()[0] for line in lines[rule + 1:] if line.strip()}
    assert CORE_FILES <= listed
    assert f"{len(listed)} files" in lines[0]
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow
def test_unauthorized_hub_is_one_error_line(tmp_path, ckpt, monkeypatch, capfd):
    with FakeHub(token=TOKEN, fail={"create_repo": 401}) as hub:
        proc = zoo_export_here(tmp_path, hub.url, monkeypatch, capfd, str(ckpt), "--push-to-hub", "me/tiny-denied")
    assert proc.returncode == 2, proc.stderr
    assert_token_not_leaked(proc)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "log in" in lines[0].lower() or "login" in lines[0].lower()
    assert "me/tiny-denied" in lines[0]

    assert hub.unexpected == []
    assert hub.calls("create_repo")[0].status == 401
    assert set(hub.routes) <= {"create_repo", "repo_info"}  # create_repo(exist_ok) looks the repo up on 401
    assert hub.commits == [] and hub.repos == {}
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow
def test_unreachable_hub_is_one_error_line(tmp_path, ckpt, monkeypatch, capfd):
    proc = zoo_export_here(tmp_path, f"http://127.0.0.1:{free_port()}",  # a port nobody listens on
                           monkeypatch, capfd, str(ckpt), "--push-to-hub", "me/tiny-offline")
    assert_token_not_leaked(proc)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "cannot reach the Hub" in lines[0]


def test_bad_repo_id_is_refused_before_exporting(tmp_path, ckpt):
    with FakeHub() as hub:
        proc = zoo_export(tmp_path, hub.url, str(ckpt), "--push-to-hub", "me/bad name", "--dry-run")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "me/bad name" in lines[0] and "Traceback" not in proc.stderr
    assert hub.requests == []


def test_fake_hub_records_and_refuses_unknown_calls():
    """The fake Hub itself: unknown endpoints get a JSON 404 and are listed; the token and fail switches work."""
    import urllib.error
    import urllib.request

    def call(url, method="GET", body=None, token=TOKEN):
        req = urllib.request.Request(url, data=body, method=method, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    with FakeHub(token=TOKEN, fail={"create_branch": 403}) as hub:
        assert call(f"{hub.url}/api/whoami-v2")[0] == 404
        assert call(f"{hub.url}/api/repos/create", "POST", b'{"name": "x", "organization": "me"}', token="bad")[0] == 401
        status, body = call(f"{hub.url}/api/repos/create", "POST", b'{"name": "x", "organization": "me"}')
        assert (status, body["url"]) == (200, f"{hub.url}/me/x")
        assert call(f"{hub.url}/api/models/me/x/branch/b", "POST", b"{}")[0] == 403
        assert call(f"{hub.url}/api/models/me/x")[1]["sha"] == hub.repos["me/x"].branches["main"]
    assert [r.path for r in hub.unexpected] == ["/api/whoami-v2"]
    assert hub.routes == [None, "create_repo", "create_repo", "create_branch", "repo_info"]
    assert [r.status for r in hub.requests] == [404, 401, 200, 403, 200]
