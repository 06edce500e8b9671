"""The chat data keys (``data.chat_template``, ``data.template_kwargs``, ``data.template_date``) of every task that
renders conversations, and the run's :class:`chat.templates.ChatTemplate` made from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from chat.templates import ChatTemplate, parse_date
from pretrain.config import DataSection, TrainConfig
from zoo.errors import UserError


@dataclass
class ChatDataSection(DataSection):
    """Data keys of a task that renders conversations with a chat template (SFT, DPO, reward models, GRPO)."""

    chat_template: str | None = None  # a Jinja chat-template file; None: the tokenizer's own template
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables (enable_thinking...)
    template_date: str = "2024-07-26"  # the day a template's strftime_now reads (renders never vary)

    def check(self) -> None:
        """The data keys' checks, and the template variables a mapping."""
        super().check()
        if not isinstance(self.template_kwargs, dict):
            raise UserError(f"data.template_kwargs must be a mapping of template variables (e.g. "
                            f"{{enable_thinking: false}}), got {self.template_kwargs!r}")


def chat_template_of(cfg: TrainConfig) -> ChatTemplate:
    """The run's chat template: the Jinja file ``data.chat_template`` (None: the tokenizer's own), its variables
    (``data.template_kwargs``) and the fixed day its ``strftime_now`` reads (``data.template_date``)."""
    d = cast(ChatDataSection, cfg.data)  # every chat task's data section is one
    parse_date(d.template_date)  # a bad date is a config error before any row is read
    if d.chat_template is None:
        return ChatTemplate(kwargs=dict(d.template_kwargs), date=d.template_date)
    p = Path(d.chat_template).expanduser()
    if not p.is_file():
        raise UserError(f"data.chat_template {d.chat_template}: no such file (give a Jinja chat-template file)")
    return ChatTemplate(source=p.read_text(), kwargs=dict(d.template_kwargs), date=d.template_date,
                        name=f"data.chat_template {d.chat_template}")
