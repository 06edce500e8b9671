"""The shared training config: YAML + overrides -> typed config, with clear errors."""

import yaml

from pretrain.cli import main
from pretrain.config import TrainConfig, load_config


def _write(tmp_path, text):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    return f


def test_yaml_and_overrides_resolve_to_typed_config(tmp_path):
    f = _write(tmp_path, "model: ckpt/llama\ndata:\n  path: data.jsonl\n  seq_len: 256\noptimizer:\n  name: lion\n")
    assert "max_steps" in __import__("pytest").raises(Exception, load_config, f).value.args[0]
    cfg = load_config(f, ["optimizer.learning_rate=3e-4", "mesh.fsdp=2", "data.packing=false", "max_steps=10"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.path == "ckpt/llama" and cfg.data.seq_len == 256 and cfg.optimizer.name == "lion"
    assert cfg.optimizer.learning_rate == 3e-4 and isinstance(cfg.optimizer.learning_rate, float)
    assert cfg.mesh.fsdp == 2 and cfg.data.packing is False and cfg.max_steps == 10
    assert cfg.schedule.name == "cosine"  # default


def _error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_unknown_key_names_nearest(tmp_path, capsys):
    f = _write(tmp_path, "model: m\ndata:\n  path: d.jsonl\nmax_steps: 1\n")
    err = _error(capsys, ["train", "--config", str(f), "optimizer.learnig_rate=1e-3", "--print-config"])
    assert "optimizer.learnig_rate" in err and "optimizer.learning_rate" in err


def test_wrong_type_names_key_and_type(tmp_path, capsys):
    f = _write(tmp_path, "model: m\ndata:\n  seq_len: long\n")
    err = _error(capsys, ["train", "--config", str(f), "--print-config"])
    assert "data.seq_len" in err and "int" in err


def test_bad_choice_and_missing_file(tmp_path, capsys):
    f = _write(tmp_path, "model: m\nschedule:\n  name: exponential\n")
    assert "cosine" in _error(capsys, ["train", "--config", str(f), "--print-config"])
    assert "no such file" in _error(capsys, ["train", "--config", str(tmp_path / "nope.yaml"), "--print-config"])


def test_print_config_shows_everything_with_defaults(tmp_path, capsys):
    f = _write(tmp_path, "model:\n  init: random\n  config: deepseek-v3-tiny\n  tokenizer: tok\n"
                         "data:\n  path: d.jsonl\nmax_steps: 5\n")
    assert main(["train", "--config", str(f), "batch_size=16", "--print-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["batch_size"] == 16 and shown["model"]["init"] == "random"
    assert shown["optimizer"]["name"] == "adamw" and shown["checkpoint"]["keep"] == 3
    assert set(shown) == {f.name for f in __import__("dataclasses").fields(TrainConfig)}


def test_yaml_is_loaded_safely(tmp_path, capsys):
    f = _write(tmp_path, "model: !!python/object/apply:os.system ['echo pwned']\n")
    assert "not valid YAML" in _error(capsys, ["train", "--config", str(f), "--print-config"])


def test_partial_multiprocess_settings_are_a_clear_error(capsys, monkeypatch):
    from pretrain.cli import main

    for env in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(env, raising=False)
    base = ["train", "model.path=m", "data.path=d.jsonl", "max_steps=1"]
    assert main(base + ["--num-processes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--coordinator" in err[0] and "--process-id" in err[0]
    monkeypatch.setenv("JAX_PROCESS_ID", "5")
    assert main(base + ["--num-processes", "2", "--coordinator", "localhost:1"]) == 2
    assert "--process-id 5 must be in 0..1" in capsys.readouterr().err
