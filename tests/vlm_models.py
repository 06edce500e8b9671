"""Hugging Face vision-language reference models: tiny random SmolVLM/Idefics3 and Gemma 3 models (transformers'
own classes), their image features and logits, and images to feed them (random pixels, optionally padded as the
processor pads).

A helper like tests/hf_models.py (whose BASE text config and ``randomize`` it reuses); no test module imports
another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.hf_models import BASE, FAMILIES, randomize

IMAGE_TOKEN = 95  # the last id of the tiny vocabulary (96)
# SigLIP 32 wide, 2 layers of 2 heads, 28-pixel images in 7-pixel patches: 4 x 4 patches, 2 x 2 shuffled into
# 4 image tokens of the language model.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=7)
# SmolVLM-Instruct's case in small: 34-pixel images in 7-pixel patches, 4 x 4 patches and 6 pixels the conv drops
# (SmolVLM-Instruct's 384-pixel tiles in 14-pixel patches: 27 x 27 and 6 pixels).
ODD_VISION = {**VISION, "image_size": 34}
TEXT = {**BASE, "num_hidden_layers": 2, "tie_word_embeddings": False}
TOKENS_PER_IMAGE = 4

# name -> (transformers config class, model class)
VLM_FAMILIES = {
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
    "smolvlm_odd": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),  # ODD_VISION's tower
}


def make_vlm(folder: Path, name: str = "smolvlm", seed: int = 0, vocab_size: int = 96,
             image_token_id: int = IMAGE_TOKEN):
    """Save a tiny random ``name`` model to ``folder``; returns the float32 transformers model (eager attention).
    ``vocab_size`` and ``image_token_id`` fit it to a tokenizer (tests/vlm_processors.py's)."""
    import transformers

    cfg_name, model_name = VLM_FAMILIES[name]
    vision = ODD_VISION if name.endswith("_odd") else VISION
    config = getattr(transformers, cfg_name)(text_config={**TEXT, "vocab_size": vocab_size}, vision_config=vision,
                                             scale_factor=2, image_token_id=image_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(folder)
    return model


def image(seed: int, rows: int = 28, cols: int = 28, size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """(pixels [3, size, size] float32, pixel mask [size, size] bool) of a random ``rows`` x ``cols`` image padded
    with zeros at the bottom and right to size x size, as the processor pads a smaller image."""
    rng = np.random.RandomState(seed)
    pixels = np.zeros((3, size, size), np.float32)
    pixels[:, :rows, :cols] = rng.uniform(-1, 1, (3, rows, cols))
    mask = np.zeros((size, size), bool)
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


# Gemma 3: the same SigLIP tower (no pooling head), average-pooled 2 x 2 into 4 tokens an image; a 3-layer text
# model whose sliding window (3) is shorter than an image's block of tokens (4). 93/94: begin/end of image.
GEMMA3_TEXT = {**{k: v for k, v in FAMILIES["gemma3"][2].items() if k != "final_logit_softcapping"}, **BASE,
               "num_hidden_layers": 3, "sliding_window": 3,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
BOI, EOI = 93, 94


def make_gemma3(folder: Path, seed: int = 0, hub_spelling: bool = False, vocab_size: int = 96,
                tokens: tuple[int, int, int] = (IMAGE_TOKEN, BOI, EOI), untied: bool = False):
    """Save a tiny random Gemma3ForConditionalGeneration to ``folder``; returns it (float32, eager attention).
    ``hub_spelling`` renames the tower's tensors as the Hub's Gemma 3 files have them
    (``vision_tower.vision_model.*``, where transformers 5 saves ``vision_tower.*``). ``vocab_size`` and
    ``tokens`` (the image, begin- and end-of-image ids) fit it to a tokenizer (tests/vlm_processors.py's).
    ``untied``: an output head of its own (with Gemma's embeddings scaled by sqrt(hidden), a tied head makes
    greedy decoding repeat the last token)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tie = {"tie_word_embeddings": False} if untied else {}
    config = Gemma3Config(text_config={**GEMMA3_TEXT, "vocab_size": vocab_size, **tie}, **tie,
                          vision_config={**VISION, "vision_use_head": False},
                          mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=tokens[0],
                          boi_token_index=tokens[1], eoi_token_index=tokens[2])
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(folder)
    if hub_spelling:
        for f in folder.glob("*.safetensors"):
            tensors = load_file(f)
            save_file({n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in tensors.items()},
                      f, metadata={"format": "pt"})
    return model


def hf_gemma3_image_features(model, pixels: np.ndarray) -> np.ndarray:
    """transformers' Gemma 3 image features [images * tokens_per_image, hidden] of pixels [images, 3, S, S]."""
    with torch.no_grad():
        return model.model.get_image_features(torch.tensor(pixels), return_dict=True).pooler_output.reshape(
            -1, model.config.text_config.hidden_size).numpy()


def hf_gemma3_logits(model, tokens: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """transformers' float32 logits [rows, seq, vocab] of int tokens [rows, seq] holding the image tokens of
    pixels [images, 3, S, S] in order, with the ``token_type_ids`` (1 on image tokens) that make Gemma 3's image
    blocks bidirectional."""
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=torch.tensor(pixels),
                     token_type_ids=(ids == IMAGE_TOKEN).long()).logits.float().numpy()


def gemma3_row(seq: int, starts: list[int], seed: int) -> np.ndarray:
    """Int tokens [seq]: random text ids (below the begin-of-image id) with one image's TOKENS_PER_IMAGE image
    tokens, between its begin and end markers, from each of ``starts``, as Gemma 3's processor expands them."""
    row = np.random.RandomState(seed).randint(0, BOI, seq).astype(np.int32)
    for at in starts:
        row[at - 1], row[at + TOKENS_PER_IMAGE] = BOI, EOI
        row[at:at + TOKENS_PER_IMAGE] = IMAGE_TOKEN
    return row


def assert_export_round_trip(hf, ckpt: Path, out: Path) -> None:
    """`zoo export` of ``ckpt`` (converted from ``ckpt.parent / "hf"``, transformers' model ``hf``) to ``out``
    gives back every tensor bit for bit and the config (dtype keys aside), which transformers loads as ``hf``'s
    class."""
    import json

    from transformers import AutoModelForImageTextToText

    from tests.hf_models import hf_tensors
    from zoo.cli import main

    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert hf_tensors(ckpt.parent / "hf") == hf_tensors(out)
    a = json.loads((ckpt.parent / "hf" / "config.json").read_text())
    b = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in a.items() if "dtype" not in k} == {k: v for k, v in b.items() if "dtype" not in k}
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32)
    assert type(back) is type(hf)
