"""SFT's config schema: the chat data keys (chat/config.py) and the example format (``data.format``).

The shared loop's keys are :class:`pretrain.config.TrainConfig`'s; a task's
schema subclasses it, and ``sft train --print-config`` shows the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from chat.config import ChatDataSection
from distill.config import DistillSection
from pretrain.config import DataSource, TrainConfig


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
