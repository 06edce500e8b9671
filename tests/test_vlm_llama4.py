"""Llama 4 whole (Llama4ForConditionalGeneration) against transformers, on a tiny random model
(tests/vlm_llama4_models.py): the tower's and adapter's image features, image+text logits with images laid out as
transformers' Llama4Processor writes them (tiles, separators, the global tile), the bit-identical round trip
exported as Llama4ForConditionalGeneration, greedy KV-cache decoding with images against ``generate``, LoRA on the
tower, adapter and projector loaded by peft, the registry's Scout and Maverick counted as transformers counts them,
and the one-line errors of a vision config whose widths do not chain and of LoRA targets its tower lacks."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_tensors, mean_kl
from tests.vlm_llama4_models import (
    PATCH_TOKEN,
    SPECIALS,
    TOKENS_PER_TILE,
    VISION,
    hf_image_features,
    hf_logits,
    image_row,
    make_llama4_vlm,
    tiles,
)
from zoo.cli import main
from zoo.data.vision_layout import layout_rows, llama4_tile_patches
from zoo.model.vision import VisionInputs, encode_images

TOL = 1e-4
# Two rows: an image cut into 2 x 2 tiles (4 tiles and the global one: 5 x 4 features between separators) in the
# first; two single-tile images (no separators, the global tile alone) in the second.
IMAGES = [[(3, (2, 2))], [(5, (1, 1)), (20, (1, 1))]]
SEQ, TILES = 40, (5, 2)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """(transformers' tiny Llama 4, its `zoo convert`ed checkpoint folder)."""
    root = tmp_path_factory.mktemp("llama4_vlm")
    model = make_llama4_vlm(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    return model, root / "zoo"


def _tokens() -> np.ndarray:
    return np.stack([image_row(SEQ, images, seed=r + 1) for r, images in enumerate(IMAGES)])


def _pixels() -> np.ndarray:
    return tiles(1, sum(TILES))


def _inputs(cfg, pixels: np.ndarray) -> VisionInputs:
    """Each row's tiles (TILES of ``pixels`` in order) as VisionInputs: 17 slots a tile (16 patches, the class
    token)."""
    rows = [pixels[:TILES[0]], pixels[TILES[0]:]]
    laid = [[llama4_tile_patches(cfg.vision, t) for t in row] for row in rows]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(cfg.vision, laid, TILES[0] * 17).items()})


def test_image_features_equal_transformers(llama4):
    """The tower (class token, 2-D RoPE, pre/post LayerNorms), the pixel shuffle, the adapter MLP and the
    projector: each tile's 4 features as transformers' get_image_features gives them (1e-5)."""
    hf, ckpt = llama4
    cfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    assert (cfg.vision.tower, cfg.vision.connector, cfg.vision.tokens_per_image) == ("llama4", "pixel_shuffle_mlp",
                                                                                     TOKENS_PER_TILE)
    pixels = _pixels()
    ref = hf_image_features(hf, pixels)
    got = np.asarray(jax.jit(encode_images, static_argnums=0)(cfg, params, _inputs(cfg, pixels)))
    assert got.shape == (2, TILES[0] * 17 // 4, 64)
    np.testing.assert_allclose(got[0, :20], ref[:20], atol=1e-5)
    np.testing.assert_allclose(got[1, :8], ref[20:], atol=1e-5)
    assert ref.std() > 0.1


@pytest.mark.slow
def test_image_text_logits_equal_transformers(llama4):
    """Slow (the whole model's compilation, about 9 s): image+text logits of the two rows (the processor's layout
    of each image's tokens; transformers' chunked and NoPE layers over them): 1e-4, KL 1e-6; the images move the
    logits after them."""
    hf, ckpt = llama4
    tokens, pixels = _tokens(), _pixels()
    assert (tokens == PATCH_TOKEN).sum(axis=1).tolist() == [t * TOKENS_PER_TILE for t in TILES]
    assert (tokens[0] == SPECIALS["<|tile_x_separator|>"]).sum() == 2 and (tokens[1] == SPECIALS["<|image|>"]).sum() == 2
    ref = hf_logits(hf, tokens, pixels)
    model = zoo.load(ckpt)
    got = np.asarray(model(jnp.asarray(tokens), vision=_inputs(model.cfg, pixels)))
    assert np.abs(got - ref).max() <= TOL
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5
    other = hf_logits(hf, tokens, pixels[::-1].copy())  # the same tokens, the tiles in another order
    assert np.abs(other - ref)[:, -5:].max() > 1e-2


def test_round_trip_is_bit_identical(llama4, tmp_path):
    """HF -> zoo -> HF gives back every tensor (tower, adapter, projector, language model) bit for bit and the
    config, exported as Llama4ForConditionalGeneration; `--text-only` converts the language model alone."""
    _, ckpt = llama4
    src = ckpt.parent / "hf"
    assert main(["export", str(ckpt), "--out", str(tmp_path / "back")]) == 0
    a, b = hf_tensors(src), hf_tensors(tmp_path / "back")
    assert any(n.startswith("vision_model.") for n in a) and "multi_modal_projector.linear_1.weight" in a
    assert a == b
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Llama4ForConditionalGeneration"]
    assert config == {**json.loads((src / "config.json").read_text()), "dtype": config["dtype"]}


@pytest.mark.slow
def test_greedy_decoding_with_images_equals_generate(llama4):
    """Slow (the prefill's and steps' programs, about 20 s): both rows' prompts (their images, then text) decoded
    greedily with the KV cache, one batch: the tokens of transformers' ``generate`` (8 new tokens each, the
    chunked layers' boundary crossed)."""
    from eval.generate import GenerationConfig, generate

    hf, ckpt = llama4
    tokens, pixels = _tokens(), _pixels()
    prompts = [tokens[0, :30], tokens[1, :27]]
    frames = [[(t, None) for t in pixels[:TILES[0]]], [(t, None) for t in pixels[TILES[0]:]]]
    want = []
    for prompt, row in zip(prompts, frames, strict=True):
        ids = torch.tensor(prompt[None], dtype=torch.long)
        with torch.no_grad():  # its own attention mask: a prompt may hold token 0, generate's pad id
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              pixel_values=torch.tensor(np.stack([p for p, _ in row])), do_sample=False,
                              max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    model = zoo.load(ckpt, dtype=np.float32)
    got = generate(model.cfg, model.param_dict(), [p.tolist() for p in prompts],
                   GenerationConfig(max_new_tokens=8), frames=frames)
    assert got == want
    assert want[0] != want[1]


@pytest.mark.slow
def test_peft_loads_the_tower_adapters_with_the_zoo_models_image_text_logits(llama4, tmp_path):
    """Slow (peft's model, the merged export and a compilation): LoRA on the language model's q_proj, every
    projection of the tower (transformers' names), the adapter's fc1/fc2 and the projector, exported as PEFT:
    peft's model on transformers' wraps those modules and gives the zoo forward's image+text logits with the
    adapters beside their weights (1e-4, KL 1e-6); transformers on the merged export the same."""
    from peft import PeftModel
    from transformers import Llama4ForConditionalGeneration

    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.checkpoints.adapter import load_adapters
    from zoo.checkpoints.format import read_meta
    from zoo.lora.params import LoraConfig, lora_scale
    from zoo.lora.vision_targets import VISION_PATHS
    from zoo.lora.weights import Weights
    from zoo.model.decoder import forward

    hf, ckpt = llama4
    modules = dict(hf.named_modules())
    assert all(isinstance(modules.get(p), torch.nn.Linear) for p in VISION_PATHS["llama4"].values())
    targets = ("q_proj", "vision.q_proj", "vision.k_proj", "vision.v_proj", "vision.o_proj", "vision.fc1",
               "vision.fc2", "projector.fc1", "projector.fc2", "projector.proj")
    lora_cfg = LoraConfig(rank=4, alpha=4.0, targets=targets)
    write_adapter_checkpoint(ckpt, tmp_path / "adapter", lora_cfg)
    shutil.copy(ckpt / "hf_config.json", tmp_path / "adapter" / "hf_config.json")  # as a run's final keeps it
    assert main(["export", str(tmp_path / "adapter"), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    assert main(["export", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    cfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    adapters = load_adapters(tmp_path / "adapter", read_meta(tmp_path / "adapter"))
    tokens, pixels = _tokens(), _pixels()
    ours = np.asarray(jax.jit(lambda a: forward(cfg, Weights(params, a, lora_scale(lora_cfg)), jnp.asarray(tokens),
                                                vision=_inputs(cfg, pixels)))(adapters))
    base = hf_logits(hf, tokens, pixels)
    peft = PeftModel.from_pretrained(make_llama4_vlm(None), str(tmp_path / "peft")).eval()
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft.named_modules() if hasattr(m, "lora_A")}
    assert {"language_model.model.layers.1.self_attn.q_proj", "vision_model.model.layers.1.self_attn.o_proj",
            "vision_model.model.layers.1.mlp.fc2", "vision_model.vision_adapter.mlp.fc1",
            "multi_modal_projector.linear_1"} <= wrapped
    got = hf_logits(peft, tokens, pixels)
    assert np.abs(got - base).max() > 0.1  # the adapters change the model: the comparisons have teeth
    assert np.abs(got - ours).max() <= TOL and mean_kl(got, ours) <= 1e-6
    merged = Llama4ForConditionalGeneration.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert np.abs(hf_logits(merged, tokens, pixels) - ours).max() <= TOL


@pytest.mark.parametrize("name,hub", [("llama-4-scout", 109e9), ("llama-4-maverick", 402e9)])
def test_registry_llama4_is_whole_and_counts_as_transformers(name, hub):
    """Scout and Maverick are vision-language entries: their released configs' whole models (tower, adapter and
    projector included) have transformers' count of the same config, the Hub's rounded "model size" (109B,
    402B) and what `zoo list` shows; the tower reads 144 tokens a 336-pixel tile."""
    import transformers

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import count_params
    from zoo.registry.catalogue import get

    hf = get(name).hf_config
    assert hf is not None and hf["architectures"] == ["Llama4ForConditionalGeneration"]
    cfg = model_config_from_hf(hf)
    assert cfg.vision is not None and cfg.vision.tokens_per_image == 144 and cfg.vision.head_dim == 88
    ours = count_params(cfg)
    with torch.device("meta"):  # shapes only: nothing allocated
        model = transformers.Llama4ForConditionalGeneration(transformers.AutoConfig.for_model(**hf))
    assert ours == sum(p.numel() for p in model.parameters())
    assert round(ours / 1e9) * 1e9 == hub
    assert abs(get(name).params - ours) / ours < 0.001


@pytest.mark.parametrize("change,says", [
    ({"intermediate_size": 32}, "intermediate_size=32 must be hidden_size / pixel_shuffle_ratio² = 64"),
    ({"vision_output_dim": 16}, "vision_output_dim=16 equal"),
    ({"pixel_shuffle_ratio": 0.4}, "pixel_shuffle_ratio=0.4 must be 1 / an integer"),
])
def test_vision_configs_whose_widths_do_not_chain_are_one_line_errors(change, says):
    """A vision config transformers' modules could not chain (the shuffled patches into the adapter, the adapter
    into the projector) is a UserError naming the fields, before anything is read."""
    from transformers import Llama4Config

    from tests.hf_models import BASE, FAMILIES
    from zoo.errors import UserError
    from zoo.model.from_hf import model_config_from_hf

    config = Llama4Config(text_config={**BASE, **FAMILIES["llama4"][2]}, vision_config={**VISION, **change})
    hf = {**json.loads(config.to_json_string()), "architectures": ["Llama4ForConditionalGeneration"]}
    with pytest.raises(UserError, match="^here: ") as e:
        model_config_from_hf(hf, "here")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_lora_targets_its_tower_has_pass_and_others_are_refused(llama4):
    """Llama 4's tower and connector take the SigLIP layer's names, the adapter MLP's and the projector's (peft's
    check above); a name they lack (the Qwen towers' fused vision.qkv, Gemma 4's vision.gate_proj) is one line
    before step 1 naming what they take."""
    from pretrain.config import TrainConfig, load_config
    from pretrain.setup import check_vision_lora, lora_config
    from zoo.errors import UserError

    mcfg = zoo.read_config(llama4[1])
    base = ["model.path=m", "data.path=d", "max_steps=1", "lora.rank=4"]
    cfg = load_config(None, [*base, "lora.targets=[q_proj,vision.o_proj,vision.fc1,projector.fc2,projector.proj]"],
                      TrainConfig)
    check_vision_lora(cfg, mcfg, lora_config(cfg))
    cfg = load_config(None, [*base, "lora.targets=[q_proj,vision.qkv,vision.gate_proj]"], TrainConfig)
    with pytest.raises(UserError, match=r"^lora.targets name vision.qkv, vision.gate_proj, which this llama4 model's "
                                        r"image tower and connector do not have; they take vision.q_proj, "
                                        r"vision.k_proj, vision.v_proj, vision.o_proj, vision.up_proj, "
                                        r"vision.down_proj, projector.proj, projector.fc1, projector.fc2$"):
        check_vision_lora(cfg, mcfg, lora_config(cfg))


@pytest.mark.slow
def test_peft_loads_the_whole_models_expert_adapters(llama4, tmp_path):
    """Slow (peft's model and a compilation): LoRA on the routed experts of the whole Llama4ForConditionalGeneration,
    exported as PEFT, puts each layer's experts adapter under the composite model's language_model.model.layers
    (peft loads every key, none left over) and gives the zoo's image+text logits with the adapters (1e-4)."""
    from peft import PeftModel

    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.lora.params import LoraConfig

    hf, ckpt = llama4
    lora_cfg = LoraConfig(rank=4, alpha=4.0, targets=("experts.gate_proj", "experts.up_proj", "experts.down_proj"))
    write_adapter_checkpoint(ckpt, tmp_path / "adapter", lora_cfg)
    shutil.copy(ckpt / "hf_config.json", tmp_path / "adapter" / "hf_config.json")  # as a run's final keeps it
    assert main(["export", str(tmp_path / "adapter"), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    peft = PeftModel.from_pretrained(make_llama4_vlm(None), str(tmp_path / "peft")).eval()
    result = peft.load_adapter(str(tmp_path / "peft"), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    peft.delete_adapter("again")
    tokens, pixels = _tokens(), _pixels()
    model = zoo.load(tmp_path / "adapter")
    ours = np.asarray(model(jnp.asarray(tokens), vision=_inputs(model.cfg, pixels)))
    got = hf_logits(peft, tokens, pixels)
    assert np.abs(got - hf_logits(hf, tokens, pixels)).max() > 0.1  # the adapters move the logits
    assert np.abs(got - ours).max() <= TOL


def test_images_through_the_data_pipelines_are_one_line_naming_the_missing_backend(tmp_path):
    """Llama 4's image processor is transformers' torchvision backend only (no PIL one), and torchvision is not a
    dependency: the data pipelines' image expander stops with one line naming what it needs and the way that works
    (the processor's pixel values given to the model), not a traceback or a hint to copy files that are there."""
    from chat.images import ImageExpander
    from zoo.errors import UserError

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor"}))
    with pytest.raises(UserError) as e:
        ImageExpander.from_folder(tmp_path, tokenizer=None)
    assert str(e.value) == (f"{tmp_path}: Llama4ImageProcessor requires the Torchvision library, which lmzoo does "
                            "not use: its images cannot go through the data pipelines or `zoo generate --image` "
                            "yet; give the processor's pixel_values to zoo.load(path)(tokens, vision=...) instead")
