"""Hugging Face Qwen2.5-VL reference models: a tiny random Qwen2_5_VLForConditionalGeneration (transformers' own
class), its image features and logits, and random images as its processor's outputs (pixel_values, grid_thw).

A helper like tests/vlm_models.py (reusing tests/hf_models.py's ``randomize``); no test module imports another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.hf_models import randomize

IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 95, 92, 93, 94
# A Qwen 2 language model 64 wide (4 heads of 16: 8 frequencies, mrope sections 2 + 3 + 3); a 3-layer tower 32 wide
# (2 heads of 16) in 4-pixel patches 2 frames deep, merged 2 x 2, windows of 16 pixels (2 x 2 merged tokens, 4 x 4
# patches), layer 1 attending over the whole image.
TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, window_size=16, out_hidden_size=64, fullatt_block_indexes=[1])
PATCH_DIM = 3 * 2 * 4 * 4


def make_qwen(folder: Path, seed: int = 0, vocab_size: int = 96, image_token_id: int = IMAGE_TOKEN,
              **tokens: int):
    """Save a tiny random Qwen2.5-VL to ``folder``; returns the float32 transformers model (eager attention).
    ``vocab_size``, ``image_token_id`` and ``tokens`` (vision_start_token_id, ...) fit it to a tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    config = Qwen2_5_VLConfig(text_config={**TEXT, "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2},
                              vision_config=VISION, image_token_id=image_token_id, **{**ids, **tokens})
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(folder)
    return model


def random_image(seed: int, rows: int, cols: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values [rows * cols, PATCH_DIM] float32, grid (1, rows, cols)): random patches of one image, as the
    image processor returns them."""
    return np.random.RandomState(seed).uniform(-1, 1, (rows * cols, PATCH_DIM)).astype(np.float32), (1, rows, cols)


def hf_image_features(model, images: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[np.ndarray]:
    """transformers' image features, [tokens, hidden] per image, of ``images`` run as one batch."""
    pixels = torch.tensor(np.concatenate([p for p, _ in images]))
    grids = torch.tensor([g for _, g in images])
    with torch.no_grad():
        return [f.numpy() for f in model.model.get_image_features(pixels, grids, return_dict=True).pooler_output]


def hf_qwen_logits(model, tokens: np.ndarray, images: list[tuple[np.ndarray, tuple[int, int, int]]],
                   attention_mask: np.ndarray | None = None) -> np.ndarray:
    """transformers' float32 logits [rows, seq, vocab] of int tokens [rows, seq] holding the image tokens of
    ``images`` in order (its own multimodal positions from ``mm_token_type_ids``)."""
    ids = torch.tensor(tokens, dtype=torch.long)
    kwargs = {}
    if images:
        kwargs = dict(pixel_values=torch.tensor(np.concatenate([p for p, _ in images])),
                      image_grid_thw=torch.tensor([g for _, g in images]))
    mask = None if attention_mask is None else torch.tensor(attention_mask)
    with torch.no_grad():
        return model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), attention_mask=mask,
                     **kwargs).logits.float().numpy()


def qwen_row(seq: int, images: list[tuple[int, tuple[int, int, int]]], seed: int) -> np.ndarray:
    """Int tokens [seq]: random text ids (below the vision markers) with, from each (start, grid), that image's
    t * h * w / 4 image tokens between its vision start and end markers, as the processor expands them."""
    row = np.random.RandomState(seed).randint(0, VISION_START, seq).astype(np.int32)
    for at, (t, h, w) in images:
        n = t * h * w // 4
        row[at - 1], row[at + n] = VISION_START, VISION_END
        row[at:at + n] = IMAGE_TOKEN
    return row
