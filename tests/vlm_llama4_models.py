"""Hugging Face Llama 4 reference models: a tiny random Llama4ForConditionalGeneration (transformers' own classes:
tests/hf_models.py's tiny Llama 4 text model beside a tiny Llama4VisionModel), its image features and logits, tiles
of pixels, and rows of tokens with each image's tokens laid out by transformers' Llama4Processor.

A helper like tests/vlm_models.py (reusing tests/hf_models.py's ``randomize``); no test module imports another."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tests.hf_models import BASE, FAMILIES, randomize

# The image's tokens inside the tiny vocabulary (96): <|image_start|>, <|image_end|>, <|image|> (the global tile's
# marker), <|patch|> (the features' placeholder: the config's image_token_id), the tiles' x and y separators.
SPECIALS = {"<|image_start|>": 90, "<|image_end|>": 91, "<|image|>": 92, "<|tile_x_separator|>": 93,
            "<|tile_y_separator|>": 94, "<|patch|>": 95}
PATCH_TOKEN = SPECIALS["<|patch|>"]
# Llama 4's tower, tiny: 2 layers of 2 heads 8 wide (2-D RoPE: 2 frequencies an axis), 28-pixel tiles in 7-pixel
# patches (4 x 4 and the class token), shuffled 2 x 2 into 4 tokens a tile; the adapter's MLP 32 wide.
VISION = dict(hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=7, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
              pixel_shuffle_ratio=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
TOKENS_PER_TILE = 4


def make_llama4_vlm(folder: Path | None, seed: int = 0):
    """A tiny random Llama4ForConditionalGeneration (float32, eager attention), saved to ``folder`` unless None."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = {**BASE, **FAMILIES["llama4"][2]}
    config = Llama4Config(text_config=text, vision_config=VISION, image_token_index=PATCH_TOKEN)
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    if folder is not None:
        model.save_pretrained(folder)
    return model


def tiles(seed: int, count: int) -> np.ndarray:
    """Float32 [count, 3, 28, 28] tiles in [-1, 1] (Llama 4's image processor normalizes by mean 0.5, std 0.5)."""
    return np.random.RandomState(seed).uniform(-1, 1, (count, 3, 28, 28)).astype(np.float32)


def image_string(ratio: tuple[int, int]) -> str:
    """One image's text as transformers' Llama4Processor writes it for tiles of ``ratio`` (rows, columns): its
    own ``_prompt_split_image`` (which reads nothing of the processor; the processor itself needs the image
    processor, which needs torchvision)."""
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    return Llama4Processor._prompt_split_image(None, ratio, TOKENS_PER_TILE)


def image_row(seq: int, images: list[tuple[int, tuple[int, int]]], seed: int) -> np.ndarray:
    """Int tokens [seq]: random text ids (below the image tokens) with each image of ``images`` ((start, tile
    ratio)) written from its start as :func:`image_string` says."""
    row = np.random.RandomState(seed).randint(0, min(SPECIALS.values()), seq).astype(np.int32)
    for at, ratio in images:
        ids = [SPECIALS[t] for t in re.findall(r"<\|[a-z_]+\|>", image_string(ratio))]
        row[at:at + len(ids)] = ids
    return row


def hf_image_features(model, pixels: np.ndarray) -> np.ndarray:
    """transformers' projected features [tiles * 4, hidden] of tiles [tiles, 3, 28, 28]."""
    with torch.no_grad():
        out = model.get_image_features(pixel_values=torch.tensor(pixels)).pooler_output
    return out.reshape(-1, out.shape[-1]).float().numpy()


def hf_logits(model, tokens: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """transformers' logits [b, t, vocab] of rows of tokens whose images' tiles are ``pixels``, in order."""
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                     pixel_values=torch.tensor(pixels)).logits.float().numpy()
