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
the tokenizer's, with ``data.template_kwargs``), each answer inside the whole
conversation ``prompt + answer`` as chat/spans.py locates an assistant turn:
from after the header the model is prompted with, through the template's
end-of-turn token (the separator written after it, ChatML's ``\\n``, is a
prompt-side token and is left out, as in SFT). The text before the answer is
the prompt; both answers' renders must agree on it. A row's ``tools`` column (the functions' JSON schemas,
chat/tool_rows.py) is passed to every render, and its messages may carry tool calls and tool answers.

Tokens come from the whole text, never from a piece tokenized alone: each of
``prompt + chosen`` and ``prompt + rejected`` is tokenized as one text and
split at the prompt's last whole token (TRL's rule; a token that merges the
prompt's end with the answer's start belongs to the answer). This matters for
SentencePiece tokenizers with a dummy prefix (Llama 2, Mistral), which would
give an answer tokenized alone a space the text never had. The shared prompt
is what both sequences agree on; where the two splits differ (a merge on one
side only), each answer keeps its own remaining prompt tokens ahead of it,
untrained (:attr:`PairTokens.chosen_head`), so each answer sees exactly the
tokens of its whole text.

Batch layout (the one-forward-pass choice): a pair is ONE row of at most
``data.seq_len + 1`` tokens, and by default its prompt is in it once:
``[prompt[:-1] | prompt[-1] + chosen | prompt[-1] + rejected]``, as
segments 3, 1 and 2. Both answer segments attend to the prompt segment as a
shared prefix (the model's ``prefix_ids``; see :func:`zoo.model.masks.attention_mask`)
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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from chat.formats import BadRow, parse_messages
from chat.loss_masks import TokenizeStats, bos_head, special_affixes, split_whole, with_eos
from chat.spans import assistant_spans
from chat.templates import ChatTemplate, as_template
from chat.tool_rows import check_tool_order, row_tools
from zoo.errors import UserError

if TYPE_CHECKING:
    from pretrain.config import TrainConfig
    from pretrain.task import RowSource
    from zoo.model.config import ModelConfig

CHOSEN, REJECTED, PROMPT = 1, 2, 3  # the segment ids of a pair's answers and of its shared prompt


@dataclass(frozen=True)
class Pair:
    """One normalized preference pair: all strings, or a message-list prompt and message-list answers."""

    prompt: str | list[dict[str, str]]
    chosen: str | list[dict[str, str]]
    rejected: str | list[dict[str, str]]
    tools: list[dict[str, Any]] | None = None  # the row's tools column, passed to the chat template

    @property
    def is_chat(self) -> bool:
        """True when the pair is rendered with a chat template."""
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class PairTokens:
    """The token ids of a pair: the shared prompt and each answer (each ends with its end-of-turn token).

    ``chosen_head`` / ``rejected_head`` are prompt tokens of one answer's
    whole text beyond the shared prompt (empty unless the two texts tokenize
    the prompt's end differently): they precede that answer, untrained.
    """

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    chosen_head: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rejected_head: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


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
        c, r = parse_messages(chosen, "chosen"), parse_messages(rejected, "rejected")
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
        p = parse_messages(prompt, "prompt")
        pair = Pair(p, _answer(chosen, "chosen"), _answer(rejected, "rejected"))
    if pair.chosen == pair.rejected:
        raise BadRow("'chosen' and 'rejected' are identical (the pair prefers nothing)")
    if not pair.is_chat:
        return pair
    for answer, name in ((pair.chosen, "prompt + chosen"), (pair.rejected, "prompt + rejected")):
        check_tool_order(cast(list, pair.prompt) + cast(list, answer), name)
    tools = row_tools(row)
    return replace(pair, tools=tools) if tools else pair


def _common_prefix(a: list, b: list) -> int:
    """How many leading items ``a`` and ``b`` share (messages, or token ids)."""
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
    msgs = parse_messages(value, name)
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadRow(f"field '{name}' has no assistant turn")
    return msgs


def tokenize_pair(pair: Pair, tokenizer: Any, chat_template: ChatTemplate | str | None = None,
                  stats: TokenizeStats | None = None) -> PairTokens:
    """The shared prompt's ids and each answer's ids, all from whole texts (see the module docstring); raises
    BadRow for an unusable pair. A boundary merge is counted in ``stats``."""
    texts, head = pair_texts(pair, tokenizer, chat_template)
    return pair_tokens(texts, head, tokenizer, pair.is_chat, stats)


def pair_texts(pair: Pair, tokenizer: Any, chat_template: ChatTemplate | str | None = None
               ) -> tuple[list[tuple[str, str]], list[int]]:
    """((prompt text, answer text) of the chosen and of the rejected answer, the BOS head the ids start with
    unless the text writes it): a conversational pair rendered with the chat template."""
    if not pair.is_chat:
        return ([(cast(str, pair.prompt), cast(str, pair.chosen)), (cast(str, pair.prompt), cast(str, pair.rejected))],
                special_affixes(tokenizer)[0])
    template = as_template(chat_template)
    texts = [chat_texts(tokenizer, cast(list, pair.prompt), cast(list, a), template, name, pair.tools)
             for a, name in ((pair.chosen, "chosen"), (pair.rejected, "rejected"))]
    if texts[0][0] != texts[1][0]:
        raise BadRow("the chat template renders the prompt differently before 'chosen' and before 'rejected', "
                     "so the two answers have no common prompt")
    return texts, bos_head(tokenizer, texts[0][0] + texts[0][1])


def pair_tokens(texts: list[tuple[str, str]], head: list[int], tokenizer: Any, is_chat: bool,
                stats: TokenizeStats | None = None) -> PairTokens:
    """The :class:`PairTokens` of a pair's two (prompt text, answer text) (:func:`pair_texts`), each tokenized
    whole and split at the prompt's last whole token; ``head`` goes first unless the text starts with it."""
    sides = []
    for prompt_text, answer_text in texts:
        ids, n, merged = split_whole(prompt_text, answer_text, tokenizer)
        if merged and stats is not None:
            stats.boundary_merges += 1
        if head and ids[:len(head)] == head:  # the text starts with its own BOS: no second one
            head = []
        sides.append((ids[:n], ids[n:]))
    if not is_chat:  # string answers end with one EOS (unless they already do)
        sides = [(p, with_eos(a, tokenizer)) for p, a in sides]
    (pc, chosen), (pr, rejected) = sides
    shared = _common_prefix(pc, pr)
    prompt = head + pc[:shared]
    if not prompt:
        raise BadRow("the prompt renders to no token (nothing to condition the answers on)")
    for ids, name in ((chosen, "chosen"), (rejected, "rejected")):
        if not ids:
            raise BadRow(f"the '{name}' answer renders to no token")
    if pc[shared:] + chosen == pr[shared:] + rejected:
        raise BadRow("'chosen' and 'rejected' tokenize identically (the pair prefers nothing)")
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return PairTokens(i32(prompt), i32(chosen), i32(rejected), i32(pc[shared:]), i32(pr[shared:]))


def chat_texts(tokenizer: Any, prompt: list[dict[str, str]], answer: list[dict[str, str]],
               template: ChatTemplate, name: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, str]:
    """(the prompt's text, the answer's text) inside the render of ``prompt + answer`` (with the row's ``tools``):
    the answer from its first assistant turn's start to its last one's end-of-turn token."""
    messages = prompt + answer
    turns = [i for i in range(len(prompt), len(messages)) if messages[i]["role"] == "assistant"]
    try:
        full, spans = assistant_spans(tokenizer, messages, turns, template, tools)
    except BadRow as e:
        raise BadRow(f"'{name}': {e}") from None
    return full[:spans[0][0]], full[spans[0][0]:spans[-1][1]]


def pair_length(t: PairTokens, shared_prompt: bool = True) -> int:
    """The tokens of the pair's row: ``prompt + chosen + rejected + 1`` with the prompt shared, else
    ``2 * prompt + chosen + rejected`` (each answer's own head tokens counted with it)."""
    p = len(t.prompt)
    c, r = len(t.chosen_head) + len(t.chosen), len(t.rejected_head) + len(t.rejected)
    return p + c + r + 1 if shared_prompt else 2 * p + c + r


def fit_pair(t: PairTokens, max_len: int, shared_prompt: bool = True) -> tuple[PairTokens, bool]:
    """(the pair cut to fit ``pair_length(t) <= max_len``, whether it was cut).

    The prompt loses tokens from its left first (down to one token: the first
    answer token must be predicted from something), then the answers from
    their right, the longer one first.
    """
    p, c, r = len(t.prompt), len(t.chosen), len(t.rejected)
    hc, hr = len(t.chosen_head), len(t.rejected_head)
    if pair_length(t, shared_prompt) <= max_len:
        return t, False
    copies, extra = (1, 1) if shared_prompt else (2, 0)  # prompt copies in the row, and the +1 of sharing
    keep_p = min(p, max(1, (max_len - extra - hc - hr - c - r) // copies))
    room = max_len - extra - copies * keep_p - hc - hr
    keep_c = min(c, max(room // 2, room - r))
    keep_r = min(r, room - keep_c)
    return PairTokens(t.prompt[p - keep_p:], t.chosen[:keep_c], t.rejected[:keep_r], t.chosen_head,
                      t.rejected_head), True


def keeps_meaning(whole: PairTokens, kept: PairTokens) -> bool:
    """Whether a pair cut to fit still says what is preferred to what: it keeps at least half of its prompt
    and of each answer (a preference between two answer fragments, or without the question, teaches nothing
    a user asked for)."""
    return all(2 * len(b) >= len(a) for a, b in ((whole.prompt, kept.prompt), (whole.chosen, kept.chosen),
                                                  (whole.rejected, kept.rejected)))


def shared_prompt_layout(share: bool, mcfg: ModelConfig) -> bool:
    """Whether pairs share one copy of their prompt: ``share`` (``dpo.share_prompt``), except for models with
    sliding-window layers (zoo.model.masks). ``model.attention: splash`` cannot read a shared prompt
    (zoo.kernels.choice): said here, before any documents, with what to change."""
    shared = share and "sliding" not in mcfg.kinds
    if shared and mcfg.attention == "splash":
        raise UserError("model.attention splash cannot read DPO's shared prompts (an answer reads its prompt's "
                        "segment; splash's segment ids only pair equal ids): set dpo.share_prompt: false, or "
                        "attention: auto or blockwise")
    return shared


def pair_document(t: PairTokens, shared_prompt: bool = True) -> dict[str, np.ndarray]:
    """The row features of a pair: tokens, loss_mask (the answer tokens), its own segment ids and positions,
    and, with the prompt shared, each token's prefix segment (``tokens_prefix_ids``; see the module docstring)."""
    # Each answer segment opens with the prompt tokens it does not share (all of them, or the last one), then
    # its own head tokens (prompt tokens of its whole text beyond the shared prompt): none of them trained.
    lead = t.prompt[-1:] if shared_prompt else t.prompt
    start = len(t.prompt) - len(lead)  # the position of the answer segments' first token
    prefix = PROMPT if shared_prompt else 0
    parts = [(t.prompt[:start], np.zeros(start, bool), PROMPT, 0, np.arange(start))]
    for seg, head, answer in ((CHOSEN, t.chosen_head, t.chosen), (REJECTED, t.rejected_head, t.rejected)):
        tokens = np.concatenate([lead, head, answer])
        mask = np.concatenate([np.zeros(len(lead) + len(head), bool), np.ones(len(answer), bool)])
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


class PairImages(Protocol):
    """What :func:`pair_documents` asks of rows with images (prefs/image_pairs.py's ImagePairs)."""

    def tokenize(self, i: int, row: dict[str, Any], tokenizer: Any, template: ChatTemplate,
                 stats: TokenizeStats | None) -> PairTokens:
        """Row ``i``'s pair tokens, its images expanded; raises BadRow."""
        ...

    def attach(self, i: int, whole: PairTokens, kept: PairTokens, doc: dict[str, np.ndarray],
               shared_prompt: bool) -> None:
        """Keep row ``i``'s images with its document ``doc`` (``kept``: the pair as cut to fit)."""
        ...


def load_pair_rows(path: str, cfg: TrainConfig, need: str) -> RowSource:
    """The rows of ``path`` as preference pairs; one line (``need``: what the rows need) when a column is
    missing."""
    from pretrain.task import RowSource
    from zoo.data.files import load_dataset_rows

    ds, _ = load_dataset_rows(path, cfg.data.split)
    missing = [c for c in ("chosen", "rejected") if c not in ds.column_names]
    if missing:
        raise UserError(f"data.path {path}: {need}; missing {', '.join(missing)} (columns: {ds.column_names})")
    return RowSource(ds, "pairs", path)


def pair_documents(rows: Iterable[tuple[int, dict[str, Any]]], tokenizer: Any,
                   chat_template: ChatTemplate | str | None,
                   path: str, skip_bad_rows: bool, max_len: int, drop_long: bool,
                   shared_prompt: bool = True, images: PairImages | None = None
                   ) -> tuple[dict[int, dict[str, np.ndarray]], int, set[int]]:
    """(pair documents by row index, bad rows skipped, row indices too long for ``max_len`` tokens).

    A bad row raises ``UserError("{file}, line {n}: ...")`` (:func:`zoo.data.row_origin.bad_row`) unless
    ``skip_bad_rows``; a too-long pair is cut (see :func:`fit_pair`) or, with
    ``drop_long``, left out. ``shared_prompt`` picks the row layout (see the
    module docstring). ``images`` (prefs/image_pairs.py): rows with images, on a vision-language model.
    """
    from zoo.data.row_origin import bad_row, row_where

    out: dict[int, dict[str, np.ndarray]] = {}
    skipped, too_long, first_bad = 0, set(), ""
    stats, template = TokenizeStats(), as_template(chat_template)
    for i, row in rows:
        try:
            tokens = (tokenize_pair(normalize_pair(row), tokenizer, template, stats) if images is None
                      else images.tokenize(i, row, tokenizer, template, stats))
        except BadRow as e:
            if not skip_bad_rows:
                raise bad_row(path, i, e) from None
            skipped += 1
            first_bad = first_bad or f"{row_where(path, i)}: {e}"
            continue
        kept, cut = fit_pair(tokens, max_len, shared_prompt)
        if cut:
            too_long.add(i)
            if drop_long:
                continue
        out[i] = pair_document(kept, shared_prompt)
        if images is not None:  # its images kept, its tokens tagged (or a UserError: a cut through its images)
            images.attach(i, tokens, kept, out[i], shared_prompt)
        if cut and not keeps_meaning(tokens, kept):
            out[i]["loss_mask"][:] = False  # trains nothing: the loop counts it as cut to nothing and leaves it out
    if skipped and not out:
        raise UserError(f"{path}: all {skipped} rows are bad; the first is {first_bad}")
    stats.report(path, len(out))
    return out, skipped, too_long


def row_label(row: dict[str, Any]) -> bool:
    """A KTO row's label; raises BadRow when it is missing or not a boolean."""
    label = row.get("label")
    if label is None:
        raise BadRow("field 'label' is missing (true for a desirable completion, false for an undesirable one)")
    if not isinstance(label, bool):
        raise BadRow(f"field 'label' is {label!r}, not true or false")
    return label
