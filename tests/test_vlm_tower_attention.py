"""The SigLIP tower's blockwise attention (zoo/model/vision.py) in many query blocks, against transformers: a tiny
SmolVLM's tower (tests/vlm_models.py) whose 16-patch images would otherwise fit one block."""

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

BLOCK = 8  # queries a block: a row of two 16-patch images and 4 padding patches is 5 blocks, the last one short


def _hf_features_and_pixel_grads(model, pixels: np.ndarray, masks: np.ndarray, weights: np.ndarray):
    """transformers' image features [images * tokens, hidden] of one image a row, and the gradient of
    sum(features * weights) with respect to the pixels [images, 3, S, S]."""
    px = torch.tensor(pixels[:, None], requires_grad=True)
    out = model.model.get_image_features(px, torch.tensor(masks[:, None]), return_dict=True)
    feats = torch.cat(out.pooler_output)
    (feats * torch.tensor(weights)).sum().backward()
    return feats.detach().numpy(), px.grad[:, 0].numpy()


def test_blockwise_tower_equals_transformers_features_and_gradients(tmp_path, monkeypatch):
    """With blocks of 8 queries over a row of two images (one padded, so some keys are not real patches) and
    row padding, the tower and connector give transformers' image features (1e-5, as the one-block test in
    test_vlm_families.py) and the kernel's backward pass gives transformers' gradient of a weighted sum of the
    features with respect to the pixels, laid out as patches (the row's padding patches: none)."""
    hf = make_vlm(tmp_path / "hf", "smolvlm")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    import zoo

    cfg, params = zoo.read_config(tmp_path / "zoo"), zoo.load_params(tmp_path / "zoo")
    v = cfg.vision
    monkeypatch.setattr(vision, "tower_block", lambda n: BLOCK)
    (pa, ma), (pb, mb) = image(0), image(1, rows=20, cols=13)
    assert not image_patches(v, pb, mb)["patch_valid"].all()  # the second image has padding patches
    inputs = VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(
        v, [[image_patches(v, pa, ma), image_patches(v, pb, mb)]], 36).items()})
    tokens = 2 * TOKENS_PER_IMAGE
    weights = np.random.RandomState(3).normal(size=(tokens, 64)).astype(np.float32)

    def weighted(patches):
        feats = encode_images(cfg, params, dataclasses.replace(inputs, patches=patches))[0, :tokens]
        return jnp.sum(feats * weights), feats

    (_, got), grads = jax.jit(jax.value_and_grad(weighted, has_aux=True))(inputs.patches)
    ref, ref_grads = _hf_features_and_pixel_grads(hf, np.stack([pa, pb]), np.stack([ma, mb]), weights)
    assert np.abs(np.asarray(got) - ref).max() <= 1e-5 and ref.std() > 0.5
    want = np.concatenate([image_patches(v, g, None)["patches"] for g in ref_grads])  # pixels laid out as patches
    grads = np.asarray(grads[0])
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(grads[:32] - want).max() <= 1e-5 * scale
    assert not grads[32:].any()
