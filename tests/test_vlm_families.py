"""Vision-language models against transformers: SmolVLM's host-side patch layout, its SigLIP tower's image features
and its image+text logits, from a `zoo convert`ed tiny random SmolVLMForConditionalGeneration; ``smolvlm_odd`` is
one whose image size is not a multiple of its patch size (SmolVLM-Instruct's 384 pixels in 14-pixel patches)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_logits, mean_kl, random_tokens
from tests.vlm_models import (
    TOKENS_PER_IMAGE,
    assert_export_round_trip,
    hf_image_features,
    hf_vlm_logits,
    image,
    image_row,
    make_vlm,
)
from zoo.cli import main
from zoo.data.vision_layout import bucketized_positions, image_patches, layout_rows, patch_validity, shuffle_slots
from zoo.model.vision import VisionInputs, encode_images


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (transformers' tiny model of VLM_FAMILIES' ``name``, its `zoo convert`ed checkpoint folder), each
    made once."""
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            model = make_vlm(root / "hf", name)
            assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
            made[name] = model, root / "zoo"
        return made[name]

    return get


@pytest.fixture(scope="module")
def smolvlm(converted):
    """(transformers' tiny SmolVLM, its `zoo convert`ed checkpoint folder)."""
    return converted("smolvlm")


def _inputs(cfg, images) -> VisionInputs:
    """One image per row: the batch's VisionInputs (16 patches a row)."""
    rows = [[image_patches(cfg.vision, pixels, mask)] for pixels, mask in images]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(cfg.vision, rows, 16).items()})


@pytest.mark.parametrize("side,image_size,shapes", [(4, 28, [(28, 28), (20, 28), (28, 13), (7, 7)]),
                                                    (26, 364, [(364, 364), (300, 364), (364, 141), (15, 200)]),
                                                    (4, 34, [(34, 34), (33, 34), (34, 30), (29, 9)])])
def test_positions_and_validity_equal_transformers(side, image_size, shapes):
    """The bucketized position rows and patch validity, against SmolVLMVisionEmbeddings' own (read by a hook on
    its position table), on padded images; 26 patches a side has bucket edges that are not exact in float32;
    34 pixels in 8-pixel patches leave 2 pixels the conv drops (a 33-row image fills the 4 patch rows it has)."""
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionEmbeddings

    patch = image_size // side
    emb = SmolVLMVisionEmbeddings(SmolVLMVisionConfig(hidden_size=8, image_size=image_size, patch_size=patch))
    seen = []
    emb.position_embedding.register_forward_hook(lambda m, args, out: seen.append(args[0].numpy()))
    for rows, cols in shapes:
        mask = np.zeros((image_size, image_size), bool)
        mask[:rows, :cols] = True
        valid = patch_validity(mask, patch)
        ref_valid = torch.tensor(mask).unfold(0, patch, patch).unfold(1, patch, patch).sum(dim=(-1, -2)) > 0
        np.testing.assert_array_equal(valid, ref_valid.numpy())
        with torch.no_grad():
            emb(torch.zeros(1, 3, image_size, image_size), ref_valid[None])
        np.testing.assert_array_equal(bucketized_positions(valid, side), seen[-1][0])


def test_shuffle_slots_equal_pixel_shuffle():
    """Each patch's (token, slot) puts it where SmolVLMConnector.pixel_shuffle does."""
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector

    side, scale, dim = 6, 3, 2
    states = torch.arange(side * side * dim, dtype=torch.float32).reshape(1, side * side, dim)
    ref = SmolVLMConnector.pixel_shuffle(None, states, scale)[0].reshape(side * side // scale**2, scale**2, dim)
    token, slot = shuffle_slots(side, side, scale)
    got = np.zeros(ref.shape, np.float32)
    got[token, slot] = states[0].numpy()
    np.testing.assert_array_equal(got, ref.numpy())


@pytest.mark.parametrize("name", ["smolvlm", "idefics3", "smolvlm_odd"])
def test_image_features_equal_transformers(converted, name):
    """The tower and connector's features of one image equal transformers' (``smolvlm_odd``: a 34 x 34 image whose
    last 6 rows and columns of pixels the conv drops)."""
    hf, ckpt = converted(name)
    cfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    pixels, mask = image(0, 34, 34, 34) if name.endswith("_odd") else image(0)
    ref = hf_image_features(hf, pixels[None], mask[None])
    got = np.asarray(jax.jit(encode_images, static_argnums=0)(cfg, params, _inputs(cfg, [(pixels, mask)])))
    assert got.shape == (1, TOKENS_PER_IMAGE, 64)
    assert np.abs(got[0] - ref).max() <= 1e-5
    assert ref.std() > 0.5


@pytest.mark.parametrize("name", ["smolvlm", "smolvlm_odd"])
def test_image_text_logits_equal_transformers(converted, name):
    """Two rows, one image each: a full image and a 13 x 20 one padded to the image size (28, or 34 of which the
    conv drops the last 6 pixels): 2 x 3 patches hold pixels (the last of each partly), so its bucketized
    positions are rows 0 and 2 of the 4 x 4 table (a 20 x 28 image's 3 x 4 patches would read the table's first
    rows as they lie) and its padding patches run as queries only."""
    hf, ckpt = converted(name)
    size = hf.config.vision_config.image_size
    images = [image(1, size, size, size), image(2, rows=13, cols=20, size=size)]
    tokens = np.stack([image_row(16, 3, seed=3), image_row(16, 9, seed=4)])
    ref = hf_vlm_logits(hf, tokens, np.stack([p for p, _ in images]), np.stack([m for _, m in images]))
    model = zoo.load(ckpt)
    got = np.asarray(model(jnp.asarray(tokens), vision=_inputs(model.cfg, images)))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5
    # The images matter: other pixels change the logits from the first image token on, and only from there.
    other = hf_vlm_logits(hf, tokens, np.stack([image(5, size, size, size)[0], image(6, 13, 20, size)[0]]),
                          np.stack([m for _, m in images]))
    assert np.abs(other - ref)[0, :3].max() < 1e-5 and np.abs(other - ref)[0, 3:].max() > 1e-2


@pytest.mark.parametrize("name", ["smolvlm", "smolvlm_odd"])
def test_round_trip_is_bit_identical(converted, name, tmp_path):
    """HF -> zoo -> HF gives back every tensor, bit for bit, and the config, which transformers loads."""
    hf, ckpt = converted(name)
    assert_export_round_trip(hf, ckpt, tmp_path / "back")


def test_text_rows_without_images_equal_transformers(smolvlm):
    """A vision-language model reads text alone (no vision arrays) as transformers does."""
    hf, ckpt = smolvlm
    tokens = random_tokens(95, seq=16)  # never the image token
    ref = hf_logits(hf, tokens)
    got = np.asarray(zoo.load(ckpt)(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6


def test_vision_config_refuses_what_the_tower_cannot_run():
    from zoo.errors import UserError
    from zoo.model.vision_config import VisionConfig

    ok = dict(arch="SmolVLMForConditionalGeneration", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
              patch_size=7, image_size=28, image_token_id=95)
    with pytest.raises(UserError, match="image_size=28 // patch_size=7 = 4 patches a side must be a multiple of "
                                        "scale_factor=3"):
        VisionConfig(**ok, scale_factor=3)
    assert VisionConfig(**{**ok, "image_size": 34}, scale_factor=2).side == 4  # the conv drops 6 pixels a side
    with pytest.raises(UserError, match="connector 'mean' is not one of shuffle_linear, avg_pool"):
        VisionConfig(**ok, connector="mean")


def test_processor_rows_with_tiles_equal_transformers(tmp_path):
    """Two images in one row through transformers' own processor, split into tiles: each image is its four 28 px
    tiles and then the whole image shrunk, 4 image tokens a frame between the processor's row/column markers;
    the row's frames, in order, are the row's images."""
    from PIL import Image

    from tests.vlm_processors import reference_processor, smolvlm_folder, write_images

    proc = reference_processor(smolvlm_folder(tmp_path / "proc", splitting=True))
    images = [Image.open(tmp_path / n).convert("RGB") for n in write_images(tmp_path, [(56, 42), (30, 50)])]
    ref_in = proc(text=["User:<image>What is in this picture?<image>Describe the image, please."],
                  images=[images], return_tensors="np")
    frames, masks = ref_in["pixel_values"][0], ref_in["pixel_attention_mask"][0].astype(bool)
    assert len(frames) == 10  # 2 x 2 tiles and the whole, each image
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    hf = make_vlm(tmp_path / "hf", vocab_size=len(proc.tokenizer), image_token_id=image_id)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    tokens = ref_in["input_ids"].astype(np.int32)
    ref = hf_vlm_logits(hf, tokens, frames, masks, per_row=len(frames))
    model = zoo.load(tmp_path / "zoo")
    rows = [[image_patches(model.cfg.vision, p, m) for p, m in zip(frames, masks, strict=True)]]
    vision = VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(model.cfg.vision, rows, 16 * 10).items()})
    got = np.asarray(model(jnp.asarray(tokens), vision=vision))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
