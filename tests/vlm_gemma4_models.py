"""Hugging Face Gemma 4 reference models: a tiny random Gemma4ForConditionalGeneration (transformers' own class, its
clip bounds and standardization set to bite) and two small images as its image processor lays them out.

A helper like tests/vlm_models.py (reusing tests/hf_models.py's Gemma 4 text config and ``randomize``); no test
module imports another."""

from __future__ import annotations

import numpy as np
import torch

from tests.hf_models import BASE, FAMILIES, randomize

IMAGE, BOI, EOI = 95, 93, 94  # inside the tiny vocabulary (96)
# Gemma 4's tower, tiny: 2 layers of 2 query heads over 1 key/value head 16 wide, 4-pixel patches pooled 2 x 2,
# clipped linears and standardized features (each exercised: the bounds are set to bite below).
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=32, use_clipped_linears=True,
              standardize=True)
SIZES = [(20, 36), (28, 12)]  # (height, width) of the two images: different shapes, different token counts


def make_gemma4_vlm(folder, seed: int = 0, audio: bool = False, **text_overrides):
    """Save a tiny random Gemma4ForConditionalGeneration (text: tests/hf_models' Gemma 4, its image tokens
    bidirectional on sliding layers, with ``text_overrides``); returns it (float32, eager attention)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {**BASE, **FAMILIES["gemma4"][2], "use_bidirectional_attention": "vision", **text_overrides}
    audio_config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2) if audio else None
    config = Gemma4Config(text_config=text, vision_config=VISION, audio_config=audio_config, image_token_id=IMAGE,
                          boi_token_id=BOI, eoi_token_id=EOI)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    with torch.no_grad():  # buffers randomize leaves: clip bounds that bite, a standardization that moves
        for name, buf in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buf.fill_(-0.6)
            elif name.endswith(("input_max", "output_max")):
                buf.fill_(0.7)
        tower = model.model.vision_tower
        for name, p in tower.named_parameters():  # halved: float32's rounding grows ~100x through the tiny tower
            if "norm" not in name:
                p.mul_(0.5)
        tower.std_bias.copy_(torch.randn(32) * 0.5)
        tower.std_scale.copy_(torch.rand(32) + 0.5)
    model.save_pretrained(folder)
    return model


def grid_images(seed: int = 0) -> dict:
    """Two images as the image processor lays them out, but small (so the test's float32 spread stays far under the
    tolerance; the processor scales every image up to ~70 tokens): 8 x 4 and 4 x 4 patches (columns x rows) of
    random pixels in [0, 1], row-major, padded with (-1, -1) positions to the processor's 280 patches."""
    rng = np.random.RandomState(seed)
    pixels = np.zeros((2, 280, 48), np.float32)
    positions = np.full((2, 280, 2), -1, np.int64)
    for k, (cols, rows) in enumerate([(8, 4), (4, 4)]):
        n = cols * rows
        pixels[k, :n] = rng.uniform(0, 1, (n, 48))
        positions[k, :n] = np.stack(np.meshgrid(np.arange(cols), np.arange(rows)), -1).reshape(n, 2)
    return {"pixel_values": pixels, "image_position_ids": positions, "num_soft_tokens_per_image": np.array([8, 4])}
