"""DPO's config schema: the ``dpo:`` section (loss, constants, reference) and the chat-template data keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from chat.config import ChatDataSection
from pretrain.config import COMMON_UNREAD, TEXT_FIELD_UNREAD, TrainConfig, layout_unread
from pretrain.config_unread import Unread, keys_unread
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

    @property
    def reference_mode(self) -> str:
        """How the reference is read: none, base, precomputed or path (a checkpoint)."""
        ref = self.reference or ("none" if self.loss_type in REFERENCE_FREE else "base")
        return ref if ref in ("none", "base", "precomputed") else "path"


def _loss_reads(*losses: str) -> tuple[Callable[[Any], bool], str]:
    """(the condition, the reason) of a ``dpo.*`` key that only ``losses`` read."""
    return (lambda c: c.dpo.loss_type not in losses,
            f"is read by dpo.loss_type {', '.join(losses)} only, not {{cfg.dpo.loss_type}}: remove it")


# The dpo keys a run reads only under a condition (pretrain/config_unread.py): each loss's own constants.
DPO_UNREAD: tuple[Unread, ...] = (
    Unread("dpo.reference_model", lambda c: c.dpo.reference != "precomputed",
           "is read only with dpo.reference: precomputed; for a live reference checkpoint set dpo.reference to its "
           "path"),
    Unread("dpo.sft_weight", lambda c: c.dpo.loss_type in ("orpo", "cpo"),
           "adds RPO's NLL term, which dpo.loss_type {cfg.dpo.loss_type} has built in (orpo: weight 1; cpo: "
           "dpo.cpo_alpha): remove dpo.sft_weight"),
    Unread("dpo.sft_weight", lambda c: c.dpo.loss_type == "kto",
           "adds RPO's NLL term to pair losses; dpo.loss_type kto has none (TRL's KTOTrainer neither): remove "
           "dpo.sft_weight"),
    Unread("dpo.label_smoothing", *_loss_reads("sigmoid", "robust", "simpo", "cpo")),
    Unread("dpo.simpo_gamma", *_loss_reads("simpo")),
    Unread("dpo.cpo_alpha", *_loss_reads("cpo")),
    *keys_unread(("dpo.desirable_weight", "dpo.undesirable_weight"), *_loss_reads("kto")),
)


@dataclass
class DPODataSection(ChatDataSection):
    """DPO's data keys: the chat template's, and the patch budget of pairs with images."""

    # pairs with images (a vision-language model): the patches a row holds at most (its images' frames, twice where
    # the prompt is not shared, times the tower's patches per frame); None: the largest row's (prefs/image_pairs.py)
    max_patches: int | None = field(default=None, metadata={"range": "[1, inf)"})


@dataclass
class DPOConfig(TrainConfig):
    """Everything a DPO run needs (`dpo train`)."""

    UNREAD: ClassVar[tuple[Unread, ...]] = (*COMMON_UNREAD, TEXT_FIELD_UNREAD, *layout_unread("dpo train"),
                                            *DPO_UNREAD)

    data: DPODataSection = field(default_factory=DPODataSection)
    dpo: DpoSection = field(default_factory=DpoSection)

    def check(self) -> None:
        """The shared checks, then the ``dpo:`` section's."""
        super().check()
        self.dpo.check()
