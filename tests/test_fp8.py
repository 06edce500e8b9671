"""FP8 block-scaled checkpoints (DeepSeek-V3/R1's Hub format): dequantized while converting, exactly.

The FP8 checkpoints here are made by this file's own tooling (``quantize_blocks``: one scale per 128 x 128
block, ``scale = amax / 448``, written as ``<name>_scale_inv`` with the real safetensors library), and the
oracle is transformers' model loaded with this file's own dequantized weights.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from convert.fp8 import BlockScaling, dequantize
from tests.hf_models import make_hf, mean_kl, random_tokens
from zoo.cli import main

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def reference_dequant(w: np.ndarray, s: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """DeepSeek's formula, elementwise and whole: ``dtype(fp32(w[i, j]) * s[i // 128, j // 128])``."""
    i = np.arange(w.shape[0])[:, None] // 128
    j = np.arange(w.shape[1])[None, :] // 128
    return (w.astype(np.float32) * s.astype(np.float32)[i, j]).astype(dtype)


def random_fp8(shape, rng) -> np.ndarray:
    """Every finite e4m3 bit pattern (zeros, subnormals, both signs) at random; NaN codes left out."""
    bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C
    return bits.view(FP8)


@pytest.mark.parametrize("shape", [(576, 7168), (300, 200), (128, 128), (7, 129), (1, 1)])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_dequantize_is_deepseeks_formula_bit_for_bit(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    w = random_fp8(shape, rng)
    grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    if shape == (576, 7168):
        assert grid == (5, 56)  # DeepSeek-V3's kv_a_proj_with_mqa: a 64-row tail block
    s = np.exp(rng.uniform(-20, 5, size=grid)).astype(np.float32)
    got = dequantize(w, s, BlockScaling(128, 128), dtype)
    want = reference_dequant(w, s, dtype)
    assert got.dtype == dtype and got.shape == shape
    assert np.array_equal(got.view(np.uint8 if dtype.itemsize == 1 else f"u{dtype.itemsize}"),
                          want.view(f"u{dtype.itemsize}"))
    if dtype == BF16:  # and what DeepSeek's own (torch) weight_dequant rounds to
        t = torch.from_numpy(w.view(np.uint8)).view(torch.float8_e4m3fn).float()
        ts = torch.from_numpy(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
        ref = (t * ts).to(torch.bfloat16).view(torch.int16).numpy()
        assert np.array_equal(got.view(np.int16), ref)


def test_non_square_blocks_index_rows_and_columns_apart():
    rng = np.random.default_rng(1)
    w = random_fp8((10, 9), rng)
    s = rng.uniform(0.5, 2, size=(3, 5)).astype(np.float32)  # 4-row, 2-column blocks
    got = dequantize(w, s, BlockScaling(4, 2), np.dtype(np.float32))
    want = w.astype(np.float32) * s[np.arange(10)[:, None] // 4, np.arange(9)[None, :] // 2]
    assert np.array_equal(got, want)


# --- test tooling: make an FP8 block-scaled checkpoint out of a transformers one -------------------------


def quantize_blocks(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Per-block e4m3 quantization, as DeepSeek's checkpoints are made: ``scale = amax / 448``."""
    rows, cols = w.shape
    s = np.ones((math.ceil(rows / block), math.ceil(cols / block)), np.float32)
    q = np.zeros(w.shape, FP8)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = w[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block].astype(np.float32)
            amax = float(np.abs(blk).max())
            s[bi, bj] = amax / 448.0 if amax > 0 else 1.0
            q[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block] = (blk / s[bi, bj]).astype(FP8)
    return q, s


# q/kv/o, kv_a_proj_with_mqa, MLP, shared and routed experts, MTP's eh_proj
FP8_SUFFIXES = ("proj.weight", "proj_with_mqa.weight")


def _is_fp8_weight(name: str, x: np.ndarray) -> bool:
    """What DeepSeek stores as FP8: every 2-D projection but the embeddings, the head and the router."""
    return x.ndim == 2 and name.endswith(FP8_SUFFIXES)


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == FP8:
        return torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def make_fp8_checkpoint(src: Path, fp8_dir: Path, ref_dir: Path, mtp: bool = False) -> dict[str, np.ndarray]:
    """From the fp32 transformers folder ``src``: ``fp8_dir`` (FP8 projections + ``_scale_inv``, everything else
    bf16 but ``e_score_correction_bias``, quantization_config set; with ``mtp``, an MTP layer past the last) and
    ``ref_dir`` (the same weights dequantized to fp32, no MTP, no quantization_config). Returns the dequantized
    fp32 tensors of the FP8 folder, MTP included."""
    with safe_open(src / "model.safetensors", "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.loads((src / "config.json").read_text())
    if mtp:  # DeepSeek's layer 61: a decoder layer (here a copy of the last) plus its own norms and projection
        last, nxt = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
        d = cfg["hidden_size"]
        rng = np.random.default_rng(7)
        for k in [k for k in tensors if k.startswith(f"model.layers.{last}.")]:
            tensors[k.replace(f".{last}.", f".{nxt}.", 1)] = tensors[k] * 1.5
        p = f"model.layers.{nxt}."
        tensors[p + "enorm.weight"] = np.ones(d, np.float32)
        tensors[p + "hnorm.weight"] = np.ones(d, np.float32)
        tensors[p + "eh_proj.weight"] = rng.normal(0, 0.1, (d, 2 * d)).astype(np.float32)
        tensors[p + "shared_head.norm.weight"] = np.ones(d, np.float32)
        cfg["num_nextn_predict_layers"] = 1
    stored, deq = {}, {}
    for k, x in tensors.items():
        if _is_fp8_weight(k, x):
            q, s = quantize_blocks(x)
            stored[k], stored[k + "_scale_inv"] = q, s
            deq[k] = reference_dequant(q, s, np.dtype(np.float32))
        elif k.endswith("e_score_correction_bias"):
            stored[k] = deq[k] = x.astype(np.float32)
        else:
            stored[k] = x.astype(BF16)
            deq[k] = stored[k].astype(np.float32)
    for d in (fp8_dir, ref_dir):
        d.mkdir(parents=True)
    save_file({k: _torch(v) for k, v in stored.items()}, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    (fp8_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": QCONFIG}))
    n = cfg["num_hidden_layers"]
    ref = {k: v for k, v in deq.items() if not k.startswith(f"model.layers.{n}.")}
    save_file({k: _torch(v) for k, v in ref.items()}, ref_dir / "model.safetensors", metadata={"format": "pt"})
    (ref_dir / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    return deq


def _transformers(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return model


def _logits_match(model, ckpt: Path, vocab: int) -> None:
    import zoo

    tokens = random_tokens(vocab)
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    got = np.asarray(zoo.load(ckpt)(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6, np.abs(got - ref).max()


# hidden 160 and intermediate 200: weights of two blocks a side with a partial tail block in rows and columns.
DEEPSEEK = dict(hidden_size=160, intermediate_size=200)


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-deepseek")
    make_hf(root / "src", "deepseek_v3", **DEEPSEEK)
    deq = make_fp8_checkpoint(root / "src", root / "fp8", root / "ref", mtp=True)
    return root, deq


@pytest.mark.slow
def test_tiny_deepseek_v3_fp8_converts_to_transformers_logits(deepseek_fp8, tmp_path, monkeypatch, capsys):
    """Converted by its registry name, `zoo convert deepseek-r1`: the name resolves to the Hub repository, found
    in the local cache (here: the tiny FP8 model; offline, conftest.py sets HF_HUB_OFFLINE; the cache set as
    tests/test_model_card.py sets it). test_keep_mtp_keeps_the_layer_for_export converts the folder itself."""
    import huggingface_hub.constants

    from tests.hub_runs import lay_out_hf_cache

    root, deq = deepseek_fp8
    with safe_open(root / "fp8" / "model.safetensors", "pt") as f:  # the tooling made what DeepSeek ships
        assert f.get_tensor("model.layers.3.self_attn.kv_a_proj_with_mqa.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.gate_proj.weight_scale_inv").shape == (2, 2)
        assert f.get_tensor("model.layers.3.mlp.gate.weight").dtype == torch.bfloat16
    lay_out_hf_cache(tmp_path / "cache", "deepseek-ai/DeepSeek-R1", root / "fp8")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    out = root / "zoo"
    assert main(["convert", "deepseek-r1", "--out", str(out), "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    # The MTP layer is dropped and reported; the summary counts what was dequantized.
    assert "dropped the multi-token-prediction layer" in err and "model.layers.4" in err and "--keep-mtp" in err
    n_fp8 = sum(1 for k in deq if k.endswith(FP8_SUFFIXES))
    kept_fp8 = sum(1 for k in deq if k.endswith(FP8_SUFFIXES) and ".layers.4." not in k)
    summary = [ln for ln in err.splitlines() if ln.startswith("fp8:")]
    assert len(summary) == 1 and f"dequantized {kept_fp8} of {n_fp8} FP8 tensors" in summary[0], err
    assert " in (weights + scales)" in summary[0] and "out" in summary[0]
    _logits_match(_transformers(root / "ref"), out, 96)
    # Nothing of the quantization is left in the checkpoint: no scale tensor, no quantization_config.
    for f in out.rglob("*"):
        if f.is_file():
            assert b"scale_inv" not in f.read_bytes() and b"quantization_config" not in f.read_bytes(), f
    assert json.loads((out / "hf_config.json").read_text())["num_nextn_predict_layers"] == 0  # what it holds

    # zoo export writes an ordinary HF folder that transformers loads, with the same logits.
    assert main(["export", str(out), "--out", str(root / "back")]) == 0
    back = json.loads((root / "back" / "config.json").read_text())
    assert "quantization_config" not in back
    with safe_open(root / "back" / "model.safetensors", "np") as f:
        names = set(f.keys())
        assert not any("scale_inv" in k or ".layers.4." in k for k in names)
        for k in names:  # every weight is the dequantized one, bit for bit
            assert np.array_equal(f.get_tensor(k), deq[k]), k
    assert names == {k for k in deq if ".layers.4." not in k}
    _logits_match(_transformers(root / "back"), out, 96)


def test_keep_mtp_keeps_the_layer_for_export(deepseek_fp8, capsys):
    root, deq = deepseek_fp8
    out = root / "zoo-mtp"
    capsys.readouterr()
    assert main(["convert", str(root / "fp8"), "--out", str(out), "--keep-mtp"]) == 0
    err = capsys.readouterr().err
    assert "dropped" not in err
    n_fp8 = sum(1 for k in deq if k.endswith(FP8_SUFFIXES))  # every FP8 tensor, MTP's included
    assert f"dequantized {n_fp8} of {n_fp8} FP8 tensors" in err and "to bfloat16" in err
    assert main(["export", str(out), "--out", str(root / "back-mtp")]) == 0
    cfg = json.loads((root / "back-mtp" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and "quantization_config" not in cfg
    with safe_open(root / "back-mtp" / "model.safetensors", "np") as f:
        mtp = {k for k in f.keys() if k.startswith("model.layers.4.")}
        assert mtp == {k for k in deq if k.startswith("model.layers.4.")} and "model.layers.4.eh_proj.weight" in mtp
        for k in mtp:  # FP8 weights dequantized to bf16 (the default), rounded once; the rest as stored
            x = f.get_tensor(k)
            want = np.dtype(np.float32) if k.endswith("e_score_correction_bias") else BF16
            assert x.dtype == want and np.array_equal(x.astype(np.float32), deq[k].astype(want).astype(np.float32)), k
        assert not any("scale_inv" in k for k in f.keys())


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_dense_fp8_block_scaled_checkpoints_convert(tmp_path, family, request):
    if family == "llama":  # the user-error tests' folders (llama_fp8): made the same way, once
        root = request.getfixturevalue("llama_fp8").parent
    else:
        root = tmp_path
        make_hf(root / "src", family, hidden_size=160, intermediate_size=200)
        make_fp8_checkpoint(root / "src", root / "fp8", root / "ref")
    assert main(["convert", str(root / "fp8"), "--out", str(tmp_path / "zoo"), "--dtype", "float32"]) == 0
    _logits_match(_transformers(root / "ref"), tmp_path / "zoo", 96)


# --- what a user gets wrong -------------------------------------------------------------------------------


def _edit_fp8(root: Path, dest: Path, tensors=None, config=None) -> Path:
    """A copy of the llama FP8 folder with some tensors replaced/removed (None) and the config edited."""
    with safe_open(root / "model.safetensors", "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in (tensors or {}).items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v
    dest.mkdir()
    save_file(t, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((root / "config.json").read_text())
    for k, v in (config or {}).items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-llama")
    make_hf(root / "src", "llama", hidden_size=160, intermediate_size=200)
    make_fp8_checkpoint(root / "src", root / "fp8", root / "ref")
    return root / "fp8"


W = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("case, edit, words", [
    ("missing scale", dict(tensors={W + "_scale_inv": None}), [repr(W), "_scale_inv"]),
    ("bad grid", dict(tensors={W + "_scale_inv": torch.ones(1, 1)}), [repr(W + "_scale_inv"), "(1, 1)", "(2, 2)"]),
    ("other method", dict(config={"quantization_config": {"quant_method": "bitsandbytes"}}),
     ["'bitsandbytes'", "fp8"]),
    ("per-tensor", dict(config={"quantization_config": {**QCONFIG, "weight_block_size": None}}),
     ["weight_block_size", "per-tensor"]),
    ("no quantization_config", dict(config={"quantization_config": None}), ["FP8", "quantization_config"]),
])
def test_fp8_user_errors_are_one_line(llama_fp8, tmp_path, capsys, case, edit, words):
    src = _edit_fp8(llama_fp8, tmp_path / "src", **edit)
    capsys.readouterr()
    assert main(["convert", str(src), "--out", str(tmp_path / "zoo")]) == 2, case
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert all(w in err[0] for w in words), err[0]
    assert not (tmp_path / "zoo").exists()


def test_keep_mtp_without_an_mtp_layer_is_a_user_error(llama_fp8, tmp_path, capsys):
    capsys.readouterr()
    assert main(["convert", str(llama_fp8), "--out", str(tmp_path / "zoo"), "--keep-mtp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep-mtp" in err[0] and "multi-token-prediction" in err[0]
    assert not (tmp_path / "zoo").exists()


# --- memory: one tensor at a time, FP8 too -----------------------------------------------------------------

# torch blocked (import fails, find_spec answers None): the conversion needs none
# (tests/test_runtime_without_test_extras.py), and transformers' config classes would import it, seconds a process.
PROBE = textwrap.dedent("""
    import json, sys
    sys.modules["torch"] = None
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    from convert.convert import convert
    import jax; jax.numpy.zeros(1).block_until_ready()
    import orbax.checkpoint  # noqa: F401  (imports are not the conversion's cost)
    before = status("VmHWM")
    convert(sys.argv[1], sys.argv[2], progress=False)
    print(json.dumps({"peak": status("VmHWM"), "before": before}))
""")


def _convert_peak(hf: Path, out: Path) -> int:
    """Bytes the conversion of ``hf`` raised the process's peak RSS by, in a fresh process."""
    p = subprocess.run([sys.executable, "-c", PROBE, str(hf), str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    return m["peak"] - m["before"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_fp8_conversion_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """An FP8 llama (~125 MB, its projections dequantizing to 180 MiB of bf16) converts within the peak memory of
    the same model stored in bf16, plus a couple of its largest dequantized tensors: one tensor at a time.
    Slow (about 87 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.convert_memory import build_checkpoint, build_fp8_checkpoint

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 1024,
           "intermediate_size": 4096, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 128, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    fp8_files = build_fp8_checkpoint(tmp_path / "fp8", config=cfg)
    build_checkpoint(tmp_path / "bf16", config=cfg)
    mib = 2**20
    largest_fp8 = 4096 * 1024 * 2  # an MLP projection dequantized to bf16 (8 MiB)
    dequantized = 6 * (2 * 1024 * 1024 + 2 * 512 * 1024 + 3 * 4096 * 1024) * 2  # every projection, in bf16
    assert sum(f.stat().st_size for f in fp8_files) > 110 * mib and dequantized >= 180 * mib
    fp8_peak = _convert_peak(tmp_path / "fp8", tmp_path / "zoo-fp8")
    bf16_peak = _convert_peak(tmp_path / "bf16", tmp_path / "zoo-bf16")
    # Holding the FP8 weights (~95 MB) or their dequantized copies (180 MiB) would stand far above this.
    assert fp8_peak <= bf16_peak + 2 * largest_fp8 + 32 * mib, (fp8_peak / mib, bf16_peak / mib)
