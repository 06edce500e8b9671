"""gpt-oss in the one decoder (attention sinks, alternating sliding/full layers, biased router and experts, the
clamped SwiGLU, YaRN without truncation) against transformers, and its MXFP4 releases dequantized while converting.

Greedy KV-cache decoding against transformers' generate, and the cached forward against the full one, run for
gpt-oss through tests/hf_models.py FAMILIES in tests/test_decode.py (slow lane), as for every family.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import zoo
from tests.hf_models import FAMILIES, beside, hf_logits, hf_tensors, mean_kl, random_tokens
from zoo.cli import main

SEQ = 24  # past the sliding window (7) of the tiny model
BF16 = np.dtype(ml_dtypes.bfloat16)
EXPERTS = ("gate_up_proj", "down_proj")  # what gpt-oss's releases store in MXFP4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_family):
    """(transformers model, folder with hf/ and zoo/ and room for outputs): the tiny gpt-oss of tests/hf_models.py
    (conftest.py's tiny_family)."""
    hf, shared = tiny_family("gpt_oss")
    return hf, beside(shared, tmp_path_factory.mktemp("gpt-oss"))


def test_logits_match_transformers_past_the_window(tiny):
    hf, root = tiny
    cfg = zoo.read_config(root / "zoo")
    assert cfg.attn_sinks and cfg.expert_bias and cfg.router_logits_bias and cfg.swiglu_limit == 1.5
    assert cfg.kinds == ("sliding", "full", "sliding", "full") and not cfg.rope.truncate
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    ref = hf_logits(hf, tokens)
    got = np.asarray(zoo.load(root / "zoo")(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5


def test_round_trip_is_bit_identical(tiny):
    _, root = tiny
    assert main(["export", str(root / "zoo"), "--out", str(root / "back")]) == 0
    assert hf_tensors(root / "hf") == hf_tensors(root / "back")  # gate_up_proj interleaved again, biases too
    a = json.loads((root / "hf" / "config.json").read_text())
    b = json.loads((root / "back" / "config.json").read_text())
    assert {k: v for k, v in a.items() if "dtype" not in k} == {k: v for k, v in b.items() if "dtype" not in k}


def test_generated_config_reproduces_the_model(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, root = tiny
    shutil.copytree(root / "zoo", tmp_path / "zoo", ignore=shutil.ignore_patterns("hf_config.json"))
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    assert type(back).__name__ == FAMILIES["gpt_oss"][1]
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


def _dense_sink_attention(q, k, v, sinks, scale, window):
    """An independent reference: every score, a causal (windowed) mask, one sink column per head in the softmax
    (transformers' eager_attention_forward), the sink's probability dropped. q [b, kv, g, t, d] -> [b, t, kv*g*d]."""
    t = q.shape[3]
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    ok = (j <= i) if window is None else (j <= i) & (i - j < window)
    s = jnp.where(ok, s, -jnp.inf)
    sink = jnp.broadcast_to(sinks.reshape(1, q.shape[1], q.shape[2], 1, 1), s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], -1), -1)[..., :-1]
    out = jnp.einsum("bhgqk,bhkd->bhgqd", p, v)
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape[0], t, -1)


@pytest.mark.parametrize("window", [None, 40])
def test_sinks_forward_and_gradients_match_a_dense_softmax(window):
    """The blockwise kernel (two query blocks, the window skipping a key block) with sinks: its output and the
    gradients of q, k, v and the sinks (its hand-written backward) against autodiff of a dense softmax."""
    from zoo.kernels.blockwise import blockwise_attention

    # NumPy, then placed: jax.random and eager ops (conversions, the mask's) compile a program per op and shape
    rng = np.random.RandomState(0)
    b, hk, g, t, d = 1, 2, 2, 200, 8
    q, k, v, w = (jnp.asarray(rng.normal(size=s).astype(np.float32))
                  for s in [(b, hk, g, t, d), (b, hk, t, d), (b, hk, t, d), (b, t, hk * g * d)])
    sinks = jnp.asarray((2.0 * rng.normal(size=hk * g)).astype(np.float32))
    pos = np.arange(t)
    causal = np.ones((b, 1, t, t), bool) & (pos[:, None] >= pos[None, :])
    mask = jnp.asarray(causal if window is None else causal & (pos[:, None] - pos[None, :] < window))

    def ours(q, k, v, sinks, mask, w):
        return jnp.sum(blockwise_attention(q, k, v, mask, 0.3, None, window, 128, sinks) * w)

    def ref(q, k, v, sinks, mask, w):
        return jnp.sum(_dense_sink_attention(q, k, v, sinks, 0.3, window) * w)

    # jitted, values and gradients together: one compilation each, not one per eager op; the mask and the output
    # weights arguments, not constants folded into the program (which compiles slower)
    ours_vg, ref_vg = (jax.jit(jax.value_and_grad(f, (0, 1, 2, 3))) for f in (ours, ref))
    (got_value, got_grads), (want_value, want_grads) = ours_vg(q, k, v, sinks, mask, w), ref_vg(q, k, v, sinks, mask, w)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    # the sinks take part: without them the output differs
    assert abs(float(got_value) - float(ours_vg(q, k, v, jnp.asarray(np.full(sinks.shape, -1e9, np.float32)), mask, w)[0])) > 1e-2


def test_kernels_without_sinks_refuse_in_one_line(tiny):
    """cuDNN's and splash's kernels have no sinks: asked for, one line; ``auto`` keeps the blockwise path."""
    import dataclasses

    from zoo.errors import UserError
    from zoo.kernels.choice import cudnn_obstacle, kernel_for, target

    _, root = tiny
    cfg = zoo.read_config(root / "zoo")
    assert "sinks" in cudnn_obstacle(cfg, jnp.bfloat16)
    with pytest.raises(UserError) as e:
        kernel_for(dataclasses.replace(cfg, attention="splash"), jnp.float32, 256)
    assert "splash" in str(e.value) and "sinks" in str(e.value) and "\n" not in str(e.value)
    with target("tpu", 1):
        assert kernel_for(cfg, jnp.bfloat16, 256) == "blockwise"


def test_registry_param_counts_are_the_released_ones():
    """openai/gpt-oss-20b and -120b: 20.91B and 116.83B parameters (OpenAI's model card)."""
    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import count_params
    from zoo.registry.catalogue import get

    for name, billions in (("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)):
        cfg = model_config_from_hf(get(name).hf_config)
        assert round(count_params(cfg) / 1e9, 2) == billions
        assert cfg.kinds[:2] == ("sliding", "full") and cfg.sliding_window == 128 and cfg.swiglu_limit == 7.0


# --- MXFP4 ------------------------------------------------------------------------------------------------------

FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The test's own MXFP4 quantizer, for transformers' layout w [E, in, out] (blocks of 32 along ``in``):
    per block the smallest power of two putting its amax within 6, each value rounded to the nearest E2M1.
    Returns (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32])."""
    e, n_in, n_out = w.shape
    x = w.transpose(0, 2, 1).reshape(e, n_out, n_in // 32, 32).astype(np.float32)
    amax = np.abs(x).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    q = x / np.exp2(exp)[..., None]
    code = np.abs(np.abs(q)[..., None] - FP4_MAGNITUDES).argmin(-1).astype(np.uint8) | ((q < 0) << 3).astype(np.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exp + 127).astype(np.uint8))  # C order for the file


def test_mxfp4_dequantize_equals_transformers_bit_for_bit():
    """Every E2M1 code and every E8M0 scale byte (255 included), to bf16 and float32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from convert.mxfp4 import dequantize

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 256, 2, 16), dtype=np.uint8)
    blocks[0, :, 0] = np.arange(256, dtype=np.uint8).reshape(16, 16).repeat(16, 0)
    scales = rng.integers(0, 256, (3, 256, 2), dtype=np.uint8)
    scales[1, :, 0] = np.arange(256, dtype=np.uint8)
    for tdt, dt, bits in ((torch.bfloat16, BF16, torch.int16), (torch.float32, np.dtype(np.float32), torch.int32)):
        want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=tdt)
        got = dequantize(blocks, scales, dt)
        assert got.dtype == dt and got.shape == tuple(want.shape) == (3, 64, 256)
        assert np.array_equal(got.view(want.view(bits).numpy().dtype), want.view(bits).numpy())


def _mxfp4_folder(hf_dir: Path, dest: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``hf_dir`` as gpt-oss's releases store it: experts' weights as _blocks/_scales, quantization_config mxfp4.
    Returns name -> (blocks, scales) of each quantized weight."""
    dest.mkdir(parents=True)
    with safe_open(hf_dir / "model.safetensors", "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    packed = {}
    for name in list(tensors):
        if name.endswith(EXPERTS):
            packed[name] = quantize_mxfp4(tensors.pop(name))
            tensors[name + "_blocks"], tensors[name + "_scales"] = packed[name]
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dest / "config.json").write_text(json.dumps(cfg))
    return packed


@pytest.fixture(scope="module")
def mxfp4(tiny):
    _, root = tiny
    return _mxfp4_folder(root / "hf", root / "mxfp4"), root / "mxfp4"


def test_mxfp4_checkpoint_converts_to_transformers_logits(tiny, mxfp4, tmp_path, capsys):
    """The oracle: transformers' model with its experts dequantized by transformers' own MXFP4 function."""
    import copy

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, _ = tiny
    packed, folder = mxfp4
    ref_model = copy.deepcopy(hf)
    state = ref_model.state_dict()
    for name, (blocks, scales) in packed.items():
        state[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32)
    ref_model.load_state_dict(state)
    capsys.readouterr()
    assert main(["convert", str(folder), "--out", str(tmp_path / "zoo"), "--dtype", "float32"]) == 0
    assert "mxfp4: dequantized" in capsys.readouterr().err
    assert "quantization_config" not in json.loads((tmp_path / "zoo" / "hf_config.json").read_text())
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    ref = hf_logits(ref_model, tokens)
    got = np.asarray(zoo.load(tmp_path / "zoo")(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5


W = "model.layers.1.mlp.experts.down_proj"


def _edit(src: Path, dest: Path, tensors: dict | None = None, config: dict | None = None) -> Path:
    shutil.copytree(src, dest)
    if tensors:
        with safe_open(src / "model.safetensors", "np") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        for k, v in tensors.items():
            t.pop(k) if v is None else t.__setitem__(k, v)
        save_file(t, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((src / "config.json").read_text())
        cfg.update(config)
        (dest / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dest


@pytest.mark.parametrize("case, edit, words", [
    ("missing scales", dict(tensors={W + "_scales": None}), [repr(W + "_blocks"), repr(W + "_scales")]),
    ("misshapen scales", dict(tensors={W + "_scales": np.zeros((4, 64, 2), np.uint8)}),
     [repr(W + "_scales"), "(4, 64, 2)", "(4, 64, 1)"]),
    ("undeclared", dict(config={"quantization_config": None}), ["mlp.experts.", "_blocks'", "mxfp4",
                                                                 "quantization_config"]),
])
def test_mxfp4_user_errors_are_one_line(mxfp4, tmp_path, capsys, case, edit, words):
    src = _edit(mxfp4[1], tmp_path / "src", **edit)
    capsys.readouterr()
    assert main(["convert", str(src), "--out", str(tmp_path / "zoo")]) == 2, case
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert all(w in err[0] for w in words), err[0]
    assert not (tmp_path / "zoo").exists()


# --- GGUF -------------------------------------------------------------------------------------------------------


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 blocks [..., G, 16] (byte j: elements 2j low, 2j + 1 high) and scales [..., G] as GGML MXFP4
    bytes [..., G * 17]: per block its E8M0 byte, then 16 bytes holding elements j (low nibble) and j + 16 (high),
    as llama.cpp's convert_hf_to_gguf.py repacks gpt-oss. Written here, apart from convert/ and the gguf package."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.ascontiguousarray(np.concatenate([scales[..., None], qs], -1).reshape(*blocks.shape[:-2], -1))


def write_gpt_oss_gguf(hf, packed: dict, path: Path) -> None:
    """The tiny gpt-oss as llama.cpp writes it (architecture ``gpt-oss``): experts MXFP4 (the MXFP4 folder's own
    blocks, repacked; gate and up apart), the rest F32, a small byte-level BPE vocabulary."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    c = hf.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name("tiny-gpt-oss")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(c.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    w.add_sliding_window(c.sliding_window)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    tokens = [chr(i) for i in range(33, 127)] + ["\u0120", "\u0120a"]
    assert len(tokens) == c.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["\u0120 a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
               "output.weight": state["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("attn_norm.weight", "input_layernorm.weight"),
                             ("post_attention_norm.weight", "post_attention_layernorm.weight"),
                             ("attn_sinks.weight", "self_attn.sinks"), ("ffn_gate_inp.weight", "mlp.router.weight"),
                             ("ffn_gate_inp.bias", "mlp.router.bias"), ("ffn_down_exps.bias", "mlp.experts.down_proj_bias")):
            tensors[b + ours] = state[p + theirs]
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            tensors[b + ours + ".weight"] = state[p + f"self_attn.{theirs}.weight"]
            tensors[b + ours + ".bias"] = state[p + f"self_attn.{theirs}.bias"]
        gate_up_bias = state[p + "mlp.experts.gate_up_proj_bias"]
        tensors[b + "ffn_gate_exps.bias"], tensors[b + "ffn_up_exps.bias"] = gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]
    for name, x in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(x, np.float32))
    for i in range(c.num_hidden_layers):
        blocks, scales = packed[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        for name, rows in (("ffn_gate_exps", slice(0, None, 2)), ("ffn_up_exps", slice(1, None, 2))):
            w.add_tensor(f"blk.{i}.{name}.weight", ggml_mxfp4(blocks[:, rows], scales[:, rows]), raw_dtype=Q.MXFP4)
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight",
                     ggml_mxfp4(*packed[f"model.layers.{i}.mlp.experts.down_proj"]), raw_dtype=Q.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_converts_to_the_logits_of_the_safetensors_conversion(tiny, mxfp4, tmp_path):
    """The same MXFP4 experts (dequantized by the gguf package there, by convert/mxfp4.py here) and F32 rest:
    the GGUF file's conversion and the MXFP4 safetensors folder's give the same model. A GGUF file cannot state
    the SwiGLU limit (llama.cpp fixes it at the released models' 7.0) nor the aux-loss coefficient: the folder's
    config says those values here, and both models' logits are compared through the tiny model's config (limit 1.5,
    its forward compiled by the tests above)."""
    import dataclasses

    hf, root = tiny
    packed, folder = mxfp4
    folder = _edit(folder, tmp_path / "st", config={"swiglu_limit": 7.0, "router_aux_loss_coef": 0.001})
    write_gpt_oss_gguf(hf, packed, tmp_path / "tiny.gguf")
    assert main(["convert", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "zoo-gguf")]) == 0
    assert main(["convert", str(folder), "--out", str(tmp_path / "zoo-st"), "--dtype", "float32"]) == 0
    a, b = zoo.load(tmp_path / "zoo-gguf"), zoo.load(tmp_path / "zoo-st")
    assert a.cfg.rms_norm_eps == pytest.approx(b.cfg.rms_norm_eps)  # stored as float32 in the file
    assert dataclasses.replace(a.cfg, rms_norm_eps=b.cfg.rms_norm_eps) == b.cfg
    tokens = jnp.asarray(random_tokens(hf.config.vocab_size, seq=SEQ))
    # The configs equal but for that rounding: both weights through one config, the tiny model's (the folder's but
    # for the two values above, which the weights do not carry), whose forward the tests above compiled already.
    cfg = zoo.read_config(root / "zoo")
    assert dataclasses.replace(cfg, swiglu_limit=7.0, aux_loss_coef=0.001) == b.cfg
    a, b = zoo.Decoder(cfg, a.param_dict()), zoo.Decoder(cfg, b.param_dict())
    np.testing.assert_allclose(np.asarray(a(tokens)), np.asarray(b(tokens)), atol=1e-5, rtol=0)


# ARGV: the source folder, the output folder, the test-only packages (comma-separated), blocked as in a runtime
# install: transformers, which reads the config, would import torch (seconds, and 200 MiB of the peak otherwise).
PROBE = textwrap.dedent("""
    import json, sys
    sys.modules.update(dict.fromkeys(sys.argv[3].split(",")))
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    from convert.convert import convert
    import jax; jax.numpy.zeros(1).block_until_ready()
    import orbax.checkpoint  # noqa: F401  (imports are not the conversion's cost)
    from transformers import AutoConfig  # noqa: F401  (nor is the one that reads the config)
    before = status("VmHWM")
    convert(sys.argv[1], sys.argv[2], progress=False)
    print(json.dumps({"peak": status("VmHWM"), "before": before}))
""")


def _convert_peak(hf: Path, out: Path) -> int:
    """Bytes the conversion of ``hf`` raised the process's peak RSS by, in a fresh process."""
    from tests.processes import TEST_ONLY

    p = subprocess.run([sys.executable, "-c", PROBE, str(hf), str(out), ",".join(TEST_ONLY)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    return m["peak"] - m["before"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_mxfp4_conversion_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """A gpt-oss whose experts (~39 MB of MXFP4) dequantize to 144 MiB of bf16 converts within the peak of the same
    model stored in bf16 plus two of its largest dequantized tensors and 32 MiB: FP8's bound (tests/test_fp8.py).
    Holding the dequantized experts would stand above it. Slow (two conversions in fresh processes)."""
    from convert.mxfp4 import dequantize

    layers, experts, hidden, inter = 6, 8, 512, 1024
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "num_local_experts": experts, "num_experts_per_tok": 2, "sliding_window": 128,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    rng = np.random.default_rng(0)

    def bf16(*shape):
        return rng.standard_normal(shape, np.float32).astype(BF16)

    quantized, plain = {}, {}
    for name, shape in (("embed_tokens.weight", (256, hidden)), ("norm.weight", (hidden,))):
        quantized["model." + name] = plain["model." + name] = bf16(*shape)
    quantized["lm_head.weight"] = plain["lm_head.weight"] = bf16(256, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        dense = {a + "q_proj.weight": (256, hidden), a + "k_proj.weight": (128, hidden),
                 a + "v_proj.weight": (128, hidden), a + "o_proj.weight": (hidden, 256), a + "q_proj.bias": (256,),
                 a + "k_proj.bias": (128,), a + "v_proj.bias": (128,), a + "o_proj.bias": (hidden,),
                 a + "sinks": (4,), p + "input_layernorm.weight": (hidden,),
                 p + "post_attention_layernorm.weight": (hidden,), p + "mlp.router.weight": (experts, hidden),
                 p + "mlp.router.bias": (experts,), p + "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
                 p + "mlp.experts.down_proj_bias": (experts, hidden)}
        for name, shape in dense.items():
            quantized[name] = plain[name] = bf16(*shape)
        for name, (rows, n_in) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            blocks = rng.integers(0, 256, (experts, rows, n_in // 32, 16), dtype=np.uint8)
            scales = rng.integers(120, 130, (experts, rows, n_in // 32), dtype=np.uint8)
            quantized[p + f"mlp.experts.{name}_blocks"], quantized[p + f"mlp.experts.{name}_scales"] = blocks, scales
            plain[p + f"mlp.experts.{name}"] = dequantize(blocks, scales, BF16)
    for folder, tensors, extra in ((tmp_path / "mxfp4", quantized, {"quantization_config": {"quant_method": "mxfp4"}}),
                                   (tmp_path / "bf16", plain, {})):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}))
    del quantized, plain
    mib = 2**20
    largest = experts * hidden * 2 * inter * 2  # a layer's gate_up_proj in bf16 (16 MiB)
    dequantized = layers * experts * 3 * hidden * inter * 2  # every expert weight, in bf16
    assert dequantized >= 144 * mib
    mxfp4_peak = _convert_peak(tmp_path / "mxfp4", tmp_path / "zoo-mxfp4")
    bf16_peak = _convert_peak(tmp_path / "bf16", tmp_path / "zoo-bf16")
    print(f"peaks MiB: mxfp4 {mxfp4_peak / mib:.1f}, bf16 {bf16_peak / mib:.1f}")
    assert mxfp4_peak <= bf16_peak + 2 * largest + 32 * mib, (mxfp4_peak / mib, bf16_peak / mib)


# --- the sharded and capacity paths: sinks under context parallelism, biases under expert parallelism ----------

SHARDED_PATHS_SCRIPT = r"""
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward
from zoo.model.params import nest, param_specs
from zoo.model.sharding import make_mesh, named_sharding
import zoo.layers.moe

import zoo.layers.attention

traced = {"experts": 0, "context": 0}  # the expert- and context-parallel paths, counted as they are traced
_parallel, _context = zoo.layers.moe._experts_parallel, zoo.layers.attention.context_attention

def _count(name, f):
    def counted(*a, **k):
        traced[name] += 1
        return f(*a, **k)
    return counted

zoo.layers.moe._experts_parallel = _count("experts", _parallel)
zoo.layers.attention.context_attention = _count("context", _context)
cfg = ModelConfig(family="gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, attention="blockwise", layer_types=("sliding", "full"), sliding_window=5,
                  qkv_bias=True, o_bias=True, num_experts=4, experts_per_token=2, moe_intermediate_size=16,
                  attn_sinks=True, router_logits_bias=True, expert_bias=True, swiglu_limit=1.5)
# drawn with NumPy (init_params's jax.random compiles a kernel per shape, seconds each): matrices ~ N(0, 0.3), norms
# 1, and the biases and sinks random too (N(0, 1), the sinks N(0, 2)) where init_params leaves them 0
rng = np.random.RandomState(1)
flat = {k: (rng.normal(0, 2.0 if "sinks" in k else 1.0 if "bias" in k else 0.3, s.shape) if s.init == "normal"
            or "bias" in k or "sinks" in k else np.full(s.shape, float(s.init == "ones"))).astype(np.float32)
        for k, s in sorted(param_specs(cfg).items())}
tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 32)), jnp.int32)

def loss(flat, cfg):
    return jnp.mean(jax.nn.log_softmax(forward(cfg, nest(flat), tokens))[..., 0])

def worst(g):  # the largest gradient difference, relative to the gradient's own largest entry
    return max(float(np.max(np.abs(np.asarray(g[k]) - np.asarray(g_ref[k]))) / (np.max(np.abs(np.asarray(g_ref[k])))
                                                                                + 1e-12)) for k in g_ref)

f = jax.jit(jax.value_and_grad(loss), static_argnums=1)
ref, g_ref = f(flat, cfg)
out = {"ref": float(ref), "bias_grad": float(np.abs(np.asarray(g_ref["layers.expert_down_bias"])).max()),
       "sinks_grad": float(np.abs(np.asarray(g_ref["layers.sinks"])).max())}
cap, g_cap = f(flat, dataclasses.replace(cfg, capacity_factor=4.0))  # room for every assignment: nothing dropped
out["capacity"] = [float(cap), worst(g_cap)]
# Both sharded paths in one program (one compilation): the experts split over expert 2, the sequence over context 2.
specs = param_specs(cfg)
mesh = make_mesh(expert=2, fsdp=2, context=2, devices=jax.devices())
placed = {k: jax.device_put(v, named_sharding(mesh, specs[k].axes, v.shape)) for k, v in flat.items()}
with jax.set_mesh(mesh):
    got, g = f.lower(placed, cfg).compile()(placed)
out["sharded"] = [float(got), worst(g)]
out["traced"] = traced
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_and_capacity_paths_keep_the_sinks_and_biases():
    """Slow (one 8-device subprocess, three compiles): against the one-device dropless run, in loss and every
    gradient (1e-5), (a) the capacity path with room for every assignment keeps the experts' biases and clamped
    SwiGLU; in one program on an (expert 2 x context 2 x fsdp 2) mesh, (b) expert parallelism keeps them too and
    (c) the sequence split over mesh.context, each device's queries attending the gathered keys, keeps the sinks
    (both paths traced: counted)."""
    from tests.processes import devices_env

    p = subprocess.run([sys.executable, "-c", SHARDED_PATHS_SCRIPT], capture_output=True, text=True,
                       env=devices_env(8), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["bias_grad"] > 0 and r["sinks_grad"] > 0, r
    assert r["traced"]["experts"] > 0 and r["traced"]["context"] > 0, r  # both sharded paths ran
    for path in ("capacity", "sharded"):
        np.testing.assert_allclose(r[path][0], r["ref"], rtol=1e-5, err_msg=path)
        assert r[path][1] < 1e-5, (path, r)
