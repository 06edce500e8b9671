"""Conversations with images -> token ids, loss masks and pixel values, as the family's transformers processor
makes them (no torch: the image processor runs with its PIL backend).

1. The conversation (chat/formats.py: contents as text and image parts) is rendered with the chat template,
   which writes each image part as its placeholder (SmolVLM, Idefics3: ``<image>``; Gemma 3:
   ``<start_of_image>``; Gemma 4: ``<|image|>``), and the trained assistant spans are found on that text
   (chat/spans.py), as for text conversations.
2. Each image is read (zoo/data/images.py) and run through the family's image processor
   (``AutoImageProcessor.from_pretrained(folder, backend="pil")``, ``return_tensors="np"``): its pixels equal
   the processor's by construction.
3. Each placeholder is replaced by the processor's expansion of that image. SmolVLM/Idefics3: transformers'
   ``get_image_prompt_string`` (processing_smolvlm), i.e.
   ``<fake_token_around_image><global-img><image>×seq<fake_token_around_image>`` for a whole image and, when
   the image processor splits it into ``rows × cols`` tiles, ``<fake_token_around_image><row_r_col_c><image>×seq``
   per tile, a ``\\n`` per row of tiles, then ``\\n`` and the whole image's run. ``seq`` is the processor's
   ``image_seq_len``. Gemma 3: transformers' ``Gemma3Processor``, ``<start_of_image>`` (the template's
   placeholder) becoming ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x ``image_seq_length`` +
   ``<end_of_image>\\n\\n`` (no pan-and-scan: the processor turns it off). Qwen2.5-VL (``Qwen2VLImageProcessor``):
   the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>``, and ``<|image_pad|>`` becomes
   ``t * h * w / merge²`` of itself (transformers' ``Qwen2_5_VLProcessor.replace_image_token``), the image its
   processor's patches and grid. Qwen3-VL alike (the same image processor, 16-pixel patches; its
   ``Qwen3VLProcessor.replace_image_token`` is the same expansion). Gemma 4 (``Gemma4ImageProcessor``):
   ``<|image|>`` becomes ``<|image>`` + ``<|image|>`` x the image's own soft tokens + ``<image|>``
   (``Gemma4Processor.replace_image_token``; the image processor resizes each image within ``max_soft_tokens``
   keeping its shape, so images differ in their tokens), the image its flattened patches and their positions
   (zoo/data/gemma4_layout.py).
4. The spans move by what each expansion before them adds, the text is tokenized whole (as the processor
   tokenizes it), and a token is trained when it overlaps a span and no expansion: image tokens are never
   trained, in whatever turn the image is (TRL's SFT collator leaves an assistant turn's image tokens in its
   mask; the zoo never trains them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from chat.formats import IMAGE_COLUMNS, BadRow, Example, _with_images, multimodal_messages, normalize, parse_messages
from chat.loss_masks import bos_head, each_usable_row, text_offsets, token_mask
from chat.spans import assistant_spans
from chat.templates import ChatTemplate, as_template
from zoo.data.files import indexed_rows
from zoo.data.images import BadImage, open_image
from zoo.data.row_origin import row_where
from zoo.errors import UserError

__all__ = ["ProcessedImage", "VisionTokens", "ImageExpander", "expand_placeholders", "tokenize_with_images",
           "image_base", "tokenize_image_rows", "image_column", "refuse_images", "prompt_ids_with_images", "processed_images"]


@dataclass(frozen=True)
class ProcessedImage:
    """One image after the family's image processor, and what its placeholder becomes in the text."""

    pixel_values: np.ndarray  # [frames, channels, height, width] float32 (SmolVLM: the tiles, then the whole image)
    pixel_attention_mask: np.ndarray | None  # [frames, height, width]: 1 on the image, 0 on padding
    text: str
    # Qwen2.5-VL: the image's (frames, rows, columns) of patches; pixel_values is then [patches, patch_dim]
    grid_thw: tuple[int, int, int] | None = None
    # Gemma 4: each patch's (column, row), (-1, -1) on padding (image_position_ids); pixel_values is then
    # [max_patches, patch_dim], the image's patches first
    positions: np.ndarray | None = None

    def frames(self) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """(pixels [C, S, S], pixel mask [S, S] or None) of each frame of a square-frame family's image (SmolVLM's
        tiles then the whole image, Gemma 3's one frame), in the order of its image tokens. Qwen's and Gemma 4's
        images are patches (:meth:`patches`, which every family's callers read: `zoo eval`, GRPO, generation)."""
        assert self.grid_thw is None and self.positions is None, "frames() of a patch image: read patches()"
        return [(pixels, None if self.pixel_attention_mask is None else self.pixel_attention_mask[f])
                for f, pixels in enumerate(self.pixel_values)]

    def patches(self, v: Any) -> list[dict[str, np.ndarray]]:
        """The image's per-patch arrays as :func:`zoo.data.vision_layout.layout_rows` takes them, one dict a frame
        (Qwen2.5-VL and Gemma 4: one for the whole image) for the tower of VisionConfig ``v``."""
        if self.positions is not None:
            from zoo.data.gemma4_layout import gemma4_image_patches

            return [gemma4_image_patches(v, self.pixel_values, self.positions)]
        if self.grid_thw is not None:
            from zoo.data.qwen_layout import qwen_image_patches

            return [qwen_image_patches(v, self.pixel_values, self.grid_thw)]
        from zoo.data.vision_layout import image_patches

        return [image_patches(v, pixels, mask) for pixels, mask in self.frames()]


@dataclass(frozen=True)
class VisionTokens:
    """A conversation with images, tokenized: ids, loss mask (True = trained), the processed images in the
    order of their placeholders, and each image's tokens as a range [start, end) of ``ids``."""

    ids: np.ndarray
    mask: np.ndarray
    images: tuple[ProcessedImage, ...]
    image_spans: tuple[tuple[int, int], ...]


# The expansion of one image from the image processor's output for it (a batch of one image).
Expansion = Callable[[dict[str, Any]], str]


class ImageExpander:
    """A family's image processor (PIL backend) and how its processor writes one image into the text."""

    def __init__(self, image_processor: Any, placeholder: str, expansion: Expansion,
                 call_kwargs: dict[str, Any] | None = None, around: tuple[str, str] = ("", "")):
        self.image_processor, self.placeholder, self.expansion = image_processor, placeholder, expansion
        self.call_kwargs = call_kwargs or {}
        # What the chat template writes around a placeholder (Qwen: <|vision_start|>, <|vision_end|>): a plain-text
        # prompt without placeholders gets each image so (text_prompt).
        self.around = around

    @classmethod
    def from_folder(cls, folder: str | Path, tokenizer: Any, **overrides: Any) -> ImageExpander:
        """The expander of a model folder's processor files (``preprocessor_config.json`` or
        ``processor_config.json``); ``overrides`` replace image-processor settings (``do_image_splitting``).
        Raises UserError when the folder has no image processor or its family is not supported."""
        from transformers import AutoImageProcessor

        folder = Path(folder)
        try:
            processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil", **overrides)
        except (OSError, ValueError) as e:
            raise UserError(f"{folder}: no image processor could be loaded ({type(e).__name__}: {e}); "
                            "copy the model's preprocessor_config.json (or processor_config.json) into it") from None
        except ImportError as e:  # a processor transformers ships for torchvision only (Llama 4's): no PIL backend
            needs = " ".join(str(e).split()).split(" but ")[0]  # "Llama4ImageProcessor requires the Torchvision library"
            raise UserError(f"{folder}: {needs}, which lmzoo does not use: its images cannot go through the data "
                            "pipelines or `zoo generate --image` yet; give the processor's pixel_values to "
                            "zoo.load(path)(tokens, vision=...) instead") from None
        family = type(processor).__name__.removesuffix("Pil")
        if family not in _FAMILIES:
            raise UserError(f"{folder}: the image processor {family} is not supported yet; "
                            f"supported: {', '.join(sorted(_FAMILIES))}")
        placeholder, expansion, kwargs = _FAMILIES[family](folder, tokenizer, processor)
        return cls(processor, placeholder, expansion, kwargs, _qwen_around(folder, tokenizer)
                   if family == "Qwen2VLImageProcessor" else ("", ""))

    def process(self, image: Any) -> ProcessedImage:
        """The pixels of one RGB PIL image and its expansion."""
        out = self.image_processor(images=[[image]], return_tensors="np", **self.call_kwargs)
        mask = out.get("pixel_attention_mask")
        grid = out.get("image_grid_thw")
        if grid is not None:  # Qwen2.5-VL: the image's patches, [patches, patch_dim], and its grid
            t, h, w = (int(x) for x in grid[0])
            return ProcessedImage(np.asarray(out["pixel_values"], np.float32), None, self.expansion(dict(out)),
                                  (t, h, w))
        pixels = np.asarray(out["pixel_values"], np.float32)
        positions = out.get("image_position_ids")
        if positions is not None:  # Gemma 4: [1, max_patches, patch_dim] flattened patches and their positions
            return ProcessedImage(pixels[0], None, self.expansion(dict(out)), positions=np.asarray(positions[0]))
        # SmolVLM batches [images, frames, C, S, S]; Gemma 3 lays the call's images flat [images, C, S, S]: one
        # image in the call, one frame.
        return ProcessedImage(pixels[0] if pixels.ndim == 5 else pixels,
                              None if mask is None else np.asarray(mask[0]), self.expansion(dict(out)))

    def prompt_ids(self, tokenizer: Any, prompt: str, system: str | None, images: Sequence[Any],
                   base_dir: str | Path, where: str) -> tuple[list[int], tuple[ProcessedImage, ...]]:
        """(token ids, processed images) of a generation prompt: a user turn of ``prompt`` (after a ``system``
        turn) with one image part per image before its text, as TRL places them
        (:func:`chat.formats.multimodal_messages`), under the tokenizer's chat template with the generation
        prompt, each placeholder expanded as the processor does. Raises BadRow naming the problem (``where``
        names the images: ``--image``)."""
        processed = tuple(self.process(_opened(ref, base_dir, where)) for ref in images)
        turns = [{"role": "system", "content": system}] if system is not None else []
        messages = multimodal_messages([*turns, {"role": "user", "content": prompt}], len(processed))
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text, _, _ = expand_placeholders(text, self.placeholder, [p.text for p in processed], [])
        return list(tokenizer(text)["input_ids"]), processed

    def chat_prompt(self, tokenizer: Any, messages: Any, images: Sequence[Any],
                    base_dir: str | Path) -> tuple[str, tuple[ProcessedImage, ...]]:
        """(text, processed images) of a conversation that the model answers next (an evaluation prompt):
        ``messages`` (string contents or TRL's content parts, inline images allowed) with ``images`` in the
        order of their image parts, placed as TRL places them (:func:`chat.formats.multimodal_messages`), under
        the tokenizer's chat template with the generation prompt, each placeholder expanded. Raises BadRow
        naming the problem (the caller names the row)."""
        example = _with_images(Example(messages=parse_messages(messages, "messages", parts=True)), list(images))
        processed = tuple(self.process(_opened(ref, base_dir, f"images[{i}]")) for i, ref in enumerate(example.images))
        text = tokenizer.apply_chat_template(example.messages, tokenize=False, add_generation_prompt=True)
        text, _, _ = expand_placeholders(text, self.placeholder, [p.text for p in processed], [])
        return text, processed

    def text_prompt(self, text: str, images: Sequence[Any],
                    base_dir: str | Path) -> tuple[str, tuple[ProcessedImage, ...]]:
        """(text, processed images) of a plain-text prompt with images: each image at its placeholder
        (``<image>``) in ``text``, or, when the text has none, all of them before it (where TRL puts a turn's
        images), each written as the chat template writes an image part (Qwen: ``<|vision_start|><|image_pad|>
        <|vision_end|>``, so that two images' runs stay two images). Raises BadRow when the placeholders are not
        one per image, or an image cannot be read."""
        found = text.count(self.placeholder)
        if found and found != len(images):
            raise BadRow(f"the prompt has {found} {self.placeholder} placeholder(s) for {len(images)} image(s); put "
                         f"one {self.placeholder} where each image goes, or none (the images then go before the text)")
        processed = tuple(self.process(_opened(ref, base_dir, f"images[{i}]")) for i, ref in enumerate(images))
        if not found:
            text = "".join(self.around[0] + self.placeholder + self.around[1] for _ in processed) + text
        text, _, _ = expand_placeholders(text, self.placeholder, [p.text for p in processed], [])
        return text, processed


def _opened(ref: Any, base_dir: str | Path, where: str) -> Any:
    """:func:`zoo.data.images.open_image`, its error a BadRow."""
    try:
        return open_image(ref, base_dir, where)
    except BadImage as e:
        raise BadRow(str(e)) from None


def _smolvlm(folder: Path, tokenizer: Any, processor: Any) -> tuple[str, Expansion, dict[str, Any]]:
    """SmolVLM and Idefics3 (their processors expand ``<image>`` the same way)."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    seq = _image_seq_len(folder)
    # The tokens the processor reads from the tokenizer, with its defaults (processing_smolvlm's __init__).
    fake = getattr(tokenizer, "fake_image_token", None) or "<fake_token_around_image>"
    image = getattr(tokenizer, "image_token", None) or "<image>"
    whole = getattr(tokenizer, "global_image_token", None) or "<global-img>"
    _require_tokens(folder, tokenizer, (fake, image, whole))

    def expansion(out: dict[str, Any]) -> str:
        return cast(str, get_image_prompt_string(int(out["rows"][0][0]), int(out["cols"][0][0]), seq,
                                                 fake_token_around_image=fake, image_token=image,
                                                 global_image_token=whole))

    return image, expansion, {"return_row_col_info": True}


def _image_seq_len(folder: Path) -> int:
    """The processor's ``image_seq_len`` (processor_config.json), else what the model config implies:
    ``(image_size / patch_size)² / scale_factor²`` (the processors' own formula)."""
    proc = folder / "processor_config.json"
    if proc.is_file():
        seq = json.loads(proc.read_text()).get("image_seq_len")
        if seq:
            return int(seq)
    conf = folder / "config.json"
    if conf.is_file():
        c = json.loads(conf.read_text())
        v = c.get("vision_config") or {}
        if v.get("image_size") and v.get("patch_size") and c.get("scale_factor"):
            return (v["image_size"] // v["patch_size"]) ** 2 // c["scale_factor"] ** 2
    raise UserError(f"{folder}: cannot tell how many tokens an image takes: no image_seq_len in "
                    "processor_config.json and no vision_config in config.json; copy the model's processor files")


def _gemma3(folder: Path, tokenizer: Any, processor: Any) -> tuple[str, Expansion, dict[str, Any]]:
    """Gemma 3 (transformers' ``Gemma3Processor``): the chat template writes an image as ``<start_of_image>``,
    which becomes ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x image_seq_length + ``<end_of_image>\\n\\n``.
    Pan-and-scan is off, as the processor calls its image processor (transformers 5.25's Gemma3Processor passes
    ``do_pan_and_scan=False`` whatever preprocessor_config.json says), so an image is one frame."""
    seq = _gemma3_seq_len(folder)
    # The tokens the processor reads from the tokenizer (its tokenizer_config.json names them), with Gemma 3's.
    boi = getattr(tokenizer, "boi_token", None) or "<start_of_image>"
    image = getattr(tokenizer, "image_token", None) or "<image_soft_token>"
    eoi = getattr(tokenizer, "eoi_token", None) or "<end_of_image>"
    _require_tokens(folder, tokenizer, (boi, image, eoi))
    full = f"\n\n{boi}{image * seq}{eoi}\n\n"  # Gemma3Processor.full_image_sequence
    return boi, lambda out: full, {"do_pan_and_scan": False}


def _gemma3_seq_len(folder: Path) -> int:
    """Gemma 3's image tokens an image: ``image_seq_length`` of processor_config.json, else the model config's
    ``mm_tokens_per_image`` (config.json)."""
    for name, key in (("processor_config.json", "image_seq_length"), ("config.json", "mm_tokens_per_image")):
        path = folder / name
        if path.is_file():
            seq = json.loads(path.read_text()).get(key)
            if seq:
                return int(seq)
    raise UserError(f"{folder}: cannot tell how many tokens an image takes: no image_seq_length in "
                    "processor_config.json and no mm_tokens_per_image in config.json; copy the model's processor files")


def _gemma4(folder: Path, tokenizer: Any, processor: Any) -> tuple[str, Expansion, dict[str, Any]]:
    """Gemma 4 (transformers' ``Gemma4Processor.replace_image_token``): the chat template writes an image as
    ``<|image|>`` (the tokenizer's ``image_token``), which becomes ``<|image>`` + ``<|image|>`` x the image's soft
    tokens + ``<image|>``; the image processor resizes each image to its own number of tokens (at most
    ``max_soft_tokens``), which it returns as ``num_soft_tokens_per_image``."""
    # The tokens the processor reads from the tokenizer (its tokenizer_config.json names them), with Gemma 4's.
    boi = getattr(tokenizer, "boi_token", None) or "<|image>"
    image = getattr(tokenizer, "image_token", None) or "<|image|>"
    eoi = getattr(tokenizer, "eoi_token", None) or "<image|>"
    _require_tokens(folder, tokenizer, (boi, image, eoi))

    def expansion(out: dict[str, Any]) -> str:
        return f"{boi}{image * int(out['num_soft_tokens_per_image'][0])}{eoi}"

    return image, expansion, {}


def _require_tokens(folder: Path, tokenizer: Any, tokens: tuple[str, ...]) -> None:
    """Raise UserError when the tokenizer lacks one of ``tokens`` as one token."""
    missing = [t for t in tokens if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:  # spelled out in characters, they would not be the tokens the model reads
        raise UserError(f"{folder}: the tokenizer has no {', '.join(missing)} token; use the model's own tokenizer")


def _qwen2_vl(folder: Path, tokenizer: Any, processor: Any) -> tuple[str, Expansion, dict[str, Any]]:
    """Qwen2.5-VL and Qwen3-VL: ``<|image_pad|>`` (the tokenizer's ``image_token``) repeated once a merged token of
    the image."""
    image = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
    if tokenizer.convert_tokens_to_ids(image) in (None, tokenizer.unk_token_id):
        raise UserError(f"{folder}: the tokenizer has no {image} token; use the model's own tokenizer")
    merge = int(processor.merge_size) ** 2

    def expansion(out: dict[str, Any]) -> str:
        return image * (int(np.prod(out["image_grid_thw"][0])) // merge)

    return image, expansion, {}


def _qwen_around(folder: Path, tokenizer: Any) -> tuple[str, str]:
    """Qwen's chat template's tokens around an image's ``<|image_pad|>`` (the tokenizer's ``vision_start_token`` and
    ``vision_end_token``, as Qwen's processors read them, with their defaults)."""
    around = (getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>",
              getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>")
    _require_tokens(folder, tokenizer, around)
    return around


_FAMILIES: dict[str, Callable[[Path, Any, Any], tuple[str, Expansion, dict[str, Any]]]] = {
    "SmolVLMImageProcessor": _smolvlm,
    "Idefics3ImageProcessor": _smolvlm,
    "Gemma3ImageProcessor": _gemma3,
    "Gemma4ImageProcessor": _gemma4,
    "Qwen2VLImageProcessor": _qwen2_vl,
}


def expand_placeholders(text: str, placeholder: str, expansions: list[str],
                        spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """(``text`` with its i-th ``placeholder`` replaced by ``expansions[i]``, ``spans`` moved accordingly, the
    character range of each expansion in the new text). Raises BadRow when the placeholders are not one per
    expansion (a chat template that drops or repeats image parts, or a placeholder typed in the text)."""
    found = [m.start() for m in re.finditer(re.escape(placeholder), text)]
    if len(found) != len(expansions):
        raise BadRow(f"the rendered conversation has {len(found)} {placeholder} placeholder(s) for "
                     f"{len(expansions)} image(s); an image goes in an image part, not as {placeholder} in the text")
    pieces: list[str] = []
    ranges: list[tuple[int, int]] = []
    grown: list[int] = []
    at = 0
    for start, expansion in zip(found, expansions):
        pieces += [text[at:start], expansion]
        new_start = start + sum(grown)
        ranges.append((new_start, new_start + len(expansion)))
        grown.append(len(expansion) - len(placeholder))
        at = start + len(placeholder)
    pieces.append(text[at:])

    def moved(p: int) -> int:  # a span edge moves by what every placeholder wholly before it adds
        return p + sum(g for s, g in zip(found, grown) if s + len(placeholder) <= p)

    return "".join(pieces), [(moved(s), moved(e)) for s, e in spans], ranges


def tokenize_with_images(example: Example, tokenizer: Any, expander: ImageExpander, base_dir: str | Path,
                         chat_template: ChatTemplate | str | None = None) -> VisionTokens:
    """Ids, loss mask and images of one conversation (see the module docstring); image paths are relative to
    ``base_dir`` (the data file's folder). Raises BadRow naming the image or the problem (the caller adds the
    row's file and line: zoo.data.row_origin.bad_row)."""
    if not example.is_chat:
        raise BadRow("images go with conversations (messages, or prompt/completion message lists)")
    # A row without images is still in parts form, as TRL renders every row of a vision dataset.
    messages = multimodal_messages(cast(list, example.messages), 0) if not example.images else example.messages
    template = as_template(chat_template)
    full, spans = assistant_spans(tokenizer, cast(list, messages), example.trained_turns(), template)
    processed = [expander.process(_opened(ref, base_dir, f"images[{i}]")) for i, ref in enumerate(example.images)]
    text, spans, ranges = expand_placeholders(full, expander.placeholder, [p.text for p in processed], spans)
    ids, offsets = text_offsets(text, tokenizer)
    mask = token_mask(offsets, spans) & ~token_mask(offsets, ranges)
    head = bos_head(tokenizer, text)
    image_spans = []
    for start, end in ranges:  # tokens overlapping the expansion's characters (special tokens: exactly them)
        inside = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
        image_spans.append((len(head) + inside[0], len(head) + inside[-1] + 1))
    mask = np.concatenate([np.zeros(len(head), bool), mask])
    if len(mask):
        mask[0] = False  # nothing predicts the first token
    if not mask.any():
        raise BadRow("no token is trained (empty completion or assistant turns?)")
    return VisionTokens(np.asarray(head + ids, np.int32), mask, tuple(processed), tuple(image_spans))


def image_base(path: str) -> Path:
    """The folder image paths of the data at ``path`` (data.path) are relative to: a data file's folder, or the
    data folder itself."""
    p = Path(path)
    return p if p.is_dir() else p.parent


def tokenize_image_rows(rows: Iterable[tuple[int, dict[str, Any]]], fmt: str, tokenizer: Any,
                        expander: ImageExpander, path: str, skip_bad_rows: bool,
                        chat_template: ChatTemplate | str | None = None,
                        image_column: str | None = None) -> tuple[dict[int, VisionTokens], int]:
    """:func:`tokenize_with_images` of every usable (index, row) pair of the data at ``path``, by row index, and
    how many rows were skipped: chat/loss_masks.py's ``tokenize_indexed`` for rows with images. A bad row (a
    missing or unreadable image, images that do not match the image parts) raises
    ``UserError("{file}, line {n}: ...")`` unless ``skip_bad_rows``; every row bad is an error too."""
    template, base = as_template(chat_template), image_base(path)
    return each_usable_row(rows, fmt, path, skip_bad_rows, lambda row: tokenize_with_images(
        normalize(row, fmt, image_column), tokenizer, expander, base, template))


def image_column(column_names: list[str]) -> str | None:
    """The column of a dataset's images (TRL's ``images``, or ``image``), or None."""
    return next((c for c in IMAGE_COLUMNS if c in column_names), None)


def refuse_images(ds: Any, column: str, path: str, model: str) -> None:
    """Raise UserError naming the first row of ``ds`` with images: ``model`` has no vision tower to read them."""
    for i, row in indexed_rows(ds, None):
        if row.get(column):
            raise UserError(f"{row_where(path, i)}: the row has images, and the model {model} has no vision tower; "
                            f"use a vision-language model or remove the {column} column")


def prompt_ids_with_images(messages: list[dict[str, Any]], images: Sequence[Any], tokenizer: Any,
                           expander: ImageExpander, base_dir: str | Path,
                           render: Callable[[list[dict[str, Any]]], str]) -> tuple[list[int], tuple[ProcessedImage, ...]]:
    """(token ids, processed images) of a conversational prompt with its images, as GRPO's rollouts read it:
    ``messages`` and ``images`` as :func:`chat.formats.prompt_with_images` gives them, rendered by ``render``
    (the chat template with its generation prompt), each placeholder expanded as the processor does, tokenized
    without special tokens (TRL's GRPO tokenizes its prompts so). Raises BadRow naming an image that cannot be
    read or placeholders that do not match the images."""
    processed = processed_images(expander, images, base_dir)
    text, _, _ = expand_placeholders(render(messages), expander.placeholder, [p.text for p in processed], [])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), processed


def processed_images(expander: ImageExpander, images: Sequence[Any], base_dir: str | Path) -> tuple[ProcessedImage, ...]:
    """A row's images (references as :func:`zoo.data.images.open_image` reads them, relative to ``base_dir``) through
    the image processor. Raises BadRow naming an image that cannot be read (``images[k]``)."""
    return tuple(expander.process(_opened(ref, base_dir, f"images[{i}]")) for i, ref in enumerate(images))
