"""Rows with images on a vision-language model: documents that keep their images, and the batches' patches (SFT's
rows here; preference pairs through prefs/image_pairs.py, which keeps each pair's images with
:meth:`ImageDocuments.keep`).

A row with images is tokenized by chat/images.py (ids, a loss mask with every image token untrained, each image's
pixels from the model's own image processor). Its document carries one more per-token feature, ``image_doc``: the
row's key + 1 on every token (0 for a row without images), which padding keeps with the tokens; the key is the
row's index offset by its file's base (:meth:`ImageDocuments.key`), so the rows of a data mixture's sources and of
an eval set never share one. When a batch of rows is made (:meth:`ImageDocuments.finish_rows`), each row's tags
name its documents in order, and their images' frames (SmolVLM: the tiles, then the whole image) become the row's
patches (zoo.data.vision_layout), as the ``vision_*`` arrays of :class:`pretrain.batch.VisionBatch`. The training
batches, a data mixture's mixed batches and the eval batches are all made this way (pretrain/data/run.py,
mixture.py, pretrain/evaluation.py); a document without images in such a run is tagged 0 (:func:`text_document`)
and gets no patches.

``data.max_patches`` is the patch budget of a row: by default the largest document's (its frames times the
tower's patches per frame), so every row fits and no row pads more than one document's worth. Best-fit packing
keeps each document whole, its images with its text: a document also carries one entry a patch of its images
(``FRAMES``; frames differ in patches where images keep their size, as Qwen2.5-VL's), which packing budgets to
``data.max_patches`` a row (:meth:`ImageDocuments.budgets`) as it budgets tokens to ``seq_len + 1``, so a packed
row's images always fit its patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from chat.images import ImageExpander, ProcessedImage, tokenize_image_rows
from chat.templates import ChatTemplate
from pretrain.batch import VISION_PREFIX
from zoo.data.files import indexed_rows
from zoo.data.row_origin import row_where
from zoo.data.vision_layout import layout_rows
from zoo.errors import UserError
from zoo.model.vision_config import VisionConfig

IMAGE_DOC = "image_doc"  # the per-token feature that tags a document's tokens with its row (index + 1)
FRAMES = IMAGE_DOC + "_frames"  # packed rows only: one entry a patch of the document's images (packing's budget)
ROWS_A_FILE = 1 << 24  # the rows one file's keys span (ImageDocuments.key): 127 files fit an int32 tag


def refuse_unsupported(data: Any, path: str) -> None:
    """Raise UserError for what a task's rows with images do not go with yet (a reward model's, KTO's unpaired
    rows: their documents are tagged by row index alone): a data mixture, an evaluation set (``data``: the run's
    data section). SFT and DPO take both (their documents are keyed per file: :meth:`ImageDocuments.key`)."""
    for bad, why in ((isinstance(data.path, list), "a data mixture (data.path a list)"),
                     (bool(data.eval_fraction or data.eval_path), "evaluation (data.eval_fraction, data.eval_path)")):
        if bad:
            raise UserError(f"data.path {path}: rows with images do not go with {why} yet; train them "
                            "from one file and no evaluation set")


def text_document(doc: dict[str, np.ndarray], packed: bool) -> dict[str, np.ndarray]:
    """A document without images as a vision-language run's documents are laid out (its tokens tagged 0, no
    frames), so that it packs and mixes with documents that have images (a data mixture, an eval set)."""
    out = {**doc, IMAGE_DOC: np.zeros(len(doc["tokens"]), np.int32)}
    if packed:
        out[FRAMES] = np.ones(0, np.int32)
    return out


def without_tags(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Data rows less their document tags (a vision-language run whose rows hold no image: a text batch)."""
    return {k: v for k, v in rows.items() if not k.startswith(IMAGE_DOC)}


class ImageDocuments:
    """The images of a run's documents by row index, and the rows' patch layout (see the module docstring)."""

    def __init__(self, v: VisionConfig, max_patches: int | None, packed: bool):
        self.v, self.fixed, self.packed = v, max_patches, packed
        self.max_patches = max_patches or 0
        self.frames: dict[int, list[dict[str, np.ndarray]]] = {}  # row index -> its frames' patch arrays
        self.spans: dict[int, tuple[tuple[int, int], ...]] = {}  # row index -> its images' token ranges
        # Each file read (a training path, an eval path, a mixture's sources) keys its rows from its own base, so
        # that the rows of two files never share a tag: the first file's keys are its row indices.
        self.bases: dict[str, int] = {}

    def key(self, path: str, i: int) -> int:
        """The key of row ``i`` of ``path`` in :attr:`frames` and :attr:`spans` (its documents' tag less 1)."""
        if path not in self.bases:
            self.bases[path] = len(self.bases) * ROWS_A_FILE
        if i >= ROWS_A_FILE:
            raise UserError(f"{row_where(path, i)}: a file of rows with images holds at most {ROWS_A_FILE} rows; "
                            "split it into several files (a data mixture)")
        return self.bases[path] + i

    def documents(self, rows: Any, fmt: str, tokenizer: Any, expander: ImageExpander, path: str, skip_bad: bool,
                  seq_len: int, template: ChatTemplate | str | None,
                  indices: list[int] | None) -> tuple[dict[int, dict[str, np.ndarray]], int]:
        """(the documents {tokens, loss_mask, image_doc} of the rows at ``indices`` by row index, the bad rows
        skipped). A row whose images do not fit (an image's tokens past ``seq_len``, more patches than
        data.max_patches) is a UserError naming it."""
        out, bad = tokenize_image_rows(indexed_rows(rows, indices), fmt, tokenizer, expander, path, skip_bad,
                                       template)
        docs = {}
        for i, t in out.items():
            tag = np.full(len(t.ids), self.keep(i, t.images, t.image_spans, path, seq_len) if t.images else 0,
                          np.int32)
            docs[i] = {"tokens": t.ids, "loss_mask": t.mask, IMAGE_DOC: tag}
            if self.packed:
                frames = self.frames.get(self.key(path, i), ()) if t.images else ()
                docs[i][FRAMES] = np.ones(sum(len(f["patches"]) for f in frames), np.int32)
        return docs, bad

    def budgets(self) -> dict[str, int]:
        """Packing's budget of patches a row (pretrain.task.Task.row_budgets): data.max_patches."""
        return {FRAMES: max(self.max_patches, 1)} if self.packed else {}

    def keep(self, i: int, images: Sequence[ProcessedImage], spans: Sequence[tuple[int, int]], path: str,
             seq_len: int, copies: int = 1) -> int:
        """Check that row ``i`` of ``path``'s images (their tokens at ``spans`` of its document) fit a row and keep
        their frames' patches; ``copies``: how many times the document holds its images' tokens, in order (a
        preference pair whose prompt is not shared holds its prompt twice). Returns the row's tag (its
        :meth:`key` + 1), which its document's tokens carry as ``image_doc`` when it has images."""
        for k, (_, end) in enumerate(spans):
            if end > seq_len:  # the model reads the first seq_len tokens of a row: the image would be cut
                raise UserError(f"{row_where(path, i)}: image {k + 1} ends at token {end}, past data.seq_len = "
                                f"{seq_len}; raise data.seq_len or use smaller images")
        key = self.key(path, i)
        frames = [f for p in images for f in p.patches(self.v)] * copies
        need = sum(len(f["patches"]) for f in frames)
        if self.fixed is not None and need > self.fixed:
            raise UserError(f"{row_where(path, i)}: its {len(images)} image(s) make {len(frames)} frame(s) of "
                            f"{need} patches in all, more than data.max_patches = {self.fixed}; "
                            "raise data.max_patches or use fewer or smaller images")
        if frames:
            if self.fixed is None and _processes() > 1:  # each process reads its own rows: budgets could differ
                raise UserError(f"{row_where(path, i)}: a run of several processes with images needs data.max_patches "
                                f"(this row needs {need}); set it to the largest row's patches, the same everywhere")
            self.frames[key], self.spans[key] = frames, tuple(spans)
            self.max_patches = max(self.max_patches, need)
        return key + 1

    def digest(self) -> str:
        """A sha256 of every kept row's frames (their patches and layout), by row index: what a cache of scores
        computed from the images depends on (dpo/reference.py)."""
        import hashlib

        h = hashlib.sha256()
        for i in sorted(self.frames):
            h.update(f"{i}\0".encode())
            for frame in self.frames[i]:
                for k in sorted(frame):
                    h.update(k.encode() + np.ascontiguousarray(frame[k]).tobytes())
        return h.hexdigest()

    def finish_rows(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Data rows [rows, seq_len + 1] with their ``image_doc`` tags -> the same rows with their images'
        ``vision_*`` arrays (pretrain.batch.VisionBatch) in the tags' place."""
        tags = rows[IMAGE_DOC]
        out = {k: v for k, v in rows.items() if not k.startswith(IMAGE_DOC)}  # the tags and packing's own
        if not self.max_patches:  # no row of the data has an image: a text batch
            return out
        # Packed rows: each document its own segment. Unpacked rows hold one document (a preference pair's two
        # sequences are two segments of one document, its images held ``copies`` times: ImageDocuments.keep).
        segments = rows.get("tokens_segment_ids") if self.packed else None
        per_row = []
        for r, row in enumerate(tags):
            order = row_documents(row, None if segments is None else segments[r])
            per_row.append([f for d in order for f in self.frames.get(d - 1, [])])
        arrays = layout_rows(self.v, per_row, self.max_patches)
        arrays["patches"] = arrays["patches"].reshape(len(tags), -1)
        arrays["patch_valid"] = arrays["patch_valid"].astype(np.int32)
        return {**out, **{VISION_PREFIX + k: v for k, v in arrays.items()}}


def row_documents(tags: np.ndarray, segments: np.ndarray | None) -> list[int]:
    """The tags (row index + 1) of a row's documents in order, one entry a document: a new document starts where
    the tag or (packed rows) the segment changes, so a document packed twice into one row has its images twice
    (the tags alone cannot tell two copies side by side apart)."""
    key = tags if segments is None else tags.astype(np.int64) * (int(segments.max()) + 1) + segments
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    return [int(tags[i]) for i in starts if tags[i]]


def _processes() -> int:
    """How many processes run this job (jax.process_count)."""
    import jax

    return jax.process_count()
