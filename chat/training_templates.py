"""Training templates: a family's chat template made fit for episodes with tools, swapped in as TRL swaps its own.

An episode's tokens after a tool call are the template's rendering of the tools' answers, found as the difference
between a conversation rendered with and without them (grpo/episodes.py, TRL's ``_get_tool_suffix_ids``). That
needs a *prefix-preserving* template: appending messages must not change how the earlier ones render. Some
families' own templates are not: Qwen3's writes a ``<think>`` block only for assistant turns after the last user
turn, so the turn before a tool's answer renders differently once the answer follows it. TRL 1.16's GRPOTrainer
then trains under a training template of the family (``get_training_chat_template``), recognised by comparing the
tokenizer's template with the family's original, text for text. This module does the same with the project's own
templates (``chat/jinja/*_training.jinja``, adapted from TRL's patches; tests check them token for token against
TRL's): the originals are recognised by their SHA-256 (the same exact-text identity, without shipping them).

SFT's tool-call rows (chat/loss_masks.py) render under a family's training template too, as TRL 1.16's SFTTrainer
swaps one in for its assistant-only loss (:func:`for_tool_rows`): what trains is what its ``{% generation %}``
blocks hold, TRL's masks. That covers one more family, gpt-oss, whose own template serves tool episodes.

Covered for tool episodes: Qwen3 (whose own template re-renders earlier turns: TRL's swap) and DeepSeek-V3 (whose own template
cannot write a call's arguments as a mapping, the bug TRL's training template fixes; TRL 1.16's check passes it
on string arguments and its episodes then fail at the first call). The other families the zoo holds render tool
turns as prefixes with their own templates (Qwen2.5, Llama 3/3.1/3.2, gpt-oss, GLM-4.5, DeepSeek-R1-distill), so,
as with TRL, they train under them; Gemma 2/3's templates refuse a ``tool`` message, and so do their training
templates, so they cannot run tool episodes (TRL's check raises there too).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from chat.formats import BadRow
from chat.templates import ChatTemplate, render, template_text


@dataclass(frozen=True)
class TrainingTemplate:
    """A family's training template: the originals it replaces (SHA-256 of their exact text, as TRL compares
    them) and its file in ``chat/jinja/``."""

    family: str
    originals: tuple[str, ...]
    file: str
    episodes: bool = True  # whether tool episodes need it (its family's own template does not serve them)

    def source(self) -> str:
        """The template's Jinja text (package data)."""
        return resources.files("chat").joinpath("jinja", self.file).read_text(encoding="utf-8")


TRAINING_TEMPLATES = (
    # Qwen/Qwen3-* (TRL's chat_templates/qwen3.jinja)
    TrainingTemplate("Qwen3", ("a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",),
                     "qwen3_training.jinja"),
    # deepseek-ai/DeepSeek-V3 (TRL's chat_templates/deepseekv3.jinja)
    TrainingTemplate("DeepSeek-V3", ("563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64",),
                     "deepseekv3_training.jinja"),
    # openai/gpt-oss-20b and -120b (TRL's chat_templates/gptoss.jinja): its own is prefix-preserving, so tool
    # episodes keep it; SFT's tool-call rows train under this one's {% generation %} blocks
    TrainingTemplate("gpt-oss", ("a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",),
                     "gptoss_training.jinja", episodes=False),
)

COVERED = ", ".join(t.family for t in TRAINING_TEMPLATES if t.episodes)


def recognise(source: str) -> TrainingTemplate | None:
    """The training template whose family's original is exactly ``source`` (TRL's identity comparison)."""
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    return next((t for t in TRAINING_TEMPLATES if digest in t.originals), None)


def tool_turns_problem(tokenizer: Any, template: ChatTemplate, source: str) -> str | None:
    """Why ``source`` cannot serve tool episodes, or None when it can: TRL's ``is_chat_template_prefix_preserving``
    (a user turn and an assistant call, then the same with the tool's answer and the generation prompt: the first's
    ids must begin the second's), first with the call's arguments as a mapping (what episodes pass), then, where
    the template cannot render that, as a JSON string (TRL's fallback)."""

    def ids(messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        return tokenizer(render(tokenizer, messages, template, source, generation_prompt),
                         add_special_tokens=False)["input_ids"]

    def preserving(arguments: Any) -> bool:
        call = [{"type": "function", "function": {"name": "dummy", "arguments": arguments}}]
        said: list[dict[str, Any]] = [{"role": "user", "content": "dummy"},
                                      {"role": "assistant", "content": "", "tool_calls": call}]
        first, second = ids(said, False), ids(said + [{"role": "tool", "name": "dummy", "content": "dummy"}], True)
        return second[:len(first)] == first

    try:
        return None if preserving({}) else "re-renders earlier turns when a tool's answer follows"
    except BadRow:
        pass
    try:
        preserving("{}")
    except BadRow as bad:
        return f"cannot render a tool's answer ({bad})"
    return "cannot write a call's arguments as a mapping"


def for_tool_rows(tokenizer: Any, template: ChatTemplate) -> ChatTemplate:
    """The template SFT's tool-call rows render under: the family's training template when ``template`` is the
    family's original (TRL 1.16's SFTTrainer swaps in its training template so, for an assistant-only loss), with
    the run's template variables and day; else ``template`` itself."""
    family = recognise(template_text(tokenizer, template))
    if family is None:
        return template
    return replace(template, source=family.source(),
                   name=f"lmzoo's {family.family} training template (chat/jinja/{family.file})")


def for_tools(tokenizer: Any, template: ChatTemplate) -> tuple[ChatTemplate, str]:
    """The template tool episodes train under, and the log line that names it: ``template`` itself when it serves
    them (or is no family's original: grpo/episodes.py then says what is wrong), else its family's training
    template, with the run's template variables and day."""
    source = template_text(tokenizer, template)
    problem = tool_turns_problem(tokenizer, template, source)
    family = recognise(source) if problem else None
    if family is None or not family.episodes:
        return template, f"chat template: {template.name}"
    where = f"chat/jinja/{family.file}"
    swapped = replace(template, source=family.source(), name=f"lmzoo's {family.family} training template ({where})")
    return swapped, (f"chat template: {swapped.name}, prefix-preserving, in place of {template.name}: "
                     f"{family.family}'s own, which {problem} (as TRL's get_training_chat_template swaps)")
