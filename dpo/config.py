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
    beta: float = field(default=0.1, metadata={"range": "(0, inf)"})
    # sigmoid (conservative DPO), robust and simpo: the assumed label-noise rate
    label_smoothing: float = field(default=0.0, metadata={"range": "[0, 0.5)"})
    simpo_gamma: float = 0.5  # simpo's target reward margin (any finite number)
    # RPO (TRL's "sft" term): adds this times one mean NLL over the batch's chosen tokens
    sft_weight: float = field(default=0.0, metadata={"range": "[0, inf)"})
    reference: str = "base"  # base (LoRA: the adapters switched off) | precomputed | a zoo checkpoint path
    reference_model: str | None = None  # precomputed: the checkpoint scored once; None: the starting weights
    share_prompt: bool = True  # one copy of a pair's prompt, read by both answers (off: prompt+chosen | prompt+rejected)

    def check(self) -> None:
        """The reference named consistently (each constant's range is its field's ``range``)."""
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
