"""Qwen2.5-VL's images on the host: each image's patches with their grid places.

An image is what its image processor (``Qwen2VLImageProcessor``) returns: ``pixel_values`` rows, one flattened
patch each (``channels x temporal_patch_size x patch x patch``), in block-major order (each ``m x m`` block of
patches that makes one token consecutive, ``m`` the merge size), and its ``grid_thw`` (frames, rows, columns of
patches). :func:`qwen_image_patches` gives each patch its grid place (``patch_pos``, row * HW_STRIDE + column), its
token and slot; :func:`zoo.data.vision_layout.layout_rows` lays a batch's out.

The language model's multimodal RoPE positions are computed from these on the device (:mod:`zoo.model.mrope`).
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
