"""Chat requests: ``messages`` (and ``tools``) checked and rendered with the model's chat template into prompt
ids; an answer read for tool calls with its family's parser (:mod:`chat.tool_calls`) into OpenAI's message.

Messages arrive in OpenAI's shape, where a call's ``arguments`` is a JSON string; the families' templates render
``arguments`` as a mapping (as transformers and TRL pass them), so they are decoded first.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from pathlib import Path
from typing import Any

from chat.formats import BadRow
from chat.templates import ChatTemplate, render
from chat.tool_calls import ParsedTurn, Parser
from serve.errors import bad

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})


def _content(value: Any, where: str, images: list[bytes] | None) -> str | list[dict[str, str]] | None:
    """A message's content: a string, null, or a list of text parts (joined); with ``images`` (a model that reads
    them) image parts too: then the parts as the chat template reads them (``{"type": "image"}`` where each
    image goes), the images' bytes appended to ``images``."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where} must be a string, null or a list of content parts", where)
    parts: list[dict[str, str]] = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and images is not None:
            images.append(_image_bytes(part.get("image_url"), f"{where}[{k}].image_url"))
            parts.append({"type": "image"})
        elif kind == "image_url":
            raise bad(f"{where}[{k}]: this model reads no images (a text model, or its processor files are missing)",
                      f"{where}[{k}]", "unsupported_parameter")
        else:
            raise bad(f"{where}[{k}]: only text and image_url parts are served", f"{where}[{k}]")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _image_bytes(value: Any, where: str) -> bytes:
    """An ``image_url`` part's image: a ``data:`` URL's base64 bytes (the server fetches no URL and reads no file)."""
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str):
        raise bad(f'{where} must be {{"url": "data:image/png;base64,..."}}', where)
    head, sep, data = url.partition(",")
    if not (head.startswith("data:") and head.endswith(";base64") and sep):
        raise bad(f"{where}: give the image inline as a data: URL (data:image/png;base64,...); this server fetches "
                  "no URL", where, "unsupported_parameter")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{where}: the data: URL is not valid base64", where) from None


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


def messages_of(value: Any, images: list[bytes] | None = None) -> list[dict[str, Any]]:
    """The request's ``messages``, checked, as the chat template reads them; with ``images`` (a model that reads
    them), image parts are taken, their bytes appended to it in order."""
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
                               "content": _content(m.get("content"), f"{where}.content", images) or ""}
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


def image_prompt(expander: Any, vision: Any, tokenizer: Any, messages: list[dict[str, Any]], images: list[bytes],
                 tools: list[dict[str, Any]] | None) -> tuple[list[int], list[dict[str, Any]]]:
    """(token ids, the images' frames as the engine takes them) of ``messages`` holding image parts: under the chat
    template with each image expanded as the model's processor does (:meth:`chat.images.ImageExpander.chat_prompt`,
    `zoo generate --image`'s expansion), tokenized as the processor tokenizes. An unreadable image is a 400."""
    if tools:
        raise bad("tools with images are not served yet: send the images without tools", "tools",
                  "unsupported_parameter")
    try:
        # Bytes only (never a path): no base folder is ever read.
        text, processed = expander.chat_prompt(tokenizer, messages, images, Path("/nonexistent"))
    except BadRow as e:
        raise bad(f"messages: {e}", "messages") from None
    return list(tokenizer(text)["input_ids"]), [f for p in processed for f in p.patches(vision)]


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
