"""Hugging Face vision-language reference models: tiny random SmolVLM/Idefics3 models (transformers' own classes),
their image features and logits, and images to feed them (random pixels, optionally padded as the processor pads).

A helper like tests/hf_models.py (whose BASE text config and ``randomize`` it reuses); no test module imports
another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.hf_models import BASE, randomize

IMAGE_TOKEN = 95  # the last id of the tiny vocabulary (96)
# SigLIP 32 wide, 2 layers of 2 heads, 28-pixel images in 7-pixel patches: 4 x 4 patches, 2 x 2 shuffled into
# 4 image tokens of the language model.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=7)
TEXT = {**BASE, "num_hidden_layers": 2, "tie_word_embeddings": False}
TOKENS_PER_IMAGE = 4

# name -> (transformers config class, model class)
VLM_FAMILIES = {
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
}


def make_vlm(folder: Path, name: str = "smolvlm", seed: int = 0, vocab_size: int = 96,
             image_token_id: int = IMAGE_TOKEN):
    """Save a tiny random ``name`` model to ``folder``; returns the float32 transformers model (eager attention).
    ``vocab_size`` and ``image_token_id`` fit it to a tokenizer (tests/vlm_processors.py's)."""
    import transformers

    cfg_name, model_name = VLM_FAMILIES[name]
    config = getattr(transformers, cfg_name)(text_config={**TEXT, "vocab_size": vocab_size}, vision_config=VISION,
                                             scale_factor=2, image_token_id=image_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(folder)
    return model


def image(seed: int, rows: int = 28, cols: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """(pixels [3, 28, 28] float32, pixel mask [28, 28] bool) of a random ``rows`` x ``cols`` image padded with
    zeros at the bottom and right to 28 x 28, as the processor pads a smaller image."""
    rng = np.random.RandomState(seed)
    pixels = np.zeros((3, 28, 28), np.float32)
    pixels[:, :rows, :cols] = rng.uniform(-1, 1, (3, rows, cols))
    mask = np.zeros((28, 28), bool)
    mask[:rows, :cols] = True
    return pixels, mask


def hf_image_features(model, pixels: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """transformers' image features [images * tokens_per_image, hidden] of one image per row: pixels
    [rows, 3, S, S], masks [rows, S, S]."""
    with torch.no_grad():
        out = model.model.get_image_features(torch.tensor(pixels[:, None]),
                                             torch.tensor(masks[:, None]), return_dict=True)
    return torch.cat(out.pooler_output).numpy()


def hf_vlm_logits(model, tokens: np.ndarray, pixels: np.ndarray, masks: np.ndarray, per_row: int = 1) -> np.ndarray:
    """transformers' float32 logits [rows, seq, vocab] of int tokens [rows, seq] with ``per_row`` images (frames)
    a row: pixels [rows * per_row, 3, S, S], masks [rows * per_row, S, S]."""
    b = len(tokens)
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                     pixel_values=torch.tensor(pixels.reshape(b, per_row, *pixels.shape[1:])),
                     pixel_attention_mask=torch.tensor(masks.reshape(b, per_row, *masks.shape[1:])),
                     ).logits.float().numpy()


def image_row(seq: int, at: int, seed: int) -> np.ndarray:
    """Int tokens [seq]: random text ids (never the image token) with one image's TOKENS_PER_IMAGE image tokens
    from ``at``, as the processor expands an image placeholder without splitting."""
    row = np.random.RandomState(seed).randint(0, IMAGE_TOKEN, seq).astype(np.int32)
    row[at:at + TOKENS_PER_IMAGE] = IMAGE_TOKEN
    return row
