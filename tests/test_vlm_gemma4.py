"""Gemma 4 whole (Gemma4ForConditionalGeneration, its vision tower) against transformers: image features of
differently shaped images through Gemma 4's own image processor, image+text logits (bidirectional image blocks on
the sliding layers only, per-layer inputs reading the padding token at image tokens), and the round trip with
the clip bounds and standardization buffers; the audio tower left out with a note."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_tensors, mean_kl
from tests.vlm_gemma4_models import BOI, EOI, IMAGE, SIZES, grid_images, make_gemma4_vlm
from zoo.cli import main
from zoo.data.gemma4_layout import gemma4_image_patches
from zoo.data.vision_layout import layout_rows
from zoo.model.vision import VisionInputs, encode_images


def processed_images(seed: int = 0) -> dict:
    """Gemma 4's image processor (PIL backend) on two random images of SIZES: pixel_values, image_position_ids,
    num_soft_tokens_per_image."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    rng = np.random.RandomState(seed)
    images = [Image.fromarray(rng.randint(0, 256, (h, w, 3), np.uint8)) for h, w in SIZES]
    proc = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    out = proc(images=images, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(transformers' tiny Gemma 4 VLM, its `zoo convert`ed checkpoint, the processed images)."""
    root = tmp_path_factory.mktemp("gemma4vlm")
    model = make_gemma4_vlm(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    return model, root / "zoo", processed_images()


def _inputs(cfg, rows: list[list[int]], images: dict) -> VisionInputs:
    """The VisionInputs of rows holding the processed images of the given indices, in order."""
    laid = [[gemma4_image_patches(cfg.vision, images["pixel_values"][k], images["image_position_ids"][k])
             for k in row] for row in rows]
    most = max(len(r) for r in rows) * cfg.vision.patches_per_image
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(cfg.vision, laid, most).items()})


def _row(seq: int, at: int, count: int, seed: int) -> np.ndarray:
    """A row of random text with one image's run (boi, ``count`` image tokens, eoi) starting at ``at``."""
    row = np.random.RandomState(seed).randint(1, 90, seq)
    row[at], row[at + 1: at + 1 + count], row[at + 1 + count] = BOI, IMAGE, EOI
    return row


def test_image_features_equal_transformers(gemma4):
    """Both images in one row, through the tower with their own shapes, pooled and projected."""
    hf, ckpt, images = gemma4
    cfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.tensor(images["pixel_values"]),
                                          torch.tensor(images["image_position_ids"])).pooler_output
    ref = torch.cat(ref).numpy()
    counts = images["num_soft_tokens_per_image"].tolist()
    assert len(set(counts)) == 2 and ref.shape[0] == sum(counts)
    got = np.asarray(jax.jit(encode_images, static_argnums=0)(cfg, params, _inputs(cfg, [[0, 1]], images)))
    # The 1e-4: the pooled states are scaled by sqrt(32) and standardized (up to x1.5) before the
    # projection, so float32's rounding (1e-6 in the tower) reaches 2e-5 here.
    assert np.abs(got[0, :sum(counts)] - ref).max() <= 1e-4
    assert ref.std() > 0.5


def test_image_text_logits_equal_transformers(gemma4):
    """Two rows of one image each (grid_images: 8 and 4 tokens); the first image's block runs past the sliding
    window (7). transformers with its mm_token_type_ids (the blocks) against the zoo's image blocks, on the
    sliding layers only."""
    hf, ckpt, _ = gemma4
    images = grid_images()
    tokens = np.stack([_row(24, 5, 8, 1), _row(24, 9, 4, 2)])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(images["pixel_values"]),
                 image_position_ids=torch.tensor(images["image_position_ids"]),
                 mm_token_type_ids=torch.tensor((tokens == IMAGE).astype(np.int64))).logits.float().numpy()
    model = zoo.load(ckpt)
    got = np.asarray(model(jnp.asarray(tokens), vision=_inputs(model.cfg, [[0], [1]], images)))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5
    # The blocks matter, and on sliding layers alone: transformers without them differs at the image tokens.
    with torch.no_grad():
        causal = hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(images["pixel_values"]),
                    image_position_ids=torch.tensor(images["image_position_ids"])).logits.float().numpy()
    assert np.abs(causal - ref)[0, 6:13].max() > 1e-2


def test_round_trip_is_bit_identical_and_audio_is_left_out(tmp_path, capsys):
    """HF -> zoo -> HF gives back every tensor of the language model, tower (clip bounds, standardization
    buffers) and embedder bit for bit; a source's audio tower is left out with a note, and the exported config
    says it has none, so transformers loads the export."""
    from transformers import Gemma4ForConditionalGeneration

    make_gemma4_vlm(tmp_path / "hf", audio=True)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    assert "audio tower" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    src, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    kept = {n: t for n, t in src.items() if not n.startswith(("model.audio_tower.", "model.embed_audio."))}
    assert len(kept) < len(src) and any(".input_min" in n for n in kept) and "model.vision_tower.std_bias" in kept
    assert kept == back
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"] and config.get("audio_config") is None
    loaded = Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "back")
    assert loaded.model.audio_tower is None and loaded.model.vision_tower is not None


def test_lora_targets_its_tower_has_pass_and_others_are_refused(gemma4):
    """Gemma 4's tower takes adapters (tests/test_vlm_tower_lora.py checks them against peft): the set-up's check
    passes its tower's and connector's names beside the language model's; a name its tower lacks (the Qwen towers'
    fused vision.qkv, their merger's projector.fc1) is one line before step 1 naming what it takes, where silently
    training nothing there would be the alternative."""
    from pretrain.config import TrainConfig, load_config
    from pretrain.setup import check_vision_lora, lora_config
    from zoo.errors import UserError

    mcfg = zoo.read_config(gemma4[1])
    base = ["model.path=m", "data.path=d", "max_steps=1", "lora.rank=4"]
    cfg = load_config(None, [*base, "lora.targets=[q_proj,vision.q_proj,vision.gate_proj,projector.proj]"],
                      TrainConfig)
    check_vision_lora(cfg, mcfg, lora_config(cfg))
    cfg = load_config(None, [*base, "lora.targets=[q_proj,vision.qkv,projector.fc1]"], TrainConfig)
    with pytest.raises(UserError, match=r"^lora.targets name vision.qkv, projector.fc1, which this gemma4 model's "
                                        r"image tower and connector do not have; they take vision.q_proj, "
                                        r"vision.k_proj, vision.v_proj, vision.o_proj, vision.gate_proj, "
                                        r"vision.up_proj, vision.down_proj, projector.proj$"):
        check_vision_lora(cfg, mcfg, lora_config(cfg))


@pytest.mark.slow
def test_peft_loads_the_whole_moe_models_expert_adapters(tmp_path):
    """Slow (a model of its own, peft's model): LoRA on the routed experts of a whole Gemma4ForConditionalGeneration
    with experts (the 26B-A4B's kind), exported as PEFT, puts each layer's experts adapter under the composite
    model's model.language_model.layers (peft loads every key, none left over) and gives the zoo's logits with the
    adapters (1e-4) on text."""
    import shutil

    from peft import PeftModel

    from tests.hf_models import random_tokens
    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.lora.params import LoraConfig

    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    hf = make_gemma4_vlm(tmp_path / "hf", **moe)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    write_adapter_checkpoint(tmp_path / "zoo", tmp_path / "adapter",
                             LoraConfig(rank=4, alpha=4.0, targets=("experts.gate_up_proj", "experts.down_proj")))
    shutil.copy(tmp_path / "zoo" / "hf_config.json", tmp_path / "adapter" / "hf_config.json")
    assert main(["export", str(tmp_path / "adapter"), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    tokens = random_tokens(96, batch=2, seq=24) % BOI  # text only: below the image tokens
    with torch.no_grad():
        base = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    peft = PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    result = peft.load_adapter(str(tmp_path / "peft"), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    peft.delete_adapter("again")
    with torch.no_grad():
        got = peft(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    ours = np.asarray(zoo.load(tmp_path / "adapter")(jnp.asarray(tokens)))
    assert np.abs(got - base).max() > 0.1 and np.abs(got - ours).max() <= 1e-4
