"""What a task of pair-layout rows (a reward model's pairs, rm/task.py) needs for rows with images on a
vision-language model: the pair tokenizer that keeps each row's images (prefs/image_pairs.py), the batches' patches
(chat/image_documents.py), and the rows' patch budget in the batch layout. Reward models (rm/task.py), DPO and KTO
(dpo/task.py, dpo/kto.py) share it."""

from __future__ import annotations

from typing import Any

from chat.image_documents import ImageDocuments, refuse_unsupported, without_tags
from chat.images import ImageExpander, image_base, image_column, refuse_images
from prefs.image_pairs import ImagePairs
from pretrain.config import TrainConfig
from pretrain.setup import tokenizer_folder
from pretrain.task import RowSource, Tokenizer
from zoo.model.vision_config import VisionConfig


class PairImageRows:
    """A mixin of a pair task: ``cfg`` its config; ``vision`` the model's tower (set by the task's ``prepare``)."""

    cfg: TrainConfig

    def init_images(self) -> None:
        """No tower known yet, no image read."""
        self.vision: VisionConfig | None = None
        self.images: ImageDocuments | None = None
        self.expander: ImageExpander | None = None
        self.text_rows_read = False  # a vision-language model's data read, and no row of it has an images column

    def rows_keyed_by_index(self) -> bool:
        """Whether the task's rows with images are known by their row index alone (one file: no evaluation set or
        data mixture with images; reward models' and KTO's), not by their file's range as DPO's pairs are."""
        return True

    def image_pairs(self, rows: RowSource, tokenizer: Tokenizer, path: str) -> ImagePairs | None:
        """The pair tokenizer of rows with images (None: the rows have no image column); rows with images on a
        model without a vision tower, and what rows with images do not go with yet, are a UserError."""
        column = image_column(list(rows.ds.column_names))
        if column is None:
            self.text_rows_read = self.vision is not None
            return None
        if self.vision is None:
            refuse_images(rows.ds, column, path, str(self.cfg.model.path))
            return None  # the column holds no image
        d = self.cfg.data
        if self.rows_keyed_by_index():
            refuse_unsupported(d, path)
        if self.expander is None:
            self.expander = ImageExpander.from_folder(tokenizer_folder(self.cfg), tokenizer)
        if self.images is None:
            self.images = ImageDocuments(self.vision, getattr(d, "max_patches", None), packed=False)
        return ImagePairs(self.expander, self.images, image_base(path), path, d.seq_len, column)

    def finish_rows(self, rows: dict[str, Any]) -> dict[str, Any]:
        """Rows of pairs with images get their images' patches (chat/image_documents.py); text rows lose their
        document tags (a vision-language model's text pairs, which may mix with pairs that have images)."""
        return without_tags(rows) if self.images is None else self.images.finish_rows(rows)

    def vision_layout(self) -> tuple[int, int] | None:
        """(patches a row, patch_dim) of a vision-language model's rows: data.max_patches (unset: the largest
        pair's once the data is read, None when no row of it has images; else one frame's), or None."""
        v = self.vision
        if v is None:
            return None
        if self.images is not None or self.text_rows_read:  # the data is read: its rows' budget (0: text rows)
            patches = self.images.max_patches if self.images is not None else 0
        else:
            patches = getattr(self.cfg.data, "max_patches", None) or v.patches_per_image
        return (patches, v.patch_dim) if patches else None
