"""Multimodal RoPE positions (Qwen2.5-VL): each token's (time, row, column) position, computed on the device from a
batch's 1-D positions and its images, as transformers' ``get_rope_index`` computes them for images.

Text counts up on all three axes. A run of one image's tokens starts where the text before it stopped (``start``):
its token at merged-grid (row r, column c) takes (start, start + r, start + c); the text after the image goes on
from start + max(token rows, token columns), where 1-D positions would go on from start + the image's tokens. So
each finished image shifts the positions after it, within its document, by that difference.

Everything comes from what a batch already holds: the 1-D ``positions`` (restarting at each packed document, so a
document starts at index - position) and the images' :class:`zoo.model.vision.VisionInputs` (each patch's grid
place, image and merged token: :mod:`zoo.data.qwen_layout`), so packing, micro-batch slicing and sharding treat a
batch of a multimodal-RoPE model as any other. A segment that reads a shared prefix (``prefix_ids``: DPO's answers
after their shared prompt, GRPO's completions after their group's) continues its prefix's positions, so its tokens
move by all of the prefix's images and by its own earlier ones, wherever in the row the prefix lies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.model.vision import VisionInputs
from zoo.model.vision_config import VisionConfig
from zoo.model.vision_qwen import HW_STRIDE


def _per_token(v: VisionConfig, vision: VisionInputs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(merged row, merged column, image) [b, F] of each of a row's F image features (scattered from its patches;
    the group's patches agree on all three)."""
    b, n = vision.patch_group.shape
    feats = n // v.group
    group = jnp.where(vision.patch_group >= 0, vision.patch_group, feats)  # patches of no token land past the end
    rows = jnp.arange(b)[:, None]

    def scatter(values: jax.Array) -> jax.Array:
        return jnp.zeros((b, feats + 1), jnp.int32).at[rows, group].max(values.astype(jnp.int32))[:, :feats]

    m = v.scale_factor
    return (scatter(vision.patch_pos // HW_STRIDE // m), scatter(vision.patch_pos % HW_STRIDE // m),
            scatter(vision.patch_image))


def mrope_positions(v: VisionConfig, tokens: jax.Array, positions: jax.Array, vision: VisionInputs,
                    segment_ids: jax.Array | None = None, prefix_ids: jax.Array | None = None) -> jax.Array:
    """Int positions [3, b, t] of int ``tokens`` [b, t] with 1-D ``positions`` [b, t] (each document from 0) and the
    rows' images ``vision``, as transformers' ``get_rope_index`` gives each document. With ``prefix_ids`` [b, t]
    (and the ``segment_ids`` they name), a token of a segment with a shared prefix continues that prefix's
    positions (:func:`zoo.model.masks.attention_mask`'s layout), as if the prefix stood right before its segment."""
    b, t = tokens.shape
    tok_row, tok_col, tok_img = _per_token(v, vision)
    feats = tok_row.shape[1]
    rows = jnp.arange(b)[:, None]
    images = feats + 1  # image ids 1.. (0: padding); a row holds at most one image a feature
    extent = jnp.zeros((b, images), jnp.int32).at[rows, tok_img].max(jnp.maximum(tok_row, tok_col) + 1)
    count = jnp.zeros((b, images), jnp.int32).at[rows, tok_img].add(1)
    first = jnp.full((b, images), feats, jnp.int32).at[rows, tok_img].min(jnp.broadcast_to(jnp.arange(feats), (b, feats)))
    is_image = tokens == v.image_token_id
    k = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, max(feats - 1, 0))  # each image token's feature

    def at(table: jax.Array, index: jax.Array) -> jax.Array:
        return jnp.take_along_axis(table, index, axis=1)

    img = at(tok_img, k)
    within = k - at(first, img)  # the token's place within its image
    last = is_image & (within == at(count, img) - 1)
    shift_here = jnp.where(last, at(extent, img) - at(count, img), 0)  # felt by the tokens after the image
    before = jnp.cumsum(shift_here, axis=1) - shift_here
    doc_start = jnp.clip(jnp.arange(t)[None, :] - positions, 0, t - 1)
    shift = before - at(before, doc_start)  # what the document's earlier images moved the token by
    if prefix_ids is not None and segment_ids is not None:
        # A segment after a shared prefix starts past position 0 and elsewhere in the row than its prefix, so
        # index - position names no document start: it moves by its prefix's images and its own earlier ones.
        seg = jnp.clip(segment_ids, 0, t)
        index = jnp.broadcast_to(jnp.arange(t), (b, t))
        first = jnp.full((b, t + 1), t - 1, jnp.int32).at[rows, seg].min(index)
        total = jnp.zeros((b, t + 1), jnp.int32).at[rows, seg].add(shift_here)
        own = before - at(before, at(first, seg))
        shift = jnp.where(prefix_ids > 0, own + at(total, jnp.clip(prefix_ids, 0, t)), shift)
    base = positions + shift  # 1-D positions shifted by the document's earlier images
    start = base - within
    return jnp.stack([jnp.where(is_image, start, base), jnp.where(is_image, start + at(tok_row, k), base),
                      jnp.where(is_image, start + at(tok_col, k), base)]).astype(jnp.int32)
