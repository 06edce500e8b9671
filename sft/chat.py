"""Chat templates as data: render a conversation, and find each assistant turn's span in the whole render.

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

Renders never depend on the day: ``strftime_now`` (Llama 3.2, Mistral-Small,
Granite templates) reads a fixed date (``data.template_date``), and template
variables (``data.template_kwargs``: ``enable_thinking``, ``date_string``, …)
are passed to every render.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from sft.formats import BadRow
from zoo.errors import UserError

SENTINEL = "\ue000"  # a private-use character: never whitespace, never in a template, kept by every filter
DEFAULT_DATE = "2024-07-26"  # Llama 3.x's own fallback date ("26 Jul 2024") when no clock is given
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateMismatch(BadRow):
    """The chat template renders an assistant turn in a way that cannot be located in the whole render."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the variables every render gets.

    ``source`` is the Jinja text (None: the tokenizer's own), ``kwargs`` the
    extra template variables (``data.template_kwargs``) and ``date`` the
    fixed day ``strftime_now`` reads (``data.template_date``, YYYY-MM-DD).
    """

    source: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    date: str = DEFAULT_DATE
    name: str = "the tokenizer's chat template"

    def identity(self) -> dict[str, Any]:
        """What a render depends on besides the tokenizer (for cache keys)."""
        return {"source": self.source, "kwargs": self.kwargs, "date": self.date}


def as_template(template: ChatTemplate | str | None) -> ChatTemplate:
    """A :class:`ChatTemplate` from a Jinja string (``data.chat_template``'s text), None, or one already made."""
    if isinstance(template, ChatTemplate):
        return template
    if template is None:
        return ChatTemplate()
    return ChatTemplate(source=template, name="data.chat_template")


def parse_date(value: str) -> _dt.datetime:
    """``data.template_date`` as a datetime (noon, so no time zone moves its day)."""
    try:
        return _dt.datetime.strptime(str(value), "%Y-%m-%d").replace(hour=12)
    except ValueError:
        raise UserError(f"data.template_date {value!r} is not a date; write it as YYYY-MM-DD, e.g. 2024-07-26") from None


def template_text(tokenizer: Any, template: ChatTemplate) -> str:
    """The Jinja source to render with: the template's own, else the tokenizer's."""
    text = template.source or getattr(tokenizer, "chat_template", None)
    if not text:
        raise UserError("conversational data needs a chat template, and the tokenizer has none; "
                        "set data.chat_template to a Jinja chat template")
    if isinstance(text, dict):  # some tokenizers keep several named templates
        if "default" not in text:
            raise UserError(f"the tokenizer has several chat templates ({', '.join(text)}) and no 'default'; "
                            "set data.chat_template")
        text = text["default"]
    return text


@contextlib.contextmanager
def _fixed_clock(date: str) -> Iterator[None]:
    """transformers' ``strftime_now`` reads this day while rendering (it calls ``datetime.now()`` of its module)."""
    from transformers.utils import chat_template_utils as ctu

    day = parse_date(date)

    class _Day(_dt.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> _Day:  # noqa: ARG003 - the signature of datetime.now
            return cast(_Day, day)

    saved = ctu.datetime
    setattr(ctu, "datetime", _Day)  # noqa: B010 - a module attribute mypy takes for the class
    try:
        yield
    finally:
        setattr(ctu, "datetime", saved)  # noqa: B010


def render(tokenizer: Any, messages: list[dict[str, Any]], template: ChatTemplate, source: str,
           generation_prompt: bool, tools: list[Any] | None = None) -> str:
    """The template's text for ``messages`` (raises UserError for a template that does not compile, BadRow for
    a row it refuses, e.g. roles that do not alternate); ``tools``: the functions (or JSON schemas) the
    template describes to the model, as transformers' ``tools=``."""
    import jinja2

    extra = {"tools": tools} if tools else {}  # none at all, not []: Llama's template renders tool text for []
    try:
        with _fixed_clock(template.date):
            return tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                 add_generation_prompt=generation_prompt, **template.kwargs, **extra)
    except jinja2.TemplateSyntaxError as e:  # the same for every row: a configuration error
        raise UserError(f"{template.name} does not compile: {e}") from None
    except UserError:
        raise
    except Exception as e:  # raise_exception() in the template (e.g. roles must alternate), missing keys, ...
        raise BadRow(f"the chat template cannot render it ({type(e).__name__}: {e})") from None


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

    def __init__(self, tokenizer: Any, messages: list[dict[str, Any]], template: ChatTemplate):
        self.tok, self.messages, self.template = tokenizer, messages, template
        self.source = template_text(tokenizer, template)
        self._cache: dict[tuple, str] = {}

    def text(self, n: int, generation_prompt: bool, mark: int | None = None) -> str:
        """The render of ``messages[:n]``; with ``mark``, message ``mark``'s content carries the sentinel."""
        key = (n, generation_prompt, mark)
        if key not in self._cache:
            msgs = self.messages[:n]
            if mark is not None:
                m = dict(msgs[mark])
                content = m.get("content") or ""
                cut = len(content.rstrip())
                m["content"] = content[:cut] + SENTINEL + content[cut:]
                msgs = msgs[:mark] + [m] + msgs[mark + 1:]
            self._cache[key] = render(self.tok, msgs, self.template, self.source, generation_prompt)
        return self._cache[key]

    def content_end(self, n: int, generation_prompt: bool, k: int) -> int:
        """Where message ``k``'s (right-stripped) content ends in the render of ``messages[:n]``."""
        plain, marked = self.text(n, generation_prompt), self.text(n, generation_prompt, mark=k)
        at = common_prefix(plain, marked)
        if marked != plain[:at] + SENTINEL + plain[at:]:
            how = "drops" if marked == plain else "rewrites or repeats"
            raise TemplateMismatch(f"turn {k} ({self.messages[k]['role']}): {self.template.name} {how} its content, "
                                   "so the turn cannot be located in the rendered conversation")
        return at


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], turns: list[int],
                    template: ChatTemplate) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation's render, the character span of each of ``turns`` in it); see the module docstring.

    Raises BadRow (TemplateMismatch) naming the turn when a span cannot be located.
    """
    r = _Renders(tokenizer, messages, template)
    n = len(messages)
    full = r.text(n, False)
    if _GENERATION.search(r.source):
        return full, _generation_spans(tokenizer, messages, turns, template, r.source, full)
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
                      source: str, full: str) -> list[tuple[int, int]]:
    """The ``{% generation %}`` blocks of the assistant turns in ``turns`` (one block per assistant message)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with _fixed_clock(template.date):
        texts, indices = cast(Any, render_jinja_template)(
            conversations=[messages], chat_template=source, return_assistant_tokens_mask=True,
            add_generation_prompt=False, **{**tokenizer.special_tokens_map, **template.kwargs})
    blocks: list[tuple[int, int]] = [(int(s[0]), int(s[1])) for s in indices[0]]
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if texts[0] != full or len(blocks) != len(assistants):
        raise TemplateMismatch(f"{template.name} has {len(blocks)} generation block(s) for {len(assistants)} "
                               "assistant turn(s), so the turns cannot be matched to them")
    by_turn = dict(zip(assistants, blocks))
    return [by_turn[k] for k in turns]
