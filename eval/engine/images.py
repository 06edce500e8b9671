"""A prompt's images as the engine's prefill takes them: each prompt's frames (pixels and mask, or per-patch
arrays) laid out for the rows of one batch."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from zoo.model.config import ModelConfig
from zoo.model.vision import VisionInputs

Frame = tuple[np.ndarray, np.ndarray | None] | dict[str, np.ndarray]  # a frame's pixels and mask, or its patches


def vision_inputs(cfg: ModelConfig, frames: Sequence[Sequence[Frame]]) -> VisionInputs | None:
    """The images of a batch of prompts as the prefill takes them: ``frames[r]`` are prompt r's frames in the order
    of its image tokens, each (pixels [C, S, S], pixel mask [S, S] or None) as the image processor gives them
    (SmolVLM: an image's tiles, then the whole image), or already as per-patch arrays (``ProcessedImage.patches`` of
    chat/images.py, as `zoo eval`'s rows give them: any family's layout, Qwen's images at their own size and the
    multimodal positions the forward computes from them). None when no prompt has an image. Llama 4's frames are
    its image processor's tiles (the whole image last where it has several), which need no mask."""
    from zoo.data.vision_layout import image_patches, llama4_tile_patches

    v = cfg.vision
    assert v is not None, "vision_inputs needs a model with a vision tower"

    def patches(f: Frame) -> dict[str, np.ndarray]:
        if isinstance(f, dict):
            return f
        return llama4_tile_patches(v, f[0]) if v.tower == "llama4" else image_patches(v, *f)

    return patch_inputs(cfg, [[patches(f) for f in row] for row in frames])


def patch_inputs(cfg: ModelConfig, rows: Sequence[Sequence[dict[str, np.ndarray]]]) -> VisionInputs | None:
    """The images of a batch of prompts as the prefill takes them, from each prompt's frames as per-patch arrays
    (``ProcessedImage.patches`` of chat/images.py: any tower, Qwen2.5-VL's images at their own size). None when no
    prompt has an image."""
    from zoo.data.vision_layout import layout_rows

    v = cfg.vision
    assert v is not None, "patch_inputs needs a model with a vision tower"
    most = max((sum(len(f["patches"]) for f in row) for row in rows), default=0)
    if most == 0:
        return None
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(v, rows, most).items()})
