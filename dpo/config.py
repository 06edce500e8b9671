"""DPO's config schema: the ``dpo:`` section (loss, constants, reference) and the chat-template data keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.config import TrainConfig
from sft.config import ChatDataSection
from zoo.errors import UserError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")  # dpo/losses.py


@dataclass
class DpoSection:
    """Preference optimization (`dpo train`, dpo/): the loss, its constants and the reference model."""

    loss_type: str = field(default="sigmoid", metadata={"choices": LOSS_TYPES})
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid (conservative DPO), robust and simpo: the assumed label-noise rate
    simpo_gamma: float = 0.5  # simpo's target reward margin
    sft_weight: float = 0.0  # RPO (TRL's "sft" term): adds this times one mean NLL over the batch's chosen tokens
    reference: str = "base"  # base (LoRA: the adapters switched off) | precomputed | a zoo checkpoint path
    reference_model: str | None = None  # precomputed: the checkpoint scored once; None: the starting weights
    share_prompt: bool = True  # one copy of a pair's prompt, read by both answers (off: prompt+chosen | prompt+rejected)

    def check(self) -> None:
        """The constants in range and the reference named consistently."""
        if self.beta <= 0:
            raise UserError(f"dpo.beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UserError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.sft_weight < 0:
            raise UserError(f"dpo.sft_weight must be at least 0, got {self.sft_weight}")
        if not self.reference.strip():
            raise UserError("dpo.reference must be base, precomputed or a zoo checkpoint path, got ''")
        if self.reference_model is not None and self.reference != "precomputed":
            raise UserError("dpo.reference_model is read only with dpo.reference: precomputed; for a live reference "
                            "checkpoint set dpo.reference to its path")


@dataclass
class DPOConfig(TrainConfig):
    """Everything a DPO run needs (`dpo train`)."""

    data: ChatDataSection = field(default_factory=ChatDataSection)
    dpo: DpoSection = field(default_factory=DpoSection)

    def check(self) -> None:
        """The shared checks, then the ``dpo:`` section's."""
        super().check()
        self.dpo.check()
