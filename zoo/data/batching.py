"""Documents -> fixed-shape model batches, and the one scoring pass over them.

A *document* is int32 token ids, or a dict of per-token arrays: ``tokens``,
optionally ``loss_mask`` (which tokens are trained or scored), and any other
per-token features. A document may lay out its own segments, positions and
shared prefix (``tokens_segment_ids``, ``tokens_positions``,
``tokens_prefix_ids``, the names packing gives them): several sequences in one
row, e.g. one prompt read by two answers. :func:`to_model_batch` turns padded
or packed rows of such documents into the model's inputs, targets and weights;
:func:`score_documents` computes each target's log-probability, the pass that
a frozen reference model, held-out pair scores and evaluation's
log-likelihoods all make.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
from jax.sharding import NamedSharding

from zoo.model.config import ModelConfig
from zoo.model.logps import batch_logps
from zoo.model.quant import cast_params
from zoo.model.sharding import mesh_context
from zoo.model.vision import VisionInputs

Document: TypeAlias = np.ndarray | dict[str, np.ndarray]


def features(doc: Document) -> dict[str, np.ndarray]:
    """A document as a dict of per-token arrays (plain ids become ``{"tokens": ids}``)."""
    return dict(doc) if isinstance(doc, dict) else {"tokens": doc}


def padded(doc: Document, length: int) -> dict[str, np.ndarray]:
    """One row of exactly ``length`` tokens from ``doc``: cut, or padded with zeros (segment id 0: padding).

    A document that lays out its own segments keeps them; any other gets one
    segment (id 1) over its tokens and positions counted from 0.
    """
    doc = features(doc)
    n = min(len(doc["tokens"]), length)
    out = {}
    for k, v in doc.items():
        out[k] = np.zeros(length, v.dtype)
        out[k][:n] = v[:n]
    if "tokens_segment_ids" in out:
        return out
    seg = np.zeros(length, np.int32)
    seg[:n] = 1
    pos = np.where(seg > 0, np.arange(length, dtype=np.int32), 0).astype(np.int32)
    return {**out, "tokens_segment_ids": seg, "tokens_positions": pos}


def to_model_batch(b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs, targets and loss weights from a batch of padded or packed rows ([..., length + 1] each).

    A target counts when it continues its input's segment and, where the
    documents carry a ``loss_mask``, when the mask marks it. A shared prefix
    (``tokens_prefix_ids``) becomes the model's ``prefix_ids``, aligned with
    the inputs; any other per-token feature comes along aligned with the
    targets (it describes a token as a target), and a row's images (``vision_*`` keys) come along whole.
    """
    tok, seg, pos = b["tokens"], b["tokens_segment_ids"], b["tokens_positions"]
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    if "loss_mask" in b:
        same &= b["loss_mask"][:, 1:].astype(bool)
    out = {
        "inputs": tok[:, :-1].astype(np.int32),
        "targets": tok[:, 1:].astype(np.int32),
        "weights": same.astype(np.float32),
        "segment_ids": seg[:, :-1].astype(np.int32),
        "positions": pos[:, :-1].astype(np.int32),
    }
    if "tokens_prefix_ids" in b:
        out["prefix_ids"] = b["tokens_prefix_ids"][:, :-1].astype(np.int32)
    for k in b.keys() - {"tokens", "tokens_segment_ids", "tokens_positions", "tokens_prefix_ids", "loss_mask"}:
        # a row's images (``vision_*``: pretrain.batch.VisionBatch's arrays) are per row, not per token: kept whole
        out[k] = b[k] if k.startswith("vision_") else b[k][:, 1:]
    return out


Finish: TypeAlias = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # stacked rows -> the rows to batch


def stacked(docs: Sequence[Document], length: int, rows: int, finish: Finish | None = None) -> dict[str, np.ndarray]:
    """A model batch of ``rows`` rows of ``length`` tokens from ``docs`` (at most ``rows``; the last one repeats
    to fill the batch, so every batch has one shape and compiles once). ``finish`` makes what it will of the
    stacked rows first (a task's: rows with images get their patches, pretrain.task.Task.finish_rows)."""
    rows_ = [padded(d, length) for d in docs]
    rows_ += [rows_[-1]] * (rows - len(rows_))
    b = {k: np.stack([r[k] for r in rows_]) for k in rows_[0]}
    return to_model_batch(b if finish is None else finish(b))


def batch_vision(cfg: ModelConfig, batch: dict[str, Any]) -> VisionInputs | None:
    """The images of a model batch (its ``vision_*`` arrays, [rows, width] each: pretrain.batch.VisionBatch's
    layout) as the model reads them, or None where it has none."""
    if cfg.vision is None or "vision_patches" not in batch:
        return None
    patches = batch["vision_patches"]
    rows, width = patches.shape
    return VisionInputs(patches.reshape(rows, width // cfg.vision.patch_dim, cfg.vision.patch_dim),
                        batch["vision_patch_image"], batch["vision_patch_valid"].astype(bool),
                        batch["vision_patch_pos"], batch["vision_patch_group"], batch["vision_patch_slot"])


def replicated_batch(b: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays laid out as ``sharding`` from a batch every process holds whole."""
    return {k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__) for k, v in b.items()}


@functools.partial(jax.jit, static_argnums=(0, 3))
def _target_logps(cfg: ModelConfig, params: dict, batch: dict, compute: Any) -> jax.Array:
    """log p(target) * weight [rows, length - 1] of one model batch."""
    if compute is not None:
        params = cast_params(params, compute)
    logp, _, _ = batch_logps(cfg, params, batch, vision=batch_vision(cfg, batch))
    return logp * batch["weights"]


def score_documents(cfg: ModelConfig, params: dict, documents: Sequence[Document], length: int, rows: int,
                    sharding: NamedSharding | None = None, compute: Any = None,
                    on_batch: Callable[[int], None] | None = None, finish: Finish | None = None) -> list[np.ndarray]:
    """Each document's per-token target log-probabilities (float32, one per token, 0 where the token is no target).

    Entry ``i`` of a document's array is log p(token i | the earlier tokens of
    its segment and its shared prefix) when token i is a target (it continues
    its segment and, with a ``loss_mask``, is marked), else 0; a document
    longer than ``length`` is scored on its first ``length`` tokens. The
    documents go ``rows`` at a time through one fixed-shape forward pass
    (params cast to ``compute`` inside it when given), laid out as
    ``sharding`` when given (every process holds all documents); ``on_batch``
    hears how many documents each batch scored (a progress bar). ``finish``: :func:`stacked`'s (documents with
    images: their rows' patches).
    """
    out: list[np.ndarray] = []
    for start in range(0, len(documents), rows):
        chunk = documents[start:start + rows]
        b = stacked(chunk, length, rows, finish)
        if sharding is None:
            got = np.asarray(jax.device_get(_target_logps(cfg, params, b, compute)), np.float32)
        else:
            with mesh_context(sharding.mesh):  # traced for the mesh: splash attention shards itself (zoo.kernels.splash)
                logps = _target_logps(cfg, params, replicated_batch(b, sharding), compute)
            got = np.asarray(jax.device_get(logps), np.float32)
        for j, d in enumerate(chunk):
            n = min(len(features(d)["tokens"]), length)
            per_token = np.zeros(n, np.float32)
            per_token[1:] = got[j, :n - 1]  # target j of the row is token j + 1
            out.append(per_token)
        if on_batch is not None:
            on_batch(len(chunk))
    return out
