"""Chat templates as data: a template and the variables every render gets, and the render of a conversation.

Renders never depend on the day: ``strftime_now`` (Llama 3.2, Mistral-Small,
Granite templates) reads a fixed date (``data.template_date``), and template
variables (``data.template_kwargs``: ``enable_thinking``, ``date_string``, …)
are passed to every render.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from chat.formats import BadRow
from zoo.errors import UserError

DEFAULT_DATE = "2024-07-26"  # Llama 3.x's own fallback date ("26 Jul 2024") when no clock is given


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
def fixed_clock(date: str) -> Iterator[None]:
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
        with fixed_clock(template.date):
            return tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                 add_generation_prompt=generation_prompt, **template.kwargs, **extra)
    except jinja2.TemplateSyntaxError as e:  # the same for every row: a configuration error
        raise UserError(f"{template.name} does not compile: {e}") from None
    except UserError:
        raise
    except Exception as e:  # raise_exception() in the template (e.g. roles must alternate), missing keys, ...
        raise BadRow(f"the chat template cannot render it ({type(e).__name__}: {e})") from None
