"""Tool-call conversations and the tokenizers of five chat template families, for the tool-row tests
(tests/test_sft_tool_rows.py): SmolLM2's byte-level tokenizer with each family's special tokens, BOS and EOS, and
the family's real template (tests/data/chat_templates/, or TRL's copy of Qwen3's current one).

Where TRL 1.16 has no training template for a family (Llama 3.1, Mistral), TRL's SFT refuses an assistant-only
loss and asks for a template with ``{% generation %}`` markers: ``Family.marks`` are the edits that make one of the
real template, written here by hand (the assistant's text from after its header through its end-of-turn token,
as TRL's own llama3_training.jinja marks Llama 3's)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"

MISTRAL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[CALL_ID]", "[ARGS]", "[TOOL_CONTENT]"]


@dataclass(frozen=True)
class Family:
    """A real template, its tokenizer's BOS/EOS and special tokens, and (for TRL-less families) its marks."""

    template: Path
    bos: str | None
    eos: str
    special: list[str]
    marks: list[tuple[str, str]] = field(default_factory=list)  # (text of the template, with markers)
    developer: bool = False  # the template writes a developer message


_LLAMA_SAY = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
              "+ '<|eot_id|>' }}")
_LLAMA_CALL = "{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
_LLAMA_ARGS = "{{- tool_call.arguments | tojson }}\n            {{- \"}\" }}"
_LLAMA_EOT = "{%- else %}\n            {{- \"<|eot_id|>\" }}"
_V03_CALLS = "{{- \"[TOOL_CALLS] [\" }}"
_V03_END = "        {%- endfor %}\n    {%- elif message[\"role\"] == \"assistant\" %}"
_V03_SAY = "{{- \" \" + content|trim + eos_token }}"
_SMALL_OPEN = "{%- elif message['role'] == 'assistant' %}"
_SMALL_CLOSE = "{%- elif message['role'] == 'tool_results' or message['role'] == 'tool' %}"
G, E = "{%- generation %}", "{%- endgeneration %}"

FAMILIES = {
    "qwen3": Family(TRL_TEMPLATES / "qwen3.jinja", None, "<|im_end|>",
                    ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "gpt-oss": Family(TEMPLATES / "gpt-oss.jinja", None, "<|return|>",
                      ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|constrain|>"],
                      developer=True),
    "llama-3.1": Family(TEMPLATES / "llama-3.1.jinja", "<|begin_of_text|>", "<|eot_id|>",
                        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
                        [(_LLAMA_SAY, "{%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant"
                                      "<|end_header_id|>\\n\\n' }}" + G + "{{- message['content'] | trim + "
                                      "'<|eot_id|>' }}" + E + "{%- else %}" + _LLAMA_SAY + "{%- endif %}"),
                         (_LLAMA_CALL, G + _LLAMA_CALL), (_LLAMA_ARGS, _LLAMA_ARGS + E),
                         (_LLAMA_EOT, "{%- else %}" + G + "{{- \"<|eot_id|>\" }}" + E)], developer=True),
    "mistral-v0.3": Family(TEMPLATES / "mistral-v0.3.jinja", "<s>", "</s>", MISTRAL,
                           [(_V03_CALLS, G + _V03_CALLS), (_V03_END, _V03_END.replace("    {%- elif", E + "{%- elif")),
                            (_V03_SAY, G + _V03_SAY + E)]),
    "mistral-small-3.2": Family(TEMPLATES / "mistral-small-3.2.jinja", "<s>", "</s>", MISTRAL,
                                [(_SMALL_OPEN, _SMALL_OPEN + G), (_SMALL_CLOSE, E + _SMALL_CLOSE)]),
}


def marked_template(name: str) -> str:
    """The family's real template with its generation markers (``Family.marks``: each edit applies exactly once)."""
    text = FAMILIES[name].template.read_text(encoding="utf-8")
    for old, new in FAMILIES[name].marks:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    return text


def family_tokenizer(folder: Path, name: str) -> Any:
    """SmolLM2's tokenizer (``folder``) with the family's special tokens, BOS, EOS and real template."""
    from transformers import AutoTokenizer

    family = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(str(folder))
    specials = family.special + [t for t in (family.bos, family.eos) if t]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.eos_token = family.eos
    if family.bos:
        tok.bos_token = family.bos
    tok.chat_template = family.template.read_text(encoding="utf-8")
    return tok


CALC = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "Numbers with + - * / and parentheses."}}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city."}}}}}


def call(name: str, n: int, **arguments: Any) -> dict[str, Any]:
    """One tool call (its id nine characters, as Mistral's templates need)."""
    return {"type": "function", "id": f"call{n:05d}", "function": {"name": name, "arguments": arguments}}


def answer(name: str, n: int, content: str) -> dict[str, Any]:
    """A tool's answer to call ``n``."""
    return {"role": "tool", "name": name, "tool_call_id": f"call{n:05d}", "content": content}


def tool_rows(developer: bool) -> list[dict[str, Any]]:
    """Tool-call rows (TRL's shape): a call, its answer and the final answer; a call with words before it, two
    user turns and two tools; with ``developer``, a developer turn first. Tool outputs hold 'Toolsaid'."""
    first = {"role": "developer", "content": "Answer with numbers only."} if developer else \
        {"role": "system", "content": "Answer with numbers only."}
    return [
        {"messages": [first, {"role": "user", "content": "What is 37 * 48?"},
                      {"role": "assistant", "content": "", "tool_calls": [call("calculate", 1, expression="37 * 48")]},
                      answer("calculate", 1, "Toolsaid 1776"), {"role": "assistant", "content": "1776"}],
         "tools": [CALC]},
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "Let me look.",
                       "tool_calls": [call("get_weather", 2, city="Paris")]},
                      answer("get_weather", 2, "Toolsaid sunny"), {"role": "assistant", "content": "Sunny."},
                      {"role": "user", "content": "And 12 + 30?"},
                      {"role": "assistant", "content": "", "tool_calls": [call("calculate", 3, expression="12 + 30")]},
                      answer("calculate", 3, "Toolsaid 42"), {"role": "assistant", "content": "42"}],
         "tools": [WEATHER, CALC]},
    ]


def with_string_arguments(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every call's arguments written as a JSON string and its tools as a JSON string."""
    def turn(m: dict[str, Any]) -> dict[str, Any]:
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                 for c in m.get("tool_calls", [])]
        return {**m, "tool_calls": calls} if calls else m
    return {"messages": [turn(m) for m in row["messages"]], "tools": json.dumps(row["tools"])}
