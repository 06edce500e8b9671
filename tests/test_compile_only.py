"""`train --compile-only --topology NAME`: the run's step compiled for a TPU slice on this CPU machine (libtpu),
without weights or data: the report, the exit codes (0 fits, 3 does not, 2 user errors) and its errors."""

import json
import os

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


def _config(tmp_path, model: dict, extra: str = "", name: str = "run.yaml", data: bool = True):
    """A run's YAML for ``model`` (a config.json beside it); ``data``: with a data.path (a file that does not exist)
    and max_steps, else neither (what a compile-only run may leave out)."""
    (tmp_path / "config.json").write_text(json.dumps(model))
    f = tmp_path / name
    inputs = f"  path: {tmp_path / 'absent.jsonl'}\n" if data else ""
    f.write_text(f"model: {tmp_path / 'config.json'}\ndata:\n{inputs}  seq_len: 64\nbatch_size: 8\n"
                 f"{'max_steps: 1' if data else ''}\noutput_dir: {tmp_path / 'run'}\n{extra}")
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


def _param_count(m: dict) -> int:
    """A Llama config's parameters, written out: projections, embedding and head (untied), norms."""
    return _projection_count(m) + 2 * m["vocab_size"] * m["hidden_size"] + (2 * m["num_hidden_layers"] + 1) * \
        m["hidden_size"]


def _projection_count(m: dict) -> int:
    """The weights of a Llama config's attention and MLP projections (what QLoRA quantizes)."""
    e, f, h, kv, d, n = (m[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "num_hidden_layers"))
    return n * (2 * e * h * d + 2 * e * kv * d + 3 * e * f)


@pytest.mark.parametrize("command,extra,factor", [
    ("pretrain", "", 6.0),
    ("sft", "lora:\n  rank: 4\n", 4.0),
    # slow lane: a TPU compilation of 5-6 s each; the fast lane compiles pretraining's and SFT's
    pytest.param("dpo", "lora:\n  rank: 4\n", 4.0, marks=pytest.mark.slow),
    pytest.param("grpo", "lora:\n  rank: 4\ngrpo:\n  rewards: [final_number]\n  num_generations: 2\n"
                 "  max_completion_length: 8\n  beta: 0.1\n", 4.0,
                 marks=pytest.mark.slow),  # slow lane: its sampler compiles too (8 s)
    pytest.param("rm", "lora:\n  rank: 4\n", 4.0, marks=pytest.mark.slow),
])
def test_a_small_run_compiles_for_a_4_chip_slice_and_reports(tmp_path, capsys, command, extra, factor):
    """The step of each train command compiles for v5e:2x2 (4 chips) from its config alone: the JSON report's
    keys, the chip count and HBM of a v5e, parts that add up, and FLOPs from the model's arithmetic. The data
    file does not exist: nothing is read; SFT's config has no data.path and no max_steps at all (compile-only
    needs neither: its schedule is 1 step)."""
    f = _config(tmp_path, TINY, extra, data=command != "sft")
    report = tmp_path / "report.json"
    code = _main(command)(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                           "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0, out.err
    rep = json.loads(report.read_text())
    assert KEYS <= set(rep) and rep["fits"] is True
    # a v5e's HBM as the TPU compiler counts it (15.75 of 16 GiB), the figure fits is judged by
    assert rep["topology"] == "v5e:2x2" and rep["chips"] == 4 and rep["hbm_bytes_per_chip"] == 15.75 * 2**30
    parts = rep["bytes_per_chip"]
    assert rep["fits"] == (parts["total"] <= rep["hbm_bytes_per_chip"])
    assert set(parts) == {"params", "optimizer", "adapters", "activations", "outputs", "total", "host"}
    assert parts["host"] == 0  # nothing offloaded without remat: offload
    assert parts["total"] >= parts["params"] + parts["optimizer"] + parts["adapters"] + parts["activations"] > 0
    assert (parts["adapters"] > 0) == ("lora" in extra) and parts["optimizer"] > 0
    if command == "pretrain":  # Adam's two float32 moments sharded like the weights over fsdp 4 (+ step counters)
        assert 0 <= parts["optimizer"] - 2 * 4 * _param_count(TINY) // 4 < 64
    rows, row = 8, 64
    if command == "grpo":  # one row per group of G = 2 (grpo.share_prompt, whole groups on each of the 4 chips):
        rows, row = 8 // 2, 64 + 2 * (8 + 1)  # the prompt once, then each completion after the prompt's last token
    assert rep["tokens_per_step"] == rows * row
    # A reward model's head is [hidden, 1]: a vocabulary of one in the arithmetic
    head = {**TINY, "vocab_size": 1} if command == "rm" else TINY
    assert rep["model_flops_per_step"] == pytest.approx(_flops(head, row, rows * row, factor), rel=1e-9)
    sampler = rep.get("programs", {}).get("sampler")  # GRPO's sampler, compiled beside its update
    assert (sampler is not None) == (command == "grpo")
    if sampler:
        assert sampler["total"] > sampler["temporaries"] > 0 and "sampler GiB/chip" in out.out
        # The engine's page pool: k and v x layers x rows x kv heads x head_dim x (prompt row 65 + 8 new = 73
        # tokens in 5 pages of 16) slots x float32; TINY's 2 kv heads do not divide the 4 chips, so each chip holds
        # them all
        assert sampler["kv_cache"] == 2 * 2 * 8 * 2 * 16 * (5 * 16) * 4 and "KV cache" in out.out
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
    # one figure for the chip's HBM: the compiler's own limit, in the report and the advice alike
    assert rep["hbm_bytes_per_chip"] == 15.75 * 2**30 and rep["advice"][0].endswith("of 15.75 GiB a chip")
    assert "NO" in out and "over by" in out
    # The largest buffers, by the compiler's buffer report: the MLP's float32 [batch, seq, intermediate] kept for
    # the backward pass of each of the 4 layers (4 x 2 rows x 2048 x 14336 x 4 bytes = 896 MiB), named by the
    # line of the model that makes it.
    largest = [a for a in rep["advice"] if a.startswith("largest buffer ")]
    assert largest and largest == [f"largest buffer {b}" for b in rep["largest_buffers"]]
    assert any("896 MiB" in a and "f32[4,2,2048,14336]" in a and "zoo/" in a for a in largest), largest


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

    from zoo.compiled import topology

    real = importlib.util.find_spec
    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda n, *a: None if n == "libtpu" else real(n, *a))
    with pytest.raises(UserError, match=r"pip install 'lmzoo\[tpu\]'"):
        topology.topology_devices("v5e:2x2")


def test_libtpu_never_sees_the_cpu_backends_flags(monkeypatch):
    """libtpu aborts the process on an XLA flag it does not define, and reads XLA_FLAGS at its first topology or
    compile: while it does, the CPU backend's flags are hidden from it, and put back after. (The suite runs with
    --xla_cpu_use_fusion_emitters=false, tests/conftest.py: without this every TPU compile here would abort.)"""
    from zoo.compiled.compiler import flags_libtpu_knows

    flags = "--xla_cpu_use_fusion_emitters=false --xla_dump_to=/x --xla_cpu_enable_fast_math=false"
    monkeypatch.setenv("XLA_FLAGS", flags)
    with flags_libtpu_knows():
        assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/x"
    assert os.environ["XLA_FLAGS"] == flags
    monkeypatch.delenv("XLA_FLAGS")
    with flags_libtpu_knows():
        assert "XLA_FLAGS" not in os.environ


def test_hbm_per_chip_is_the_compilers_own_limit():
    """The HBM a chip's program may use is the TPU compiler's own figure (what it refuses a program over), below
    the nominal HBM: 15.75 of a v5e's 16 GiB, 31.24 of a v6e's 32 (and 95.73 GiB on a v5p)."""
    from zoo.compiled.topology import hbm_bytes, topology_devices

    assert [round(hbm_bytes(topology_devices(t)[0]) / 2**30, 2) for t in ("v5e:2x2", "v6e:2x2", "v5p:2x2x1")] == \
        [15.75, 31.24, 95.73]


@pytest.mark.slow
def test_commands_on_a_cpu_machine_with_libtpu_stay_quiet(tmp_path):
    """Slow (a subprocess): with the tpu extra installed and no TPU, a command that starts JAX (`zoo init`) prints
    nothing of libtpu's start-up (TPU_ACCELERATOR_TYPE, worker hostnames, INVALID_ARGUMENT) to stderr."""
    import os
    import subprocess
    import sys

    from tests.processes import REPO

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
    """`--compile-only`'s model, `model.config` and `zoo init` read names one way (zoo.registry.catalogue.hf_config_of)."""
    from zoo.registry.catalogue import hf_config_of

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


@pytest.mark.parametrize("name,published,last_digit", [
    ("llama3.1-8b", 8.03e9, 0.01e9), ("llama3.1-70b", 70.55e9, 0.01e9), ("llama3.2-1b", 1.24e9, 0.01e9),
    ("deepseek-v3", 671e9, 1e9)])
def test_released_configs_have_their_published_parameter_counts(name, published, last_digit):
    """The configs `--compile-only` compiles for registry names build the models their authors published (Meta's
    and DeepSeek's parameter counts; DeepSeek-V3's 671B leave out its 14B multi-token-prediction module)."""
    import math

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import param_specs
    from zoo.registry.catalogue import hf_config_of

    cfg = model_config_from_hf(hf_config_of(name, "model"), name)
    # published counts are rounded: within half a unit of their last digit
    assert abs(sum(math.prod(s.shape) for s in param_specs(cfg).values()) - published) <= last_digit / 2


@pytest.mark.slow  # slow lane: a whole TPU compile of 6-7 s
def test_qlora_compiles_with_its_base_quantized(tmp_path, capsys):
    """QLoRA (lora.base_quant: nf4) under --compile-only: the projections' packed codes and absmax as the run would
    shard them over fsdp 4, so a chip holds 4.5 bits a projection weight (64-value blocks, a float32 absmax each)
    beside the bfloat16 embedding, head and norms: below the bfloat16 LoRA run's 16 bits. No weights are read."""
    f = _config(tmp_path, TINY, "dtype:\n  params: bfloat16\n  compute: bfloat16\nlora:\n  rank: 4\n"
                                "  base_quant: nf4\n")
    report = tmp_path / "report.json"
    assert _main("sft")(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                         "--report", str(report)]) == 0, capsys.readouterr().err
    params = json.loads(report.read_text())["bytes_per_chip"]["params"]
    proj, rest = _projection_count(TINY), _param_count(TINY) - _projection_count(TINY)
    assert params == (2 * rest + proj // 2 + 4 * proj // 64) // 4
    assert params < 2 * _param_count(TINY) // 4 / 1.9  # the bfloat16 LoRA run's weights a chip


@pytest.mark.slow  # slow lane: a whole TPU compile of 6-7 s
def test_remat_offload_keeps_the_layer_inputs_and_attention_projections_in_host_memory(tmp_path, capsys):
    """remat: offload (MaxText's policy for Llama-3.1-8B on v6e) compiles for v5e:2x2 and its report counts the host
    memory: at least every layer's input and its q, k, v and o outputs (float32, a chip's 2 rows of 128 tokens), at
    most one layer's more than there are (the compiler stages a layer's copies in host memory too). The MLP's gate
    and up (8 times as wide as x here) are recomputed, not kept: before, they went to the host too (and on
    Llama-3.1-8B at 32 layers stayed on the chip, 56 GiB of it). Widths are multiples of 128, so the TPU's tiles
    add no padding."""
    m = {**TINY, "hidden_size": 128, "intermediate_size": 1024, "num_attention_heads": 1, "num_key_value_heads": 1,
         "head_dim": 128}
    f = _config(tmp_path, m, f"remat: offload\ndata:\n  seq_len: 128\n  path: {tmp_path / 'absent.jsonl'}\n")
    report = tmp_path / "report.json"
    assert _main("pretrain")(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                              "--report", str(report)]) == 0
    rep = json.loads(report.read_text())
    tokens, layers, host = 2 * 128, 2, rep["bytes_per_chip"]["host"]
    named = 128 + 3 * 128 + 128  # a layer's input, q, k, v (one head of 128 each) and o's output
    assert rep["remat"] == "offload"
    assert layers * tokens * named * 4 <= host <= (layers + 1) * tokens * named * 4, host
    assert "host memory GiB/chip" in capsys.readouterr().out


def _advice_for(overrides: list[str], largest: str) -> str:
    """The advice line of part ``largest`` (over 16 GiB, the others 1 byte) for a config with ``overrides``."""
    from pretrain.compile_only import advice
    from pretrain.config import load_config

    parts = {"params": 1, "optimizer": 1, "adapters": 0, "activations": 1, "outputs": 0, largest: 20 * 2**30}
    parts["total"] = sum(parts.values())
    cfg = load_config(None, ["model.path=none", "data.path=none", "max_steps=1", *overrides])
    return next(line for line in advice(cfg, parts, 16 * 2**30) if line.startswith(largest))


@pytest.mark.parametrize("remat,remedies", [
    ("none", ["set remat: full", "remat: offload", "lower batch_size"]),
    ("save_dots", ["set remat: full", "remat: offload", "lower batch_size"]),
    ("full", ["set remat: offload", "lower batch_size"]),
    ("offload", ["set remat: full", "lower batch_size"]),
])
def test_advice_for_activations_names_each_remat_that_keeps_less_on_the_chip(remat, remedies):
    """Activations over the chip: every remat setting that may keep less on the chip than the config's (remat:
    full after none, save_dots and offload: Llama-3.1-8B on v6e:16x16 needed 14.64 GiB a chip with full and 19.99
    with offload; offload after full), and a smaller batch or sequence; never the config's own setting."""
    line = _advice_for([f"remat={remat}"], "activations")
    assert all(r in line for r in remedies), line
    assert f"set remat: {remat}" not in line and f"or remat: {remat}" not in line, line


@pytest.mark.parametrize("overrides,absent,present", [
    (["dtype.params=bfloat16"], ["dtype.params: bfloat16"], ["use LoRA"]),
    (["dtype.params=float32"], [], ["dtype.params: bfloat16", "use LoRA"]),
    (["dtype.params=bfloat16", "lora.rank=4"], ["dtype.params: bfloat16", "LoRA"], ["a larger slice"]),
])
def test_advice_for_the_optimizer_suggests_nothing_already_set(overrides, absent, present):
    """Llama-3.1-70B's advice suggested dtype.params: bfloat16 to a config that had it: the optimizer's remedies
    leave out the weights' dtype and LoRA where the config has them already."""
    line = _advice_for(overrides, "optimizer")
    assert not any(a in line for a in absent) and all(p in line for p in present), line


@pytest.mark.slow
def test_context_parallelism_compiles_with_the_keys_gathered_over_the_context_chips(tmp_path, capsys, monkeypatch):
    """Slow (a 15 s TPU compile): mesh.context 2 x fsdp 2 on v5e:2x2. The compiled step's attention all-gathers
    each layer's keys/values over the context pairs of chips (a chip's [4 rows, 2 heads, 32 tokens, 16] to the
    row's 64 tokens: its sequence is split), and the report's mesh shows the context axis."""
    from tests.program_checks import keep_compiled_text

    texts = keep_compiled_text(monkeypatch)
    f = _config(tmp_path, TINY, "mesh:\n  fsdp: 2\n  context: 2\n")
    report = tmp_path / "report.json"
    assert _main("pretrain")(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2",
                              "--report", str(report)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(report.read_text())
    assert rep["mesh"]["context"] == 2 and rep["mesh"]["fsdp"] == 2 and "fsdp 2 x context 2" in out
    gathers = [line for line in texts[0].splitlines() if "all-gather(" in line and "shard_map/all_gather" in line]
    assert any("[4,2,64,16]" in line and "dimensions={2}" in line for line in gathers), gathers


def _task_classes(command: str) -> tuple:
    """The task classes ``command train`` picks from (pretrain.task.task_for)."""
    if command == "pretrain":
        from pretrain.task import PretrainTask

        return (PretrainTask,)
    if command == "rm":
        from rm.cli import reward_tasks

        return reward_tasks()
    from grpo.cli import grpo_tasks

    return grpo_tasks()


@pytest.mark.parametrize("command,extra", [
    ("pretrain", []),
    ("rm", []),  # the score head drawn in place of the LM head
    ("grpo", ["grpo.rewards=[final_number]", "grpo.num_generations=2", "grpo.max_completion_length=4",
              "grpo.beta=0.1"]),  # full fine-tuning's reference: a copy of the starting model
])
def test_the_compile_only_state_is_the_runs_own_layout(tmp_path, command, extra):
    """One set-up path: the set-up a run makes its arrays with (pretrain.setup.RUN) and the one --compile-only
    lowers from (LAYOUT) give the same trees of the same shapes, dtypes and shardings: the model the task trains,
    its frozen inputs and the train state."""
    import jax

    from pretrain.config import load_config
    from pretrain.loop import build_step, prepare_task
    from pretrain.setup import LAYOUT, RUN, TokenIds, run_mesh, set_up_model
    from pretrain.task import task_for

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    classes = _task_classes(command)
    cfg = load_config(None, ["model.init=random", f"model.config={tmp_path / 'config.json'}", "data.path=none",
                             "model.tokenizer=none", "max_steps=1", "batch_size=2", "data.seq_len=16", *extra],
                      classes[0].config_class)
    mesh = run_mesh(cfg, jax.devices())

    def layout(arrays):
        task = task_for(cfg, classes)
        model = set_up_model(cfg, mesh, arrays)
        model, _, frozen_inputs = prepare_task(cfg, task, model, arrays, TokenIds.stand_in(model.mcfg))
        step = build_step(cfg, task, model, frozen_inputs, arrays, 1)
        described = lambda x: (x.shape, x.dtype, x.sharding.spec)  # noqa: E731
        return model.mcfg, jax.tree.map(described, (model.params, frozen_inputs, step.state))

    assert layout(RUN) == layout(LAYOUT)


@pytest.mark.slow
def test_bfloat16_full_fine_tuning_keeps_no_float32_copy_of_a_gradient(tmp_path):
    """Slow (a TPU compile of 2 layers, 9 s): the step divides each gradient leaf by the token count in the leaf's
    own dtype. Divided by the float32 count, a bfloat16 leaf became a float32 copy of itself, which XLA kept where
    the layers' stacked gradients change layout after the layer scan (f32[2,2048,128] and three more here, in the
    chip's fast memory; 896 MiB of HBM a chip on Llama-3.1-8B, the largest buffer on 70B). No buffer of the
    compiled step, in any memory, is float32 and shaped like a chip's shard of a layer's bfloat16 weights, by the
    compiler's own buffer assignment."""
    import re

    import jax

    from pretrain.compile_only import abstract_run
    from pretrain.config import load_config
    from pretrain.task import PretrainTask, task_for
    from zoo.compiled.compiler import compile_lowered, dump_options
    from zoo.compiled.topology import topology_devices
    from zoo.kernels.choice import target

    # The smallest model that still shows the old division's copy of the MLP's down gradient (checked against it:
    # half as wide again keeps only the attention's): a third of the compile time of 4 layers of 1024 x 4096.
    mid = {**TINY, "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 2,
           "num_attention_heads": 4, "head_dim": 128}
    f = _config(tmp_path, mid, "remat: full\ndtype:\n  params: bfloat16\n  compute: bfloat16\n")
    cfg = load_config(f, [], PretrainTask.config_class)
    devices = topology_devices("v5e:2x2")
    run = abstract_run(cfg, task_for(cfg, (PretrainTask,)), "v5e:2x2", devices)
    with target("tpu", len(devices)):
        lowered = run.step.train.lower(run.state, run.batch, run.model.frozen, frozen_inputs=run.frozen_inputs)
    compile_lowered(lowered, "tpu", dump_options(str(tmp_path / "dump")), devices[0].device_kind)
    # the shards of the weights stacked over the 2 layers (their norms' gradients are float32 by design, in
    # rms_norm's backward, and so is the head's, in the chunked loss: neither is this division's)
    shards = {"f32[" + ",".join(map(str, shape)) + "]" for x in jax.tree.leaves(run.state["params"])
              if x.dtype == jax.numpy.bfloat16 and len(shape := x.sharding.shard_shape(x.shape)) >= 3}
    assert "f32[2,2048,128]" in shards  # the MLP's down weights, whose gradient the old division copied
    text = next((tmp_path / "dump").glob("*after_optimizations-buffer-assignment.txt")).read_text()
    values = re.findall(r"^ value: <\d+ (\S+) @\d+> \(size=\d+,offset=\d+\): (\w+\[[\d,]*\])", text, re.M)
    assert values and not [(name, shape) for name, shape in values if shape in shards]


def test_a_run_without_data_or_length_is_refused_unless_it_only_compiles(tmp_path, capsys):
    """The config compile-only takes without data.path and max_steps (the test above) is refused, in one line,
    by a run that trains, before any model code loads."""
    f = _config(tmp_path, TINY, "lora:\n  rank: 4\n", data=False)
    assert _main("sft")(["train", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: config needs `data.path` (a jsonl/json/parquet/txt file or folder)"], err
    g = _config(tmp_path, TINY, f"data:\n  path: {tmp_path / 'absent.jsonl'}\n", name="nolength.yaml", data=False)
    assert _main("sft")(["train", "--config", str(g)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: config needs `max_steps` or `epochs`"]
