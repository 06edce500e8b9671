"""A vision-language model's image tower and connector: patches in, one feature per image token out.

:func:`encode_images` runs the SigLIP tower of SmolVLM/Idefics3 and Gemma 3 on a batch's patches
(:class:`VisionInputs`, laid out on the host by :mod:`zoo.data.vision_layout`): the patch embedding (a conv as one
matmul over flattened patches) plus the learned position table at each patch's row, the pre-norm encoder layers
scanned over their stacked weights, ``post_layernorm``, then the connector that ``VisionConfig.connector`` names
(:data:`CONNECTORS`: ``shuffle_linear``, ``avg_pool``). The tower attends bidirectionally within each image;
keys are the image's real patches only (transformers' ``patch_attention_mask``), while padding patches still run
as queries, since their outputs reach the connector as transformers' do.

Attention here is a plain masked softmax over a row's patches ([patches, patches] scores per head): SmolVLM's
images are at most 1024 patches, so the dense mask is small beside the tower's matmuls. The zoo's blockwise
kernels and :class:`zoo.model.masks.Visibility` are causal; a bidirectional option there is the design's next
step for the larger towers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from zoo.layers.blocks import ACTIVATIONS, dense, layer_norm, rms_norm
from zoo.model.config import ModelConfig
from zoo.model.vision_config import VisionConfig


@partial(jax.tree_util.register_dataclass,
         data_fields=("patches", "patch_image", "patch_valid", "patch_pos", "patch_group", "patch_slot"),
         meta_fields=())
@dataclass(frozen=True)
class VisionInputs:
    """A batch's images as patches, [rows, max_patches, ...] each (:mod:`zoo.data.vision_layout` has the meaning
    of every field): ``patches`` [b, n, patch_dim] float, ``patch_image`` [b, n] int (0: no image),
    ``patch_valid`` [b, n] bool, ``patch_pos`` [b, n] int, ``patch_group`` [b, n] int (-1: no token),
    ``patch_slot`` [b, n] int."""

    patches: jax.Array
    patch_image: jax.Array
    patch_valid: jax.Array
    patch_pos: jax.Array
    patch_group: jax.Array
    patch_slot: jax.Array


def _attention(v: VisionConfig, x: jax.Array, p: dict[str, jax.Array], visible: jax.Array) -> jax.Array:
    """Bidirectional multi-head attention of one tower layer over x [b, n, D] where ``visible`` [b, 1, n, n]."""
    b, n, _ = x.shape
    q, k, val = (dense(x, p[name]).reshape(b, n, v.num_heads, v.head_dim) + p[f"{name}_bias"] for name in "qkv")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * v.head_dim**-0.5
    # A finite floor, not -inf: a row's padding patches see no key, and must come out finite (then unused).
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(val.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, val).reshape(b, n, v.hidden_size)
    return dense(out, p["o"], contract=2) + p["o_bias"]


def _layer(v: VisionConfig, visible: jax.Array, x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
    """One SigLIP encoder layer: x + attention(LayerNorm(x)), then x + fc2(act(fc1(LayerNorm(x))))."""
    x = x + _attention(v, layer_norm(x, p["attn_norm"], p["attn_norm_bias"], v.norm_eps), p, visible)
    h = layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], v.norm_eps)
    h = ACTIVATIONS[v.hidden_act](dense(h, p["up"]) + p["up_bias"])
    return x + dense(h, p["down"]) + p["down_bias"], None


def tower(v: VisionConfig, params: dict[str, Any], inputs: VisionInputs) -> jax.Array:
    """The tower's final hidden states [b, n, D] (after ``post_layernorm``) of every patch of the batch."""
    w = params["vision"]
    x = dense(inputs.patches.astype(w["patch_embed"].dtype), w["patch_embed"]) + w["patch_bias"]
    x = x + jnp.take(w["pos_embed"], inputs.patch_pos, axis=0)
    img = inputs.patch_image
    visible = (img[:, :, None] == img[:, None, :]) & inputs.patch_valid[:, None, :]
    x, _ = jax.lax.scan(partial(_layer, v, visible[:, None]), x, w["layers"])
    return layer_norm(x, w["final_norm"], w["final_norm_bias"], v.norm_eps)


def shuffle_linear(v: VisionConfig, params: dict[str, Any], h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """The pixel-shuffle connector: each token's group of patch states [b, n, D] concatenated in slot order, then
    projected -> [b, n / group, hidden]."""
    b, n, d = h.shape
    tokens = n // v.group
    group = jnp.where(inputs.patch_group >= 0, inputs.patch_group, tokens)  # patches of no token land past the end
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    grouped = jnp.zeros((b, tokens + 1, v.group, d), h.dtype).at[rows, group, inputs.patch_slot].set(h)
    return dense(grouped[:, :tokens].reshape(b, tokens, v.group * d), params["projector"]["proj"])


def avg_pool(v: VisionConfig, params: dict[str, Any], h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """Gemma 3's connector (transformers' ``Gemma3MultiModalProjector``): each token's group of patch states
    [b, n, D] averaged (``AvgPool2d`` over ``scale_factor`` x ``scale_factor`` patches), Gemma's ``(1 + w)``
    RMSNorm, then projected -> [b, n / group, hidden]."""
    b, n, d = h.shape
    tokens = n // v.group
    group = jnp.where(inputs.patch_group >= 0, inputs.patch_group, tokens)  # patches of no token land past the end
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    summed = jnp.zeros((b, tokens + 1, d), jnp.float32).at[rows, group].add(h.astype(jnp.float32))
    pooled = (summed[:, :tokens] / v.group).astype(h.dtype)
    w = params["projector"]
    return dense(rms_norm(pooled, w["norm"], v.norm_eps, 1.0), w["proj"])


# VisionConfig.connector -> the function from the tower's states to one feature per image token
CONNECTORS = {"shuffle_linear": shuffle_linear, "avg_pool": avg_pool}


def encode_images(cfg: ModelConfig, params: dict[str, Any], inputs: VisionInputs) -> jax.Array:
    """The image features [b, max_patches / group, hidden] of a batch's rows, in the order of their image tokens."""
    v = cfg.vision
    assert v is not None, "encode_images needs a model with a vision tower"
    if v.tower == "qwen2_5":  # imported here: zoo.model.vision_qwen builds on this module's VisionInputs
        from zoo.model.vision_qwen import encode_qwen

        return encode_qwen(v, params, inputs)
    return CONNECTORS[v.connector](v, params, tower(v, params, inputs), inputs)
