"""Qwen3-VL's image tower, patch merger and DeepStack mergers (transformers' ``Qwen3VLVisionModel``): patches in, one
feature per image token out, and one more per DeepStack level. Qwen3.5's tower (``Qwen3_5VisionModel``) is this one
with no DeepStack levels (``VisionConfig.deepstack_layers`` empty).

The patches come laid out as Qwen2.5-VL's (:mod:`zoo.data.qwen_layout`: each image its own grid, block-major, each
patch's row and column in ``patch_pos``), and the tower shares that one's 2-D RoPE and attention
(:mod:`zoo.model.vision_qwen`); what differs:

- the conv3d patch embedding has a bias, and a learned position table (``pos_table`` rows: a square grid) is
  resampled to each image's grid bilinearly with aligned corners, as transformers'
  ``get_vision_interpolation_indices_and_weights`` (once ``fast_pos_embed_interpolate``) does: a patch at row r of
  an image h patches high reads the table at r * (side - 1) / (h - 1), likewise for its column, its four nearest
  entries weighted. Each image's rows and columns are counted from its own patches on the device.
- the layers are LayerNorm (with biases) pre-norm blocks: fused qkv, 2-D RoPE, full attention within each image
  (no windows), and a plain fc1 -> act -> fc2 MLP (``hidden_act``, gelu_pytorch_tanh in the releases).
- the merger LayerNorms each patch, concatenates a token's group, then fc1 -> gelu -> fc2.
- DeepStack: the states after each of ``VisionConfig.deepstack_layers`` go through a merger of their own (the
  LayerNorm after the concatenation, over the group's width); the language model adds the j-th level's features to
  its hidden states at the image tokens after its j-th layer (:mod:`zoo.model.multimodal`).

The layers are scanned in pieces that end at the DeepStack layers (three in the releases), so the program's size
grows with the levels, never with the depth.

LoRA (``vision.*``, ``projector.fc1``/``fc2`` and ``projector.deepstack.fc1``/``fc2`` targets:
:mod:`zoo.lora.vision_targets`) adds its adapters beside the fused qkv (one adapter, as peft adapts the one
``attn.qkv`` Linear), ``o``, fc1 and fc2 of each layer, and the mergers' fc1 and fc2 (the DeepStack mergers' stacked
over the levels, as their weights).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from zoo.layers.blocks import ACTIVATIONS, dense, layer_norm
from zoo.lora.projections import (
    DEEPSTACK_DROPOUT,
    PROJECTOR_DROPOUT,
    TOWER_DROPOUT,
    LayerLora,
    PartLora,
    adapted_dense,
)
from zoo.lora.weights import Weights
from zoo.model.layer_scan import REMAT_POLICIES, stack_slice
from zoo.model.sharding import batch_sharded
from zoo.model.vision_config import VisionConfig
from zoo.model.vision_inputs import VisionInputs
from zoo.model.vision_qwen import HW_STRIDE, group_patches, merger_mlp, qwen_attention, qwen_masks, qwen_rope

NORM_EPS = 1e-6  # transformers' Qwen3-VL tower and mergers fix their LayerNorms' epsilon


def _axis_taps(index: jax.Array, size: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    """(table index [..., 2], weight [..., 2]) of a patch at ``index`` of an axis ``size`` patches long on a table
    ``side`` long: bilinear with aligned corners, in float32 as transformers computes them."""
    src = index.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    floor = jnp.floor(src)
    offsets = jnp.arange(2, dtype=jnp.float32)
    taps = jnp.clip(floor.astype(jnp.int32)[..., None] + jnp.arange(2), 0, side - 1)
    weights = jnp.clip(1 - jnp.abs(src[..., None] - floor[..., None] - offsets), 0, None)
    return taps, weights


def position_embeddings(v: VisionConfig, table: jax.Array, inputs: VisionInputs, row: jax.Array,
                        col: jax.Array) -> jax.Array:
    """The learned positions [b, n, D] of each patch: the square table [side * side, D] resampled to its image's
    grid (:func:`_axis_taps` along each axis; the four taps summed in transformers' order)."""
    b, n = row.shape
    side = round(v.pos_table**0.5)
    img, rows = inputs.patch_image, jnp.arange(b)[:, None]
    # Each image's rows and columns of patches: one more than its patches' largest row and column.
    height = jnp.zeros((b, n + 1), jnp.int32).at[rows, img].max(row + 1)
    width = jnp.zeros((b, n + 1), jnp.int32).at[rows, img].max(col + 1)
    h_taps, h_w = _axis_taps(row, jnp.take_along_axis(height, img, axis=1), side)
    w_taps, w_w = _axis_taps(col, jnp.take_along_axis(width, img, axis=1), side)
    index = (h_taps[..., :, None] * side + w_taps[..., None, :]).reshape(b, n, 4)
    weight = (h_w[..., :, None] * w_w[..., None, :]).reshape(b, n, 4)
    gathered = jnp.take(table, index, axis=0).astype(jnp.float32)  # [b, n, 4, D]
    return (gathered * weight[..., None]).sum(axis=2)


def _layer(v: VisionConfig, rope: tuple[jax.Array, jax.Array], visible: jax.Array, part: PartLora, x: jax.Array,
           inputs: tuple[dict[str, jax.Array], dict | None, jax.Array | None]) -> tuple[jax.Array, None]:
    """One block: x + attention(LayerNorm(x)) within its image, then x + fc2(act(fc1(LayerNorm(x)))); ``inputs``:
    the layer's weights, its LoRA adapters (or None) and dropout key (or None)."""
    p, adapters, key = inputs
    lora = part.layer(adapters, key)
    x = batch_sharded(x, sequence=False)  # each chip its own rows' patches (zoo.model.vision's towers alike)
    h = layer_norm(x, p["attn_norm"], p["attn_norm_bias"], NORM_EPS)
    x = batch_sharded(x + qwen_attention(v, rope, visible, h, p, lora), sequence=False)
    h = layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], NORM_EPS)
    h = ACTIVATIONS[v.hidden_act](adapted_dense(h, p["up"], lora, "up") + p["up_bias"])
    return batch_sharded(x + adapted_dense(h, p["down"], lora, "down") + p["down_bias"], sequence=False), None


def qwen3_tower(v: VisionConfig, params: Any, inputs: VisionInputs,
                remat: str = "none") -> tuple[jax.Array, list[jax.Array]]:
    """(the tower's last hidden states [b, n, D], the states after each DeepStack layer, in order) of every patch
    of the batch; ``params``: the model's parameters or its :class:`zoo.lora.weights.Weights` (LoRA's
    ``vision.layers`` adapters beside their weights); ``remat`` (:data:`zoo.model.layer_scan.REMAT_POLICIES`)
    wraps each layer as the decoder's."""
    w = Weights.wrap(params).base["vision"]
    part = PartLora.of(params, ("vision", "layers"), TOWER_DROPOUT)
    stacked = (w["layers"], part.adapters, part.keys(v.num_layers))
    x = dense(inputs.patches.astype(w["patch_embed"].dtype), w["patch_embed"]) + w["patch_bias"]
    row, col = inputs.patch_pos // HW_STRIDE, inputs.patch_pos % HW_STRIDE
    x = x + position_embeddings(v, w["pos_embed"], inputs, row, col).astype(x.dtype)
    # No windows (VisionConfig.window_patches is 0): every layer attends within each whole image.
    layer: Callable[..., Any] = partial(_layer, v, qwen_rope(v, row, col), qwen_masks(v, inputs, row, col)[0], part)
    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    levels, start = [], 0
    for stop in (*(i + 1 for i in v.deepstack_layers), v.num_layers):  # one scan a piece between the levels
        if stop > start:
            x, _ = jax.lax.scan(layer, x, stack_slice(stacked, start, stop - start))
        levels.append(x)
        start = stop
    return x, levels[:-1]


def _merger(v: VisionConfig, w: dict[str, jax.Array], h: jax.Array, inputs: VisionInputs,
            postshuffle: bool, lora: LayerLora | None) -> jax.Array:
    """A patch merger of patch states h [b, n, D] -> [b, n / group, hidden]: LayerNorm per patch (or, with
    ``postshuffle``, after each token's group is concatenated: the DeepStack mergers), fc1 -> gelu -> fc2 (with
    their LoRA adapters where ``lora`` has them)."""
    if postshuffle:
        x = layer_norm(group_patches(v, h, inputs), w["norm"], w["norm_bias"], NORM_EPS)
    else:
        x = group_patches(v, layer_norm(h, w["norm"], w["norm_bias"], NORM_EPS), inputs)
    return merger_mlp(w, x, lora)


def encode_qwen3(v: VisionConfig, params: Any, inputs: VisionInputs,
                 remat: str = "none") -> tuple[jax.Array, jax.Array | None]:
    """(the image features [b, max_patches / group, hidden] of a batch's rows in the order of their image tokens,
    the DeepStack features [levels, b, max_patches / group, hidden] in the same order, or None without levels).
    ``params``: the model's parameters or its :class:`zoo.lora.weights.Weights` (the tower's and the mergers'
    adapters beside their weights)."""
    last, levels = qwen3_tower(v, params, inputs, remat)
    w = Weights.wrap(params).base["projector"]
    main = PartLora.of(params, ("projector",), PROJECTOR_DROPOUT).whole()
    features = _merger(v, {k: a for k, a in w.items() if k != "deepstack"}, last, inputs, False, main)
    if not levels:
        return features, None
    deep = PartLora.of(params, ("projector", "deepstack"), DEEPSTACK_DROPOUT)

    def level(p: dict[str, jax.Array], h: jax.Array, adapters: dict | None, key: jax.Array | None) -> jax.Array:
        return _merger(v, p, h, inputs, True, deep.layer(adapters, key))

    return features, jax.vmap(level)(w["deepstack"], jnp.stack(levels), deep.adapters, deep.keys(len(levels)))
