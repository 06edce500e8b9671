"""The shared training config: YAML + overrides -> typed config, with clear errors."""

import pytest
import yaml

from pretrain.cli import main
from pretrain.config import TrainConfig, load_config
from zoo.errors import UserError


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


# ---- numeric keys in range (issue 41, items 7 and 8): checked when the config is read, by each key's `range` -----

def _schema(task: str):
    from grpo.config import GRPOConfig
    from sft.config import SFTConfig

    return {"sft": SFTConfig, "grpo": GRPOConfig}[task]


def _base(task: str) -> list[str]:
    """The least a config of ``task`` needs (GRPO: a reward function too)."""
    return ["model.path=m", "data.path=d.jsonl", "max_steps=1", *(["grpo.rewards=[format]"] if task == "grpo" else [])]

SHARED_OUT_OF_RANGE = [
    ("optimizer.learning_rate=-1e-3", "config key 'optimizer.learning_rate' must be at least 0, got -0.001"),
    ("optimizer.learning_rate=.nan", "config key 'optimizer.learning_rate' must be a finite number, got nan"),
    ("optimizer.weight_decay=.inf", "config key 'optimizer.weight_decay' must be a finite number, got inf"),
    ("optimizer.b1=1", "config key 'optimizer.b1' must be in [0, 1), got 1.0"),
    ("optimizer.b2=-0.5", "config key 'optimizer.b2' must be in [0, 1), got -0.5"),
    ("optimizer.eps=0", "config key 'optimizer.eps' must be positive, got 0.0"),
    ("optimizer.grad_clip=-1", "config key 'optimizer.grad_clip' must be at least 0, got -1.0"),
    ("schedule.warmup_steps=-10", "config key 'schedule.warmup_steps' must be at least 0, got -10"),
    ("schedule.min_lr_ratio=2", "config key 'schedule.min_lr_ratio' must be in [0, 1], got 2.0"),
    ("lora.dropout=1", "config key 'lora.dropout' must be in [0, 1), got 1.0"),
    ("lora.alpha=0", "config key 'lora.alpha' must be positive, got 0.0"),
    ("batch_size=0", "config key 'batch_size' must be at least 1, got 0"),
    ("grad_accum=-2", "config key 'grad_accum' must be at least 1, got -2"),
    ("data.seq_len=0", "config key 'data.seq_len' must be at least 1, got 0"),
    ("data.eval_fraction=1", "config key 'data.eval_fraction' must be in [0, 1), got 1.0"),
    ("epochs=0", "config key 'epochs' must be at least 1, got 0"),
    ("seed=-1", "config key 'seed' must be in [0, 4294967295], got -1"),
    ("checkpoint.every=0", "config key 'checkpoint.every' must be at least 1, got 0"),
    ("eval.limit=0", "config key 'eval.limit' must be at least 1, got 0"),
]
GRPO_OUT_OF_RANGE = [
    ("grpo.temperature=0", "config key 'grpo.temperature' must be positive (greedy decoding makes a group's "
                           "completions equal), got 0.0"),
    ("grpo.top_p=1.5", "config key 'grpo.top_p' must be in (0, 1], got 1.5"),
    ("grpo.top_k=-1", "config key 'grpo.top_k' must be at least 0, got -1"),
    ("grpo.num_generations=1", "config key 'grpo.num_generations' must be at least 2 (a group compares its "
                               "completions), got 1"),
    ("grpo.epsilon_high=0", "config key 'grpo.epsilon_high' must be positive, got 0.0"),
    ("grpo.beta=-0.1", "config key 'grpo.beta' must be at least 0, got -0.1"),
    ("grpo.reward_weights=[1, .nan]", "grpo.reward_weights must be finite numbers, got [1, nan]"),
    ("grpo.reward_weights=[0, 0]", "grpo.reward_weights are all 0 ([0, 0])"),
]


@pytest.mark.parametrize("task, override, message", [
    *[pytest.param(t, o, m, id=f"{t}-{o}") for t in ("sft", "grpo") for o, m in SHARED_OUT_OF_RANGE],
    *[pytest.param("grpo", o, m, id=f"grpo-{o}") for o, m in GRPO_OUT_OF_RANGE],
])
def test_a_numeric_key_out_of_range_is_refused_when_the_config_is_read(task, override, message):
    """A negative learning rate trained sft and grpo runs into the ground (exit 0); every numeric key's range is
    checked by load_config: one line naming the key, the allowed range and the value."""
    two = ["grpo.rewards=[format, length_penalty]"] if "reward_weights" in override else []
    with pytest.raises(UserError) as e:
        load_config(None, [*_base(task), *two, override], _schema(task))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("task", ["sft", "grpo"])
def test_keys_at_the_edge_of_their_range_are_accepted(task):
    """0 where it means something (learning rate: the weights stay; warmup, weight decay, grad_clip: off), and
    the closed ends of an interval."""
    cfg = load_config(None, [*_base(task), "optimizer.learning_rate=0",
                             "schedule.warmup_steps=0", "optimizer.grad_clip=0", "schedule.min_lr_ratio=1",
                             "data.max_untrainable_fraction=1", "optimizer.b1=0", "lora.dropout=0"], _schema(task))
    assert cfg.optimizer.learning_rate == 0.0 and cfg.schedule.min_lr_ratio == 1.0


@pytest.mark.parametrize("max_steps", ["0", "-3"])
def test_max_steps_below_1_is_a_config_error(max_steps):
    """max_steps=0 ended in a TypeError traceback, max_steps=-3 in "holds a run at step 0" and an empty
    checkpoints/ folder: both are refused when the config is read (null max_steps: epochs decide)."""
    with pytest.raises(UserError) as e:
        load_config(None, ["model.path=m", "data.path=d.jsonl", f"max_steps={max_steps}"], _schema("sft"))
    assert str(e.value) == f"config key 'max_steps' must be at least 1, got {max_steps}"


@pytest.mark.parametrize("task, override", [("sft", "optimizer.learning_rate=-1e-3"), ("grpo", "max_steps=0"),
                                            ("sft", "max_steps=-3")])
def test_the_cli_refuses_an_out_of_range_key_in_one_line_writing_nothing(task, override, tmp_path, capsys):
    from grpo.cli import main as grpo_main
    from sft.cli import main as sft_main

    out = tmp_path / "run"
    argv = ["train", *_base(task), f"output_dir={out}", override]
    code = {"sft": sft_main, "grpo": grpo_main}[task](argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: config key '"), err
    assert override.split("=")[0] in err[0] and not out.exists()


def test_the_largest_seed_the_config_accepts_shuffles_the_lanes():
    """seed is in [0, 2**32 - 1] (numpy's and grain's range); a lane's seed (seed x 1_000_003 + lane) wraps into
    it, so the largest seed reads its data (grain refused any seed from 4295 on)."""
    import numpy as np

    from pretrain.data.pipeline import lane_dataset, split_rows

    seed = load_config(None, [*_base("sft"), "seed=4294967295"], _schema("sft")).seed
    order, _ = split_rows(10, 0.0, seed)
    docs = [{"tokens": np.arange(i, i + 5, dtype=np.int32)} for i in range(4)]
    row = next(lane_dataset(docs, 8, seed * 1_000_003 + 3, "concat"))
    assert sorted(order) == list(range(10)) and row["tokens"].shape == (9,)


def test_every_example_config_loads_with_its_command(tmp_path):
    """Each examples/**/*.yaml is a valid config of the command its folder names (keys, types, ranges and the
    sections' own checks), so an example never drifts from the schema; no model or data is read."""
    from pathlib import Path

    from dpo.config import DPOConfig
    from grpo.config import GRPOConfig
    from pretrain.config import TrainConfig, load_config
    from rm.config import RMConfig
    from sft.config import SFTConfig

    schema = {"dpo": DPOConfig, "grpo": GRPOConfig, "finetune": SFTConfig, "distill": SFTConfig,
              "reward": RMConfig, "vision": SFTConfig, "examples": TrainConfig}
    files = sorted((Path(__file__).parent.parent / "examples").rglob("*.yaml"))
    assert len(files) >= 5
    by_name = {"calculator_sft.yaml": SFTConfig, "calculator_grpo.yaml": GRPOConfig}  # examples/agents: two steps
    for f in files:
        cls = by_name.get(f.name) or schema.get(f.parent.name)
        assert cls is not None, f"{f}: which command's config is it? (add its folder here)"
        cfg = load_config(str(f), [], cls)
        assert cfg.max_steps, f
