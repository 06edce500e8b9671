"""Gemma 3 whole (Gemma3ForConditionalGeneration) against transformers: its SigLIP tower and average-pool
connector's image features, image+text logits with bidirectional image blocks (a block longer than the sliding
window), the round trip in both spellings of the tower's names, the kernels' handling of image blocks, and the
cached prefill's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_logits, hf_tensors, mean_kl, random_tokens
from tests.vlm_models import (
    IMAGE_TOKEN,
    TOKENS_PER_IMAGE,
    gemma3_row,
    hf_gemma3_image_features,
    hf_gemma3_logits,
    image,
    make_gemma3,
)
from zoo.cli import main
from zoo.data.vision_layout import image_patches, layout_rows
from zoo.errors import UserError
from zoo.model.vision import VisionInputs, encode_images


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers' tiny Gemma 3, its `zoo convert`ed checkpoint folder)."""
    root = tmp_path_factory.mktemp("gemma3")
    model = make_gemma3(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    return model, root / "zoo"


def _inputs(cfg, rows) -> VisionInputs:
    """VisionInputs of rows of images (pixels [3, 28, 28] each), 16 patches an image, 32 a row."""
    laid = [[image_patches(cfg.vision, pixels) for pixels in row] for row in rows]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(cfg.vision, laid, 32).items()})


def test_image_features_equal_transformers(gemma3):
    hf, ckpt = gemma3
    cfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    pixels = np.stack([image(0)[0], image(1)[0]])
    ref = hf_gemma3_image_features(hf, pixels)
    got = np.asarray(jax.jit(encode_images, static_argnums=0)(cfg, params, _inputs(cfg, [list(pixels)])))
    assert got.shape == (1, 2 * TOKENS_PER_IMAGE, 64)
    assert np.abs(got[0] - ref).max() <= 1e-5
    assert ref.std() > 0.5


def test_image_text_logits_equal_transformers(gemma3):
    """Two rows: two images in the first, one in the second. Each image's 4 tokens form one bidirectional block,
    longer than the sliding window (3), so on sliding layers the block's first token sees its block's later
    tokens but not the text before it past the window."""
    hf, ckpt = gemma3
    pixels = np.stack([image(k)[0] for k in (1, 2, 3)])
    tokens = np.stack([gemma3_row(20, [3, 11], seed=3), gemma3_row(20, [8], seed=4)])
    ref = hf_gemma3_logits(hf, tokens, pixels)
    model = zoo.load(ckpt)
    got = np.asarray(model(jnp.asarray(tokens), vision=_inputs(model.cfg, [pixels[:2], pixels[2:]])))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5
    # The blocks matter: transformers without token_type_ids (causal over image tokens) differs at them.
    with torch.no_grad():
        causal = hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                    pixel_values=torch.tensor(pixels)).logits.float().numpy()
    assert np.abs(causal - ref)[0, 3:7].max() > 1e-2


@pytest.mark.parametrize("hub", [False, True])
def test_round_trip_is_bit_identical(tmp_path, hub):
    """HF -> zoo -> HF gives back every tensor bit for bit, in the source's spelling of the tower's names
    (transformers' `vision_tower.*` or the Hub's `vision_tower.vision_model.*`), with the config."""
    import json

    make_gemma3(tmp_path / "hf", hub_spelling=hub)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    src, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert any(n.startswith("vision_tower.vision_model." if hub else "vision_tower.encoder.") for n in src)
    assert src == back
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"]


def test_hub_spelling_converts_to_the_same_weights(gemma3, tmp_path):
    _, ckpt = gemma3
    make_gemma3(tmp_path / "hf", hub_spelling=True)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    a, b = zoo.load_params(ckpt), zoo.load_params(tmp_path / "zoo")
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_blockwise_sees_a_block_past_its_query_block():
    """A bidirectional block across the kernel's 128-query blocks: its first queries see its keys in the next
    query block (the lookahead), as the whole mask in one block says."""
    from zoo.kernels.blockwise import blockwise_attention
    from zoo.model.masks import image_block_ids, visibility

    t, d = 300, 8
    tokens = np.zeros((1, t), np.int32)
    tokens[0, 124:132] = tokens[0, 200:204] = IMAGE_TOKEN
    blocks = image_block_ids(jnp.asarray(tokens), IMAGE_TOKEN)
    assert np.asarray(blocks)[0, [123, 124, 131, 132, 200]].tolist() == [-1, 0, 0, -1, 1]
    vis = visibility(jnp.ones((1, t), jnp.int32), window=5, block_ids=blocks, lookahead=7)
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 1, 1, t, d)) for i in range(3))
    k, v = k[:, :, 0], v[:, :, 0]
    # Jitted (the scale, cap, window and block size static): run eagerly, each of the kernel's ops compiled a
    # program of its own (282 compilations, 5 s), where each of these passes is one program.
    attend = jax.jit(blockwise_attention, static_argnums=(4, 5, 6, 7))
    whole = attend(q, k, v, vis, d**-0.5, None, 5, t)
    got = attend(q, k, v, vis, d**-0.5, None, 5, 128)
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole), atol=1e-6)
    causal = attend(q, k, v, dataclasses.replace(vis, block_ids=None), d**-0.5, None, 5, t)
    assert np.abs(np.asarray(causal - whole))[0, 124:128].max() > 1e-2  # the block's later keys count
    # The backward pass scores the same keys: gradients equal the one-block pass's.
    grads = [jax.jit(jax.grad(lambda q, k, v, n=n: blockwise_attention(q, k, v, vis, d**-0.5, None, 5, n).sum(),
                              argnums=(0, 1, 2)))(q, k, v) for n in (t, 128)]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_splash_and_cudnn_refuse_image_blocks(gemma3):
    from zoo.kernels.choice import cudnn_rows_obstacle, kernel_for, splash_obstacle

    cfg = zoo.read_config(gemma3[1])
    assert "image blocks" in splash_obstacle(128, blocks=True)
    assert "image blocks" in cudnn_rows_obstacle(1, blocks=True)
    assert kernel_for(dataclasses.replace(cfg, attention="auto"), jnp.bfloat16, 128, blocks=True) == "blockwise"
    with pytest.raises(UserError, match="image blocks"):
        kernel_for(dataclasses.replace(cfg, attention="splash"), jnp.bfloat16, 128, blocks=True)


def test_text_rows_without_images_equal_transformers(gemma3):
    """The whole Gemma 3 reads text alone (no vision arrays) as transformers does."""
    hf, ckpt = gemma3
    tokens = random_tokens(93, seq=16)  # never an image token or its markers
    ref = hf_logits(hf, tokens)
    got = np.asarray(zoo.load(ckpt)(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6


def test_text_only_refuses_a_text_model(tmp_path, capsys):
    from tests.hf_models import make_hf

    make_hf(tmp_path / "hf", "llama")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo"), "--text-only"]) == 2
    err = capsys.readouterr().err
    assert "--text-only:" in err and "convert without --text-only" in err and "Traceback" not in err


def test_cached_prefill_with_images_equals_the_forward(gemma3):
    """Generation's prefill (an empty cache) with images attends within each image both ways as the training
    forward does, a block longer than the sliding window: equal logits at every real position, a right-padded
    row included. (Gemma 3 generation against transformers: tests/test_vlm_gemma3_data.py.)"""
    from zoo.model.decode import forward_step, init_cache

    _, ckpt = gemma3
    model = zoo.load(ckpt)
    cfg = model.cfg
    pixels = np.stack([image(k)[0] for k in (1, 2, 3)])
    tokens = np.stack([gemma3_row(20, [3, 11], seed=3), gemma3_row(20, [8], seed=4)])
    vision = _inputs(cfg, [pixels[:2], pixels[2:]])
    want = np.asarray(model(jnp.asarray(tokens), vision=vision))
    valid = np.ones(tokens.shape, bool)
    valid[1, 16:] = False  # the second row is 16 tokens, padded
    prefill = jax.jit(lambda p, t, c, v, vis: forward_step(cfg, p, t, c, v, fresh=True, vision=vis)[0])
    got = np.asarray(prefill(model.param_dict(), jnp.asarray(np.where(valid, tokens, 0)), init_cache(cfg, 2, 32),
                             jnp.asarray(valid), vision))
    assert np.abs(got[0] - want[0]).max() <= 1e-5 and np.abs(got[1, :16] - want[1, :16]).max() <= 1e-5
