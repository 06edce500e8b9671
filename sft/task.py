"""Supervised fine-tuning as a task of the shared loop: chat/instruction rows -> tokens with a loss mask. With
``distill.teacher`` the config picks a variant of it: GKD (sft/gkd.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, cast

import jax

from chat.config import chat_template_of
from chat.formats import detect_format
from chat.image_documents import ImageDocuments, text_document, without_tags
from chat.images import ImageExpander, image_column, refuse_images
from chat.loss_masks import tokenize_indexed
from pretrain.batch import TokenBatch
from pretrain.config import TrainConfig
from pretrain.metrics import LossOutput
from pretrain.setup import tokenizer_folder
from pretrain.task import Documents, RowSource, RunContext, Task, Tokenizer, next_token_loss_sums
from sft.config import SFTConfig, SFTDataSection
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.batching import Document
from zoo.data.files import indexed_rows, load_dataset_rows
from zoo.errors import UserError
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.vision_config import VisionConfig


class SFTTask(Task[TokenBatch]):
    """Completion-only / assistant-only next-token loss over SFT rows (see chat/formats.py for the formats)."""

    method = "sft"
    packing = "best_fit"  # an example is never cut across rows (its prompt would lose its answer)
    config_class = SFTConfig
    reads_images: ClassVar[bool] = True  # rows with images on a vision-language model (not yet online GKD's)
    images_refused_by: ClassVar[tuple[str, str]] = ("", "")  # (what does not read images, the fix) if not reads_images

    def __init__(self, cfg: SFTConfig):
        super().__init__(cfg)
        self.cfg = cfg
        self.chat_template = chat_template_of(cfg)
        self.images: ImageDocuments | None = None  # a vision-language model's (prepare), with rows that have images
        self.text_rows_read = False  # a vision-language model's data read, and no row of it has an images column
        self.vision: VisionConfig | None = None
        self.expander: ImageExpander | None = None

    def prepare(self, ctx: RunContext) -> Any:
        """Keep the model's vision tower's config: rows with images need one (:meth:`documents`)."""
        self.vision = ctx.mcfg.vision
        return None

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
        """{tokens, loss_mask} of each usable row; a bad row is an error naming file and row, or skipped. Rows
        with images (an ``images`` column) on a vision-language model also tag their tokens with their row
        (chat/image_documents.py)."""
        column = image_column(list(rows.ds.column_names))
        if column is not None and not self.reads_images:
            what, fix = self.images_refused_by
            raise UserError(f"data.path {path}: the rows have images, and {what} does not read images yet; "
                            f"remove the {column} column or {fix}")
        if column is not None and self.vision is None:
            refuse_images(rows.ds, column, path, str(self.cfg.model.path))
        if column is not None and self.vision is not None:
            return self._image_documents(rows, tokenizer, path, skip_bad, indices)
        self.text_rows_read = self.vision is not None
        out, bad = tokenize_indexed(indexed_rows(rows.ds, indices), rows.field, tokenizer, self.chat_template,
                                    path, skip_bad)
        docs = {i: {"tokens": ids, "loss_mask": mask} for i, (ids, mask) in out.items()}
        if self.vision is not None and self.reads_images:  # they may pack or mix with rows that have images
            docs = {i: text_document(x, bool(self.cfg.data.packing)) for i, x in docs.items()}
        return Documents(cast(dict[int, Document], docs), bad)

    def _image_documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                         indices: list[int] | None) -> Documents:
        """The documents of rows with images (:class:`ImageDocuments`)."""
        d = self.cfg.data
        if self.expander is None:
            self.expander = ImageExpander.from_folder(tokenizer_folder(self.cfg), tokenizer)
        if self.images is None:
            self.images = ImageDocuments(cast(VisionConfig, self.vision), d.max_patches, d.packing)
        docs, bad_rows = self.images.documents(rows.ds, rows.field, tokenizer, self.expander, path, skip_bad,
                                               d.seq_len, self.chat_template, indices)
        return Documents(cast(dict[int, Document], docs), bad_rows)

    def finish_rows(self, rows: dict[str, Any]) -> dict[str, Any]:
        """Rows of documents with images get their images' patches (chat/image_documents.py); others are unchanged."""
        return without_tags(rows) if self.images is None else self.images.finish_rows(rows)

    def image_spans(self, i: int) -> tuple[tuple[int, int], ...]:
        """Row ``i``'s image tokens, a range [start, end) each (``sft inspect`` shows each as one marker)."""
        return () if self.images is None else self.images.spans.get(i, ())

    def row_budgets(self) -> dict[str, int]:
        """Packed rows with images: data.max_patches' worth of frames a row (chat/image_documents.py)."""
        return {} if self.images is None else self.images.budgets()

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> TokenBatch:
        """The token batch, with the rows' images on a vision-language model: data.max_patches of them a row (unset:
        the largest row's once the data is read, none when no row of it has images; else one frame's, as no data is
        read to size it by)."""
        v = self.vision
        if v is None:
            return super().batch_layout(grad_accum, micro, seq_len)
        if self.images is not None or self.text_rows_read:  # the data is read: its rows' budget (0: text rows)
            patches = self.images.max_patches if self.images is not None else 0
        else:
            patches = self.cfg.data.max_patches or v.patches_per_image
        if not patches:
            return super().batch_layout(grad_accum, micro, seq_len)
        return TokenBatch.layout((grad_accum, micro, seq_len), vision=(patches, v.patch_dim))

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: TokenBatch, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None) -> LossOutput:
        """Next-token cross-entropy over the trained (masked-in) targets only."""
        return next_token_loss_sums(mcfg, weights, mb, compute, remat, max_segments=self.row_segments)
