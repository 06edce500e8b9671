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


# Qwen2-VL's chat template (Qwen2.5-VL's too): each image part as <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] "
    "!= 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>"
    "{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
WORDS = "system You are a helpful assistant. user What is in this picture? It is a red square and a blue circle."


def qwen_folder(folder: Path) -> Path:
    """A Qwen2.5-VL processor folder: a small byte-level BPE tokenizer with Qwen's special tokens and chat template,
    and Qwen2VLImageProcessor (PIL) at the tiny tower's patches (4 px, 2 frames, merged 2 x 2), images resized to
    between 64 and 1024 pixels."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([WORDS] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 64, "longest_edge": 1024}).save_pretrained(str(folder))
    return folder


def qwen_token_ids(tok) -> dict[str, int]:
    """make_qwen's token id arguments for the tokenizer ``tok`` (qwen_folder's)."""
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return {"vocab_size": len(tok), **ids}


def assert_rows_expand_as_processor(root: Path, folder: Path, tok, processor_class, question: str,
                                    answer: str) -> None:
    """A conversation with two images (``root``'s img0.png, 8 x 6 merged patches, and img1.png, 4 x 4) tokenized
    by chat/images.py: its ids are the tokenized text with each <|image_pad|> replaced as
    ``processor_class.replace_image_token`` replaces it, its pixels and grids those of the image processor of
    ``folder`` (the checkpoint's processor files), and its image tokens untrained."""
    from types import SimpleNamespace

    from PIL import Image
    from transformers import AutoImageProcessor

    from chat.formats import normalize
    from chat.images import ImageExpander, tokenize_with_images

    names = ["img0.png", "img1.png"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}, {"type": "image"}]},
                {"role": "assistant", "content": answer}]
    got = tokenize_with_images(normalize({"messages": messages, "images": names}, "messages"), tok,
                               ImageExpander.from_folder(folder, tok), root)
    processor = AutoImageProcessor.from_pretrained(str(folder))
    ref = dict(processor(images=[Image.open(root / n).convert("RGB") for n in names], return_tensors="np"))
    pieces = tok.apply_chat_template(messages, tokenize=False).split("<|image_pad|>")
    this = SimpleNamespace(image_processor=processor, image_token="<|image_pad|>")
    text = pieces[0] + "".join(processor_class.replace_image_token(this, ref, i) + pieces[i + 1] for i in range(2))
    np.testing.assert_array_equal(got.ids, tok(text)["input_ids"])
    np.testing.assert_array_equal(np.concatenate([p.pixel_values for p in got.images]), ref["pixel_values"])
    assert [p.grid_thw for p in got.images] == [tuple(g) for g in ref["image_grid_thw"].tolist()] == [(1, 8, 6),
                                                                                                       (1, 4, 4)]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert [e - s for s, e in got.image_spans] == [12, 4] and not got.mask[got.ids == image_id].any()


def hf_image_reply(hf, ckpt: Path, root: Path, question: str, image: str, new_tokens: int = 8) -> list[int]:
    """transformers' greedy reply (token ids) to the prompt `zoo generate --prompt QUESTION --image IMAGE` makes
    on the checkpoint ``ckpt`` (the user turn with its image part, expanded from the checkpoint's processor files,
    as chat/images.py's ImageExpander.prompt_ids expands it), with the image processor's pixels and grid."""
    from chat.images import ImageExpander
    from zoo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt)
    ids, (processed,) = ImageExpander.from_folder(ckpt / "tokenizer", tok).prompt_ids(tok, question, None, [image],
                                                                                      root, "--image")
    ids_t = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(input_ids=ids_t, pixel_values=torch.tensor(processed.pixel_values),
                          image_grid_thw=torch.tensor([processed.grid_thw]), do_sample=False,
                          max_new_tokens=new_tokens, mm_token_type_ids=(ids_t == hf.config.image_token_id).int(),
                          eos_token_id=[tok.eos_token_id], pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()
