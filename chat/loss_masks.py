"""Examples (chat/formats.py) -> token ids + loss masks, and the whole-text tokenization every chat task shares.

``mask[i]`` is True when token ``i`` is a training target, i.e. the loss on
predicting ``ids[i]`` from ``ids[:i]`` counts. ``mask[0]`` is always False:
nothing precedes the first token, so it is never predicted (a trainer uses
``ids[:-1]`` as inputs, ``ids[1:]`` as targets and ``mask[1:]`` as weights).

* text: every token after the first is trained; the tokenizer adds its
  special tokens as configured (no second BOS when the text already starts
  with one) and one EOS is appended unless the tokenizer added it, so the
  model learns to stop.
* prompt/completion strings: ``prompt + completion`` is tokenized as ONE text
  (then the tokenizer's BOS, and an EOS); the completion's tokens are those of
  the whole text after the prompt's last token, as TRL splits them. Tokenizing
  the completion alone would be wrong for SentencePiece tokenizers with a
  dummy prefix (Llama 2, Mistral): they would prepend a space the data never
  had. The rule at the boundary: a token is trained when it covers any
  completion character, so a token merging the prompt's last characters with
  the completion's first is trained (and counted: see :class:`TokenizeStats`).
* conversations: rendered with the chat template (and the row's ``tools``); the ids are those of the
  whole render (tokenized without added special tokens, as
  ``apply_chat_template`` does), and each trained assistant turn's span in
  that render (chat/spans.py: its content and end-of-turn token(s) as the
  template writes them at that position, found without assuming that a
  prefix renders as a prefix) is mapped onto the tokens by their offsets: a
  token is trained when it overlaps a span. Whitespace the template writes
  after the end-of-turn token (ChatML's and Gemma's ``\\n``) is not trained: it
  is a prompt-side separator. The one exception to "the ids of the render":
  a tokenizer configured to add a BOS gets it prepended when the template did
  not write one itself. A tool-call row (chat/tool_rows.py) of a template
  that is a family's original lmzoo holds a training template for (Qwen3,
  DeepSeek-V3, gpt-oss: chat/training_templates.py) renders under that
  training template, whose ``{% generation %}`` blocks say what trains, as
  TRL 1.16's SFT swaps templates for an assistant-only loss.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from chat.formats import BadRow, Example, normalize
from chat.spans import assistant_spans
from chat.templates import ChatTemplate, as_template
from chat.training_templates import for_tool_rows
from zoo.errors import UserError

T = TypeVar("T")

GREEN, RESET = "\x1b[42m", "\x1b[0m"
PLAIN_OPEN, PLAIN_CLOSE = "[[", "]]"
__all__ = ["TokenizeStats", "tokenize_example", "tokenize_rows", "tokenize_indexed",
           "render_mask", "encode", "special_affixes", "split_whole", "text_offsets", "token_mask", "bos_head",
           "with_eos"]


@dataclass
class TokenizeStats:
    """Counts kept while tokenizing: examples whose prompt/completion boundary falls inside a token."""

    boundary_merges: int = 0

    def report(self, path: str, total: int) -> None:
        """One warning line when a boundary merge happened (the merged token was trained)."""
        if self.boundary_merges:
            print(f"warning: {path}: in {self.boundary_merges} of {total} examples a token spans the end of the prompt "
                  "and the start of the completion; it is trained as part of the completion (the text is tokenized "
                  "whole, as at inference)", file=sys.stderr)


def tokenize_example(example: Example, tokenizer: Any, chat_template: ChatTemplate | str | None = None,
                     stats: TokenizeStats | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and loss mask (bool, True = trained) of one example.

    ``chat_template`` (a :class:`chat.templates.ChatTemplate`, or a Jinja string)
    replaces the tokenizer's own for conversations and carries the template
    variables. Raises BadRow when the row cannot be used (including when no
    token would be trained) and UserError for configuration problems (no chat
    template, a template that does not compile).
    """
    _text_only(example)
    if example.is_chat:
        ids, mask = _chat(example, tokenizer, as_template(chat_template))
    elif example.text is not None:
        ids, mask = _plain("", example.text, tokenizer, stats)
    else:
        ids, mask = _plain(cast(str, example.prompt), cast(str, example.completion), tokenizer, stats)
    if len(ids):
        mask[0] = False  # nothing predicts the first token
    if not mask.any():
        raise BadRow("no token is trained (empty completion or assistant turns?)")
    return ids, mask


def _text_only(example: Example) -> None:
    """Raise BadRow for a row with images or content parts: chat/images.py tokenizes those, with the model's
    image processor; this path renders string contents only."""
    if example.images:
        raise BadRow(f"it has {len(example.images)} image(s), and this task trains on text only; "
                     "remove the images column to train on the text alone")
    for i, m in enumerate(example.messages or []):
        if not isinstance(m["content"], str):
            raise BadRow(f"message {i} ({m['role']}) content is a list of parts, and this task trains on text "
                         "only; write the content as a string")


def tokenize_rows(rows: Iterable[dict[str, Any]], fmt: str, tokenizer: Any,
                  chat_template: ChatTemplate | str | None, path: str,
                  skip_bad_rows: bool) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """(ids, mask) of every usable row of ``rows`` (in format ``fmt``), and how many rows were skipped
    (see :func:`tokenize_indexed`)."""
    out, skipped = tokenize_indexed(enumerate(rows), fmt, tokenizer, chat_template, path, skip_bad_rows)
    return list(out.values()), skipped


def tokenize_indexed(rows: Iterable[tuple[int, dict[str, Any]]], fmt: str, tokenizer: Any,
                     chat_template: ChatTemplate | str | None, path: str,
                     skip_bad_rows: bool) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], int]:
    """(ids, mask) by row index of every usable (index, row) pair, and how many rows were skipped.

    A bad row raises ``UserError("{file}, line {n}: ...")`` (:func:`zoo.data.row_origin.bad_row`) unless
    ``skip_bad_rows``, when it is skipped and counted; if every row is bad,
    that is an error too (it usually means a wrong format or template).
    Examples whose prompt/completion boundary falls inside a token are
    counted and reported in one warning line.
    """
    stats = TokenizeStats()
    template = as_template(chat_template)
    out, skipped = each_usable_row(rows, fmt, path, skip_bad_rows,
                                   lambda row: tokenize_example(normalize(row, fmt), tokenizer, template, stats))
    stats.report(path, len(out))
    return out, skipped


def each_usable_row(rows: Iterable[tuple[int, dict[str, Any]]], fmt: str, path: str, skip_bad_rows: bool,
                    tokenize: Callable[[dict[str, Any]], T]) -> tuple[dict[int, T], int]:
    """``tokenize(row)`` by row index of every (index, row) pair whose row it does not refuse (BadRow), and how
    many it refused: a refused row is ``UserError("{file}, line {n}: ...")`` unless ``skip_bad_rows``, and
    every row refused is an error either way."""
    from zoo.data.row_origin import bad_row, row_where

    out: dict[int, T] = {}
    skipped, first_bad = 0, ""
    for i, row in rows:
        try:
            out[i] = tokenize(row)
        except BadRow as e:
            if not skip_bad_rows:
                raise bad_row(path, i, e) from None
            skipped += 1
            first_bad = first_bad or f"{row_where(path, i)}: {e}"
    if skipped and not out:
        raise UserError(f"{path}: all {skipped} rows are bad (format {fmt}); the first is {first_bad}")
    return out, skipped


def render_mask(ids: np.ndarray, mask: np.ndarray, tokenizer: Any, color: bool = True,
                images: Sequence[tuple[int, int]] = ()) -> str:
    """The example's text with its trained tokens highlighted.

    Trained runs get an ANSI green background when ``color``, else they are
    wrapped in ``[[`` and ``]]``. Special tokens are shown as written.
    ``images``: the token ranges [start, end) of the image expansions (chat/images.py), each shown as one
    untrained marker ``⟨image 1: 16 tokens⟩``.
    """
    open_, close = (GREEN, RESET) if color else (PLAIN_OPEN, PLAIN_CLOSE)
    ids_, mask_ = np.asarray(ids).tolist(), np.asarray(mask).tolist()
    parts: list[str] = []
    at = 0
    for k, (start, end) in enumerate([*images, (len(ids_), len(ids_))]):
        for trained, run in _runs(ids_[at:start], mask_[at:start]):
            text = tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            parts.append(f"{open_}{text}{close}" if trained else text)
        if k < len(images):
            parts.append(f"⟨image {k + 1}: {end - start} tokens⟩")
        at = end
    return "".join(parts)


def _runs(ids: list[int], mask: list[bool]) -> list[tuple[bool, list[int]]]:
    """Maximal runs of consecutive tokens with the same mask value."""
    runs: list[tuple[bool, list[int]]] = []
    for i, m in zip(ids, mask):
        if runs and runs[-1][0] == bool(m):
            runs[-1][1].append(i)
        else:
            runs.append((bool(m), [i]))
    return runs


# ---- shared by every chat task (SFT, preference pairs): whole-text tokenization, character spans -> tokens ---


def encode(text: str, tokenizer: Any) -> list[int]:
    """The ids of ``text`` without added special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text (e.g. [BOS] and [], or [] and [EOS])."""
    bare = encode("a", tokenizer)
    full = list(tokenizer("a")["input_ids"])
    for s in range(len(full) - len(bare) + 1):
        if full[s:s + len(bare)] == bare:
            return full[:s], full[s + len(bare):]
    return [], []


def text_offsets(text: str, tokenizer: Any) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, character offsets) of ``text`` tokenized whole, without added special tokens."""
    if not text:
        return [], []
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise UserError("locating trained tokens needs a fast tokenizer (with offsets); "
                        "use the tokenizer.json one") from None
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """True for each token (by its character offsets) that overlaps one of ``spans``."""
    mask = np.zeros(len(offsets), bool)
    for i, (s, e) in enumerate(offsets):
        mask[i] = e > s and any(s < end and e > start for start, end in spans)
    return mask


def with_eos(ids: list[int], tokenizer: Any) -> list[int]:
    """``ids`` ending with one EOS (appended unless already there), so the model learns to stop."""
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def split_whole(prompt: str, completion: str, tokenizer: Any) -> tuple[list[int], int, bool]:
    """(ids of ``prompt + completion`` tokenized as one text, the number of prompt tokens, whether a token
    spans the boundary).

    The completion's tokens are those that cover any of its characters: a
    token merging the prompt's end with the completion's start belongs to the
    completion (TRL's rule: split at the prompt's last whole token).
    """
    ids, offsets = text_offsets(prompt + completion, tokenizer)
    cut = len(prompt)
    n = next((i for i, (s, e) in enumerate(offsets) if e > cut and e > s), len(ids))
    merged = n < len(ids) and offsets[n][0] < cut
    return ids, n, merged


# ---- text and prompt/completion strings ------------------------------------------------------------------


def _plain(prompt: str, completion: str, tokenizer: Any,
           stats: TokenizeStats | None) -> tuple[np.ndarray, np.ndarray]:
    """``prompt + completion`` tokenized whole, the tokenizer's special tokens and an EOS around it; the
    completion's tokens are trained."""
    head, tail = special_affixes(tokenizer)
    body, n_prompt, merged = split_whole(prompt, completion, tokenizer)
    if merged and stats is not None:
        stats.boundary_merges += 1
    if head and body[:len(head)] == head:  # the text starts with its own BOS: no second one
        head = []
    if tail and body[-len(tail):] == tail:
        tail = []
    ids = with_eos(head + body + tail, tokenizer)
    mask = np.zeros(len(ids), bool)
    mask[len(head) + n_prompt:] = True
    return np.asarray(ids, np.int32), mask


# ---- conversations ---------------------------------------------------------------------------------------


def _chat(example: Example, tokenizer: Any, template: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rendered conversation, its trained assistant turns' tokens masked in. A tool-call row renders
    under its family's training template where the template is one lmzoo has it for (as TRL's SFT does)."""
    if example.uses_tools:
        template = for_tool_rows(tokenizer, template)
    full, spans = assistant_spans(tokenizer, cast(list, example.messages), example.trained_turns(), template,
                                  example.tools)
    ids, offsets = text_offsets(full, tokenizer)
    mask = token_mask(offsets, spans)
    head = bos_head(tokenizer, full)
    return np.asarray(head + ids, np.int32), np.concatenate([np.zeros(len(head), bool), mask])


def bos_head(tokenizer: Any, rendered: str) -> list[int]:
    """[BOS] when the tokenizer is configured to add one and the template did not write it itself, else []
    (apply_chat_template never adds special tokens: templates write their own BOS)."""
    bos = tokenizer.bos_token
    head = special_affixes(tokenizer)[0]
    if head != [tokenizer.bos_token_id] or (bos and rendered.startswith(bos)):
        return []
    return head
