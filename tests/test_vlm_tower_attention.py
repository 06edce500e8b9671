"""The SigLIP tower's attention in blocks of queries (zoo/model/vision.py) against transformers: a tiny SmolVLM's
tower (tests/vlm_models.py) whose 16-patch images would otherwise fit one block."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tests.vlm_models import TOKENS_PER_IMAGE, image, make_vlm
from zoo.cli import main
from zoo.data.vision_layout import image_patches, layout_rows
from zoo.model import vision
from zoo.model.vision import VisionInputs, encode_images

BLOCK = 8  # queries a block: rows of 36 patches are 5 blocks, the last one short


def _hf_features_and_pixel_grads(model, pixels: np.ndarray, masks: np.ndarray, weights: np.ndarray):
    """transformers' image features [images * tokens, hidden] of one image a row, and the gradient of
    sum(features * weights) with respect to the pixels [images, 3, S, S]."""
    px = torch.tensor(pixels[:, None], requires_grad=True)
    out = model.model.get_image_features(px, torch.tensor(masks[:, None]), return_dict=True)
    feats = torch.cat(out.pooler_output)
    (feats * torch.tensor(weights)).sum().backward()
    return feats.detach().numpy(), px.grad[:, 0].numpy()


def test_blockwise_tower_equals_transformers_features_and_gradients(tmp_path, monkeypatch):
    """With blocks of 8 queries over two rows (two images, one of them padded so some keys are not real patches;
    that padded image alone), each with row padding, the tower and connector give transformers' image features
    (1e-5, as the one-block test in test_vlm_families.py), and the blocks' backward pass gives transformers'
    gradient of a weighted sum of the features with respect to the pixels, laid out as patches (the rows'
    padding patches: none)."""
    hf = make_vlm(tmp_path / "hf", "smolvlm")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    import zoo

    cfg, params = zoo.read_config(tmp_path / "zoo"), zoo.load_params(tmp_path / "zoo")
    v = cfg.vision
    monkeypatch.setattr(vision, "tower_block", lambda n: BLOCK)
    (pa, ma), (pb, mb) = image(0), image(1, rows=20, cols=13)
    assert not image_patches(v, pb, mb)["patch_valid"].all()  # the second image has padding patches
    a, b = image_patches(v, pa, ma), image_patches(v, pb, mb)
    inputs = VisionInputs(**{k: jnp.asarray(x) for k, x in layout_rows(v, [[a, b], [b]], 36).items()})
    t = TOKENS_PER_IMAGE
    weights = np.random.RandomState(3).normal(size=(3 * t, 64)).astype(np.float32)

    def weighted(patches):
        feats = encode_images(cfg, params, dataclasses.replace(inputs, patches=patches))
        feats = jnp.concatenate([feats[0, :2 * t], feats[1, :t]])
        return jnp.sum(feats * weights), feats

    (_, got), grads = jax.jit(jax.value_and_grad(weighted, has_aux=True))(inputs.patches)
    ref, ref_grads = _hf_features_and_pixel_grads(hf, np.stack([pa, pb, pb]), np.stack([ma, mb, mb]), weights)
    assert np.abs(np.asarray(got) - ref).max() <= 1e-5 and ref.std() > 0.5
    want = [image_patches(v, g, None)["patches"] for g in ref_grads]  # the pixels' gradients laid out as patches
    grads = np.asarray(grads)
    scale = np.abs(np.concatenate(want)).max()
    assert scale > 0 and np.abs(grads[0, :32] - np.concatenate(want[:2])).max() <= 1e-5 * scale
    assert np.abs(grads[1, :16] - want[2]).max() <= 1e-5 * scale
    assert not grads[0, 32:].any() and not grads[1, 16:].any()
