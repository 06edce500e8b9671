"""The reward model's config schema: the ``rm:`` section and the chat-template data keys of preference pairs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from chat.config import ChatDataSection
from pretrain.config import COMMON_UNREAD, TEXT_FIELD_UNREAD, TrainConfig, layout_unread
from pretrain.config_unread import Unread


@dataclass
class RmSection:
    """Reward-model training (`reward train`, rm/): TRL 1.16 RewardConfig's loss keys."""

    # adds this times mean((r_chosen + r_rejected)^2): scores centred on 0 (Eisenstein et al. 2023); None: off
    center_rewards_coefficient: float | None = field(default=None, metadata={"range": "[0, inf)"})
    margin_field: str = "margin"  # an optional column: a pair's margin, subtracted from r_chosen - r_rejected


@dataclass
class RmDataSection(ChatDataSection):
    """A reward model's data keys: the chat template's, and the patch budget of pairs with images."""

    # pairs with images (a vision-language model): the patches a row holds at most (its images' frames, twice where
    # the prompt is not shared, times the tower's patches per frame); None: the largest row's (prefs/image_pairs.py)
    max_patches: int | None = field(default=None, metadata={"range": "[1, inf)"})


@dataclass
class RMConfig(TrainConfig):
    """Everything a reward-model run needs (`reward train`)."""

    UNREAD: ClassVar[tuple[Unread, ...]] = (*COMMON_UNREAD, TEXT_FIELD_UNREAD, *layout_unread("reward train"))

    data: RmDataSection = field(default_factory=RmDataSection)
    rm: RmSection = field(default_factory=RmSection)
