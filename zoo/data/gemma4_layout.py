"""Gemma 4's images as the device receives them (the fields of :class:`zoo.model.vision.VisionInputs`).

Gemma 4's image processor (transformers' ``Gemma4ImageProcessor``) resizes an image to a multiple of
``pooling_kernel_size * patch_size`` on each side, within ``max_soft_tokens`` tokens, and returns its patches
already flattened (``pixel_values`` [max_patches, 3 * p * p], the image's first, padding after) with each patch's
(column, row) (``image_position_ids`` [max_patches, 2], (-1, -1) for padding). Here a patch's position becomes
``row * pos_table + column`` (``patch_pos``) and its token the k x k block it is pooled into, numbered along the
block rows as transformers' ``Gemma4VisionPooler`` numbers them (``patch_group``).
"""

from __future__ import annotations

import numpy as np

from zoo.model.vision_config import VisionConfig


def gemma4_image_patches(v: VisionConfig, pixel_values: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """One image's per-patch arrays (and its ``tokens``) from the image processor's ``pixel_values`` [n, dim] and
    ``image_position_ids`` [n, 2] for it; n is at most the tower's patches a image (``max_soft_tokens * k^2``)."""
    n = len(pixel_values)
    if n > v.patches_per_image or pixel_values.shape[1:] != (v.patch_dim,):
        raise ValueError(f"image of {pixel_values.shape} patches: expected at most {v.patches_per_image} of "
                         f"{v.patch_dim} values")
    valid = (positions != -1).all(axis=-1)
    col, row = np.where(valid, positions[:, 0], 0), np.where(valid, positions[:, 1], 0)
    k = v.scale_factor
    blocks_across = (col.max() + 1) // k  # transformers counts the clamped columns, padding's 0 among them
    group = np.where(valid, col // k + blocks_across * (row // k), -1)
    pad = v.patches_per_image - n
    return dict(patches=np.pad(pixel_values, ((0, pad), (0, 0))), patch_valid=np.pad(valid, (0, pad)),
                patch_pos=np.pad(row * v.pos_table + col, (0, pad)), patch_group=np.pad(group, (0, pad), constant_values=-1),
                patch_slot=np.zeros(v.patches_per_image, np.int32), tokens=np.asarray(int(valid.sum()) // (k * k)))
