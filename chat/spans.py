"""Where each assistant turn is in a conversation's whole render: the character spans a chat task trains.

Real templates render a turn differently by its position, so a render of a
conversation prefix is not, in general, a prefix of the whole render:

* Qwen3 writes a ``<think>`` block only for assistant turns after the last
  user turn (an empty one on the final turn, the reasoning where a turn has
  ``reasoning_content``), and strips reasoning from earlier turns;
* DeepSeek-R1-distill strips ``<think>…</think>`` from every assistant turn;
* Mistral v0.3 and Nemo put the system prompt into the *last* user turn
  (and drop it when the conversation ends with an assistant turn);
* Gemma 3 folds the system prompt into the first user turn; Llama 3.x writes
  a date header and moves the system text into its own block.

So the trained text of assistant turn ``k`` is located inside the render of
the whole conversation ``F`` (whose ids are the example's ids), without
assuming anything about prefixes:

1. ``x_k``, where turn ``k``'s content ends in ``F``: render the conversation
   again with a private-use sentinel character appended to that content (before
   its trailing whitespace, which templates may trim); the two renders differ by
   exactly that one inserted character, at ``x_k``. A template that drops the
   content, or writes it more than once, is reported as a row it cannot locate.
2. The end: the template's end-of-turn text after an assistant content is what
   follows the content in the render of ``messages[:k + 1]`` (found the same
   way); the trained span runs through as much of it as ``F`` agrees with after
   ``x_k``, less trailing whitespace (ChatML's and Gemma's ``\\n`` after the
   end-of-turn token is the next turn's separator, not something to generate).
3. The start: at inference the model continues the prompt
   ``render(messages[:k], add_generation_prompt=True)``, whose text after the
   previous message's content (``<|im_end|>\\n<|im_start|>assistant\\n``,
   ``[/INST]``, ``<｜Assistant｜><think>\\n``) is the header it is given. The
   trained span starts where ``F``, read from the previous message's content end
   ``x_{k-1}``, stops agreeing with that header. Whatever the template writes
   between the header and the content at that position (Qwen3's
   ``<think>\\n\\n</think>\\n\\n`` on the final turn, Mistral's space) is part of what
   the model must produce, so it is trained.

Templates with ``{% generation %}`` blocks say which text is the assistant's
themselves; their blocks are used instead.

Tool-call rows (chat/tool_rows.py) render with the row's ``tools``. An assistant turn with ``tool_calls`` is
located by its last call's function name (the sentinel goes there, as templates may drop the content of a call
turn: Llama 3.1's does), so its span runs from the header through its calls and end-of-turn token. A ``tool`` or
``developer`` message, and the ``tools`` themselves, must appear in the render: a template that drops them
(Qwen3 has no developer role; ChatML templates without a tools block) is a row it cannot render.
"""

from __future__ import annotations

import re
from typing import Any, cast

from chat.formats import BadRow
from chat.templates import ChatTemplate, fixed_clock, render, template_text

SENTINEL = "\ue000"  # a private-use character: never whitespace, never in a template, kept by every filter
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateMismatch(BadRow):
    """The chat template renders an assistant turn in a way that cannot be located in the whole render."""


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (binary search over C-level slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Renders:
    """Renders of one conversation (and its prefixes), each made once."""

    def __init__(self, tokenizer: Any, messages: list[dict[str, Any]], template: ChatTemplate,
                 tools: list[dict[str, Any]] | None = None):
        self.tok, self.messages, self.template, self.tools = tokenizer, messages, template, tools
        self.source = template_text(tokenizer, template)
        self._cache: dict[tuple, str] = {}

    def text(self, n: int, generation_prompt: bool, mark: int | None = None) -> str:
        """The render of ``messages[:n]``; with ``mark``, message ``mark``'s content carries the sentinel."""
        key = (n, generation_prompt, mark)
        if key not in self._cache:
            msgs = self.messages[:n]
            if mark is not None:
                msgs = msgs[:mark] + [_marked_message(msgs[mark])] + msgs[mark + 1:]
            self._cache[key] = render(self.tok, msgs, self.template, self.source, generation_prompt, self.tools)
        return self._cache[key]

    def content_end(self, n: int, generation_prompt: bool, k: int) -> int:
        """Where message ``k``'s (right-stripped) content ends in the render of ``messages[:n]``."""
        plain, marked = self.text(n, generation_prompt), self.text(n, generation_prompt, mark=k)
        at = common_prefix(plain, marked)
        if marked != plain[:at] + SENTINEL + plain[at:]:
            how = "drops" if marked == plain else "rewrites or repeats"
            what = "tool calls" if self.messages[k].get("tool_calls") else "content"
            raise TemplateMismatch(f"turn {k} ({self.messages[k]['role']}): {self.template.name} {how} its {what}, "
                                   "so the turn cannot be located in the rendered conversation")
        return at

    def check_tools(self, full: str) -> None:
        """Raise BadRow when the render leaves out a tool or developer message, or the row's tools."""
        n = len(self.messages)
        for i, m in enumerate(self.messages):
            if m["role"] in ("tool", "developer"):
                self.content_end(n, False, i)
        if self.tools and render(self.tok, self.messages, self.template, self.source, False) == full:
            raise BadRow(f"{self.template.name} does not write the row's tools (its 'tools' column); use a chat "
                         "template that renders tools, or leave the column out")


def _marked_message(m: dict[str, Any]) -> dict[str, Any]:
    """The message with the sentinel at its mark: its last tool call's function name, else its content."""
    calls = m.get("tool_calls")
    if not calls:
        return {**m, "content": _marked(m.get("content"))}
    last = calls[-1]
    function = {**last["function"], "name": last["function"]["name"] + SENTINEL}
    return {**m, "tool_calls": [*calls[:-1], {**last, "function": function}]}


def _marked(content: Any) -> Any:
    """``content`` with the sentinel after its text, before trailing whitespace; a list of parts (a vision
    conversation) gets it in its last text part (a text part of its own when it has none)."""
    if isinstance(content, list):
        texts = [i for i, p in enumerate(content) if p.get("type") == "text"]
        if not texts:
            return [*content, {"type": "text", "text": SENTINEL}]
        i = texts[-1]
        return [*content[:i], {**content[i], "text": _marked(content[i].get("text"))}, *content[i + 1:]]
    content = content or ""
    cut = len(content.rstrip())
    return content[:cut] + SENTINEL + content[cut:]


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], turns: list[int],
                    template: ChatTemplate, tools: list[dict[str, Any]] | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation's render, the character span of each of ``turns`` in it); see the module docstring.
    ``tools``: the row's tools, passed to every render.

    Raises BadRow (TemplateMismatch) naming the turn when a span cannot be located, or when the template leaves
    out a tool or developer message or the tools.
    """
    r = _Renders(tokenizer, messages, template, tools)
    n = len(messages)
    full = r.text(n, False)
    r.check_tools(full)
    if _GENERATION.search(r.source):
        return full, _generation_spans(tokenizer, messages, turns, template, r.source, full, tools)
    spans: list[tuple[int, int]] = []
    for k in turns:
        x = r.content_end(n, False, k)
        # End: through the end-of-turn text the template writes after this turn's content, as far as F agrees.
        own = r.text(k + 1, False)
        tail = own[r.content_end(k + 1, False, k):]
        end = x + common_prefix(full[x:], tail)
        end = x + len(full[x:end].rstrip())
        # Start: after the header the model is given at inference (the prompt's text after the previous content).
        if k == 0:
            anchor, header = 0, _try_render(r, 0)
        else:
            prompt = r.text(k, True)
            anchor, header = r.content_end(n, False, k - 1), prompt[r.content_end(k, True, k - 1):]
        start = anchor + common_prefix(full[anchor:x], header)
        if spans and start < spans[-1][1]:
            raise TemplateMismatch(f"turn {k}: its span overlaps the previous assistant turn's")
        spans.append((start, end))
    return full, spans


def _try_render(r: _Renders, n: int) -> str:
    """The generation prompt of an empty conversation ('' when the template needs a message first)."""
    try:
        return r.text(n, True)
    except BadRow:
        return ""


def _generation_spans(tokenizer: Any, messages: list[dict[str, Any]], turns: list[int], template: ChatTemplate,
                      source: str, full: str, tools: list[dict[str, Any]] | None = None) -> list[tuple[int, int]]:
    """The ``{% generation %}`` blocks of the assistant turns in ``turns`` (one block per assistant message)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with fixed_clock(template.date):
        texts, indices = cast(Any, render_jinja_template)(
            conversations=[messages], tools=tools or None, chat_template=source, return_assistant_tokens_mask=True,
            add_generation_prompt=False, **{**tokenizer.special_tokens_map, **template.kwargs})
    blocks: list[tuple[int, int]] = [(int(s[0]), int(s[1])) for s in indices[0]]
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if texts[0] != full or len(blocks) != len(assistants):
        raise TemplateMismatch(f"{template.name} has {len(blocks)} generation block(s) for {len(assistants)} "
                               "assistant turn(s), so the turns cannot be matched to them")
    by_turn = dict(zip(assistants, blocks))
    return [by_turn[k] for k in turns]
