"""Images as the device receives them: flattened patches with per-patch metadata, computed on the host (numpy).

A row of a batch holds at most ``max_patches`` patches (a static shape) of the images of that row, in order.
Per patch: its pixels (``[channels * p * p]``, flattened in the (channel, row, column) order of a conv patch
embedding's weight), the image it belongs to (``patch_image``: 1.. within the row, 0 for the row's padding;
the tower attends within one image), whether it holds any real pixels (``patch_valid``: only those are keys),
its row of the learned position table (``patch_pos``), and where the connector puts it (``patch_group``: the
row's output token, -1 for none; ``patch_slot``: its place within that token's group of patches).

SmolVLM/Idefics3 (transformers' ``SmolVLMVisionEmbeddings``, ``SmolVLMConnector.pixel_shuffle``): a padded image
reads the position table at *bucketized fractional* coordinates of its real patches (padding patches row 0),
and each ``s x s`` block of patches becomes one token, patch ``(i*s + a, j*s + b)`` at slot ``a*s + b`` of
token ``i*(w/s) + j``. Gemma 3 (``VisionConfig.bucketize`` false) reads the table at each patch's own row, and
its connector averages each such block into one token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zoo.model.vision_config import VisionConfig


def patchify(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[C, H, W] pixels -> [(H//p) * (W//p), C * p * p] patches, row-major over the grid, each flattened (C, y, x).
    The last ``H % p`` rows and ``W % p`` columns of pixels are dropped, as the stride-p conv drops them
    (SmolVLM-Instruct: 384-pixel tiles in 14-pixel patches are 27 x 27 patches, the last 6 pixels unread)."""
    c, h, w = pixels.shape
    rows, cols = h // patch, w // patch
    grid = pixels[:, :rows * patch, :cols * patch].reshape(c, rows, patch, cols, patch)
    return grid.transpose(1, 3, 0, 2, 4).reshape(rows * cols, c * patch * patch)


def patch_validity(pixel_mask: np.ndarray, patch: int) -> np.ndarray:
    """Bool [H//p, W//p]: the patches with at least one real pixel of ``pixel_mask`` [H, W] (transformers'
    ``patch_attention_mask``, whose ``unfold`` drops the remainder rows and columns as the conv does)."""
    h, w = pixel_mask.shape
    rows, cols = h // patch, w // patch
    return pixel_mask[:rows * patch, :cols * patch].reshape(rows, patch, cols, patch).sum(axis=(1, 3)) > 0


def bucketized_positions(valid: np.ndarray, side: int) -> np.ndarray:
    """Int [h * w]: each patch's row of a ``side x side`` position table (SmolVLM's bucketized fractional
    coordinates of a grid whose real patches are ``valid`` [h, w]; padding patches read row 0). float32 as
    transformers computes it, so the buckets' edges fall alike."""
    boundaries = np.arange(1 / side, 1.0, 1 / side).astype(np.float32)
    rows, cols = valid[:, 0].sum(), valid[0, :].sum()
    top = np.float32(1.0 - 1e-6)
    frac_h = np.minimum(np.arange(valid.shape[0], dtype=np.float32) * (np.float32(1.0) / np.float32(rows)), top)
    frac_w = np.minimum(np.arange(valid.shape[1], dtype=np.float32) * (np.float32(1.0) / np.float32(cols)), top)
    bucket_h = np.searchsorted(boundaries, frac_h, side="right")
    bucket_w = np.searchsorted(boundaries, frac_w, side="right")
    pos = bucket_h[:, None] * side + bucket_w[None, :]
    return np.where(valid, pos, 0).reshape(-1)


def shuffle_slots(h: int, w: int, scale: int) -> tuple[np.ndarray, np.ndarray]:
    """(token, slot) int [h * w] of each patch of an h x w grid under the pixel shuffle by ``scale``."""
    i, j = np.divmod(np.arange(h * w), w)
    token = (i // scale) * (w // scale) + j // scale
    slot = (i % scale) * scale + j % scale
    return token, slot


def image_patches(v: VisionConfig, pixels: np.ndarray, pixel_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One image's per-patch arrays (``patches``, ``patch_valid``, ``patch_pos``, ``patch_group`` within the
    image, ``patch_slot``): ``pixels`` [C, S, S] at the tower's image size S, ``pixel_mask`` [S, S] its real
    pixels (None: all)."""
    if pixels.shape != (v.num_channels, v.image_size, v.image_size):
        raise ValueError(f"image of shape {pixels.shape}: expected {(v.num_channels, v.image_size, v.image_size)}")
    mask = np.ones(pixels.shape[1:], bool) if pixel_mask is None else pixel_mask.astype(bool)
    valid = patch_validity(mask, v.patch_size)
    group, slot = shuffle_slots(v.side, v.side, v.scale_factor)
    return dict(patches=patchify(pixels, v.patch_size), patch_valid=valid.reshape(-1),
                patch_pos=bucketized_positions(valid, v.side) if v.bucketize else np.arange(v.patches_per_image),
                patch_group=group, patch_slot=slot)


def layout_rows(v: VisionConfig, rows: Sequence[Sequence[dict[str, np.ndarray]]], max_patches: int,
                dtype: str = "float32") -> dict[str, np.ndarray]:
    """The batch's arrays [rows, max_patches, ...] (the fields of :class:`zoo.model.vision.VisionInputs`) from each
    row's images (each from :func:`image_patches`, :func:`zoo.data.gemma4_layout.gemma4_image_patches`, or
    :func:`zoo.data.qwen_layout.qwen_image_patches`, whose images differ in their patches), in order, each in as
    many patch slots as it has patches; a row's image k feeds the row's output tokens after those of the images
    before it (``tokens`` each, else its patches / group). ``dtype`` is the patches'."""
    b = len(rows)
    out = dict(patches=np.zeros((b, max_patches, v.patch_dim), dtype), patch_image=np.zeros((b, max_patches), np.int32),
               patch_valid=np.zeros((b, max_patches), bool), patch_pos=np.zeros((b, max_patches), np.int32),
               patch_group=np.full((b, max_patches), -1, np.int32), patch_slot=np.zeros((b, max_patches), np.int32))
    for r, images in enumerate(rows):
        need = sum(len(img["patches"]) for img in images)
        if need > max_patches:
            raise ValueError(f"row {r}: {len(images)} images of {need} patches exceed max_patches={max_patches}")
        start = first = 0  # the row's first patch slot and first output token of image k
        for k, img in enumerate(images):
            n = len(img["patches"])
            at = slice(start, start + n)
            out["patches"][r, at] = img["patches"]
            out["patch_image"][r, at] = k + 1
            out["patch_valid"][r, at] = img["patch_valid"]
            out["patch_pos"][r, at] = img["patch_pos"]
            out["patch_group"][r, at] = np.where(img["patch_group"] >= 0, img["patch_group"] + first, -1)
            out["patch_slot"][r, at] = img["patch_slot"]
            first += int(img.get("tokens", n // v.group))  # Gemma 4's images differ in their tokens
            start += n
    return out


def llama4_tile_patches(v: VisionConfig, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """One Llama 4 tile's per-patch arrays (as :func:`image_patches`'s): ``pixels`` [C, S, S] (the image
    processor's normalized tile), its patches in row-major order (the unfold's flattening is the conv's), then the
    class token's slot: no pixels, position row ``patches_per_image``, no output token (transformers drops it
    before the pixel shuffle). Every slot is a key: transformers' tower masks nothing within a tile."""
    if pixels.shape != (v.num_channels, v.image_size, v.image_size):
        raise ValueError(f"tile of shape {pixels.shape}: expected {(v.num_channels, v.image_size, v.image_size)}")
    group, slot = shuffle_slots(v.side, v.side, v.scale_factor)
    n = v.patches_per_image
    return dict(patches=np.concatenate([patchify(pixels, v.patch_size), np.zeros((1, v.patch_dim), pixels.dtype)]),
                patch_valid=np.ones(n + 1, bool), patch_pos=np.arange(n + 1),
                patch_group=np.append(group, -1), patch_slot=np.append(slot, 0), tokens=np.asarray(v.tokens_per_image))
