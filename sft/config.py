"""SFT's config schema: the chat-template data keys (shared with DPO) and the example format (``data.format``).

The shared loop's keys are :class:`pretrain.config.TrainConfig`'s; a task's
schema subclasses it, and ``sft train --print-config`` shows the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from distill.config import DistillSection
from pretrain.config import DataSection, DataSource, TrainConfig
from zoo.errors import UserError


@dataclass
class ChatDataSection(DataSection):
    """Data keys of a task that renders conversations with a chat template (SFT, DPO)."""

    chat_template: str | None = None  # a Jinja chat-template file; None: the tokenizer's own template
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables (enable_thinking...)
    template_date: str = "2024-07-26"  # the day a template's strftime_now reads (renders never vary)

    def check(self) -> None:
        """The data keys' checks, and the template variables a mapping."""
        super().check()
        if not isinstance(self.template_kwargs, dict):
            raise UserError(f"data.template_kwargs must be a mapping of template variables (e.g. "
                            f"{{enable_thinking: false}}), got {self.template_kwargs!r}")


@dataclass
class SFTDataSource(DataSource):
    """A mixture source of SFT data: it may have its own format."""

    format: str | None = None  # this source's format (None: data.format, or detected from the columns)


@dataclass
class SFTDataSection(ChatDataSection):
    """SFT's data keys: the chat template's, and the rows' format."""

    source_class: ClassVar[type[DataSource]] = SFTDataSource
    format: str | None = None  # text | prompt_completion | messages | alpaca | sharegpt; None: from the columns


@dataclass
class SFTConfig(TrainConfig):
    """Everything an SFT run needs (`sft train`)."""

    data: SFTDataSection = field(default_factory=SFTDataSection)
    distill: DistillSection = field(default_factory=DistillSection)  # GKD: a teacher's distributions (distill/)
