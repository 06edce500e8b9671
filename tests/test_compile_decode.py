"""`zoo generate --compile-only --topology NAME`: generation's programs compiled for a TPU slice on this CPU machine
(libtpu), without weights or a tokenizer: the report, the KV cache's bytes, the exit codes (0 fits, 3 does not, 2
user errors), and decoding's weight layout (no weight gathered at each token on an FSDP mesh)."""

import json
import re

import pytest

from eval.generate import Sampler
from zoo.cli import main

# Grouped-query attention: 8 query heads over 4 kv heads, which divide a v5e:2x2's 4 chips.
GQA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
       "head_dim": 16, "tie_word_embeddings": False}
KEYS = {"topology", "chips", "device_kind", "hbm_bytes_per_chip", "mesh", "fits", "bytes_per_chip", "programs",
        "batch", "prompt_length", "max_new_tokens", "cache_length", "dtype", "compile_seconds"}


def _model(tmp_path, model: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(model))
    return str(tmp_path / "config.json")


def test_generation_compiles_for_a_4_chip_slice_with_the_cache_split_by_heads(tmp_path, capsys):
    """4 prompts of 20 tokens + 8 new: the prefill and one step (cache view 64) compile for v5e:2x2; the KV cache
    a chip holds is the analytic size over the 4 chips its kv heads split over, and the weights are split 4 ways
    but the norms (tensor-parallel, embed whole)."""
    report = tmp_path / "report.json"
    code = main(["generate", _model(tmp_path, GQA), "--compile-only", "--topology", "v5e:2x2", "--report",
                 str(report), "--batch-size", "4", "--prompt-length", "20", "--max-new-tokens", "8"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rep = json.loads(report.read_text())
    assert KEYS <= set(rep) and rep["fits"] is True and rep["chips"] == 4
    assert rep["topology"] == "v5e:2x2" and rep["hbm_bytes_per_chip"] == 15.75 * 2**30  # the compiler's own limit
    assert rep["mesh"]["fsdp"] == 4  # zoo.load's mesh
    assert set(rep["programs"]) == {"prefill", "step@64"}  # prompts rounded to 32 slots, +8 -> a 64-slot cache
    assert rep["cache_length"] == 64
    parts = rep["bytes_per_chip"]
    # k and v x layers x rows x kv heads x head_dim x slots x float32 bytes / 4 chips
    assert parts["kv_cache"] == 2 * 2 * 4 * 4 * 16 * 64 * 4 // 4
    e, v, f, h, kv, d, n = 64, 256, 128, 8, 4, 16, 2
    split = 2 * v * e + n * (e * h * d + 2 * e * kv * d + h * d * e + 3 * e * f)
    norms = 2 * n * e + e
    assert parts["weights"] == split * 4 // 4 + norms * 4
    assert parts["total"] >= parts["weights"] + parts["kv_cache"] + parts["temporaries"]
    assert all(p["total"] > p["temporaries"] > 0 for p in rep["programs"].values())
    assert "kv_cache GiB/chip" in out.out and "fits" in out.out and "v5e:2x2 (4 chips, TPU v5 lite" in out.out


def test_a_generation_that_cannot_fit_exits_3(tmp_path, capsys):
    """4096 prompts of 4000 tokens + 96 new on 4 chips of 16 GiB: a 4 GiB KV cache a chip, and a prefill whose
    temporaries the TPU compiler refuses (its figure is reported)."""
    report = tmp_path / "report.json"
    code = main(["generate", _model(tmp_path, GQA), "--compile-only", "--topology", "v5e:2x2", "--report",
                 str(report), "--batch-size", "4096", "--prompt-length", "4000", "--max-new-tokens", "96"])
    out = capsys.readouterr().out
    rep = json.loads(report.read_text())
    assert code == 3 and rep["fits"] is False
    assert rep["bytes_per_chip"]["kv_cache"] == 2 * 2 * 4096 * 4 * 16 * 4096 * 4 // 4  # 4 GiB a chip
    assert rep["bytes_per_chip"]["temporaries"] > 16 * 2**30
    assert rep["advice"][0].startswith("over by ") and "the TPU compiler refused" in rep["advice"][-1]
    assert "NO" in out


@pytest.mark.parametrize("args,message", [
    (["--compile-only", "--topology", "v9z:2x2"], "--topology v9z:2x2: Invalid TPU external name"),
    (["--compile-only"], "--compile-only needs --topology, e.g. --topology v5e:2x4"),
    (["--topology", "v5e:2x2"], "--topology, --report and --prompt-length go with --compile-only"),
    (["--compile-only", "--topology", "v5e:2x2", "--batch-size", "0"], "need --max-new-tokens >= 1, --batch-size"),
    (["--compile-only", "--topology", "v5e:2x2", "--image", "a.png"], "--image does not go with --compile-only"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, capsys, args, message):
    assert main(["generate", _model(tmp_path, GQA), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err


def test_a_token_step_on_an_fsdp_mesh_gathers_no_weight(tmp_path):
    """The per-token step on v5e:2x2 with every chip on fsdp (zoo.load's mesh): FSDP's embed-split weights were
    all-gathered at every token (temporaries of a gathered layer); laid out for decoding, every collective moves
    activations only (smaller than the smallest weight matrix) and the temporaries stay under one layer's
    weights."""
    import jax.numpy as jnp

    from eval.generate_compile import lower_generation
    from pretrain.setup import model_config_of
    from zoo.compiled.compiler import compile_lowered
    from zoo.compiled.topology import topology_devices
    from zoo.model.sharding import make_mesh

    wide = {**GQA, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 1024, "head_dim": 32}
    cfg = model_config_of(_model(tmp_path, wide), "model")
    mesh = make_mesh(devices=topology_devices("v5e:2x2"))
    assert dict(mesh.shape)["fsdp"] == 4
    low = lower_generation(cfg, mesh, 4, 20, 8, Sampler(0.0, 0, 1.0), jnp.float32)
    compiled = compile_lowered(low.programs["step@64"], "tpu")
    e, f, h, kv, d = 256, 1024, 8, 4, 32
    smallest_weight = e * kv * d * 4  # k's [embed, kv heads, head_dim] float32: 128 KiB
    layer = (2 * e * h * d + 2 * e * kv * d + 3 * e * f) * 4  # one layer's matrices: 4.5 MiB
    moved = [_bytes(m[1], m[2]) for m in re.finditer(
        r"= (f32|bf16|s32|u32|pred)\[([\d,]*)\]\S* (?:all-gather|all-to-all|collective-permute)", compiled.as_text())]
    assert max(moved, default=0) < smallest_weight, sorted(moved)[-5:]
    assert compiled.memory_analysis().temp_size_in_bytes < layer


def _bytes(dtype: str, dims: str) -> int:
    n = 1
    for x in filter(None, dims.split(",")):
        n *= int(x)
    return n * {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}[dtype]
