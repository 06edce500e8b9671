"""Row formats of chat and instruction data: which columns a dataset has, and one row -> one `Example`.

Five row shapes are understood (the columns that identify them in brackets):

``text``               [text]                 plain text, every token trained
``prompt_completion``  [prompt, completion]   each a string, or both OpenAI-style message lists
``messages``           [messages]             a conversation: [{role, content[, reasoning_content]}, ...]
``alpaca``             [instruction, output]  + optional ``input`` (and ``system``) columns
``sharegpt``           [conversations]        [{from, value}, ...], from in human/gpt/system (or user/assistant)

Rows are checked here (missing or empty fields, wrong types, unknown roles, a
conversation with no assistant turn) and a problem raises `BadRow`; the
caller adds the file and line of the row (see `zoo.data.row_origin.bad_row`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo.errors import UserError

# Detection order matters when a dataset has the columns of several formats
# (ultrachat has `prompt` and `messages`): the richer, conversational shapes
# win, plain `text` comes last.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
FORMATS = tuple(FORMAT_COLUMNS)

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class BadRow(ValueError):
    """One row cannot be used; the message says why (the caller names the file and row)."""


@dataclass(frozen=True)
class Example:
    """One normalized training example: exactly one of three shapes.

    * ``text``: plain text (format ``text``).
    * ``prompt`` + ``completion``: both strings (completion-only loss), or both
      message lists (only the completion's assistant turns are trained);
      ``messages`` is then ``prompt + completion``.
    * ``messages`` alone: a conversation, every assistant turn trained.
    """

    text: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt: str | list[dict[str, str]] | None = None
    completion: str | list[dict[str, str]] | None = None

    @property
    def is_chat(self) -> bool:
        """True when the example is rendered with a chat template."""
        return self.messages is not None

    def trained_turns(self) -> list[int]:
        """Indices into ``messages`` of the assistant turns whose tokens are trained."""
        if self.messages is None:
            return []
        first = len(self.prompt) if isinstance(self.prompt, list) else 0
        return [i for i, m in enumerate(self.messages) if i >= first and m["role"] == "assistant"]


def format_help() -> str:
    """The formats and the columns that identify each, for error messages."""
    return "; ".join(f"{fmt} ({' + '.join(cols)})" for fmt, cols in FORMAT_COLUMNS.items())


def detect_format(columns: list[str], fmt: str | None = None) -> str:
    """The data format of a dataset with these ``columns``; an explicit ``fmt`` (data.format) overrides.

    Raises UserError when ``fmt`` is unknown or its columns are missing, or,
    without ``fmt``, when no format's columns are all present.
    """
    cols = set(columns)
    if fmt is not None:
        if fmt not in FORMAT_COLUMNS:
            raise UserError(f"data.format {fmt!r} is not a known format; use one of: {', '.join(FORMATS)}")
        missing = [c for c in FORMAT_COLUMNS[fmt] if c not in cols]
        if missing:
            raise UserError(f"data.format {fmt} needs the column(s) {', '.join(missing)}, "
                            f"but the rows have: {', '.join(columns) or 'no columns'}")
        return fmt
    for name, needed in FORMAT_COLUMNS.items():
        if all(c in cols for c in needed):
            return name
    raise UserError(f"cannot tell the data format from the columns {', '.join(columns) or '(none)'}; "
                    f"expected one of: {format_help()}; rename the columns or set data.format")


def normalize(row: dict[str, Any], fmt: str) -> Example:
    """The `Example` of one dataset ``row`` in format ``fmt``; raises BadRow when the row is unusable."""
    if fmt == "text":
        return Example(text=_text(row, "text"))
    if fmt == "prompt_completion":
        return _prompt_completion(row)
    if fmt == "messages":
        return Example(messages=_conversation(_field(row, "messages"), "messages"))
    if fmt == "alpaca":
        return _alpaca(row)
    if fmt == "sharegpt":
        return Example(messages=_conversation(_field(row, "conversations"), "conversations"))
    raise UserError(f"data.format {fmt!r} is not a known format; use one of: {', '.join(FORMATS)}")


def _field(row: dict[str, Any], name: str) -> Any:
    value = row.get(name)
    if value is None:
        raise BadRow(f"field '{name}' is missing")
    return value


def _text(row: dict[str, Any], name: str) -> str:
    value = _field(row, name)
    if not isinstance(value, str):
        raise BadRow(f"field '{name}' is not text ({type(value).__name__})")
    if not value.strip():
        raise BadRow(f"field '{name}' is empty")
    return value


def _prompt_completion(row: dict[str, Any]) -> Example:
    prompt, completion = _field(row, "prompt"), _field(row, "completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return Example(prompt=_text(row, "prompt"), completion=_text(row, "completion"))
    if isinstance(prompt, list) and isinstance(completion, list):
        p = parse_messages(prompt, "prompt")
        c = parse_messages(completion, "completion")
        if not any(m["role"] == "assistant" for m in c):
            raise BadRow("field 'completion' has no assistant turn (nothing to train on)")
        return Example(messages=p + c, prompt=p, completion=c)
    raise BadRow(f"fields 'prompt' and 'completion' must both be strings or both be message lists "
                 f"(got {type(prompt).__name__} and {type(completion).__name__})")


def _alpaca(row: dict[str, Any]) -> Example:
    user = _text(row, "instruction")
    extra = row.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRow(f"field 'input' is not text ({type(extra).__name__})")
    if extra and extra.strip():  # the optional input goes under the instruction, as in Alpaca's own prompt
        user = f"{user}\n\n{extra}"
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": _text(row, "output")}]
    system = row.get("system")
    if isinstance(system, str) and system.strip():
        messages.insert(0, {"role": "system", "content": system})
    return Example(messages=messages)


def _conversation(value: Any, name: str) -> list[dict[str, str]]:
    messages = parse_messages(value, name)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"field '{name}' has no assistant turn (nothing to train on)")
    return messages


def parse_messages(value: Any, name: str) -> list[dict[str, str]]:
    """A list of {role, content} (plus ``reasoning_content`` where an assistant turn has it) from OpenAI-style
    ({role, content}) or ShareGPT-style ({from, value}) turns; raises BadRow naming the field and turn."""
    if not isinstance(value, list):
        raise BadRow(f"field '{name}' is not a list of messages ({type(value).__name__})")
    if not value:
        raise BadRow(f"field '{name}' is empty")
    return [_message(m, name, i) for i, m in enumerate(value)]


def _message(m: Any, name: str, i: int) -> dict[str, str]:
    where = f"{name}[{i}]"
    if not isinstance(m, dict):
        raise BadRow(f"{where} is not a message object ({type(m).__name__})")
    # Parquet/Arrow gives every struct all the keys of the column, unused ones None: pick the pair present.
    if m.get("role") is not None or m.get("content") is not None:
        speaker, content = m.get("role"), m.get("content")
        role = speaker if speaker in ROLES else None
        allowed = ", ".join(ROLES)
    else:
        speaker, content = m.get("from"), m.get("value")
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        allowed = ", ".join(SHAREGPT_ROLES)
    if speaker is None:
        raise BadRow(f"{where} has no role (expected 'role' + 'content' or 'from' + 'value')")
    if role is None:
        raise BadRow(f"{where} has the unknown role {speaker!r} (expected one of: {allowed})")
    if not isinstance(content, str):
        what = "missing" if content is None else f"not text ({type(content).__name__})"
        raise BadRow(f"{where} ({role}) content is {what}")
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise BadRow(f"{where} ({role}) reasoning_content is not text ({type(reasoning).__name__})")
    # An empty system prompt is a real choice (it replaces a template's default); an empty turn is not
    # (an assistant turn may be all reasoning: the template renders it).
    if role != "system" and not content.strip() and not (reasoning and reasoning.strip()):
        raise BadRow(f"{where} ({role}) content is empty")
    out = {"role": role, "content": content}
    if reasoning is not None:  # a reasoning trace (Qwen3, DeepSeek-R1): the template decides what it renders
        out["reasoning_content"] = reasoning
    return out
