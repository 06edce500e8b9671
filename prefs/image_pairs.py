"""Preference pairs with images (TRL's vision preference rows) on a vision-language model.

A row is a conversational ``prompt`` whose contents may hold ``{"type": "image"}`` parts, ``chosen`` and
``rejected`` assistant turns (message lists, or strings), and its images (an ``images`` column of paths relative to
the data file, bytes or PIL images, or one ``image``). As TRL's DPO collator does
(``prepare_multimodal_messages``), the images go in the prompt: where its first user turn is a string, one image
part per image before its text. Images belong to the prompt alone: an image part in an answer, or an image's
placeholder typed in one, is a bad row.

Both answers are rendered as prefs/pairs.py renders a conversational pair (each inside the whole conversation);
the prompt's image placeholders are then expanded as the family's processor expands them (chat/images.py:
:func:`chat.images.expand_placeholders`, pixels from the model's own image processor), the same expansion before
both answers, and the texts are tokenized whole as for text pairs. The image tokens lie in the prompt, which is
never trained. A pair's row holds its prompt once (shared) or twice (``prompt + chosen | prompt + rejected``), so
its images' frames are laid out once or twice, in the order of the row's image tokens
(:meth:`chat.image_documents.ImageDocuments.keep`): the chosen and the rejected sequence read the same images.

KTO's unpaired rows with images (:meth:`ImagePairs.tokenize_unpaired`, prefs/unpaired.py) are one prompt and one
completion, tokenized as KTO tokenizes a conversational row, the prompt's placeholders expanded the same way.

A pair too long for ``data.seq_len`` is cut as a text pair is, the prompt from its left first; a cut that would
take image tokens is one line naming the row (or, with ``data.long_examples: drop``, the pair is left out).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from chat.formats import BadRow, Example, multimodal_messages, normalize
from chat.image_documents import IMAGE_DOC, ImageDocuments
from chat.images import ImageExpander, ProcessedImage, expand_placeholders
from chat.loss_masks import TokenizeStats, bos_head, split_whole, text_offsets
from chat.templates import ChatTemplate
from prefs.pairs import CHOSEN, Pair, PairTokens, chat_texts, pair_texts, pair_tokens, row_label
from zoo.data.images import BadImage, open_image
from zoo.data.row_origin import row_where
from zoo.errors import UserError


class ImagePairs:
    """Tokenizes the pairs of one data file with their images and keeps each pair's images in ``documents``
    (:func:`prefs.pairs.pair_documents` calls :meth:`tokenize`, then :meth:`attach` on each pair it keeps)."""

    def __init__(self, expander: ImageExpander, documents: ImageDocuments, base_dir: str | Path, path: str,
                 seq_len: int, image_column: str | None = None):
        self.expander, self.documents, self.base_dir = expander, documents, Path(base_dir)
        self.path, self.seq_len, self.column = path, seq_len, image_column
        # row index -> (its processed images, each image's tokens [start, end) in the whole pair's prompt)
        self.pending: dict[int, tuple[tuple[ProcessedImage, ...], list[tuple[int, int]]]] = {}

    def tokenize(self, i: int, row: dict[str, Any], tokenizer: Any, template: ChatTemplate,
                 stats: TokenizeStats | None) -> PairTokens:
        """Row ``i``'s pair tokens (see the module docstring); raises BadRow naming what is wrong with it."""
        pair, refs = image_pair(row, self.column)
        texts, head = pair_texts(pair, tokenizer, template)
        prompt, ranges, processed = self._expanded(texts[0][0], {"chosen": texts[0][1], "rejected": texts[1][1]},
                                                   refs)
        tokens = pair_tokens([(prompt, answer) for _, answer in texts], head, tokenizer, True, stats)
        spans = _checked_spans(image_spans(prompt, ranges, tokenizer, head, texts[0][1]), len(tokens.prompt))
        self.pending = {i: (processed, spans)}  # the row pair_documents attaches next (unless it leaves it out)
        return tokens

    def _expanded(self, prompt: str, answers: dict[str, str], refs: Sequence[Any]
                  ) -> tuple[str, list[tuple[int, int]], tuple[ProcessedImage, ...]]:
        """(the prompt text with its image placeholders expanded, each expansion's character range, the processed
        images) of a row whose ``answers`` (by field name) must hold no placeholder; raises BadRow naming it."""
        placeholder = self.expander.placeholder
        for name, answer in answers.items():
            if placeholder in answer:
                raise BadRow(f"'{name}' has {placeholder} in its text; images go in the prompt, as image parts")
        processed = tuple(self.expander.process(_opened(ref, self.base_dir, f"images[{k}]"))
                          for k, ref in enumerate(refs))
        text, _, ranges = expand_placeholders(prompt, placeholder, [p.text for p in processed], [])
        return text, ranges, processed

    def tokenize_unpaired(self, i: int, row: dict[str, Any], tokenizer: Any,
                          template: ChatTemplate) -> tuple[list[int], list[int], bool]:
        """(prompt ids, completion ids, label) of KTO's row ``i`` (prefs/unpaired.py) with its images in its
        prompt, tokenized as :func:`prefs.unpaired.tokenize_row` tokenizes a conversational row, the prompt's
        image placeholders expanded; its images wait for :meth:`attach`. Raises BadRow naming the problem."""
        label = row_label(row)
        ex = image_answer(row, "completion", self.column)
        prompt, answer = cast(list, ex.prompt), cast(list, ex.completion)
        if not ex.images:  # parts form, as above
            prompt, answer = multimodal_messages(prompt, 0), multimodal_messages(answer, 0)
        prompt_text, answer_text = chat_texts(tokenizer, prompt, answer, template, "completion")
        text, ranges, processed = self._expanded(prompt_text, {"completion": answer_text}, ex.images)
        head = bos_head(tokenizer, text + answer_text)
        ids, n, _ = split_whole(text, answer_text, tokenizer)
        prompt_ids = (head if head and ids[:len(head)] != head else []) + ids[:n]
        if not ids[n:]:
            raise BadRow("the completion renders to no token")
        spans = _checked_spans(image_spans(text, ranges, tokenizer, head, answer_text), len(prompt_ids))
        self.pending[i] = (processed, spans)  # KTO tokenizes a chunk's rows before it attaches them
        return prompt_ids, ids[n:], label

    def attach(self, i: int, whole: PairTokens, kept: PairTokens, doc: dict[str, np.ndarray],
               shared_prompt: bool, line: int | None = None) -> None:
        """Keep the images of row ``i``'s pair (``whole`` as tokenized, ``kept`` as cut to fit) with its document
        ``doc``: its tokens tagged with the row, its frames laid out once a prompt copy. A cut through the images
        is a UserError naming the row (its ``line`` in the file, when not ``i``: KTO's unpacked pairs)."""
        processed, spans = self.pending.pop(i)
        cut = len(whole.prompt) - len(kept.prompt)
        if spans and cut > spans[0][0]:
            raise UserError(f"{row_where(self.path, i if line is None else line)}: the pair does not fit data.seq_len = {self.seq_len} "
                            "without cutting its prompt's images; raise data.seq_len, use smaller images or "
                            "shorter answers, or set data.long_examples: drop")
        at = [(s - cut, e - cut) for s, e in spans]
        copies = 1
        if not shared_prompt and at:  # the prompt again before the rejected answer: its images' tokens twice
            second = int(np.argmax(doc["tokens_segment_ids"] != CHOSEN))
            at += [(s + second, e + second) for s, e in at]
            copies = 2
        tag = self.documents.keep(i, processed, at, self.path, self.seq_len, copies)
        doc[IMAGE_DOC] = np.full(len(doc["tokens"]), tag if processed else 0, np.int32)


def _checked_spans(spans: list[tuple[int, int]], prompt_tokens: int) -> list[tuple[int, int]]:
    """The images' token spans of a prompt of ``prompt_tokens`` tokens; BadRow when the prompt ends inside an
    image (its last token opens each answer's segment)."""
    if spans and spans[-1][1] >= prompt_tokens:
        raise BadRow("the prompt ends inside an image; the chat template must write text after it")
    return spans


def image_pair(row: dict[str, Any], image_column: str | None = None) -> tuple[Pair, tuple[Any, ...]]:
    """(the pair of a row with images, its contents in parts form; its images in the order of their image parts),
    as TRL places them; raises BadRow naming the problem."""
    chosen, rejected = (image_answer(row, name, image_column) for name in ("chosen", "rejected"))
    if chosen.completion == rejected.completion:
        raise BadRow("'chosen' and 'rejected' are identical (the pair prefers nothing)")
    prompt, c, r = (cast(list, x) for x in (chosen.prompt, chosen.completion, rejected.completion))
    if not chosen.images:  # a row without images is still in parts form, as TRL renders every row of the data
        prompt, c, r = (multimodal_messages(x, 0) for x in (prompt, c, r))
    return Pair(prompt, c, r), chosen.images


def image_answer(row: dict[str, Any], name: str, image_column: str | None = None) -> Example:
    """The prompt of a row with images (its images placed as TRL places them) and its answer ``row[name]`` (a
    message list, or a string: one assistant turn) in parts form; raises BadRow naming the problem."""
    if not isinstance(row.get("prompt"), list):
        raise BadRow("a row with images needs a conversational 'prompt' (a message list) whose user turn holds "
                     "the images")
    answer = row.get(name)
    if answer is None:
        raise BadRow(f"field '{name}' is missing")
    if isinstance(answer, str):
        answer = [{"role": "assistant", "content": answer}]
    try:  # the prompt with its images placed, the answer in parts form (chat/formats.py)
        ex = normalize({**row, "completion": answer}, "prompt_completion", image_column)
    except BadRow as e:
        raise BadRow(str(e).replace("'completion'", f"'{name}'")) from None
    completion = ex.completion if isinstance(ex.completion, list) else []
    if any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"]) for m in completion):
        raise BadRow(f"'{name}' has an image part; images go in the prompt")
    return ex


def image_spans(prompt: str, ranges: list[tuple[int, int]], tokenizer: Any, head: list[int],
                answer: str) -> list[tuple[int, int]]:
    """Each image's tokens [start, end) in the pair's prompt ids (its ``head`` first, unless the text starts with
    it: :func:`prefs.pairs.pair_tokens`' rule): the tokens of ``prompt + answer`` that overlap an expansion's
    characters ``ranges`` of ``prompt``."""
    ids, offsets = text_offsets(prompt + answer, tokenizer)
    h = 0 if head and ids[:len(head)] == head else len(head)
    spans = []
    for start, end in ranges:
        inside = [k for k, (s, e) in enumerate(offsets) if s < end and e > start]
        spans.append((h + inside[0], h + inside[-1] + 1))
    return spans


def _opened(ref: Any, base_dir: Path, where: str) -> Any:
    """:func:`zoo.data.images.open_image`, its error a BadRow."""
    try:
        return open_image(ref, base_dir, where)
    except BadImage as e:
        raise BadRow(str(e)) from None
