"""NF4 as bitsandbytes blocks it, on widths whose 64-value blocks straddle rows: every projection kind of a QLoRA
base (`zoo quantize`) stores bitsandbytes' codes and absmax of the Hugging Face ``[out, in]`` tensor and
dequantizes bit for bit to its ``quantize_4bit`` -> ``dequantize_4bit`` values, and the QLoRA forward's logits are
transformers' on those weights."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.hf_models import hf_logits, random_tokens
from tests.quant_fixtures import bnb_nf4
from zoo.cli import main as zoo_main
from zoo.model import quant

# Widths no block of 64 divides: hidden 40, head_dim 12 (q and o 60 wide, k and v 12), MLP 96 (down's rows 96
# wide, the Qwen2-shaped case), experts 12 (GLM-4.5) and 10 (Gemma 4: a fused gate/up matrix of 800 values, whose
# blocks would straddle experts were the stack blocked whole), Gemma 4's full layers 20 wide per head (q/o 100).
SHAPES = dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=1, head_dim=12, intermediate_size=96,
              num_hidden_layers=2, vocab_size=64)
MODELS = {
    # Layer 0 dense (q, k, v, o, gate, up, down, as Qwen2's), layer 1 8 routed experts and a shared one.
    "glm4_moe": dict(moe_intermediate_size=12),
    # A sliding and a full layer, each with its dense MLP and 4 experts; full layers' values their own projection.
    "gemma4": dict(global_head_dim=20, num_global_key_value_heads=1, attention_k_eq_v=False,
                   layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                   hidden_size_per_layer_input=0, use_double_wide_mlp=False, enable_moe_block=True, num_experts=4,
                   top_k_experts=2, moe_intermediate_size=10),
    # Two MoE layers of 8 experts 48 wide (down's rows straddle blocks), a Linear per expert under Mixtral's names.
    "minimax_m2": dict(intermediate_size=48, rotary_dim=8),
}
# The Hugging Face tensors of the projections QLoRA quantizes (zoo.model.quant.PROJECTIONS): attention, MLP,
# shared and routed experts (a Linear per expert, or a fused [experts, out, in] stack).
PROJECTION = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)"
                        r"\.weight$|\.experts\.(gate_up|down)_proj$|\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}  # MiniMax-M2's experts


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """family -> (its folder: hf/ (transformers' save), zoo/ (`zoo convert`), q/ (`zoo quantize --quant nf4`); the
    hf/ tensors), one of each."""
    from safetensors.numpy import load_file

    from tests.hf_models import make_hf

    out = {}
    for family, extra in MODELS.items():
        root = tmp_path_factory.mktemp(family)
        make_hf(root / "hf", family, **{**SHAPES, **extra})
        assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
        assert zoo_main(["quantize", str(root / "zoo"), "--out", str(root / "q"), "--quant", "nf4"]) == 0
        out[family] = root, load_file(str(root / "hf" / "model.safetensors"))
    return out


def _hf_matrices(family: str, path: str, lead: tuple[int, ...]) -> list[tuple[tuple[int, ...], str, int | None]]:
    """(zoo index, Hugging Face tensor name, expert index into a fused stack or None) of each matrix of ``path``."""
    stack, _, kind = path.partition(".")
    if family == "glm4_moe":  # dense_layers: layer 0; layers (MoE): layer 1
        layers = [0] if stack == "dense_layers" else [1]
    elif family == "minimax_m2":  # layers (MoE): both
        layers = [0, 1]
    else:  # Gemma 4: q/k/v/o of the sliding layer 0, global_* of the full layer 1, the MLP and experts of both
        layers = {"q": [0], "k": [0], "v": [0], "o": [0]}.get(kind, [1] if kind.startswith("global_") else [0, 1])
    name = {"expert_gate_up": "experts.gate_up_proj", "expert_down": "experts.down_proj"} if family == "gemma4" else {}
    proj = kind.removeprefix("global_").removeprefix("expert_").removeprefix("shared_")
    attn = proj in ("q", "k", "v", "o")
    sub = "experts.{x}." if kind.startswith("expert_") else "shared_experts." if kind.startswith("shared_") else ""
    out = []
    for index in np.ndindex(*lead):
        layer, x = layers[index[0]], (index[1] if len(index) > 1 else None)
        if kind in name:
            out.append((index, f"model.layers.{layer}.{name[kind]}", x))
        else:
            where = f"self_attn.{proj}_proj" if attn else f"mlp.{sub.format(x=x)}{proj}_proj"
            if family == "minimax_m2" and not attn:
                where = f"block_sparse_moe.experts.{x}.{MIXTRAL_NAMES[proj]}"
            out.append((index, f"model.layers.{layer}.{where}.weight", None))
    return out


def test_the_models_hold_every_projection_kind():
    import transformers

    from tests.hf_models import BASE, FAMILIES
    from zoo.model.from_hf import model_config_from_hf

    kinds = set()
    for family, extra in MODELS.items():
        config_class, _, defaults = FAMILIES[family]
        hf = getattr(transformers, config_class)(**{**BASE, **defaults, **SHAPES, **extra})
        kinds |= {path.rpartition(".")[2] for path in quant.quantized_paths(model_config_from_hf(hf.to_dict()))}
    # Qwen3-Next's and Qwen3.5's linear layers and output gate are mostly parts of fused Hugging Face Linears
    # (in_proj_qkvz, in_proj_ba, q_proj's query and gate per head; out_proj beside them), quantized per zoo
    # matrix where bitsandbytes quantizes the fused Linear whole: not comparable block for block. Their QLoRA is checked against LoRA on the
    # dequantized weights (tests/test_qwen3_next.py, tests/test_qwen35.py).
    fused = {"attn_gate", "lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a", "lin_out"}
    assert kinds == set(quant.PROJECTIONS) - fused


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MODELS))
def test_every_projection_is_stored_and_dequantized_as_bitsandbytes_does(quantized, family):
    """Slow (slow lane: the shared fixture converts and quantizes three models, 40 s on a loaded machine; then 15 s
    each). Each matrix of each projection a QLoRA base stores (`zoo quantize`; the same fields a run quantizing at
    load makes) holds bitsandbytes' packed codes and absmax of the Hugging Face [out, in] tensor, and dequantizes (as
    the layers and `zoo export` do) to bitsandbytes' values bit for bit. A fused expert stack is quantized per
    expert, the [out, in] matrix a Linear per expert holds (transformers' bitsandbytes integration quantizes
    nn.Linear only: it leaves a fused stack float)."""
    import zoo
    from zoo.checkpoints.format import read_meta
    from zoo.checkpoints.quantized import load_quantized

    root, hf = quantized[family]
    meta = read_meta(root / "q")
    seen = set()
    straddling = 0
    for path in quant.quantized_paths(zoo.read_config(root / "q")):
        qw = load_quantized(root / "q", meta, path)
        values = np.asarray(quant.dequantize(qw))
        for index, name, x in _hf_matrices(family, path, qw.lead):
            w = hf[name] if x is None else hf[name][x]
            packed, absmax, want = bnb_nf4(w)
            np.testing.assert_array_equal(qw.data["packed"][index], packed, err_msg=f"{path} {index}")
            np.testing.assert_array_equal(qw.data["absmax"][index], absmax, err_msg=f"{path} {index}")
            got = values[index].reshape(-1, w.shape[0]).T  # zoo [*in, *out] -> HF [out, in]
            np.testing.assert_array_equal(got, want, err_msg=f"{path} {index}")
            seen.add(name)
            straddling += w.shape[1] % 64 != 0 and w.shape[1] % 16 == 0
    assert seen == {k for k in hf if PROJECTION.search(k)}  # every HF projection tensor
    assert straddling  # rows of a multiple of 16 that blocks straddle (where bitsandbytes' CPU kernel departs)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MODELS))
def test_qlora_logits_equal_transformers_on_bitsandbytes_weights(quantized, family, tmp_path):
    """Slow (slow lane: the shared fixture, then a forward's compilation, 10-15 s each). The forward a QLoRA run
    takes (its base the stored fields, dequantized per layer inside the scan) gives transformers' logits for the
    same checkpoint with each projection replaced by bitsandbytes' NF4 round trip (not transformers' own 4-bit
    Linear: on a CPU with AVX-512 it runs the kernel tests/quant_fixtures.bnb_nf4 describes)."""
    import shutil

    import jax
    import torch
    import transformers
    from safetensors.numpy import save_file

    import zoo
    from zoo.checkpoints.loading import param_reader, quantized_param
    from zoo.model.decoder import forward
    from zoo.model.params import nest, param_specs

    root, hf = quantized[family]
    rounded = {k: (np.stack([bnb_nf4(m)[2] for m in w]) if w.ndim == 3 else bnb_nf4(w)[2]) if PROJECTION.search(k)
               else w for k, w in hf.items()}
    save_file(rounded, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(root / "hf" / "config.json", tmp_path / "config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                              attn_implementation="eager",
                                                              experts_implementation="eager").eval()
    cfg = zoo.read_config(root / "q")
    proj = quant.quantized_paths(cfg)
    flat = {p: quantized_param(root / "q", p, "nf4") if p in proj else param_reader(root / "q", p).read()
            for p in param_specs(cfg)}
    tokens = random_tokens(SHAPES["vocab_size"], seq=24)
    got = np.asarray(jax.jit(lambda params, t: forward(cfg, params, t))(nest(flat), tokens))
    ref = hf_logits(model, tokens)
    assert np.abs(got - ref).max() <= 1e-4
    assert ref.std() > 0.5  # peaked enough for the comparison to have teeth
