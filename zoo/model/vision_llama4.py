"""Llama 4's pieces around the SigLIP-shaped layers of :mod:`zoo.model.vision` (transformers' ``Llama4VisionModel``,
``Llama4VisionPixelShuffleMLP`` and ``Llama4MultiModalProjector``).

Images come as tiles of the tower's fixed ``image_size`` (the image processor cuts an image into up to 16 tiles
and adds the whole image resized as one more tile, the "global" one). Each tile is an image of
:class:`zoo.model.vision.VisionInputs` (:func:`zoo.data.vision_layout.llama4_tile_patches`): its patches in row-major
order, then one class-token slot whose ``patch_pos`` is ``patches_per_image`` (transformers appends the class
token after the patches).

- :func:`embed`: an unfold patch embedding (a bias-free Linear over the flattened (channel, row, column) patch),
  the class token's learned vector in its slot, the position table (one row a patch, the class token's last),
  then ``layernorm_pre``.
- :func:`rope_tables`: 2-D RoPE on q and k as transformers' ``Llama4VisionRotaryEmbedding``: pairs of adjacent
  channels (complex numbers), the first half of the pairs rotated by the patch's column + 1, the second half by
  its row + 1, each at ``rope_theta^(-4k / head_dim)``; the class token not rotated.
- The layers are SigLIP's (LayerNorms, q/k/v/o and fc1/fc2 with biases, exact GELU) with the rotation after the
  q/k projections; attention is within a tile, every slot a key.
- :func:`adapter`: after ``layernorm_post`` the class token is dropped (its ``patch_group`` is -1) and SmolVLM's
  pixel shuffle concatenates each 2 x 2 block of patches into one token (``patch_slot`` order), then fc1, GELU,
  fc2, GELU (no biases) and the projector's Linear to the language model's width.

LoRA: the tower's ``vision.*`` targets as SigLIP's; the connector's ``projector.fc1``, ``projector.fc2`` and
``projector.proj``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zoo.layers.blocks import ACTIVATIONS, dense, layer_norm
from zoo.lora.projections import PROJECTOR_DROPOUT, PartLora, adapted_dense
from zoo.lora.weights import Weights
from zoo.model.vision_config import VisionConfig
from zoo.model.vision_inputs import VisionInputs
from zoo.model.vision_qwen import group_patches


def embed(v: VisionConfig, w: dict[str, Any], inputs: VisionInputs) -> jax.Array:
    """The tower's input [b, n, D]: each patch's projection (the class token's vector in its slot) plus its
    position row, then the pre-layer LayerNorm. ``w``: the tower's weights (``vision.*``)."""
    x = dense(inputs.patches.astype(w["patch_embed"].dtype), w["patch_embed"])
    is_class = (inputs.patch_pos == v.patches_per_image)[..., None]
    x = jnp.where(is_class, w["class_embed"].astype(x.dtype), x)
    x = x + jnp.take(w["pos_embed"], inputs.patch_pos, axis=0).astype(x.dtype)
    return layer_norm(x, w["pre_norm"], w["pre_norm_bias"], v.norm_eps)


def rope_tables(v: VisionConfig, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [b, n, head_dim / 2] float32 of each slot's channel pairs, from its position row ``pos`` [b, n]
    (the class token's row: angle 0)."""
    quarter = v.head_dim // 4
    inv = 1.0 / (v.rope_theta ** (jnp.arange(0, 2 * quarter, 2, dtype=jnp.float32) / (2 * quarter)))
    col, row = (pos % v.side + 1).astype(jnp.float32), (pos // v.side + 1).astype(jnp.float32)
    angles = jnp.concatenate([col[..., None] * inv, row[..., None] * inv], axis=-1)
    angles = jnp.where((pos < v.patches_per_image)[..., None], angles, 0.0)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(t: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """t [b, n, heads, head_dim] with each pair of adjacent channels (a complex number) turned by its angle, in
    float32 (transformers' ``vision_apply_rotary_emb``), cast back to t's dtype."""
    cos, sin = (a[:, :, None] for a in rope)
    pairs = t.astype(jnp.float32).reshape(*t.shape[:-1], -1, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(t.shape).astype(t.dtype)


def adapter(v: VisionConfig, params: Any, h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """The ``pixel_shuffle_mlp`` connector: each token's 2 x 2 patches of the tower's states h [b, n, D]
    concatenated (the class tokens dropped), fc1 -> GELU -> fc2 -> GELU, then the projection -> [b, n / group,
    hidden]; LoRA on each of the three where ``params`` has it."""
    w = Weights.wrap(params).base["projector"]
    lora = PartLora.of(params, ("projector",), PROJECTOR_DROPOUT).whole()
    gelu = ACTIVATIONS["gelu"]  # transformers' nn.GELU(), whatever the config's hidden_act
    x = gelu(adapted_dense(group_patches(v, h, inputs), w["fc1"], lora, "fc1"))
    x = gelu(adapted_dense(x, w["fc2"], lora, "fc2"))
    return adapted_dense(x, w["proj"], lora, "proj")
