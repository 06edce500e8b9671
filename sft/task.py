"""Supervised fine-tuning as a task of the shared loop: chat/instruction rows -> tokens with a loss mask. With
``distill.teacher`` the config picks a variant of it: GKD (sft/gkd.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax

from chat.config import chat_template_of
from chat.formats import detect_format
from chat.loss_masks import tokenize_indexed
from pretrain.batch import TokenBatch
from pretrain.config import TrainConfig
from pretrain.metrics import LossOutput
from pretrain.task import Documents, RowSource, Task, Tokenizer, next_token_loss_sums
from sft.config import SFTConfig, SFTDataSection
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.files import indexed_rows, load_dataset_rows
from zoo.errors import UserError
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig


class SFTTask(Task[TokenBatch]):
    """Completion-only / assistant-only next-token loss over SFT rows (see chat/formats.py for the formats)."""

    method = "sft"
    packing = "best_fit"  # an example is never cut across rows (its prompt would lose its answer)
    config_class = SFTConfig

    def __init__(self, cfg: SFTConfig):
        super().__init__(cfg)
        self.chat_template = chat_template_of(cfg)

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """Supervised fine-tuning; with ``distill.teacher``, knowledge distillation (GKD) and its keys."""
        teacher = cast(SFTConfig, cfg).distill.teacher
        if not teacher:
            return MethodCard("supervised fine-tuning (SFT)", ("sft",))
        keys = ("distill.teacher", "distill.lmbda", "distill.beta", "distill.temperature", "distill.max_new_tokens",
                "distill.seq_kd")
        return MethodCard("knowledge distillation (GKD: the student learns the teacher's token distributions), "
                          f"from the teacher `{teacher}`", ("distillation",),
                          settings(dataclasses.asdict(cfg), keys, ("distill.seq_kd",)))

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path`` and their format (``data.format``, or detected from the columns)."""
        ds, _ = load_dataset_rows(path, cfg.data.split)
        try:  # cfg's own data.format: each source of a mixture reads with its own (pretrain/data/mixture.py)
            fmt = detect_format(list(ds.column_names), cast(SFTDataSection, cfg.data).format)
        except UserError as e:
            raise UserError(f"data.path {path}: {e}") from None
        return RowSource(ds, fmt, path)

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """{tokens, loss_mask} of each usable row; a bad row is an error naming file and row, or skipped."""
        out, bad = tokenize_indexed(indexed_rows(rows.ds, indices), rows.field, tokenizer, self.chat_template,
                                    path, skip_bad)
        return Documents({i: {"tokens": ids, "loss_mask": mask} for i, (ids, mask) in out.items()}, bad)

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: TokenBatch, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None) -> LossOutput:
        """Next-token cross-entropy over the trained (masked-in) targets only."""
        return next_token_loss_sums(mcfg, weights, mb, compute, remat, max_segments=self.row_segments)
