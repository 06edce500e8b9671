"""Preference rows -> one token row per pair: the prompt once, then each answer as its own segment.

Row shapes (columns ``prompt`` (optional), ``chosen``, ``rejected``):

* strings: ``prompt``, ``chosen``, ``rejected`` all text. The prompt gets the
  tokenizer's own special tokens (a BOS, unless the text starts with one),
  each answer its tokens and one EOS (unless it already ends with it).
* explicit prompt, conversational: ``prompt`` a message list, ``chosen`` and
  ``rejected`` the assistant turn(s) after it (message lists, or strings =
  one assistant turn).
* implicit prompt: no ``prompt``; ``chosen`` and ``rejected`` are whole
  conversations, and the prompt is their longest common prefix of messages
  (it must not be empty, and both must go on past it).

Conversations are rendered with the chat template (``data.chat_template`` or
the tokenizer's): the prompt with the generation prompt, each answer as what
the whole render adds after it, up to and including the template's
end-of-turn token (the separator the template writes after it, ChatML's
``\\n``, is a prompt-side token and is left out, as in SFT). The prompt is
tokenized once and shared by both answers, and the answers are tokenized
apart from it, as TRL's DPOTrainer does (so a pair's two sequences agree on
every prompt token).

Batch layout (the one-forward-pass choice): a pair is ONE row of at most
``data.seq_len + 1`` tokens, and by default its prompt is in it once:
``[prompt[:-1] | prompt[-1] + chosen | prompt[-1] + rejected]``, as
segments 3, 1 and 2. Both answer segments attend to the prompt segment as a
shared prefix (the model's ``prefix_ids``; see :func:`zoo.layers.attention_mask`)
and to their own earlier tokens, never to each other, with positions that
continue the prompt's; the prompt's last token opens each answer segment,
since its output predicts that answer's first token. Each answer's tokens
then see exactly the context they would see alone, and a pair costs
``prompt + chosen + rejected + 1`` tokens of compute instead of
``2 * prompt + chosen + rejected`` (Wang et al. 2024, "Accelerating Direct
Preference Optimization with Prefix Sharing"). Models with sliding-window
layers (whose windows count row indices) use the plain layout:
``prompt + chosen`` as segment 1 and ``prompt + rejected`` as segment 2,
positions restarting at 0 in each. Either way the row's ``loss_mask`` marks
the answer tokens, and the loss sums log-probabilities over them, per
segment. ``data.seq_len`` is the budget of the whole row: a pair longer
than it is cut, the prompt first (from its left: the end of a prompt, next
to the answer, matters most) down to one token, then the answers (from
their right, the longer first), or, with ``data.long_examples: drop``, left
out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sft.formats import BadRow, _messages
from sft.masks import _encode, _render, _special_affixes, _template

CHOSEN, REJECTED, PROMPT = 1, 2, 3  # the segment ids of a pair's answers and of its shared prompt


@dataclass(frozen=True)
class Pair:
    """One normalized preference pair: all strings, or a message-list prompt and message-list answers."""

    prompt: str | list[dict[str, str]]
    chosen: str | list[dict[str, str]]
    rejected: str | list[dict[str, str]]

    @property
    def is_chat(self) -> bool:
        """True when the pair is rendered with a chat template."""
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class PairTokens:
    """The token ids of a pair: the shared prompt and each answer (each ends with its end-of-turn token)."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def normalize_pair(row: dict[str, Any]) -> Pair:
    """The `Pair` of one dataset row; raises BadRow when the row is unusable."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    for name, v in (("chosen", chosen), ("rejected", rejected)):
        if v is None:
            raise BadRow(f"field '{name}' is missing")
    prompt = row.get("prompt")
    if prompt is None:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise BadRow("without a 'prompt' field, 'chosen' and 'rejected' must be whole conversations "
                         "(message lists) sharing their first messages")
        c, r = _messages(chosen, "chosen"), _messages(rejected, "rejected")
        if c == r:
            raise BadRow("'chosen' and 'rejected' are identical (the pair prefers nothing)")
        n = _common_prefix(c, r)
        if n == 0:
            raise BadRow("'chosen' and 'rejected' share no first message, so they have no common prompt")
        if n == len(c) or n == len(r):
            raise BadRow("'chosen' and 'rejected' do not both go on past their common prompt "
                         "(identical, or one is a prefix of the other)")
        pair = Pair(c[:n], c[n:], r[n:])
    elif isinstance(prompt, str):
        pair = Pair(_text(prompt, "prompt", allow_empty=True), _text(chosen, "chosen"), _text(rejected, "rejected"))
    else:
        p = _messages(prompt, "prompt")
        pair = Pair(p, _answer(chosen, "chosen"), _answer(rejected, "rejected"))
    if pair.chosen == pair.rejected:
        raise BadRow("'chosen' and 'rejected' are identical (the pair prefers nothing)")
    return pair


def _common_prefix(a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _text(value: Any, name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadRow(f"field '{name}' is not text ({type(value).__name__}) while 'prompt' is text")
    if not allow_empty and not value.strip():
        raise BadRow(f"field '{name}' is empty")
    return value


def _answer(value: Any, name: str) -> list[dict[str, str]]:
    """Answer turn(s) after a conversational prompt: a message list, or a string as one assistant turn."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"field '{name}' is empty")
        return [{"role": "assistant", "content": value}]
    msgs = _messages(value, name)
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadRow(f"field '{name}' has no assistant turn")
    return msgs


def tokenize_pair(pair: Pair, tokenizer: Any, chat_template: str | None = None) -> PairTokens:
    """The shared prompt's ids (tokenized once) and each answer's ids; raises BadRow for an unusable pair."""
    if pair.is_chat:
        template = _template(tokenizer, chat_template)
        prompt_text = _render(tokenizer, pair.prompt, template, True)
        answers = [_chat_answer(tokenizer, pair.prompt, a, prompt_text, template, name)
                   for a, name in ((pair.chosen, "chosen"), (pair.rejected, "rejected"))]
        head = _special_affixes(tokenizer)[0]
        bos = tokenizer.bos_token
        # Templates write their own BOS; add the tokenizer's configured one only when the template did not.
        if head != [tokenizer.bos_token_id] or (bos and prompt_text.startswith(bos)):
            head = []
        prompt = head + _encode(prompt_text, tokenizer)
    else:
        head = _special_affixes(tokenizer)[0]
        prompt = _encode(pair.prompt, tokenizer)
        if head and prompt[:len(head)] == head:  # the prompt starts with its own BOS: no second one
            head = []
        prompt = head + prompt
        eos = tokenizer.eos_token_id
        answers = []
        for text in (pair.chosen, pair.rejected):
            ids = _encode(text, tokenizer)
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            answers.append(ids)
    if not prompt:
        raise BadRow("the prompt renders to no token (nothing to condition the answers on)")
    for ids, name in zip(answers, ("chosen", "rejected")):
        if not ids:
            raise BadRow(f"the '{name}' answer renders to no token")
    if answers[0] == answers[1]:
        raise BadRow("'chosen' and 'rejected' tokenize identically (the pair prefers nothing)")
    return PairTokens(np.asarray(prompt, np.int32), np.asarray(answers[0], np.int32), np.asarray(answers[1], np.int32))


def _chat_answer(tokenizer: Any, prompt: list[dict[str, str]], answer: list[dict[str, str]], prompt_text: str,
                 template: str, name: str) -> list[int]:
    full = _render(tokenizer, prompt + answer, template, False)
    if not full.startswith(prompt_text):
        raise BadRow(f"the chat template does not render the prompt (with its generation prompt) as a prefix of "
                     f"prompt + '{name}', so the answer cannot be located; use a template without that behaviour")
    ids = _encode(full[len(prompt_text):], tokenizer)
    # End at the end-of-turn token: whitespace the template writes after it is the next turn's separator.
    while ids and not tokenizer.decode([ids[-1]], skip_special_tokens=False).strip():
        ids.pop()
    return ids


def pair_length(t: PairTokens, shared_prompt: bool = True) -> int:
    """The tokens of the pair's row: ``prompt + chosen + rejected + 1`` with the prompt shared, else
    ``2 * prompt + chosen + rejected``."""
    p, c, r = len(t.prompt), len(t.chosen), len(t.rejected)
    return p + c + r + 1 if shared_prompt else 2 * p + c + r


def fit_pair(t: PairTokens, max_len: int, shared_prompt: bool = True) -> tuple[PairTokens, bool]:
    """(the pair cut to fit ``pair_length(t) <= max_len``, whether it was cut).

    The prompt loses tokens from its left first (down to one token: the first
    answer token must be predicted from something), then the answers from
    their right, the longer one first.
    """
    p, c, r = len(t.prompt), len(t.chosen), len(t.rejected)
    if pair_length(t, shared_prompt) <= max_len:
        return t, False
    copies, extra = (1, 1) if shared_prompt else (2, 0)  # prompt copies in the row, and the +1 of sharing
    keep_p = min(p, max(1, (max_len - extra - c - r) // copies))
    room = max_len - extra - copies * keep_p
    keep_c = min(c, max(room // 2, room - r))
    keep_r = min(r, room - keep_c)
    return PairTokens(t.prompt[p - keep_p:], t.chosen[:keep_c], t.rejected[:keep_r]), True


def pair_document(t: PairTokens, shared_prompt: bool = True) -> dict[str, np.ndarray]:
    """The row features of a pair: tokens, loss_mask (the answer tokens), its own segment ids and positions,
    and, with the prompt shared, each token's prefix segment (``tokens_prefix_ids``; see the module docstring)."""
    # Each answer segment opens with the prompt tokens it does not share: all of them, or the last one.
    lead = t.prompt[-1:] if shared_prompt else t.prompt
    start = len(t.prompt) - len(lead)  # the position of the answer segments' first token
    prefix = PROMPT if shared_prompt else 0
    parts = [(t.prompt[:start], np.zeros(start, bool), PROMPT, 0, np.arange(start))]
    for seg, answer in ((CHOSEN, t.chosen), (REJECTED, t.rejected)):
        tokens = np.concatenate([lead, answer])
        mask = np.concatenate([np.zeros(len(lead), bool), np.ones(len(answer), bool)])
        parts.append((tokens, mask, seg, prefix, start + np.arange(len(tokens))))
    doc = {
        "tokens": np.concatenate([x[0] for x in parts]).astype(np.int32),
        "loss_mask": np.concatenate([x[1] for x in parts]),
        "tokens_segment_ids": np.concatenate([np.full(len(x[0]), x[2], np.int32) for x in parts]),
        "tokens_prefix_ids": np.concatenate([np.full(len(x[0]), x[3], np.int32) for x in parts]),
        "tokens_positions": np.concatenate([x[4] for x in parts]).astype(np.int32),
    }
    if not shared_prompt:  # no prompt segment (it is empty): the model needs no prefix ids
        del doc["tokens_prefix_ids"]
    return doc


def pair_documents(rows: Iterable[tuple[int, dict[str, Any]]], tokenizer: Any, chat_template: str | None,
                   path: str, skip_bad_rows: bool, max_len: int, drop_long: bool,
                   shared_prompt: bool = True) -> tuple[dict[int, dict[str, np.ndarray]], int, set[int]]:
    """(pair documents by row index, bad rows skipped, row indices too long for ``max_len`` tokens).

    A bad row raises ``UserError("{path} row {i}: ...")`` unless
    ``skip_bad_rows``; a too-long pair is cut (see :func:`fit_pair`) or, with
    ``drop_long``, left out. ``shared_prompt`` picks the row layout (see the
    module docstring).
    """
    from zoo.errors import UserError

    out: dict[int, dict[str, np.ndarray]] = {}
    skipped, too_long, first_bad = 0, set(), ""
    for i, row in rows:
        try:
            tokens = tokenize_pair(normalize_pair(row), tokenizer, chat_template)
        except BadRow as e:
            if not skip_bad_rows:
                raise UserError(f"{path} row {i}: {e}; fix the row or set data.skip_bad_rows: true") from None
            skipped += 1
            first_bad = first_bad or f"row {i}: {e}"
            continue
        tokens, cut = fit_pair(tokens, max_len, shared_prompt)
        if cut:
            too_long.add(i)
            if drop_long:
                continue
        out[i] = pair_document(tokens, shared_prompt)
    if skipped and not out:
        raise UserError(f"{path}: all {skipped} rows are bad; the first, {first_bad}")
    return out, skipped, too_long
