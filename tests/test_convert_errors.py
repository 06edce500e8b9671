"""Bad input to `zoo convert`: one clear line, exit code 2, nothing half-written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import make_llama
from tests.processes import kill_midway
from zoo.cli import main


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tiny"
    make_llama(d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _run(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def _assert_clean_failure(code, err, out: Path, *needles):
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    for n in needles:
        assert n in err[0], (n, err[0])
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.incomplete-*"))


def test_missing_config(tmp_path, hf_dir, capsys):
    src = _copy(hf_dir, tmp_path / "src")
    (src / "config.json").unlink()
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", str(src), "--out", str(out)], capsys), out, "config.json")


def test_unknown_architecture(tmp_path, hf_dir, capsys):
    src = _copy(hf_dir, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FancyNetForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", str(src), "--out", str(out)], capsys), out, "FancyNetForCausalLM", "supported")


def test_shape_mismatch(tmp_path, hf_dir, capsys):
    src = _copy(hf_dir, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", str(src), "--out", str(out)], capsys), out, "gate_proj", "shape")


def test_truncated_safetensors(tmp_path, hf_dir, capsys):
    src = _copy(hf_dir, tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", str(src), "--out", str(out)], capsys), out, "truncated", "model.safetensors")


def test_missing_tensor(tmp_path, hf_dir, capsys):
    from safetensors.numpy import load_file, save_file

    src = _copy(hf_dir, tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", str(src), "--out", str(out)], capsys), out,
                          "model.layers.1.mlp.up_proj.weight", "missing")


def test_pickled_weights_are_refused(tmp_path, hf_dir, capsys):
    src = _copy(hf_dir, tmp_path / "src")
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not even read")
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", str(src), "--out", str(out)], capsys), out, "pytorch_model.bin", "pickle")


def test_unknown_registry_name_suggests_nearest(tmp_path, capsys):
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", "llama3-8b-instuct", "--out", str(out)], capsys), out,
                          "llama3-8b-instuct", "llama3-8b-instruct")


def test_output_folder_not_empty(tmp_path, hf_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, err = _run(["convert", str(hf_dir), "--out", str(out)], capsys)
    assert code == 2 and len(err) == 1 and "not empty" in err[0]
    assert "--overwrite" not in err[0]  # `zoo convert` has no such flag
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


def test_failure_midway_leaves_nothing(tmp_path, hf_dir, capsys, monkeypatch):
    import zoo.checkpoints.writer
    from zoo.errors import UserError

    calls = []
    real_add = zoo.checkpoints.writer.CheckpointWriter.add

    def failing_add(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise UserError("disk full (simulated)")
        return real_add(self, *a, **k)

    monkeypatch.setattr(zoo.checkpoints.writer.CheckpointWriter, "add", failing_add)
    out = tmp_path / "out"
    _assert_clean_failure(*_run(["convert", str(hf_dir), "--out", str(out)], capsys), out, "simulated")


def test_cli_error_has_no_traceback_and_exit_2(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "zoo.cli", "convert", str(tmp_path / "nope"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()]
    assert not out.exists()


@pytest.mark.slow
def test_killed_conversion_leaves_no_checkpoint(tmp_path):
    """kill -9 in the middle of writing: --out never appears (only a hidden scratch folder may)."""
    src = tmp_path / "big"
    make_llama(src, hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=4096)
    out = tmp_path / "out"
    assert kill_midway(["convert", str(src), "--out", str(out)], tmp_path, ".out.incomplete-*/params*"), \
        "conversion never started writing"
    assert not out.exists()
    # Running again afterwards works and clears the dead writer's scratch folder.
    assert main(["convert", str(src), "--out", str(out)]) == 0
    assert (out / "model.json").is_file()
    assert not list(tmp_path.glob(".out.incomplete-*"))
