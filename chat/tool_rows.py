"""Tool-call rows of chat data: an assistant turn's ``tool_calls``, ``tool`` messages and a row's ``tools`` column.

The shapes are TRL's (and OpenAI's): an assistant message may carry ``tool_calls``, a list of
``{"type": "function", "function": {"name": ..., "arguments": {...}}, "id": ...}`` (``arguments`` an object or a
JSON string; ``id`` optional, Mistral's templates need one), a ``tool`` message answers them (``content``, and
optionally ``name`` and ``tool_call_id``), and the row's ``tools`` column is the list of the functions' JSON
schemas (or that list as a JSON string), passed to the chat template as transformers' ``tools=``.

Arguments written as a JSON string are parsed, so that every template writes them as JSON (Llama 3.1's, Mistral's
and gpt-oss's ``tojson`` them, which would quote a string). A problem raises `BadRow` naming the turn or column:
arguments that are not a JSON object, a call with no name, a ``tool`` message with no call before it, a ``tools``
column that is not a list of objects.
"""

from __future__ import annotations

import json
from typing import Any

from chat.row_errors import BadRow

TOOL_COLUMN = "tools"


def parse_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """The checked ``tool_calls`` of the assistant message ``where``: each ``{"type": "function", "function":
    {"name", "arguments"}}`` (plus its ``id`` where it has one), arguments a mapping."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"{where} (assistant) tool_calls is not a non-empty list of calls")
    return [_call(c, f"{where} (assistant) tool call {j}") for j, c in enumerate(value)]


def _call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise BadRow(f"{where} is not an object ({type(call).__name__})")
    function = call.get("function") if call.get("function") is not None else call  # the flat {name, arguments}
    if not isinstance(function, dict):
        raise BadRow(f"{where} 'function' is not an object ({type(function).__name__})")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadRow(f"{where} has no function name")
    out: dict[str, Any] = {"type": "function", "function": {"name": name,
                                                            "arguments": _arguments(function.get("arguments"),
                                                                                    f"{where} ({name})")}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _arguments(value: Any, where: str) -> dict[str, Any]:
    """A call's arguments as a mapping: an object as it is, a JSON string decoded (it must hold an object)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow(f"{where} arguments are not JSON: {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise BadRow(f"{where} arguments are not a JSON object ({type(value).__name__})")
    return value


def tool_message(m: dict[str, Any], content: Any, where: str) -> dict[str, Any]:
    """A ``tool`` message: its text content, and its ``name`` / ``tool_call_id`` where given."""
    if not isinstance(content, str):
        what = "missing" if content is None else f"not text ({type(content).__name__})"
        raise BadRow(f"{where} (tool) content is {what}")
    out: dict[str, Any] = {"role": "tool", "content": content}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise BadRow(f"{where} (tool) {key} is not text ({type(m[key]).__name__})")
            out[key] = m[key]
    return out


def check_tool_order(messages: list[dict[str, Any]], name: str) -> None:
    """Every ``tool`` message follows an assistant turn with ``tool_calls`` (other tool messages between)."""
    calling = False
    for i, m in enumerate(messages):
        if m["role"] == "tool" and not calling:
            raise BadRow(f"{name}[{i}] (tool) has no tool call before it: a tool message answers the "
                               "tool_calls of the assistant turn just before it")
        calling = (m["role"] == "assistant" and bool(m.get("tool_calls"))) or (m["role"] == "tool" and calling)


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's ``tools`` column: a list of JSON schemas (objects), or that list as a JSON string (TRL decodes
    it so too); None when absent or empty."""
    value = row.get(TOOL_COLUMN)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRow(f"column '{TOOL_COLUMN}' is not JSON: {value[:80]!r}") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRow(f"column '{TOOL_COLUMN}' is not a list of tool schemas (JSON objects)")
    return value or None


def uses_tools(messages: list[dict[str, Any]] | None, tools: list[dict[str, Any]] | None) -> bool:
    """Whether a conversation is a tool-call row: it has tools, a call, or a tool's answer."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages or [])
