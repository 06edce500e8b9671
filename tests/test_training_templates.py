"""The families' training templates (chat/training_templates.py) against TRL 1.16's: the same renders, ids and
assistant masks on the same conversations, the same originals recognised, and the same choice of template for tool
episodes; the errors where no family's template serves them.

The original templates are TRL's own copies (``trl/chat_templates/*.jinja``, the test oracle); each tokenizer is
SmolLM2's with the family's special tokens added and its BOS/EOS set, so that a template's special tokens are single
ids as in the family's own tokenizer."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"
ROOT = Path(__file__).resolve().parent.parent

# TRL's name of each family's original template: (BOS, EOS) of its tokenizer.
FAMILIES = {"qwen3": (None, "<|im_end|>"), "qwen2_5": (None, "<|im_end|>"),
            "llama3": ("<|begin_of_text|>", "<|eot_id|>"), "llama3_1": ("<|begin_of_text|>", "<|eot_id|>"),
            "llama3_2": ("<|begin_of_text|>", "<|eot_id|>"), "gptoss": (None, "<|return|>"),
            "glm4moe": (None, "<|endoftext|>"),
            "deepseekv3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
            "deepseek_r1_distill": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
            "gemma": ("<bos>", "<end_of_turn>"), "gemma3": ("<bos>", "<end_of_turn>")}
_SPECIAL = re.compile(r"<\|[a-z_]+\|>|<｜[^｜]+｜>|<start_of_turn>|<end_of_turn>|<bos>|\[gMASK\]|<sop>")


def original(name: str) -> str:
    return (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def family_tokenizer(smollm2_tokenizer, name: str):
    """SmolLM2's tokenizer carrying TRL's copy of the family's original template, with the family's special tokens
    (those its original and training templates write) and its BOS and EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    training = TRL_TEMPLATES / f"{name}_training.jinja"
    text = original(name) + (training.read_text(encoding="utf-8") if training.is_file() else "")
    bos, eos = FAMILIES[name]
    specials = set(_SPECIAL.findall(text)) | {t for t in (bos, eos) if t}
    tok.add_special_tokens({"additional_special_tokens": sorted(specials)})
    tok.eos_token = eos
    if bos:
        tok.bos_token = bos
    tok.chat_template = original(name)
    return tok


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the weather in a city.

    Args:
        city: The city.
        unit: celsius or fahrenheit.
    """
    return "sunny"


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = [
    # a call, its answer, the final answer
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", city="Paris")]},
     {"role": "tool", "name": "get_weather", "content": "sunny"},
     {"role": "assistant", "content": "It is sunny."}],
    # a system prompt, two calls in one turn, two answers, a second user turn
    [SYSTEM, {"role": "user", "content": "Paris and Rome?"},
     {"role": "assistant", "content": "Checking both.",
      "tool_calls": [_call("get_weather", city="Paris"), _call("get_weather", city="Rome", unit="fahrenheit")]},
     {"role": "tool", "name": "get_weather", "content": "sunny"},
     {"role": "tool", "name": "get_weather", "content": "rain"},
     {"role": "assistant", "content": "Paris sunny, Rome rain."},
     {"role": "user", "content": "Thanks. And Oslo?"},
     {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", city="Oslo")]}],
    # thinking: reasoning_content, a <think> block in the content, and turns before the last user turn
    [SYSTEM, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
     {"role": "user", "content": "Times 3?"},
     {"role": "assistant", "content": "<think>\n4 times 3.\n</think>\n\n12"},
     {"role": "user", "content": "Check with a tool."},
     {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [_call("get_weather", city="x")]},
     {"role": "tool", "name": "get_weather", "content": "12"}],
    # multi-turn without tools
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}],
]


@pytest.mark.parametrize("family,name", [("qwen3", "Qwen3"), ("deepseekv3", "DeepSeek-V3"), ("gptoss", "gpt-oss")])
def test_each_training_template_renders_as_trls_token_for_token(smollm2_tokenizer, family, name):
    """Ours and TRL's training template of the family, on the same conversations (calls, answers, several turns,
    system prompts, Qwen3's thinking), with and without tools and the generation prompt: the same ids and the same
    assistant masks (their {% generation %} blocks); and TRL's get_training_chat_template picks it for the
    family's original."""
    from trl.chat_template_utils import get_training_chat_template

    from chat.training_templates import recognise

    tok = family_tokenizer(smollm2_tokenizer, family)
    ours = recognise(original(family))
    assert ours is not None and ours.family == name
    theirs = get_training_chat_template(tok)
    assert theirs == (TRL_TEMPLATES / f"{family}_training.jinja").read_text(encoding="utf-8")
    compared = 0
    for conv in CONVERSATIONS:
        for n in range(2, len(conv) + 1):
            for kw in ({}, {"tools": [get_weather]}, {"enable_thinking": False}):
                for gen in (False, True):
                    a, b = (tok.apply_chat_template(conv[:n], chat_template=t, add_generation_prompt=gen,
                                                    tokenize=True, return_dict=True,
                                                    return_assistant_tokens_mask=True, **kw)
                            for t in (ours.source(), theirs))
                    assert a["input_ids"] == b["input_ids"], (conv[:n], kw, gen)
                    assert a["assistant_masks"] == b["assistant_masks"], (conv[:n], kw, gen)
                    compared += 1
    assert compared == 2 * 3 * sum(len(c) - 1 for c in CONVERSATIONS)


def test_only_the_exact_originals_are_recognised():
    """TRL compares the template's text exactly: each covered original is recognised, a one-character edit of it
    and every other template TRL ships (the training templates included) are not."""
    from chat.training_templates import TRAINING_TEMPLATES, recognise

    covered = {"qwen3": "Qwen3", "deepseekv3": "DeepSeek-V3", "gptoss": "gpt-oss"}
    assert [t.family for t in TRAINING_TEMPLATES] == list(covered.values())
    for path in sorted(TRL_TEMPLATES.glob("*.jinja")):
        found = recognise(path.read_text(encoding="utf-8"))
        assert (found.family if found else None) == covered.get(path.stem), path.name
    assert recognise(original("qwen3") + "\n") is None
    assert recognise(original("qwen3").replace("<think>", "<think >", 1)) is None


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.startswith("gemma")])
def test_tool_episodes_train_under_the_template_trl_picks(smollm2_tokenizer, family):
    """The zoo's families with tools: the family's own template where TRL's is_chat_template_prefix_preserving
    keeps it (Qwen2.5, Llama 3/3.1/3.2, gpt-oss, GLM-4.5, DeepSeek-R1-distill), its training template where TRL
    swaps (Qwen3); DeepSeek-V3's own cannot write the dict arguments episodes pass (TRL's check passes it on a
    string, then its episodes fail), so it trains under its training template. Either way a tool's answer is a
    continuation of the turn before it."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    from chat.templates import ChatTemplate, render
    from chat.training_templates import for_tools
    from grpo.episodes import tool_suffix

    tok = family_tokenizer(smollm2_tokenizer, family)
    chosen, line = for_tools(tok, ChatTemplate())
    swapped = chosen.source is not None
    assert swapped == (family == "deepseekv3" or not is_chat_template_prefix_preserving(tok)), family
    assert swapped == (family in ("qwen3", "deepseekv3")), family
    assert line.startswith("chat template: ") and ("training template" in line) == swapped
    source = chosen.source or tok.chat_template
    suffix = tool_suffix(tok, lambda m, g: render(tok, m, chosen, source, g), (tok.eos_token_id,))
    answer = suffix({"role": "assistant", "content": "", "tool_calls": [_call("get_weather", city="Paris")]},
                    [{"role": "tool", "name": "get_weather", "content": "sunny", "tool_call_id": "call00001"}])
    assert "sunny" in tok.decode(answer)


@pytest.mark.parametrize("family", ["gemma", "gemma3", "edited_qwen3"])
def test_templates_no_family_fixes_are_one_line_errors_naming_the_way_out(smollm2_tokenizer, family):
    """Gemma's templates refuse a tool message (TRL's check raises there too); an edited Qwen3 template is no
    family's original, so it is kept and re-renders earlier turns: both are refused when the agent is prepared,
    before step 1, in one line naming the covered families and data.chat_template."""
    from chat.templates import ChatTemplate
    from grpo.agentic import Agent
    from grpo.config import GRPOConfig
    from zoo.errors import UserError

    tok = family_tokenizer(smollm2_tokenizer, "qwen3" if family == "edited_qwen3" else family)
    if family == "edited_qwen3":
        tok.chat_template = original("qwen3").replace("<think>", "<think >")
    cfg = GRPOConfig()
    cfg.grpo.tool_parser = "hermes"  # Gemma's templates name no call format
    agent = Agent(cfg, [], None)
    with pytest.raises(UserError) as e:
        agent.prepare(tok, ChatTemplate(), None, (tok.eos_token_id,), None, None)
    message = str(e.value)
    assert "\n" not in message and "Qwen3, DeepSeek-V3" in message and "data.chat_template" in message
    assert ("cannot render a tool's answer" if family.startswith("gemma") else "continuation of it") in message


def test_the_training_templates_are_package_data():
    """Every chat/jinja/*.jinja file is a training template's, and pyproject's package-data carries it (so an
    install from a wheel has it)."""
    from fnmatch import fnmatch

    from chat.training_templates import TRAINING_TEMPLATES

    files = sorted(p.name for p in (ROOT / "chat" / "jinja").glob("*.jinja"))
    assert files == sorted(t.file for t in TRAINING_TEMPLATES)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["chat"]
    assert all(any(fnmatch(f"jinja/{f}", p) for p in patterns) for f in files)
