"""Tiny vision-language processor folders for the data tests (tests/test_vlm_data.py): a small byte-level BPE
tokenizer with SmolVLM's image special tokens and chat template, and SmolVLM's image processor at 28 px; the
same for Gemma 3 (its image tokens, its chat template, Gemma3ImageProcessor at 28 px: :func:`gemma3_folder`).

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
    from transformers import PreTrainedTokenizerFast
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    bpe = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
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


def _bpe(specials: list[str]):
    """A byte-level BPE tokenizer (tokenizers' Tokenizer) of 320 ids trained on WORDS, ``specials`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([WORDS] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return bpe


GEMMA3_SEQ_LEN = 4  # image tokens an image: the tiny Gemma 3's mm_tokens_per_image (tests/vlm_models.py)
GEMMA3_TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "gemma-3.jinja"  # google/gemma-3-*-it's


def gemma3_folder(folder: Path, pan_and_scan: bool = False) -> Path:
    """A Gemma 3 processor folder at ``folder``: tokenizer files (Gemma 3's image and turn tokens, named in
    tokenizer_config.json as Gemma 3's are: boi_token, image_token, eoi_token; its chat template),
    ``preprocessor_config.json`` (Gemma3ImageProcessor at 28 px; pan-and-scan as asked, crops of 8 px and
    more) and ``processor_config.json`` (``image_seq_length``)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<pad>", "<eos>", "<bos>"]), bos_token="<bos>",
                                  eos_token="<eos>", pad_token="<pad>",
                                  extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                        "image_token": "<image_soft_token>"})
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA3_TEMPLATE.read_text()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    scan = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3,
                pan_and_scan_min_ratio_to_activate=1.2) if pan_and_scan else {}
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **scan).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": GEMMA3_SEQ_LEN, "processor_class": "Gemma3Processor"}))
    return folder


def gemma3_reference_processor(folder: Path):
    """transformers' Gemma3Processor for a :func:`gemma3_folder`."""
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    return Gemma3Processor(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                           tokenizer=AutoTokenizer.from_pretrained(str(folder)), image_seq_length=GEMMA3_SEQ_LEN)


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
