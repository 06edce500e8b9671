"""GRPO prompts with images on a vision-language model: TRL's VLM rows (a conversational prompt whose contents have
``{"type": "image"}`` parts, the images in an ``images`` or ``image`` column).

A prompt with images is tokenized as ``zoo generate --image`` tokenizes one (chat/images.py: the chat template with
its generation prompt, the images placed as TRL places them, each placeholder expanded as the family's processor
expands it). Its document is its token ids, as a text prompt's; of its images only the patches they take are kept
(``data.max_patches``, a row's budget: by default the largest prompt's), not their pixels. Each step reads its own
prompts' images again from the rows the rollout reads anyway (:meth:`ImagePrompts.patches`), so a dataset's pixels
are never all held, and every process lays out the whole batch's images from the same rows (a run of several
processes sets ``data.max_patches``, the same everywhere, as ``sft train``'s). The step's images go to the sampler's
prefill and ride with the update's rows (grpo/programs.py): each completion's row carries its prompt's images (one row
a group: the group's prompt once), so the policy's, the old policy's and the reference's log-probabilities see them.
Each family's images are laid out as its processor gives them (chat/images.py: ``ProcessedImage.patches``), and what
the model does with them is the forward's, in the sampler's cached prefill as in the update's pass: Qwen2.5-VL's and
Qwen3-VL's multimodal RoPE positions (a completion after a shared prompt continuing them: zoo/model/mrope.py), the
prefill's rope delta moving every decoded token, Gemma 3's image tokens one bidirectional block each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from chat.formats import BadRow, prompt_with_images, row_images
from chat.images import ImageExpander, image_base, processed_images, prompt_ids_with_images
from zoo.data.row_origin import row_where
from zoo.data.vision_layout import layout_rows
from zoo.errors import UserError
from zoo.model.vision_config import VisionConfig

Render = Callable[[list[dict[str, Any]]], str]  # messages -> the chat template's text with its generation prompt


def has_images(row: dict[str, Any], prompt: Any) -> bool:
    """Whether a prompt row has images: an image column, or image parts in its prompt's messages."""
    if row_images(row):
        return True
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in prompt)


class ImagePrompts:
    """A run's prompts with images (module docstring): their token ids, their patch budget and each step's patches.
    ``folder()``: the tokenizer's folder, which holds the model's image processor files (asked for when a row has
    images); ``fixed``: data.max_patches; ``processes``: how many processes read the rows."""

    def __init__(self, v: VisionConfig, family: str, folder: Callable[[], Any], field: str, fixed: int | None,
                 processes: int):
        self.v, self.family, self.folder, self.field = v, family, folder, field
        self.fixed, self.processes = fixed, processes
        self.max_patches = fixed or 0  # 0 until a prompt with images is read: the run's batches carry no images
        self.expander: ImageExpander | None = None

    def _expander(self, tokenizer: Any) -> ImageExpander:
        if self.expander is None:  # only rows with images need the processor files
            self.expander = ImageExpander.from_folder(self.folder(), tokenizer)
        return self.expander

    def prompt_ids(self, row: dict[str, Any], tokenizer: Any, render: Render, path: str, i: int) -> list[int]:
        """The token ids of row ``i`` of ``path``, a prompt with images; its patches counted in the budget. Raises
        BadRow for a bad row (a missing or unreadable image, images that do not match the image parts), UserError
        for a row that cannot be laid out (more patches than data.max_patches)."""
        messages, images = prompt_with_images(row.get(self.field), row_images(row), self.field)
        ids, processed = prompt_ids_with_images(messages, images, tokenizer, self._expander(tokenizer),
                                                image_base(path), render)
        frames = [f for p in processed for f in p.patches(self.v)]  # the family's layout (chat/images.py)
        need = sum(len(f["patches"]) for f in frames)
        if self.fixed is not None and need > self.fixed:
            raise UserError(f"{row_where(path, i)}: its {len(processed)} image(s) make {len(frames)} frame(s) of "
                            f"{need} patches in all, more than data.max_patches = {self.fixed}; raise "
                            "data.max_patches or use fewer or smaller images")
        if self.fixed is None and self.processes > 1:  # each process reads its own rows: budgets could differ
            raise UserError(f"{row_where(path, i)}: a run of several processes with images needs data.max_patches "
                            f"(this row needs {need}); set it to the largest row's patches, the same everywhere")
        self.max_patches = max(self.max_patches, need)
        if not ids:
            raise BadRow(f"field '{self.field}' is empty")
        return ids

    def check_cut(self, ids: list[int], limit: int, path: str, i: int) -> None:
        """A prompt longer than data.seq_len keeps its last ``limit`` tokens: refused (UserError naming the row)
        when that would cut image tokens (the row's images would no longer match them)."""
        cut = np.asarray(ids[:len(ids) - limit])
        if (cut == self.v.image_token_id).any():
            raise UserError(f"{row_where(path, i)}: its prompt of {len(ids)} tokens is longer than data.seq_len = "
                            f"{limit}, and keeping its last {limit} tokens would cut its image tokens; raise "
                            "data.seq_len, use smaller images, or set data.long_examples: drop")

    def patches(self, path: str, rows: dict[int, dict[str, Any]], order: list[int],
                tokenizer: Any) -> dict[str, np.ndarray] | None:
        """The images of a batch's prompts (``rows[order[r]]`` is row r's, read from ``path``) as
        :class:`pretrain.batch.VisionBatch`'s arrays [len(order), ...] (patches flattened, ``patch_valid`` int32),
        ``data.max_patches`` a row; None while no prompt of the run has images (its batches are text). A row
        without images has none (all padding)."""
        if not self.max_patches:
            return None
        expander, base = self._expander(tokenizer), image_base(path)
        frames = {i: self._frames(rows[i], expander, base) for i in dict.fromkeys(order)}  # a group's rows: once
        out = layout_rows(self.v, [frames[i] for i in order], self.max_patches)
        out["patches"] = out["patches"].reshape(len(order), -1)
        out["patch_valid"] = out["patch_valid"].astype(np.int32)
        return out

    def _frames(self, row: dict[str, Any], expander: ImageExpander, base: Any) -> list[dict[str, np.ndarray]]:
        """A prompt row's frames as patch arrays, in the order of its image tokens ([] for a text prompt): each image
        laid out as its family's processor output is (:meth:`chat.images.ProcessedImage.patches`: SmolVLM's tiles,
        Gemma 3's one frame, Qwen's patches at the image's own size)."""
        if not has_images(row, row.get(self.field)):
            return []
        _, images = prompt_with_images(row.get(self.field), row_images(row), self.field)
        return [f for p in processed_images(expander, images, base) for f in p.patches(self.v)]
