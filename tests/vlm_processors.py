"""Tiny vision-language processor folders for the data tests (tests/test_vlm_data.py): a small byte-level BPE
tokenizer with SmolVLM's image special tokens and chat template, and SmolVLM's image processor at 28 px.

The tower behind it would be SigLIP at image size 28 with patch 7 (16 patches) and SmolVLM's pixel shuffle with
scale factor 2, so an image (or a tile) is ``image_seq_len`` = (28 / 7)² / 2² = 4 ``<image>`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_SIZE, PATCH, SCALE = 28, 7, 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE ** 2
# SmolVLM's tokens around images (its tokenizer's added tokens; the processor's defaults).
SMOLVLM_SPECIALS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
WORDS = "User Assistant What is in this picture? It is a red square and a blue circle. Describe the image, please."


def smolvlm_folder(folder: Path, splitting: bool) -> Path:
    """A SmolVLM processor folder at ``folder``: tokenizer files (SmolVLM's special tokens and chat template:
    transformers' ``DEFAULT_CHAT_TEMPLATE`` of processing_smolvlm), ``preprocessor_config.json`` (SmolVLM's PIL
    image processor, tiles of 28 px, images up to 56 px, ``do_image_splitting`` as asked) and
    ``processor_config.json`` (``image_seq_len``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([WORDS] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                  pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SMOLVLM_SPECIALS})
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    SmolVLMImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
                             do_image_splitting=splitting).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_seq_len": IMAGE_SEQ_LEN, "processor_class": "SmolVLMProcessor"}))
    return folder


def reference_processor(folder: Path):
    """transformers' own processor for the folder: Idefics3Processor, which expands ``<image>`` exactly as
    SmolVLMProcessor does (SmolVLMProcessor itself needs num2words and a video processor, not installed here)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Idefics3Processor

    return Idefics3Processor(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                             tokenizer=AutoTokenizer.from_pretrained(str(folder)), image_seq_len=IMAGE_SEQ_LEN)


def write_images(folder: Path, sizes: list[tuple[int, int]], seed: int = 0) -> list[str]:
    """Random RGB PNG files of ``sizes`` (width, height) in ``folder``; their file names."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    names = []
    for k, (w, h) in enumerate(sizes):
        names.append(f"img{k}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / names[-1])
    return names
