"""Qwen3-VL-MoE against transformers, on one tiny random Qwen3VLMoeForConditionalGeneration (3 layers: experts on
layers 0 and 2, a dense MLP on layer 1) `zoo convert`ed twice: as transformers 5 saves its fused experts
([experts, out, in]) and as the Hub's files hold them ([experts, in, out]). Image+text logits, the bit-identical
HF -> zoo -> HF round trip of both orders, and the released configs. The tower, DeepStack, multimodal RoPE, the
rows and `zoo generate --image`'s cached decoding are Qwen3-VL's, tested in tests/test_vlm_qwen3.py; the experts'
cached decoding is Qwen3-MoE's (tests/test_decode.py)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_tensors, mean_kl
from tests.vlm_models import assert_export_round_trip
from tests.vlm_qwen3_models import hf_qwen3_logits, hub_expert_order, image_row, make_qwen3_moe
from tests.vlm_qwen_models import random_image
from zoo.cli import main
from zoo.data.qwen_layout import qwen_image_patches
from zoo.data.vision_layout import layout_rows
from zoo.model.vision import VisionInputs

# Three images of different sizes (rows x columns of 4-pixel patches): 6 x 8, 4 x 4 and 10 x 6.
IMAGES = [random_image(0, 6, 8), random_image(1, 4, 4), random_image(2, 10, 6)]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """transformers' tiny Qwen3-VL-MoE (``hf``) saved with the tiny Qwen tokenizer (``hf/``), the same files with
    the experts in the Hub's order (``hub/``), each `zoo convert`ed (``zoo/``, ``zoo_hub/``), and its token ids."""
    from transformers import AutoTokenizer

    from tests.vlm_qwen_models import qwen_folder, qwen_token_ids

    root = tmp_path_factory.mktemp("qwen3_vl_moe")
    ids = qwen_token_ids(AutoTokenizer.from_pretrained(str(qwen_folder(root / "hf"))))
    hf = make_qwen3_moe(root / "hf", **ids)
    hub_expert_order(root / "hf", root / "hub")
    for source, out in (("hf", "zoo"), ("hub", "zoo_hub")):
        assert main(["convert", str(root / source), "--out", str(root / out)]) == 0
    return SimpleNamespace(root=root, hf=hf, ids=ids)


def _inputs(v, rows, max_patches: int = 72) -> VisionInputs:
    """The batch's VisionInputs of rows of images ((pixel_values, grid) each)."""
    laid = [[qwen_image_patches(v, pixels, grid) for pixels, grid in row] for row in rows]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(v, laid, max_patches).items()})


def test_logits_equal_transformers(qwen3_moe):
    """The logits of two rows holding the three images with text around them (multimodal positions, DeepStack's
    two levels added after the MoE layer 0 and the dense layer 1, each token routed to 2 of 4 experts, the top 2
    renormalized) are transformers' (max |diff| <= 1e-4, KL <= 1e-6); the checkpoint is a MoE one of the
    transformers order."""
    from zoo.model.decoder import forward

    hf, ids, ckpt = qwen3_moe.hf, qwen3_moe.ids, qwen3_moe.root / "zoo"
    cfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    assert cfg.hf_experts_out_in and [r[3] for r in cfg.layer_runs] == [True, False, True]
    grids, text = [g for _, g in IMAGES], (7, ids["vocab_size"])  # text: past the special tokens
    tokens = np.stack([image_row(40, [(3, grids[0]), (20, grids[1])], 3, ids, text),
                       image_row(40, [(10, grids[2])], 4, ids, text)])
    logits = jax.jit(lambda c, p, t, v: forward(c, p, t, vision=v), static_argnums=0)(
        cfg, params, jnp.asarray(tokens), _inputs(cfg.vision, [IMAGES[:2], IMAGES[2:]]))
    ref, got = hf_qwen3_logits(hf, tokens, IMAGES), np.asarray(logits)
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5


def _shapes(folder) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a HF folder (hf_tensors compares bytes, not shapes)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="np") as fh:
            out.update({name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()})
    return out


def test_round_trip_of_either_expert_order_is_bit_identical(qwen3_moe, tmp_path):
    """HF -> zoo -> HF gives back every tensor bit for bit, in its shape, and the config, which transformers
    loads: from transformers' order (fused [4, 48, 64] gate_up_proj and [4, 64, 24] down_proj) and from the Hub's
    ([4, 64, 48], [4, 24, 64]), which converts to the same zoo weights and which transformers reads back (its
    own transpose on loading) as the same model."""
    from transformers import AutoModelForImageTextToText

    root, hf = qwen3_moe.root, qwen3_moe.hf
    assert_export_round_trip(hf, root / "zoo", tmp_path / "back")
    assert _shapes(root / "hf") == _shapes(tmp_path / "back")
    expert = "model.language_model.layers.2.mlp.experts."
    assert [_shapes(root / "hub")[expert + n] for n in ("gate_up_proj", "down_proj")] == [(4, 64, 48), (4, 24, 64)]
    hub = zoo.read_config(root / "zoo_hub")
    assert not hub.hf_experts_out_in and hub == zoo.read_config(root / "zoo")
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), zoo.load_params(root / "zoo_hub"),
                        zoo.load_params(root / "zoo"))
    assert all(jax.tree.leaves(same))
    assert main(["export", str(root / "zoo_hub"), "--out", str(tmp_path / "hub_back")]) == 0
    assert hf_tensors(root / "hub") == hf_tensors(tmp_path / "hub_back")
    assert _shapes(root / "hub") == _shapes(tmp_path / "hub_back")
    assert (root / "hub" / "config.json").read_text() == (tmp_path / "hub_back" / "config.json").read_text()
    back = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hub_back"), dtype=torch.float32)
    want = hf.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in back.state_dict().items()) and len(want) == len(back.state_dict())


def test_released_configs():
    """The registry's Qwen3-VL-MoE configs read as the published models: every layer MoE (128 experts, 8 a token,
    renormalized, softmax routing), the larger tower with DeepStack at 8, 16, 24 feeding the language model's
    width, interleaved multimodal RoPE (their parameter counts: tests/test_vlm_registry.py)."""
    from zoo.model.from_hf import model_config_from_hf
    from zoo.registry.catalogue import get

    for name, width, inter, layers in (("qwen3-vl-30b-a3b", 2048, 768, 48), ("qwen3-vl-235b-a22b", 4096, 1536, 94)):
        cfg = model_config_from_hf(get(name).hf_config)
        assert (cfg.family, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers) == (
            "qwen3_vl_moe", width, inter, layers)
        assert (cfg.num_experts, cfg.experts_per_token, cfg.router_norm_topk, cfg.router_score) == (
            128, 8, True, "softmax")
        assert all(cfg.is_moe_layer(i) for i in range(layers)) and (cfg.num_kv_heads, cfg.head_dim) == (4, 128)
        assert (cfg.vision.num_layers, cfg.vision.deepstack_layers, cfg.vision.hidden_size) == (27, (8, 16, 24), 1152)
        rope = cfg.rope
        assert (rope.mrope_section, rope.mrope_interleaved, rope.theta) == ((24, 20, 20), True, 5_000_000.0)
        assert not cfg.tie_word_embeddings


@pytest.mark.slow
def test_cli_generate_with_an_image_equals_transformers_generate(qwen3_moe, capsys):
    """Slow (12-20 s on 2 busy cores; the fast lane has the same cached decoding with images on dense Qwen3-VL, and
    the experts' cached decoding on Qwen3-MoE): `zoo generate --prompt TEXT --image A`'s text is transformers'
    greedy reply to the same prompt ids and pixels, every step routed through the experts."""
    from tests.vlm_processors import write_images
    from tests.vlm_qwen_models import hf_image_reply
    from zoo.data.tokenizer import load_tokenizer

    root, question = qwen3_moe.root, "What is in this picture?"
    ckpt, (name,) = root / "zoo", write_images(root, [(30, 45)])  # 8 x 6 patches: 12 image tokens
    reply = hf_image_reply(qwen3_moe.hf, ckpt, root, question, str(root / name))
    want = load_tokenizer(ckpt).decode(reply, skip_special_tokens=True)
    assert want.strip() and len(set(reply)) > 1
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", question, "--image", str(root / name), "--max-new-tokens",
                 "8"]) == 0
    assert capsys.readouterr().out == want + "\n"
