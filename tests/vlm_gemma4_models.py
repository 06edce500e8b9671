"""Hugging Face Gemma 4 reference models and processor files: a tiny random Gemma4ForConditionalGeneration
(transformers' own class), a Gemma 4 processor folder (a small byte-level BPE tokenizer with Gemma 4's image and
turn tokens and a Gemma 4-style chat template, Gemma4ImageProcessor at 4-pixel patches pooled 2 x 2, 70 tokens an
image at most) and transformers' Gemma4Processor over it; two small images as its image processor lays them out.

A helper like tests/vlm_models.py (reusing tests/hf_models.py's ``randomize``); no test module imports another."""

from __future__ import annotations

from pathlib import Path

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
PATCH, POOL, MAX_SOFT_TOKENS = 4, 2, 70  # the image processor's, fitting VISION (70: the least it allows)


def make_gemma4_vlm(folder: Path, seed: int = 0, audio: bool = False, vocab_size: int = 96,
                    tokens: tuple[int, int, int] = (IMAGE, BOI, EOI), **text_overrides):
    """Save a tiny random Gemma4ForConditionalGeneration (text: tests/hf_models' Gemma 4, its image tokens
    bidirectional on sliding layers); returns it (float32, eager attention). ``vocab_size`` and ``tokens`` (the
    image, begin- and end-of-image ids) fit it to a tokenizer (:func:`gemma4_folder`'s); the per-layer inputs
    then cover the whole vocabulary, as Gemma 4's do; ``text_overrides`` change the text config."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {**BASE, **FAMILIES["gemma4"][2], "use_bidirectional_attention": "vision", "vocab_size": vocab_size,
            **text_overrides}
    if vocab_size != BASE["vocab_size"]:
        text["vocab_size_per_layer_input"] = vocab_size
    audio_config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2) if audio else None
    config = Gemma4Config(text_config=text, vision_config=VISION, audio_config=audio_config, image_token_id=tokens[0],
                          boi_token_id=tokens[1], eoi_token_id=tokens[2])
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


# Gemma 4's control tokens (ai.google.dev's "Gemma 4 prompt formatting"): turns <|turn>role ... <turn|>, an image
# written as the placeholder <|image|>, which the processor replaces by <|image> + soft tokens + <image|>.
TOKENS = dict(boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>", boa_token="<|audio>",
              audio_token="<|audio|>", eoa_token="<audio|>")
# Gemma 4's turn layout, pared down to what the tests use (no tools, no thinking): the assistant is "model".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}<|turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def gemma4_folder(folder: Path) -> Path:
    """A Gemma 4 processor folder at ``folder``: tokenizer files (Gemma 4's image, audio and turn tokens, named in
    tokenizer_config.json as Gemma 4's are: boi_token, image_token, eoi_token, ...; :data:`CHAT_TEMPLATE`) and
    ``preprocessor_config.json`` (Gemma4ImageProcessor: 4-pixel patches pooled 2 x 2, at most 70 tokens an
    image)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from tests.vlm_processors import _bpe

    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<pad>", "<eos>", "<bos>"]), bos_token="<bos>",
                                  eos_token="<eos>", pad_token="<pad>", extra_special_tokens=TOKENS)
    tok.add_special_tokens({"additional_special_tokens": ["<|turn>", "<turn|>"]})
    tok.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    Gemma4ImageProcessorPil(patch_size=PATCH, max_soft_tokens=MAX_SOFT_TOKENS,
                            pooling_kernel_size=POOL).save_pretrained(str(folder))
    return folder


def gemma4_token_ids(tok) -> tuple[int, int, int]:
    """make_gemma4_vlm's ``tokens`` (image, begin- and end-of-image ids) in the tokenizer ``tok``."""
    return tuple(tok.convert_tokens_to_ids(TOKENS[k]) for k in ("image_token", "boi_token", "eoi_token"))


def gemma4_reference_processor(folder: Path):
    """transformers' Gemma4Processor for a :func:`gemma4_folder`, for text and images: its audio feature extractor
    at its defaults, and no video processor (Gemma4VideoProcessor needs torchvision, not installed here, and the
    processor's class check looks its base up where transformers exports it only with torchvision), the one check
    skipped; every step of the processor's call is its own."""
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    class ImagesOnly(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly(feature_extractor=Gemma4AudioFeatureExtractor(),
                      image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                      tokenizer=AutoTokenizer.from_pretrained(str(folder)), video_processor=None)


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
