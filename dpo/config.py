"""DPO's config schema: the ``dpo:`` section (loss, constants, reference) and the chat-template data keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from chat.config import ChatDataSection
from pretrain.config import TrainConfig
from zoo.errors import UserError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "cpo", "kto")  # dpo/losses.py
REFERENCE_FREE = ("simpo", "orpo", "cpo")  # losses that read the policy alone (dpo.reference: none)


@dataclass
class DpoSection:
    """Preference optimization (`dpo train`, dpo/): the loss, its constants and the reference model."""

    # the objective (TRL's names): sigmoid is DPO; ipo, hinge, robust, the reference-free orpo, cpo and simpo, kto
    loss_type: str = field(default="sigmoid", metadata={"choices": LOSS_TYPES})
    # the implicit reward's scale (DPO's beta): higher keeps the policy closer to the reference
    beta: float = field(default=0.1, metadata={"range": "(0, inf)"})
    # sigmoid (conservative DPO), robust and simpo: the assumed label-noise rate
    label_smoothing: float = field(default=0.0, metadata={"range": "[0, 0.5)"})
    simpo_gamma: float = 0.5  # simpo's target reward margin (any finite number)
    # RPO (TRL's "sft" term): adds this times one mean NLL over the batch's chosen tokens
    sft_weight: float = field(default=0.0, metadata={"range": "[0, inf)"})
    # base (LoRA: the adapters switched off) | precomputed | a zoo checkpoint path | none (orpo, cpo, simpo);
    # unset: base, or none for the reference-free losses
    reference: str | None = None
    reference_model: str | None = None  # precomputed: the checkpoint scored once; None: the starting weights
    # CPO (Xu et al. 2024): the weight of its NLL term on the chosen answers (TRL CPOConfig's cpo_alpha)
    cpo_alpha: float = field(default=1.0, metadata={"range": "[0, inf)"})
    # KTO (Ethayarajh et al. 2024): the weights of the desirable and undesirable rows' losses (TRL KTOConfig's)
    desirable_weight: float = field(default=1.0, metadata={"range": "(0, inf)"})
    undesirable_weight: float = field(default=1.0, metadata={"range": "(0, inf)"})  # (see desirable_weight)
    share_prompt: bool = True  # one copy of a pair's prompt, read by both answers (off: prompt+chosen | prompt+rejected)

    def check(self) -> None:
        """The reference named consistently with the loss (each constant's range is its field's ``range``)."""
        free = self.loss_type in REFERENCE_FREE
        if self.reference is not None and not self.reference.strip():
            raise UserError("dpo.reference must be base, precomputed, none or a zoo checkpoint path, got ''")
        if free and self.reference not in (None, "none"):
            raise UserError(f"dpo.loss_type {self.loss_type} uses no reference model (it compares the policy's own "
                            f"answers), but dpo.reference is {self.reference}: remove dpo.reference or set it to none")
        if not free and self.reference == "none":
            raise UserError(f"dpo.loss_type {self.loss_type} needs a reference model: set dpo.reference to base "
                            "(LoRA), precomputed or a checkpoint path, or use a reference-free loss (orpo, cpo, simpo)")
        if self.reference_model is not None and self.reference != "precomputed":
            raise UserError("dpo.reference_model is read only with dpo.reference: precomputed; for a live reference "
                            "checkpoint set dpo.reference to its path")
        if self.sft_weight and self.loss_type in ("orpo", "cpo"):
            raise UserError(f"dpo.sft_weight adds RPO's NLL term, which dpo.loss_type {self.loss_type} has built in "
                            "(orpo: weight 1; cpo: dpo.cpo_alpha): remove dpo.sft_weight")
        if self.sft_weight and self.loss_type == "kto":
            raise UserError("dpo.sft_weight adds RPO's NLL term to pair losses; dpo.loss_type kto has none (TRL's "
                            "KTOTrainer neither): remove dpo.sft_weight")

    @property
    def reference_mode(self) -> str:
        """How the reference is read: none, base, precomputed or path (a checkpoint)."""
        ref = self.reference or ("none" if self.loss_type in REFERENCE_FREE else "base")
        return ref if ref in ("none", "base", "precomputed") else "path"


@dataclass
class DPOConfig(TrainConfig):
    """Everything a DPO run needs (`dpo train`)."""

    data: ChatDataSection = field(default_factory=ChatDataSection)
    dpo: DpoSection = field(default_factory=DpoSection)

    def check(self) -> None:
        """The shared checks, then the ``dpo:`` section's."""
        super().check()
        self.dpo.check()
