"""`train --compile-only --topology NAME`: the run's step compiled for a TPU slice on this CPU machine (libtpu),
without weights or data: the report, the exit codes (0 fits, 3 does not, 2 user errors) and its errors."""

import json

import pytest

from zoo.errors import UserError

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "tie_word_embeddings": False}
# Wide enough that full fine-tuning with float32 Adam, replicated over data=4, cannot fit a v5e chip's 16 GiB:
# 4 layers of 218M parameters, 3.5 GB of weights, 7 GB of moments and 3.5 GB of gradients a chip before activations.
WIDE = {**TINY, "vocab_size": 1024, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
KEYS = {"topology", "chips", "hbm_bytes_per_chip", "fits", "bytes_per_chip", "model_flops_per_step",
        "tokens_per_step", "compile_seconds"}


def _config(tmp_path, model: dict, extra: str = "", name: str = "run.yaml"):
    (tmp_path / "config.json").write_text(json.dumps(model))
    f = tmp_path / name
    f.write_text(f"model: {tmp_path / 'config.json'}\ndata:\n  path: {tmp_path / 'absent.jsonl'}\n  seq_len: 64\n"
                 f"batch_size: 8\nmax_steps: 1\noutput_dir: {tmp_path / 'run'}\n{extra}")
    return f


def _main(command: str):
    import importlib

    return importlib.import_module(f"{command}.cli").main


def _flops(m: dict, seq: int, tokens: int, factor: float) -> float:
    """The model's arithmetic for a Llama config, written out: factor x matmul weights per token (head included,
    embedding gather not) plus causal attention 6 x layers x heads x head_dim x seq."""
    e, f, h, kv, d, v, n = (m[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "vocab_size", "num_hidden_layers"))
    weights = n * (e * h * d + 2 * e * kv * d + h * d * e + 3 * e * f) + e * v
    return (factor * weights + 6 * n * h * d * seq) * tokens


@pytest.mark.parametrize("command,extra,factor", [
    ("pretrain", "", 6.0),
    ("sft", "lora:\n  rank: 4\n", 4.0),
    ("dpo", "lora:\n  rank: 4\n", 4.0),
    ("grpo", "lora:\n  rank: 4\ngrpo:\n  rewards: [final_number]\n  num_generations: 2\n"
             "  max_completion_length: 8\n  beta: 0.1\n", 4.0),
])
def test_a_small_run_compiles_for_a_4_chip_slice_and_reports(tmp_path, capsys, command, extra, factor):
    """The step of each train command compiles for v5e:2x2 (4 chips) from its config alone: the JSON report's
    keys, the chip count and HBM of a v5e, parts that add up, and FLOPs from the model's arithmetic. The data
    file does not exist: nothing is read."""
    f = _config(tmp_path, TINY, extra)
    report = tmp_path / "report.json"
    code = _main(command)(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                           "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0, out.err
    rep = json.loads(report.read_text())
    assert KEYS <= set(rep) and rep["fits"] is True
    assert rep["topology"] == "v5e:2x2" and rep["chips"] == 4 and rep["hbm_bytes_per_chip"] == 16 * 2**30
    parts = rep["bytes_per_chip"]
    assert set(parts) == {"params", "optimizer", "adapters", "activations", "outputs", "total"}
    assert parts["total"] >= parts["params"] + parts["optimizer"] + parts["adapters"] + parts["activations"] > 0
    assert (parts["adapters"] > 0) == ("lora" in extra) and parts["optimizer"] > 0
    row = 64 + (8 if command == "grpo" else 0)  # GRPO's rows: the prompt and its completion
    assert rep["tokens_per_step"] == 8 * row
    assert rep["model_flops_per_step"] == pytest.approx(_flops(TINY, row, 8 * row, factor), rel=1e-9)
    sampler = rep.get("programs", {}).get("sampler")  # GRPO's sampler, compiled beside its update
    assert (sampler is not None) == (command == "grpo")
    if sampler:
        assert sampler["total"] > sampler["temporaries"] > 0 and "sampler GiB/chip" in out.out
    assert "fits" in out.out and "v5e:2x2 (4 chips, TPU v5 lite" in out.out
    assert not (tmp_path / "run").exists()  # nothing written but the report


def test_a_run_that_cannot_fit_exits_3_and_says_what_to_change(tmp_path, capsys):
    f = _config(tmp_path, WIDE, "mesh:\n  data: 4\n  fsdp: 1\nremat: none\ndata:\n  seq_len: 2048\n"
                              f"  path: {tmp_path / 'absent.jsonl'}\n")
    report = tmp_path / "report.json"
    code = _main("pretrain")(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                              "--report", str(report)])
    out = capsys.readouterr().out
    rep = json.loads(report.read_text())
    assert code == 3 and rep["fits"] is False and rep["bytes_per_chip"]["total"] > 16 * 2**30
    assert rep["advice"][0].startswith("over by ") and any("remat: full" in a for a in rep["advice"])
    assert "NO" in out and "over by" in out


@pytest.mark.parametrize("args,message", [
    (["--compile-only", "--topology", "v9z:2x2"], "--topology v9z:2x2: Invalid TPU external name"),
    (["--compile-only", "--topology", "v5e:3x3"], "--topology v5e:3x3: Topology layout"),
    (["--compile-only"], "--compile-only needs --topology, e.g. --topology v5e:2x4"),
    (["--topology", "v5e:2x2"], "--topology and --report go with --compile-only"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, capsys, args, message):
    f = _config(tmp_path, TINY)
    assert _main("pretrain")(["train", "--config", str(f), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err


def test_without_libtpu_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    from pretrain import compile_only

    real = importlib.util.find_spec
    monkeypatch.setattr(compile_only.importlib.util, "find_spec", lambda n, *a: None if n == "libtpu" else real(n, *a))
    with pytest.raises(UserError, match=r"pip install 'lmzoo\[tpu\]'"):
        compile_only.topology_devices("v5e:2x2")


def test_hbm_per_chip_by_device_kind():
    from pretrain.compile_only import hbm_bytes

    gib = 2**30
    assert [hbm_bytes(k) // gib for k in ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v5p", "TPU v6 lite")] == \
        [32, 16, 95, 95, 32]
    with pytest.raises(UserError, match="no HBM size known"):
        hbm_bytes("TPU v9")


@pytest.mark.slow
def test_commands_on_a_cpu_machine_with_libtpu_stay_quiet(tmp_path):
    """Slow (a subprocess): with the tpu extra installed and no TPU, a command that starts JAX (`zoo init`) prints
    nothing of libtpu's start-up (TPU_ACCELERATOR_TYPE, worker hostnames, INVALID_ARGUMENT) to stderr."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-m", "zoo.cli", "init", str(tmp_path / "config.json"), "--out",
                           str(tmp_path / "zoo")], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "TPU" not in proc.stderr and "INVALID_ARGUMENT" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_activations_stay_split_over_the_chips(tmp_path):
    """Slow (a 10 s TPU compile): full fine-tuning over an FSDP mesh of 4 chips keeps each chip's rows only. The
    partitioner, unconstrained, laid the layers' saved gate and up out for the whole global batch on every chip
    (51 MB here; Llama-3.1-8B on v5p:2x2x2: two 14 GiB buffers a chip); split, a chip's share is a quarter."""
    mid = {**TINY, "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
           "head_dim": 64}
    f = _config(tmp_path, mid, "dtype:\n  params: bfloat16\n  compute: bfloat16\ndata:\n  seq_len: 512\n"
                              f"  path: {tmp_path / 'absent.jsonl'}\n")
    report = tmp_path / "report.json"
    assert _main("pretrain")(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                              "--report", str(report)]) == 0
    rep = json.loads(report.read_text())
    gate_and_up_whole_batch = 2 * 8 * 512 * 2048 * 2 * 2  # layers x rows x seq x mlp x bf16 x (gate, up)
    assert rep["bytes_per_chip"]["activations"] < 1.5 * gate_and_up_whole_batch / 4


def test_a_model_named_without_weights_is_a_config_json_or_a_released_config(tmp_path):
    """`--compile-only`'s model, `model.config` and `zoo init` read names one way (zoo.registry.hf_config_of)."""
    from zoo.registry import hf_config_of

    assert hf_config_of("llama3.1-8b", "model")["num_hidden_layers"] == 32
    (tmp_path / "c.json").write_text(json.dumps(TINY))
    assert hf_config_of(str(tmp_path / "c.json"), "model") == TINY
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match=r"^model: .*bad.json is not valid JSON"):
        hf_config_of(str(tmp_path / "bad.json"), "model")
    with pytest.raises(UserError, match="^zoo init: llama3-8b has no built-in config; give its config.json path"):
        hf_config_of("llama3-8b", "zoo init")
    with pytest.raises(UserError, match="unknown model name 'llama9'"):
        hf_config_of("llama9", "model.config")


@pytest.mark.slow
def test_context_parallelism_compiles_with_the_keys_gathered_over_the_context_chips(tmp_path, capsys, monkeypatch):
    """Slow (a 15 s TPU compile): mesh.context 2 x fsdp 2 on v5e:2x2. The compiled step's attention all-gathers
    each layer's keys/values over the context pairs of chips (a chip's [4 rows, 2 heads, 32 tokens, 16] to the
    row's 64 tokens: its sequence is split), and the report's mesh shows the context axis."""
    import pretrain.step as step

    texts = []
    compile_lowered = step.compile_lowered

    def keep_hlo(lowered, platform=None):
        compiled = compile_lowered(lowered, platform)
        texts.append(compiled.as_text())
        return compiled

    monkeypatch.setattr(step, "compile_lowered", keep_hlo)
    f = _config(tmp_path, TINY, "mesh:\n  fsdp: 2\n  context: 2\n")
    report = tmp_path / "report.json"
    assert _main("pretrain")(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                              "--report", str(report)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(report.read_text())
    assert rep["mesh"]["context"] == 2 and rep["mesh"]["fsdp"] == 2 and "fsdp 2 x context 2" in out
    gathers = [line for line in texts[0].splitlines() if "all-gather(" in line and "shard_map/all_gather" in line]
    assert any("[4,2,64,16]" in line and "dimensions={2}" in line for line in gathers), gathers
