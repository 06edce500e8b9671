"""SFT's config schema: the chat data keys (chat/config.py) and the example format (``data.format``).

The shared loop's keys are :class:`pretrain.config.TrainConfig`'s; a task's
schema subclasses it, and ``sft train --print-config`` shows the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from chat.config import ChatDataSection
from distill.config import DISTILL_UNREAD, DistillSection
from pretrain.config import COMMON_UNREAD, TEXT_FIELD_UNREAD, DataSource, TrainConfig, layout_unread
from pretrain.config_unread import Unread


@dataclass
class SFTDataSource(DataSource):
    """A mixture source of SFT data: it may have its own format."""

    format: str | None = None  # this source's format (None: data.format, or detected from the columns)


@dataclass
class SFTDataSection(ChatDataSection):
    """SFT's data keys: the chat template's, and the rows' format."""

    source_class: ClassVar[type[DataSource]] = SFTDataSource
    format: str | None = None  # text | prompt_completion | messages | alpaca | sharegpt; None: from the columns
    # rows with images (a vision-language model): the patches a row holds at most (its images' frames times the
    # tower's patches per frame); None: the largest row's (chat/image_documents.py)
    max_patches: int | None = field(default=None, metadata={"range": "[1, inf)"})


# The packing keys: best-fit packing's bound without packing, and both under on-policy GKD (one example a row).
PACKING_UNREAD: tuple[Unread, ...] = (
    *(Unread(r.key, lambda c: c.distill.teacher is not None and c.distill.samples, r.why)
      for r in layout_unread("on-policy GKD (distill.lmbda > 0 or distill.seq_kd)")),
    Unread("data.max_segments", lambda c: not c.data.packing,
           "bounds the examples a packed row holds, and data.packing is false (one example a row): remove it"),
)


@dataclass
class SFTConfig(TrainConfig):
    """Everything an SFT run needs (`sft train`)."""

    UNREAD: ClassVar[tuple[Unread, ...]] = (*COMMON_UNREAD, TEXT_FIELD_UNREAD, *PACKING_UNREAD, *DISTILL_UNREAD)

    data: SFTDataSection = field(default_factory=SFTDataSection)
    distill: DistillSection = field(default_factory=DistillSection)  # GKD: a teacher's distributions (distill/)
