"""Row formats of chat and instruction data: which columns a dataset has, and one row -> one `Example`.

Five row shapes are understood (the columns that identify them in brackets):

``text``               [text]                 plain text, every token trained
``prompt_completion``  [prompt, completion]   each a string, or both OpenAI-style message lists
``messages``           [messages]             a conversation: [{role, content[, reasoning_content]}, ...]
``alpaca``             [instruction, output]  + optional ``input`` (and ``system``) columns
``sharegpt``           [conversations]        [{from, value}, ...], from in human/gpt/system (or user/assistant)

Conversations may be tool-call rows (chat/tool_rows.py): assistant turns with ``tool_calls``, ``tool``
messages answering them, a ``developer`` turn, and the row's ``tools`` column (the functions' JSON schemas, passed
to the chat template); only assistant turns are trained, tool outputs never.

Rows are checked here (missing or empty fields, wrong types, unknown roles, a
conversation with no assistant turn) and a problem raises `BadRow`; the
caller adds the file and line of the row (see `zoo.data.row_origin.bad_row`).

Conversations with images (TRL's vision rows): a message's ``content`` may be a
list of parts, ``{"type": "text", "text": ...}`` and ``{"type": "image"}``
(kept structured: vision chat templates iterate the parts), and the row's
images are its ``images`` column (or ``image``: one image). As TRL's
``prepare_multimodal_messages`` does, string contents then become text parts
and, when the first user turn is a string, one image part per image is put
before its text. Rows without images or parts are read exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

from chat.row_errors import BadRow
from chat.tool_rows import check_tool_order, parse_tool_calls, row_tools, tool_message, uses_tools
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

ROLES = ("system", "developer", "user", "assistant", "tool")
# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# The columns a row's images are read from (TRL's names): a list of images, or one image.
IMAGE_COLUMNS = ("images", "image")
PART_TYPES = ("text", "image")


@dataclass(frozen=True)
class Example:
    """One normalized training example: exactly one of three shapes.

    * ``text``: plain text (format ``text``).
    * ``prompt`` + ``completion``: both strings (completion-only loss), or both
      message lists (only the completion's assistant turns are trained);
      ``messages`` is then ``prompt + completion``.
    * ``messages`` alone: a conversation, every assistant turn trained.

    A conversation with images has structured contents (lists of parts) and ``images``.
    """

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[dict[str, Any]] | None = None
    completion: str | list[dict[str, Any]] | None = None
    # The row's images as read (paths, HF Image dicts, bytes, PIL images), one per image part of ``messages``
    # in their order; the parts themselves are bare ``{"type": "image"}``.
    images: tuple[Any, ...] = ()
    # The row's tools column (the functions' JSON schemas), passed to the chat template as ``tools=``.
    tools: list[dict[str, Any]] | None = None

    @property
    def is_chat(self) -> bool:
        """True when the example is rendered with a chat template."""
        return self.messages is not None

    @property
    def uses_tools(self) -> bool:
        """True for a tool-call row: it has tools, a tool call or a tool's answer."""
        return uses_tools(self.messages, self.tools)

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


def normalize(row: dict[str, Any], fmt: str, image_column: str | None = None) -> Example:
    """The `Example` of one dataset ``row`` in format ``fmt``; raises BadRow when the row is unusable.

    ``image_column`` (data.image_column) names the column of the row's images; by default ``images``, else
    ``image``.
    """
    example = _normalize(row, fmt)
    images = row_images(row, image_column)
    if not images and not (example.is_chat and _has_image_parts(cast(list, example.messages))):
        return example
    if not example.is_chat:
        raise BadRow(f"it has images, but {fmt} rows are plain text; images go with conversations "
                     "(messages, or prompt/completion message lists)")
    return _with_images(example, images)


def _normalize(row: dict[str, Any], fmt: str) -> Example:
    example = _shape(row, fmt)
    if not example.is_chat:
        return example
    check_tool_order(cast(list, example.messages), {"messages": "messages", "sharegpt": "conversations"}.get(
        fmt, "prompt + completion"))
    tools = row_tools(row)
    return replace(example, tools=tools) if tools else example


def _shape(row: dict[str, Any], fmt: str) -> Example:
    if fmt == "text":
        return Example(text=_text(row, "text"))
    if fmt == "prompt_completion":
        return _prompt_completion(row)
    if fmt == "messages":
        return Example(messages=_conversation(_field(row, "messages"), "messages", parts=True))
    if fmt == "alpaca":
        return _alpaca(row)
    if fmt == "sharegpt":
        return Example(messages=_conversation(_field(row, "conversations"), "conversations", parts=True))
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
        p = parse_messages(prompt, "prompt", parts=True)
        c = parse_messages(completion, "completion", parts=True)
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


def _conversation(value: Any, name: str, parts: bool = False) -> list[dict[str, Any]]:
    messages = parse_messages(value, name, parts)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"field '{name}' has no assistant turn (nothing to train on)")
    return messages


def parse_messages(value: Any, name: str, parts: bool = False) -> list[dict[str, Any]]:
    """A list of {role, content} (plus ``reasoning_content`` where an assistant turn has it) from OpenAI-style
    ({role, content}) or ShareGPT-style ({from, value}) turns; raises BadRow naming the field and turn.

    With ``parts``, a content may also be a list of text and image parts (see the module docstring)."""
    if not isinstance(value, list):
        raise BadRow(f"field '{name}' is not a list of messages ({type(value).__name__})")
    if not value:
        raise BadRow(f"field '{name}' is empty")
    return [_message(m, name, i, parts) for i, m in enumerate(value)]


def _message(m: Any, name: str, i: int, parts: bool = False) -> dict[str, Any]:
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
    if role == "tool":
        return tool_message(m, content, where)
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise BadRow(f"{where} ({role}) has tool_calls; only assistant turns call tools")
    if calls is not None:
        calls = parse_tool_calls(calls, where)
        content = "" if content is None else content  # OpenAI writes a call's content as null
    if parts and _is_part_list(content):
        content = _parts(cast(list, content), f"{where} ({role})")
    elif not isinstance(content, str):
        what = "missing" if content is None else f"not text ({type(content).__name__})"
        raise BadRow(f"{where} ({role}) content is {what}")
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise BadRow(f"{where} ({role}) reasoning_content is not text ({type(reasoning).__name__})")
    # An empty system prompt is a real choice (it replaces a template's default); an empty turn is not
    # (an assistant turn may be all reasoning: the template renders it).
    if role not in ("system", "developer") and not _said(content) and not (reasoning and reasoning.strip()) \
            and not calls:
        raise BadRow(f"{where} ({role}) content is empty")
    out: dict[str, Any] = {"role": role, "content": content}
    if reasoning is not None:  # a reasoning trace (Qwen3, DeepSeek-R1): the template decides what it renders
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out


# ---- conversations with images (TRL's vision rows) ----------------------------------------------------------


def _is_part_list(content: Any) -> bool:
    """Whether ``content`` is a non-empty list of typed parts (a list of strings stays "not text")."""
    return isinstance(content, list) and bool(content) and all(isinstance(p, dict) and "type" in p for p in content)


def _parts(content: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The content parts, checked: text parts keep their text, image parts their inline image if any."""
    out = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in PART_TYPES:
            raise BadRow(f"{where} content part {j} has the type {kind!r}; use one of: {', '.join(PART_TYPES)}")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise BadRow(f"{where} content part {j} (text) has no 'text' string")
            out.append({"type": "text", "text": part["text"]})
        else:  # Arrow gives every part all keys of the column: an image part's unused 'text' is None
            inline = part.get("image")
            out.append({"type": "image"} if inline is None else {"type": "image", "image": inline})
    return out


def _said(content: str | list[dict[str, Any]]) -> bool:
    """Whether a content says anything: non-blank text, or an image."""
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] == "image" or p["text"].strip() for p in content)


def _has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"]) for m in messages)


def row_images(row: dict[str, Any], column: str | None = None) -> list[Any]:
    """The images of ``row``: its ``column`` (data.image_column), else ``images``, else ``image`` (one image);
    None and [] mean none."""
    names = (column,) if column else IMAGE_COLUMNS
    for name in names:
        value = row.get(name)
        if value is None:
            continue
        if name == "image" and not column:
            return [value]
        return list(value) if isinstance(value, list | tuple) else [value]
    return []


def multimodal_messages(messages: list[dict[str, Any]], n_images: int) -> list[dict[str, Any]]:
    """``messages`` with every string content made one text part and, in the first user turn whose content is
    a string, ``n_images`` image parts put before its text: TRL's ``prepare_multimodal_messages``
    (trl/data_utils.py). Raises BadRow, in TRL's words, when the image parts without an inline image are not
    ``n_images``."""
    out, placed = [], False
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            text = [{"type": "text", "text": content}]
            if m["role"] == "user" and not placed:
                placed = True
                m = {**m, "content": [{"type": "image"} for _ in range(n_images)] + text}
            else:
                m = {**m, "content": text}
        out.append(m)
    slots = sum(1 for m in out for p in m["content"] if p["type"] == "image" and "image" not in p)
    if slots != n_images:
        raise BadRow(f"Number of images provided ({n_images}) does not match number of image placeholders ({slots})")
    return out


def _with_images(example: Example, images: list[Any]) -> Example:
    """The conversation ``example`` in parts form with its images, in the order of its image parts (a part's
    inline image, else the next of ``images``); the parts are left bare (``{"type": "image"}``)."""
    bare, ordered = _placed(cast(list, example.messages), images)
    if isinstance(example.prompt, list):
        k = len(example.prompt)
        return replace(example, messages=bare, prompt=bare[:k], completion=bare[k:], images=ordered)
    return replace(example, messages=bare, images=ordered)


def _placed(messages: list[dict[str, Any]], images: list[Any]) -> tuple[list[dict[str, Any]], tuple[Any, ...]]:
    """(``messages`` in parts form with bare image parts, their images in the order of the parts): a part's inline
    image, else the next of ``images`` (:func:`multimodal_messages` places them)."""
    messages = multimodal_messages(messages, len(images))
    queue, ordered = iter(images), []
    for m in messages:
        for p in m["content"]:
            if p["type"] == "image":
                ordered.append(p["image"] if "image" in p else next(queue))
    bare = [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            for m in messages]
    return bare, tuple(ordered)


def prompt_with_images(prompt: Any, images: list[Any], name: str) -> tuple[list[dict[str, Any]], tuple[Any, ...]]:
    """A prompt (GRPO's: the start of a conversation, no assistant turn needed) of the field ``name`` with its row's
    ``images``: (its messages, checked, in parts form with bare image parts, the images in the order of their
    parts), TRL's placement (:func:`multimodal_messages`). Raises BadRow: a prompt that is not a list of
    messages (images go with conversational prompts), a bad turn or part, images that do not match the parts."""
    if not isinstance(prompt, list):
        what = "missing" if prompt is None else f"a {type(prompt).__name__}"
        raise BadRow(f"field '{name}' is {what}, and the row has images; images go with conversational prompts "
                     "(a list of messages whose content has {\"type\": \"image\"} parts)")
    return _placed(parse_messages(prompt, name, parts=True), images)
