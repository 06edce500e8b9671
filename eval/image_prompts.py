"""Prompts with images for `zoo eval` (a vision-language model): a task row's text and images -> the prompt's token
ids and the images' frames, as the model's processor makes them.

The expansion itself is chat/images.py's ``ImageExpander`` (a floor above this one): `zoo eval`'s dispatcher makes
it from the checkpoint's processor files and passes it in; here it is the :class:`Expander` protocol. A row's
problem (a missing or unreadable image, images that do not match their placeholders, a prompt with its images
longer than the model's context) is one :class:`~zoo.errors.UserError` naming the row's file and line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from eval.task_files import Task
from zoo.errors import UserError
from zoo.model.config import ModelConfig

# One prompt's images as per-patch arrays, one dict a frame (:func:`zoo.data.vision_layout.layout_rows` takes them):
# each image as its family's processor lays it out (SmolVLM's tiles, Qwen's patches at the image's own size).
Frames = list[dict[str, np.ndarray]]


class Processed(Protocol):
    """One processed image (chat/images.py's ``ProcessedImage``)."""

    def patches(self, v: Any) -> Frames: ...


class Expander(Protocol):
    """A model's image processor and its expansion of an image into the text (chat/images.py's ``ImageExpander``)."""

    placeholder: str

    def chat_prompt(self, tokenizer: Any, messages: Any, images: Sequence[Any],
                    base_dir: str | Path) -> tuple[str, Sequence[Processed]]: ...

    def text_prompt(self, text: str, images: Sequence[Any],
                    base_dir: str | Path) -> tuple[str, Sequence[Processed]]: ...


class RowImages:
    """The images of one task's rows: :meth:`chat` and :meth:`text` expand a row's prompt and give its frames,
    each problem a UserError naming the row (file and line)."""

    def __init__(self, expander: Expander, task: Task, cfg: ModelConfig):
        self.expander, self.task, self.cfg = expander, task, cfg
        self.base = Path(task.data).parent  # image paths are relative to the data file

    def wanted(self, row: dict[str, Any], text: str = "") -> bool:
        """Whether ``row``'s prompt goes through the images' path: it has images, or ``text`` holds a placeholder
        (which, without an image, is an error there rather than a token with nothing behind it)."""
        return self.task.has_images(row) or self.expander.placeholder in text

    def chat(self, i: int, tokenizer: Any, messages: Any, row: dict[str, Any]) -> tuple[str, Frames]:
        """(text, frames) of row ``i``'s conversation under the chat template, the images where TRL puts them."""
        return self._expanded(i, lambda: self.expander.chat_prompt(tokenizer, messages, self.task.row_images(row),
                                                                   self.base))

    def text(self, i: int, text: str, row: dict[str, Any]) -> tuple[str, Frames]:
        """(text, frames) of row ``i``'s plain-text prompt: the images at its placeholders, else before it."""
        return self._expanded(i, lambda: self.expander.text_prompt(text, self.task.row_images(row), self.base))

    def _expanded(self, i: int, expand: Any) -> tuple[str, Frames]:
        try:
            text, processed = expand()
        except ValueError as e:  # chat.formats.BadRow, zoo.data.images.BadImage: the row's problem
            raise self.error(i, str(e)) from None
        return text, [f for p in processed for f in p.patches(self.cfg.vision)]

    def error(self, i: int, cause: str) -> UserError:
        """The one-line error of row ``i``."""
        return UserError(f"{self.task.row_where(i)}: {cause}; fix the row")

    def check_length(self, i: int, tokens: int, what: str) -> None:
        """A prompt with images is never cut to fit (its image tokens would lose their features): longer than the
        model's context, it is row ``i``'s error."""
        if tokens > self.cfg.max_position_embeddings:
            raise self.error(i, f"its {what} with its image(s) is {tokens} tokens, more than the model's context of "
                                f"{self.cfg.max_position_embeddings}; give fewer or smaller images or a shorter prompt")


def row_images(task: Task, expander: Expander | None, cfg: ModelConfig, rows: list[dict[str, Any]],
               k: int) -> RowImages | None:
    """The :class:`RowImages` of ``task`` when an image processor is given (None without one), after the checks
    every row can fail before any image is read: images (a row's, or with ``k`` few-shot examples a
    ``fewshot_data`` row's) on a model without a vision tower, a generation task's images with few-shot examples."""
    first = next((i for i, row in enumerate(rows) if task.has_images(row)), None)
    shots = k > 0 and any(task.has_images(row) for row in task.fewshot_rows() or [])
    if first is None and not shots:
        return RowImages(expander, task, cfg) if expander is not None else None
    where = task.row_where(first) if first is not None else f"task {task.name} ({task.source}): fewshot_data"
    if cfg.vision is None:
        raise UserError(f"{where}: the row has images, and the model has no vision tower (a text "
                        "model); give a vision-language model's checkpoint or leave the images out")
    if k > 0 and task.kind != "multiple_choice":  # fewshot_context: MC's
        raise UserError(f"task {task.name} ({task.source}): generation rows with images do not go with few-shot "
                        "examples yet; set num_fewshot: 0 (or --num-fewshot 0)")
    if expander is None:
        raise UserError(f"{where}: the row has images, which only `zoo eval` reads (it loads the "
                        "model's image processor); score this task with `zoo eval`")
    return RowImages(expander, task, cfg)


def fewshot_context(images: RowImages, i: int, parts: Sequence[tuple[str, dict[str, Any]]], sep: str,
                    head: str = "") -> tuple[str, Frames]:
    """(text, frames) of row ``i``'s few-shot context: ``parts`` the solved examples' texts then the question's, each
    with its row, joined by ``sep`` after ``head``; each part's images at its placeholders, else before its text, so
    every example's images precede the question's, in order. A part whose placeholders are not one per image is
    row ``i``'s error."""
    task, mark = images.task, images.expander.placeholder
    shots = task.opt("fewshot_data")  # its rows' image paths are relative to it, the task's rows' to theirs
    texts, refs = [], []
    for k, (text, row) in enumerate(parts):
        own, found = task.row_images(row), text.count(mark)
        what = "its question" if k == len(parts) - 1 else f"its few-shot example {k + 1}"
        if found and found != len(own):
            raise images.error(i, f"{what} has {found} {mark} placeholder(s) for {len(own)} image(s); put one {mark} "
                                  "where each image goes, or none (the images then go before its text)")
        texts.append(text if found else mark * len(own) + text)
        base = Path(shots).parent if shots and k < len(parts) - 1 else images.base
        refs += [_anchored(ref, base) for ref in own]
    return images._expanded(i, lambda: images.expander.text_prompt(head + sep.join(texts), refs, images.base))


def _anchored(ref: Any, base: Path) -> Any:
    """An image reference with a relative path made absolute against ``base`` (the folder it is relative to)."""
    if isinstance(ref, str | Path) and not Path(ref).is_absolute():
        return str(base / ref)
    if isinstance(ref, dict) and ref.get("bytes") is None and ref.get("path") is not None:
        return {**ref, "path": str(base / ref["path"])}
    return ref
