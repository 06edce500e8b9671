"""Qwen2.5-VL's images on the host: each image's patches with their grid places, and the language model's 3-D
(multimodal RoPE) positions of a row, as transformers computes them.

An image is what its image processor (``Qwen2VLImageProcessor``) returns: ``pixel_values`` rows, one flattened
patch each (``channels x temporal_patch_size x patch x patch``), in block-major order (each ``m x m`` block of
patches that makes one token consecutive, ``m`` the merge size), and its ``grid_thw`` (frames, rows, columns of
patches). :func:`qwen_image_patches` gives each patch its grid place (``patch_pos``, row * HW_STRIDE + column), its
token and slot; :func:`zoo.data.vision_layout.layout_rows` lays a batch's out.

:func:`mrope_positions` is transformers' ``get_rope_index`` for images: text tokens count up on all three axes; a
run of image tokens (one image's ``t * h * w / m^2``) takes (start + frame, start + token row, start + token column),
and the text after it goes on from start + max(token rows, token columns).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zoo.model.vision_config import VisionConfig
from zoo.model.vision_qwen import HW_STRIDE


def block_places(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) int [h * w] of each patch of an h x w grid in the processor's block-major order (m x m blocks
    of patches, the blocks row-major, the patches of a block row-major)."""
    k = np.arange(h * w)
    block, inner = np.divmod(k, m * m)
    bi, bj = np.divmod(block, w // m)
    a, b = np.divmod(inner, m)
    return bi * m + a, bj * m + b


def qwen_image_patches(v: VisionConfig, pixel_values: np.ndarray, grid_thw: Sequence[int]) -> dict[str, np.ndarray]:
    """One image's per-patch arrays (``patches``, ``patch_valid``, ``patch_pos``, ``patch_group`` within the image,
    ``patch_slot``) from its processor outputs: ``pixel_values`` [t * h * w, patch_dim], ``grid_thw`` (t, h, w)."""
    t, h, w = (int(x) for x in grid_thw)
    m = v.scale_factor
    if t != 1 or h % m or w % m or pixel_values.shape != (h * w, v.patch_dim):
        raise ValueError(f"an image of grid {(t, h, w)} and pixel_values {pixel_values.shape}: expected one frame, "
                         f"sides a multiple of {m}, and [{h * w}, {v.patch_dim}] pixel values")
    row, col = block_places(h, w, m)
    k = np.arange(h * w)
    return dict(patches=pixel_values, patch_valid=np.ones(h * w, bool), patch_pos=(row * HW_STRIDE + col),
                patch_group=k // (m * m), patch_slot=k % (m * m))


def image_tokens(v: VisionConfig, grid_thw: Sequence[int]) -> int:
    """The language model's tokens of one image of grid (t, h, w): t * h * w / m^2."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // v.group


def mrope_positions(v: VisionConfig, tokens: np.ndarray, grids: Sequence[Sequence[int]],
                    length: int | None = None) -> tuple[np.ndarray, int]:
    """(positions int32 [3, len(tokens)], the row's rope delta: max position + 1 - length) of a row's first
    ``length`` tokens (None: all; the rest get 0, as transformers' padding) holding the images of ``grids`` in
    order, each one run of ``v.image_token_id``."""
    n = len(tokens) if length is None else length
    out = np.zeros((3, len(tokens)), np.int32)
    is_image = np.asarray(tokens[:n]) == v.image_token_id
    starts = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))  # run edges
    pos, at, images = 0, 0, iter(grids)
    for run_start, run_end in [*zip(starts[::2], starts[1::2], strict=True), (n, n)]:
        out[:, at:run_start] = np.arange(run_start - at) + pos  # the text before this run
        pos += run_start - at
        if run_start == n:
            break
        grid = next(images, None)
        if grid is None or image_tokens(v, grid) != run_end - run_start:
            raise ValueError(f"a run of {run_end - run_start} image tokens at {run_start} does not match the next "
                             f"image's grid {None if grid is None else tuple(grid)}")
        t, h, w = (int(x) for x in grid)
        th, tw = h // v.scale_factor, w // v.scale_factor
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(th), np.arange(tw), indexing="ij")
        out[:, run_start:run_end] = np.stack([ti, hi, wi]).reshape(3, -1) + pos
        pos += max(th, tw)
        at = run_end
    return out, int(out[:, :n].max(initial=-1)) + 1 - n
