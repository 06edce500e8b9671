"""Chat requests: ``messages`` (and ``tools``) checked and rendered with the model's chat template into prompt
ids; an answer read for tool calls with its family's parser (:mod:`chat.tool_calls`) into OpenAI's message.

Messages arrive in OpenAI's shape, where a call's ``arguments`` is a JSON string; the families' templates render
``arguments`` as a mapping (as transformers and TRL pass them), so they are decoded first.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from chat.formats import BadRow
from chat.templates import ChatTemplate, render
from chat.tool_calls import ParsedTurn, Parser
from serve.errors import bad

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})


def _content(value: Any, where: str) -> str | None:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are served", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where} must be a string, null or a list of text parts", where)


def _calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each ``arguments`` decoded into a mapping."""
    if not isinstance(value, list):
        raise bad(f"{where} must be a list", where)
    out = []
    for k, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                      where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"{where}[{k}].function.arguments is not JSON", where) from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{k}].function.arguments must be a JSON object", where)
        out.append({"type": "function", **({"id": call["id"]} if isinstance(call.get("id"), str) else {}),
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def messages_of(value: Any) -> list[dict[str, Any]]:
    """The request's ``messages``, checked, as the chat template reads them."""
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"{where} must be an object with a role of {', '.join(ROLES)}", where)
        extra = set(m) - _MESSAGE_FIELDS
        if extra:
            raise bad(f"{where}: unknown field {sorted(extra)[0]!r}", f"{where}.{sorted(extra)[0]}",
                      "unknown_parameter")
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                               "content": _content(m.get("content"), f"{where}.content") or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = _calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def tools_of(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's ``tools`` (function schemas the template describes to the model), None for none or for
    ``tool_choice`` "none"; a choice this server cannot force (``required``, a named function) is a 400."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad('tool_choice must be "auto" or "none" (this server cannot force a call)', "tool_choice",
                  "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad('response_format: only {"type": "text"} is served', "response_format", "unsupported_parameter")
    if tools is None or choice == "none":
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                  "tools")
    return tools or None


def prompt_ids(tokenizer: Any, template: str | None, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> list[int]:
    """The token ids of ``messages`` under the chat template, ready for the assistant's reply (as
    ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)`` gives them)."""
    if not template:
        raise bad("this model's tokenizer has no chat template; use /v1/completions", "messages", "no_chat_template")
    try:
        text = render(tokenizer, messages, ChatTemplate(), template, True, tools)
    except BadRow as e:  # the template refused the conversation (roles out of order, ...)
        raise bad(f"messages: {e}", "messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tool_message(parsed: ParsedTurn) -> dict[str, Any] | None:
    """OpenAI's assistant message for a turn the parser read calls in (None where it read none)."""
    if not parsed.calls:
        return None
    calls = [{"id": c.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}


def answer(text: str, raw: str, parser: Parser | None, tools: bool) -> tuple[dict[str, Any], bool]:
    """(the assistant's message, whether it calls tools): with ``tools`` given, the answer with its special tokens
    (``raw``) read by the family's ``parser``; otherwise, or when it holds no call, the ``text``."""
    if tools and parser is not None:
        message = tool_message(parser(raw))
        if message is not None:
            return message, True
    return {"role": "assistant", "content": text}, False
