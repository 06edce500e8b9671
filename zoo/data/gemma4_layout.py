"""Gemma 4's images as the device receives them (the fields of :class:`zoo.model.vision.VisionInputs`).

Gemma 4's image processor (transformers' ``Gemma4ImageProcessor``) resizes an image to a multiple of
``pooling_kernel_size * patch_size`` on each side, within ``max_soft_tokens`` tokens, and returns its patches
already flattened (``pixel_values`` [max_patches, 3 * p * p], the image's first, padding after) with each patch's
(column, row) (``image_position_ids`` [max_patches, 2], (-1, -1) for padding). Here the padding is left out (an
image takes as many patch slots of its row as it has patches), a patch's position becomes
``row * pos_table + column`` (``patch_pos``) and its token the k x k block it is pooled into, numbered along the
block rows as transformers' ``Gemma4VisionPooler`` numbers them (``patch_group``).
"""

from __future__ import annotations

import numpy as np

from zoo.errors import UserError
from zoo.model.vision_config import VisionConfig


def gemma4_image_patches(v: VisionConfig, pixel_values: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """One image's per-patch arrays (and its ``tokens``) from the image processor's ``pixel_values`` [n, dim] and
    ``image_position_ids`` [n, 2] for it: its real patches only, the processor's padding left out (a padding patch
    neither attends nor is pooled, so the image takes its own patches' slots of a row, not ``max_soft_tokens * k^2``).
    Raises UserError when the image has more patches than the tower's ``patches_per_image``."""
    if pixel_values.shape[1:] != (v.patch_dim,) or positions.shape != (len(pixel_values), 2):
        raise ValueError(f"image of {pixel_values.shape} patches at {positions.shape} positions: expected patches of "
                         f"{v.patch_dim} values, a (column, row) each")
    valid = (positions != -1).all(axis=-1)
    if valid.sum() > v.patches_per_image:
        raise UserError(f"an image of {int(valid.sum())} patches is more than Gemma 4's {v.patches_per_image} "
                        f"({v.max_soft_tokens} tokens of {v.group} patches); set max_soft_tokens of the image "
                        f"processor (preprocessor_config.json) to at most {v.max_soft_tokens}")
    col, row = positions[valid, 0], positions[valid, 1]
    k = v.scale_factor
    # transformers counts the blocks across from the largest clamped column, padding's 0 among them: the image's own
    blocks_across = (col.max(initial=0) + 1) // k
    n = len(col)
    return dict(patches=pixel_values[valid], patch_valid=np.ones(n, bool), patch_pos=row * v.pos_table + col,
                patch_group=col // k + blocks_across * (row // k), patch_slot=np.zeros(n, np.int32),
                tokens=np.asarray(n // (k * k)))
