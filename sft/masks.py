"""SFT examples -> token ids + loss masks.

``mask[i]`` is True when token ``i`` is a training target, i.e. the loss on
predicting ``ids[i]`` from ``ids[:i]`` counts. ``mask[0]`` is always False:
nothing precedes the first token, so it is never predicted (a trainer uses
``ids[:-1]`` as inputs, ``ids[1:]`` as targets and ``mask[1:]`` as weights).

* text: every token after the first is trained; the tokenizer adds its
  special tokens as configured (no second BOS when the text already starts
  with one) and one EOS is appended unless the tokenizer added it, so the
  model learns to stop.
* prompt/completion strings: ``tok(prompt) + tok(completion) + [EOS]``; only
  the completion and the EOS are trained. The two are tokenized apart (as at
  inference, where the prompt is tokenized alone), so the boundary is exact.
* conversations: rendered with the chat template; each trained assistant
  turn contributes the tokens its render adds after the generation prompt
  (``<|im_start|>assistant\\n``, ``<start_of_turn>model\\n``, ...): its content
  and the end-of-turn token(s) the template writes (``<|im_end|>``,
  ``<end_of_turn>``, ``<|eot_id|>``), as TRL does. Whitespace the template
  writes after the end-of-turn token (ChatML's and Gemma's ``\\n``) is not
  trained: it is a prompt-side separator, and training it would teach the
  model to emit a token after it should have stopped.

Assistant tokens are found without ``{% generation %}`` markers (few
templates have them): the conversation is rendered turn by turn, and each
assistant turn's tokens are the difference between the render up to it
(with the generation prompt) and the render that includes it. When the
tokens of the shorter render are not a prefix of the longer one (a BPE merge
across the boundary, e.g. ``"\\n\\n" + "Hi"``), the same difference is taken
on characters and mapped to the tokens of the whole conversation through the
tokenizer's offsets. Either way the ids are those of the whole rendered
conversation (tokenized without added special tokens, as
``apply_chat_template`` does), so masking never changes the tokenization.
The one exception: a tokenizer configured to add a BOS gets it prepended
when the template did not write one itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from sft.formats import BadRow, Example, normalize
from zoo.errors import UserError

GREEN, RESET = "\x1b[42m", "\x1b[0m"
PLAIN_OPEN, PLAIN_CLOSE = "[[", "]]"


class TemplateMismatch(BadRow):
    """The chat template renders a conversation prefix as something other than a prefix of the whole."""


def tokenize_example(example: Example, tokenizer: Any,
                     chat_template: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and loss mask (bool, True = trained) of one example.

    ``chat_template`` (a Jinja string) replaces the tokenizer's own for
    conversations. Raises BadRow when the row cannot be used (including
    when no token would be trained) and UserError for configuration
    problems (no chat template, a template that does not compile).
    """
    if example.is_chat:
        ids, mask = _chat(example, tokenizer, chat_template)
    elif example.text is not None:
        ids, mask = _plain("", example.text, tokenizer)
    else:
        ids, mask = _plain(example.prompt, example.completion, tokenizer)
    if len(ids):
        mask[0] = False  # nothing predicts the first token
    if not mask.any():
        raise BadRow("no token is trained (empty completion or assistant turns?)")
    return ids, mask


def tokenize_rows(rows: Iterable[dict[str, Any]], fmt: str, tokenizer: Any, chat_template: str | None,
                  path: str, skip_bad_rows: bool) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """(ids, mask) of every usable row of ``rows`` (in format ``fmt``), and how many rows were skipped
    (see :func:`tokenize_indexed`)."""
    out, skipped = tokenize_indexed(enumerate(rows), fmt, tokenizer, chat_template, path, skip_bad_rows)
    return list(out.values()), skipped


def tokenize_indexed(rows: Iterable[tuple[int, dict[str, Any]]], fmt: str, tokenizer: Any,
                     chat_template: str | None, path: str,
                     skip_bad_rows: bool) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], int]:
    """(ids, mask) by row index of every usable (index, row) pair, and how many rows were skipped.

    A bad row raises ``UserError("{path} row {i}: ...")`` unless
    ``skip_bad_rows``, when it is skipped and counted; if every row is bad,
    that is an error too (it usually means a wrong format or template).
    """
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    skipped, first_bad = 0, ""
    for i, row in rows:
        try:
            out[i] = tokenize_example(normalize(row, fmt), tokenizer, chat_template)
        except BadRow as e:
            if not skip_bad_rows:
                raise UserError(f"{path} row {i}: {e}; fix the row or set data.skip_bad_rows: true") from None
            skipped += 1
            first_bad = first_bad or f"row {i}: {e}"
    if skipped and not out:
        raise UserError(f"{path}: all {skipped} rows are bad (format {fmt}); the first, {first_bad}")
    return out, skipped


def render_mask(ids: np.ndarray, mask: np.ndarray, tokenizer: Any, color: bool = True) -> str:
    """The example's text with its trained tokens highlighted.

    Trained runs get an ANSI green background when ``color``, else they are
    wrapped in ``[[`` and ``]]``. Special tokens are shown as written.
    """
    open_, close = (GREEN, RESET) if color else (PLAIN_OPEN, PLAIN_CLOSE)
    parts = []
    for trained, run in _runs(np.asarray(ids).tolist(), np.asarray(mask).tolist()):
        text = tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        parts.append(f"{open_}{text}{close}" if trained else text)
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


# ---- text and prompt/completion strings ------------------------------------------------------------------


def _plain(prompt: str, completion: str, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """tok(prompt) + tok(completion) + [EOS] with the tokenizer's own special tokens; the completion is trained."""
    head, tail = _special_affixes(tokenizer)
    p, c = _encode(prompt, tokenizer), _encode(completion, tokenizer)
    body = p + c
    if head and body[:len(head)] == head:  # the text starts with its own BOS: no second one
        head = []
    if tail and body[-len(tail):] == tail:
        tail = []
    ids = head + body + tail
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    mask = np.zeros(len(ids), bool)
    mask[len(head) + len(p):] = True
    return np.asarray(ids, np.int32), mask


def _special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text (e.g. [BOS] and [], or [] and [EOS])."""
    bare = _encode("a", tokenizer)
    full = list(tokenizer("a")["input_ids"])
    for s in range(len(full) - len(bare) + 1):
        if full[s:s + len(bare)] == bare:
            return full[:s], full[s + len(bare):]
    return [], []


def _encode(text: str, tokenizer: Any) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


# ---- conversations ---------------------------------------------------------------------------------------


def _chat(example: Example, tokenizer: Any, chat_template: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rendered conversation, its trained assistant turns' tokens masked in."""
    template = _template(tokenizer, chat_template)
    messages = example.messages
    full = _render(tokenizer, messages, template, False)
    # Turn k's trained text is after[len(before):]: the render with turn k minus the render up to its header.
    turns = [(k, _render(tokenizer, messages[:k], template, True),
              _render(tokenizer, messages[:k + 1], template, False)) for k in example.trained_turns()]
    ids = _encode(full, tokenizer)
    mask = _mask_by_tokens(ids, turns, tokenizer)
    if mask is None:
        mask = _mask_by_chars(full, ids, turns, tokenizer, _template_name(chat_template))
    # apply_chat_template never adds special tokens (templates write their own BOS); add the tokenizer's
    # configured BOS only if the template did not write it, so models that need a BOS always get one.
    bos = tokenizer.bos_token
    head = _special_affixes(tokenizer)[0]
    if head != [tokenizer.bos_token_id] or (bos and full.startswith(bos)):
        head = []
    return np.asarray(head + ids, np.int32), np.concatenate([np.zeros(len(head), bool), mask])


def _template(tokenizer: Any, chat_template: str | None) -> str:
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError("conversational data needs a chat template, and the tokenizer has none; "
                        "set data.chat_template to a Jinja chat template")
    if isinstance(template, dict):  # some tokenizers keep several named templates
        if "default" not in template:
            raise UserError(f"the tokenizer has several chat templates ({', '.join(template)}) and no 'default'; "
                            "set data.chat_template")
        template = template["default"]
    return template


def _template_name(chat_template: str | None) -> str:
    return "data.chat_template" if chat_template else "the tokenizer's chat template"


def _render(tokenizer: Any, messages: list[dict[str, str]], template: str, generation_prompt: bool) -> str:
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except jinja2.TemplateSyntaxError as e:  # the same for every row: a configuration error
        raise UserError(f"the chat template does not compile: {e}") from None
    except Exception as e:  # raise_exception() in the template (e.g. roles must alternate), missing keys, ...
        raise BadRow(f"the chat template cannot render it ({type(e).__name__}: {e})") from None


def _mask_by_tokens(ids: list[int], turns: list[tuple[int, str, str]], tokenizer: Any) -> np.ndarray | None:
    """The mask from token prefixes, or None when a shorter render's tokens do not prefix a longer one's."""
    mask = np.zeros(len(ids), bool)
    for _, before, after in turns:
        a, b = _encode(before, tokenizer), _encode(after, tokenizer)
        if b[:len(a)] != a or ids[:len(b)] != b:
            return None
        end = len(b)
        while end > len(a) and not tokenizer.decode([b[end - 1]], skip_special_tokens=False).strip():
            end -= 1  # the separator the template writes after the end-of-turn token
        mask[len(a):end] = True
    return mask


def _mask_by_chars(full: str, ids: list[int], turns: list[tuple[int, str, str]], tokenizer: Any,
                   name: str) -> np.ndarray:
    """The mask from character spans of the turns, mapped onto the tokens of ``full`` by offsets."""
    spans = []
    for k, before, after in turns:
        if not (after.startswith(before) and full.startswith(after)):
            raise TemplateMismatch(
                f"{name} does not render the conversation up to turn {k} as a prefix of the whole conversation "
                "(it rewrites earlier turns, or its generation prompt differs from how it writes an assistant "
                "turn), so the assistant tokens cannot be located; use a template without that behaviour")
        spans.append((len(before), len(after.rstrip())))
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise UserError(f"{name}: its token boundaries shift between turns, and locating the assistant tokens "
                        "then needs a fast tokenizer (with offsets); use the tokenizer.json one") from None
    if list(enc["input_ids"]) != ids:
        raise TemplateMismatch(f"{name}: the tokenizer's offsets do not match its ids")
    mask = np.zeros(len(ids), bool)
    for i, (s, e) in enumerate(enc["offset_mapping"]):
        # A token is trained when it overlaps a turn's trained characters (a token merging the header's
        # last character with the content's first is part of what the model must produce).
        mask[i] = e > s and any(s < end and e > start for start, end in spans)
    return mask
