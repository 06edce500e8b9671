"""`zoo generate --compile-only --topology NAME`: the inference engine's programs (eval/engine/paged.py's prefill and
decode over a paged KV cache) compiled for a TPU slice on this CPU machine (libtpu), without weights or a
tokenizer: the report, the weights' and the page pool's bytes a chip by the compiler against the model's
arithmetic, the exit codes (0 fits, 3 does not, 2 user errors), and decoding's weight layout (no weight gathered
at each token on an FSDP mesh)."""

import json
import re

import pytest

from zoo.cli import main

# Grouped-query attention: 8 query heads over 4 kv heads, which divide a v5e:2x2's 4 chips.
GQA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
       "head_dim": 16, "tie_word_embeddings": False}
# Every split dimension a whole number of the TPU's 128 lanes on each of 4 chips (a head_dim of 16 is padded to
# 128 in the chip's tiled layout), so the compiler's bytes are the model's arithmetic.
LANES = {**GQA, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
         "head_dim": 128}
KEYS = {"topology", "chips", "device_kind", "hbm_bytes_per_chip", "mesh", "fits", "bytes_per_chip", "programs",
        "max_seqs", "page_size", "pages", "prefill_rows", "prefill_tokens", "prompt_length", "max_new_tokens",
        "cache_length", "dtype", "compile_seconds"}


def _model(tmp_path, model: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(model))
    return str(tmp_path / "config.json")


def test_the_engine_compiles_for_a_4_chip_slice_with_the_pool_split_by_heads(tmp_path, capsys):
    """3 sequences (--batch-size's, --max-seqs unset) of 20 prompt tokens + 8 new on v5e:2x2 in bfloat16 (--dtype:
    weights and pool; the other tests compile float32, the default): the engine's prefill
    (3 rows padded to 4, 20 tokens to 32) and decode compile; the pool holds 3 x 2 pages of 16 tokens (28 tokens
    rounded up to 32). By the compiler (memory_analysis): the donated pool a chip is the arithmetic of its pages
    over the 4 chips its kv heads split over, and each program's arguments are the weights split 4 ways (but the
    norms) and the pool, plus its rows' few ints."""
    report = tmp_path / "report.json"
    code = main(["generate", _model(tmp_path, LANES), "--compile-only", "--topology", "v5e:2x2", "--report",
                 str(report), "--batch-size", "3", "--prompt-length", "20", "--max-new-tokens", "8",
                 "--dtype", "bfloat16"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rep = json.loads(report.read_text())
    assert KEYS <= set(rep) and rep["fits"] is True and rep["chips"] == 4
    assert rep["topology"] == "v5e:2x2" and rep["hbm_bytes_per_chip"] == 15.75 * 2**30  # the compiler's own limit
    assert rep["mesh"]["fsdp"] == 4  # zoo.load's mesh
    assert set(rep["programs"]) == {"prefill", "decode"}
    assert (rep["max_seqs"], rep["page_size"], rep["pages"], rep["cache_length"]) == (3, 16, 6, 32)
    assert (rep["prefill_rows"], rep["prefill_tokens"], rep["dtype"]) == (4, 32, "bfloat16")
    parts = rep["bytes_per_chip"]
    # k and v x layers x pages x page x kv heads x head_dim x bfloat16 bytes / 4 chips
    pool = 2 * 2 * 6 * 16 * 4 * 128 * 2 // 4
    assert parts["kv_cache"] == pool
    e, v, f, h, kv, d, n = 128, 512, 512, 4, 4, 128, 2
    split = 2 * v * e + n * (e * h * d + 2 * e * kv * d + h * d * e + 3 * e * f)
    norms = 2 * n * e + e
    assert parts["weights"] == split * 2 // 4 + norms * 2
    for p in rep["programs"].values():
        assert p["donated"] == pool  # the pool, donated to each program and returned
        assert 0 <= p["arguments"] - parts["weights"] - pool < 64 * 2**10  # tokens, tables, lengths, sampling
        assert p["total"] > p["arguments"] + p["temporaries"] and p["temporaries"] > 0
    assert parts["total"] == max(p["total"] for p in rep["programs"].values())
    assert "kv_cache GiB/chip" in out.out and "fits" in out.out and "v5e:2x2 (4 chips, TPU v5 lite" in out.out


def test_a_prompt_over_the_prefill_budget_is_compiled_as_its_widest_chunk():
    """A 40,000-token prompt is prefilled in chunks of PREFILL_TOKENS (eval.engine.engine): --compile-only lowers
    one row's chunk of that many tokens reading the pages before it (not a fresh 65,536-token prefill), its page
    table the row's whole; a short prompt's prefill stays one fresh piece."""
    from eval.engine.engine import PREFILL_TOKENS
    from eval.generate_compile import EngineShape

    long = EngineShape.of(2, 40_000, 8, 16)
    assert (long.prefill_rows, long.prefill_tokens, long.prefill_fresh) == (1, PREFILL_TOKENS, False)
    assert long.prefill_width == long.table_width == 40_032 // 16  # max_len: 40,008 rounded up
    short = EngineShape.of(3, 20, 8, 16)
    assert (short.prefill_rows, short.prefill_tokens, short.prefill_fresh) == (4, 32, True)


def test_a_generation_that_cannot_fit_exits_3(tmp_path, capsys):
    """4096 sequences of 4000 prompt tokens + 96 new on 4 chips of 16 GiB: a pool of 1,048,576 pages (4 GiB a chip
    by its arithmetic), and a prefill of the 4096 prompts together whose temporaries the TPU compiler refuses (its
    figure is reported)."""
    report = tmp_path / "report.json"
    code = main(["generate", _model(tmp_path, GQA), "--compile-only", "--topology", "v5e:2x2", "--report",
                 str(report), "--max-seqs", "4096", "--prompt-length", "4000", "--max-new-tokens", "96"])
    out = capsys.readouterr().out
    rep = json.loads(report.read_text())
    assert code == 3 and rep["fits"] is False
    assert rep["pages"] == 4096 * 4096 // 16
    assert rep["bytes_per_chip"]["kv_cache"] == 2 * 2 * 4096 * 4 * 16 * 4096 * 4 // 4  # 4 GiB a chip
    assert rep["programs"]["prefill"]["temporaries"] > 16 * 2**30
    assert rep["bytes_per_chip"]["temporaries"] == rep["programs"]["prefill"]["temporaries"]
    assert rep["advice"][0].startswith("over by ")
    assert any(a.startswith("the TPU compiler refused the prefill program") for a in rep["advice"])
    assert "NO" in out


@pytest.mark.parametrize("args,message", [
    (["--compile-only", "--topology", "v9z:2x2"], "--topology v9z:2x2: Invalid TPU external name"),
    (["--compile-only"], "--compile-only needs --topology, e.g. --topology v5e:2x4"),
    (["--topology", "v5e:2x2"], "--topology, --report, --prompt-length, --max-seqs and --page-size go with "
                                "--compile-only"),
    (["--max-seqs", "8"], "--topology, --report, --prompt-length, --max-seqs and --page-size go with"),
    (["--compile-only", "--topology", "v5e:2x2", "--max-seqs", "0"], "--compile-only needs --prompt-length >= 1, "
                                                                     "--max-seqs >= 1 and --page-size >= 1"),
    (["--compile-only", "--topology", "v5e:2x2", "--batch-size", "0"], "need --max-new-tokens >= 1, --batch-size"),
    (["--compile-only", "--topology", "v5e:2x2", "--image", "a.png"], "--image does not go with --compile-only"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, capsys, args, message):
    assert main(["generate", _model(tmp_path, GQA), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err


def test_a_token_step_on_an_fsdp_mesh_gathers_no_weight(tmp_path):
    """The engine's programs on v5e:2x2 with every chip on fsdp (zoo.load's mesh) take the shapes the engine runs:
    the step's page tables at their widest (every row at max_len), the prefill's rows and pages padded as
    Engine._prefill pads them. The step, its weights laid out for decoding, keeps every weight resident: each
    collective moves activations only (smaller than the smallest weight matrix), and its temporaries (the rows'
    gathered pages among them) stay under one layer's weights. (The one-token step before the engine gathered
    FSDP's embed-split weights at every token; the engine's step keeps even that layout's weights resident on
    this tiny model, so this checks the property, not the layout's need.)"""
    import jax.numpy as jnp

    from eval.generate_compile import EngineShape, lower_engine
    from pretrain.setup import model_config_of
    from zoo.compiled.compiler import compile_lowered
    from zoo.compiled.topology import topology_devices
    from zoo.model.sharding import make_mesh

    wide = {**GQA, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 1024, "head_dim": 32}
    cfg = model_config_of(_model(tmp_path, wide), "model")
    mesh = make_mesh(devices=topology_devices("v5e:2x2"))
    assert dict(mesh.shape)["fsdp"] == 4
    low = lower_engine(cfg, mesh, EngineShape.of(3, 20, 300, 16), jnp.float32)
    # (weights, pool, tokens, valid or active, tables, ...): cfg is static. 320 tokens a sequence: 20 pages of 16,
    # every one read by the step; the prefill's 3 rows padded to 4 (20-token prompts, 32 wide) read the pages of 64
    # tokens (Engine._width: a power of two of at least 64 tokens).
    assert low.programs["decode"].args_info[0][4].shape == (3, 20)
    assert low.programs["prefill"].args_info[0][4].shape == (4, 4)
    compiled = compile_lowered(low.programs["decode"], "tpu")
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
