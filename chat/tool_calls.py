"""Tool calls read from a model's text, by its chat template family's convention.

A parser takes one assistant turn's decoded text (special tokens kept, the end-of-turn token removed) and returns
a :class:`ParsedTurn`: the text besides the calls, the calls (name and a dict of arguments), and, for a call that
is there but cannot be read, an error that goes back to the model as the tool's answer (TRL 1.16 does the same
with a call it cannot run: ``{"error": ...}``) and is counted as a failure. Each parser inverts what its family's
own chat template renders for an assistant message with ``tool_calls``, which the tests check against the real
templates (tests/data/chat_templates/):

- ``hermes`` (Qwen 2.5, Qwen 3, Hermes, SmolLM3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the whole message is ``{"name": ..., "parameters": {...}}``, after an
  optional ``<|python_tag|>``;
- ``mistral`` (Mistral 7B v0.3, Nemo): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]``;
- ``mistral_args`` (Mistral Small 3.2 and the v11 tokenizers): ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``, one
  such run per call (``[CALL_ID]id`` optional).

:func:`parser_for` picks one from the chat template's source (``grpo.tool_parser: auto``; `zoo serve`'s answers),
or takes a name, or ``path/to/file.py:function`` / ``module:function`` for another convention: a function of the
text that returns a :class:`ParsedTurn`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UserError


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None  # the call's id where the model wrote one (Mistral's), echoed in the tool's answer


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn read: ``content`` (its text besides the calls), ``calls``, and ``errors``: one message
    per call that is there but malformed (each answered to the model as a failed call)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


Parser = Callable[[str], ParsedTurn]


def _call_of(obj: Any, args_key: str = "arguments") -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or the error that says why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object with \"name\" and \"{args_key}\", got {json.dumps(obj)[:200]}"
    name = obj.get("name")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some templates and models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return f"the arguments of tool call {name!r} are not JSON: {args[:200]}"
    if not isinstance(name, str) or not name:
        return f"a tool call needs a \"name\" string, got {json.dumps(obj)[:200]}"
    if not isinstance(args, dict):
        return f"the arguments of tool call {name!r} must be a JSON object, got {json.dumps(args)[:200]}"
    call_id = obj.get("id")
    return ToolCall(name, args, call_id if isinstance(call_id, str) and call_id else None)


def _add(out: ParsedTurn, found: ToolCall | str) -> None:
    if isinstance(found, ToolCall):
        out.calls.append(found)
    else:
        out.errors.append(found)


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except ValueError as e:
        return None, f"the tool call is not valid JSON ({e}): {text[:200]}"


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def hermes(text: str) -> ParsedTurn:
    """Qwen/Hermes: each ``<tool_call>JSON</tool_call>`` block is a call (an unclosed last block is read too)."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(text.strip())
    out = ParsedTurn(text[:start].strip())
    for body in _HERMES.findall(text[start:]):
        obj, err = _loads(body.strip())
        _add(out, err if err else _call_of(obj))
    return out


def llama3_json(text: str) -> ParsedTurn:
    """Llama 3.x: the message is one JSON object ``{"name", "parameters"}`` (or a list of them, or several
    separated by ``;``), after an optional ``<|python_tag|>``; a message that is not JSON is plain content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith(("{", "[")):
        return ParsedTurn(text.strip())
    obj, err = _loads(body)
    if err is not None and ";" in body:  # `{...}; {...}`: several calls
        parts = [_loads(p.strip()) for p in body.split(";") if p.strip()]
        if all(e is None for _, e in parts):
            obj, err = [o for o, _ in parts], None
    if err is not None:
        # A message that opens like a call but is not JSON: malformed only if it names a function
        return ParsedTurn("", [], [err]) if '"name"' in body else ParsedTurn(text.strip())
    out = ParsedTurn("")
    for o in obj if isinstance(obj, list) else [obj]:
        if isinstance(o, dict) and "name" not in o:
            return ParsedTurn(text.strip())  # a JSON answer, not a call
        _add(out, _call_of(o, "parameters"))
    return out


def mistral(text: str) -> ParsedTurn:
    """Mistral v0.3 / Nemo: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedTurn(text.strip())
    out = ParsedTurn(text[:start].strip())
    obj, err = _loads(text[start + len("[TOOL_CALLS]"):].strip())
    if err is not None:
        out.errors.append(err)
        return out
    for o in obj if isinstance(obj, list) else [obj]:
        _add(out, _call_of(o))
    return out


_ARGS_CALL = re.compile(r"\[TOOL_CALLS\]([^\[]*?)(?:\[CALL_ID\]([^\[]*?))?\[ARGS\]")


def mistral_args(text: str) -> ParsedTurn:
    """Mistral Small 3.2 (v11 tokenizers): ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{json}`` per call."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedTurn(text.strip())
    out = ParsedTurn(text[:start].strip())
    rest = text[start:]
    matches = list(_ARGS_CALL.finditer(rest))
    if not matches:
        out.errors.append(f"a [TOOL_CALLS] without its name[ARGS]{{arguments}}: {rest[:200]}")
        return out
    for k, m in enumerate(matches):
        end = matches[k + 1].start() if k + 1 < len(matches) else len(rest)
        name = m.group(1).strip()
        obj, err = _loads(rest[m.end():end].strip())
        if err is not None:
            out.errors.append(err)
        else:
            _add(out, _call_of({"name": name, "arguments": obj, "id": (m.group(2) or "").strip()}))
    return out


PARSERS: dict[str, Parser] = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral,
                              "mistral_args": mistral_args}


def detect(template: str) -> str | None:
    """The parser a chat template's source implies (its own rendering of ``tool_calls``), or None."""
    if "<tool_call>" in template:
        return "hermes"
    if "[ARGS]" in template:
        return "mistral_args"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "tool_calls" in template and '"parameters"' in template:
        return "llama3_json"
    return None


def parser_for(setting: str, template: str, load: Callable[[str, str], Callable] | None = None,
               where: str = "grpo.tool_parser") -> Parser:
    """The parser a setting names (``where``: the setting, for its errors): ``auto`` (from the chat template's
    source), a name of :data:`PARSERS`, or ``module:function`` / ``path/to/file.py:function``, which ``load``
    imports (grpo passes :func:`grpo.rewards.load_callable`; without it such a setting is refused). One-line
    UserErrors."""
    if setting == "auto":
        name = detect(template)
        if name is None:
            raise UserError(f"{where} auto: the chat template renders no tool calls this version can read "
                            f"(none of {', '.join(PARSERS)}); use a model whose template supports tools, or set "
                            f"{where} to one of them or to path/to/file.py:function")
        return PARSERS[name]
    if setting in PARSERS:
        return PARSERS[setting]
    if ":" not in setting or load is None:
        raise UserError(f"{where} {setting!r}: choose auto, one of {', '.join(PARSERS)}"
                        + (", or path/to/file.py:function" if load is not None else ""))
    return load(setting, f"{where} {setting!r}")
