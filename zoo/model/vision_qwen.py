"""Qwen2.5-VL's image tower and patch merger (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``): patches in,
one feature per image token out.

Each image is its own grid of patches (dynamic resolution), laid out on the host by :mod:`zoo.data.qwen_layout` in
the order transformers' image processor emits them: block-major, each ``scale_factor`` x ``scale_factor`` block of
patches (one merged token) consecutive. Per patch, :class:`zoo.model.vision.VisionInputs` carries its pixels
(``channels x temporal_patch_size x patch x patch``, the conv3d's (C, T, y, x) order, so the patch embedding is one
matmul), its image (``patch_image``), its place in the image's grid (``patch_pos`` = row * :data:`HW_STRIDE` + column:
the tower's 2-D RoPE and its windows read both), and its merged token and slot (``patch_group``, ``patch_slot``).

transformers permutes the patches into window order, runs each window (or, in ``fullatt_layers``, each image) as its
own sequence, and permutes the merged tokens back; attention is the same under any order of the patches, so here
the patches stay in the processor's order and a mask says which patches see which: the same image, and in windowed
layers the same window (``VisionConfig.window_patches`` a side, counted from the image's top-left patch, as
transformers pads the merged grid at the bottom and right). The layers are pre-norm (RMSNorm): fused qkv with 2-D
rotary positions (the head's first half rotated by the row, its second by the column), a SwiGLU MLP with biases;
then the merger: ``ln_q`` per patch, each block's patches concatenated, fc1 -> gelu -> fc2.

LoRA (``vision.*`` and ``projector.fc1``/``fc2`` targets: :mod:`zoo.lora.vision_targets`) adds its adapters beside
the fused qkv (one adapter over its three outputs, as peft adapts transformers' one ``attn.qkv`` Linear), ``o``, the
MLP's projections and the merger's, scanned with their layer as the decoder's are.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo.layers.blocks import ACTIVATIONS, dense, rms_norm
from zoo.lora.projections import PROJECTOR_DROPOUT, TOWER_DROPOUT, LayerLora, PartLora, adapted_dense
from zoo.lora.weights import Weights
from zoo.model.layer_scan import REMAT_POLICIES
from zoo.model.sharding import batch_sharded
from zoo.model.vision_config import VisionConfig
from zoo.model.vision_inputs import VisionInputs

HW_STRIDE = 1 << 12  # patch_pos = row * HW_STRIDE + column: rows and columns of at most 4096 patches
NORM_EPS = 1e-6  # transformers' Qwen2.5-VL tower and merger fix their RMSNorms' epsilon


def qwen_rope(v: VisionConfig, row: jax.Array, col: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [b, n, head_dim] of the tower's 2-D RoPE: head_dim/4 frequencies (over half the head) for the row,
    the same for the column, concatenated, then repeated as rotate-half pairs (transformers' axial RoPE)."""
    half = v.head_dim // 2
    inv_np = 1.0 / (np.float32(v.rope_theta) ** (np.arange(0, half, 2, dtype=np.int64).astype(np.float32) / half))
    inv = jnp.asarray(inv_np.astype(np.float32))
    freqs = jnp.concatenate([row.astype(jnp.float32)[..., None] * inv, col.astype(jnp.float32)[..., None] * inv], -1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x [b, n, heads, head_dim] in float32 (transformers' ``apply_rotary_pos_emb_vision``)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def qwen_attention(v: VisionConfig, rope: tuple[jax.Array, jax.Array], visible: jax.Array, h: jax.Array,
                   p: dict[str, jax.Array], lora: LayerLora | None = None) -> jax.Array:
    """The tower's attention of normed states h [b, n, D] (Qwen2.5-VL's and Qwen3-VL's alike): the fused qkv with
    its bias, 2-D RoPE on q and k, a masked softmax over the keys ``visible`` [b, 1, n, n], then ``o`` and its bias;
    the layer's ``lora`` adapters (if any) beside qkv and o."""
    b, n, _ = h.shape
    qkv = adapted_dense(h, p["qkv"], lora, "qkv").reshape(b, n, 3, v.num_heads, v.head_dim) + p["qkv_bias"]
    q, k, val = _rotate(qkv[:, :, 0], *rope), _rotate(qkv[:, :, 1], *rope), qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * v.head_dim**-0.5
    # A finite floor, not -inf: a row's padding patches see no key, and must come out finite (then unused).
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(val.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, val).reshape(b, n, v.hidden_size)
    return adapted_dense(out, p["o"], lora, "o", contract=2) + p["o_bias"]


def _layer(v: VisionConfig, rope: tuple[jax.Array, jax.Array], masks: tuple[jax.Array, jax.Array], part: PartLora,
           x: jax.Array, inputs: tuple[dict[str, jax.Array], jax.Array, dict | None, jax.Array | None]
           ) -> tuple[jax.Array, None]:
    """One block: x + attention(RMSNorm(x)) over its window (or its image where ``full``), then
    x + down(silu(gate(h)) * up(h)) of h = RMSNorm(x); the layer's LoRA adapters (or None) and dropout key (or
    None) beside its projections."""
    p, full, adapters, key = inputs
    lora = part.layer(adapters, key)
    x = batch_sharded(x, sequence=False)  # each chip its own rows' patches (zoo.model.vision's towers alike)
    visible = jnp.where(full, masks[0], masks[1])
    x = batch_sharded(x + qwen_attention(v, rope, visible, rms_norm(x, p["attn_norm"], NORM_EPS), p, lora),
                      sequence=False)
    h = rms_norm(x, p["mlp_norm"], NORM_EPS)
    gated = ACTIVATIONS[v.hidden_act](adapted_dense(h, p["gate"], lora, "gate") + p["gate_bias"]) * (
        adapted_dense(h, p["up"], lora, "up") + p["up_bias"])
    return batch_sharded(x + adapted_dense(gated, p["down"], lora, "down") + p["down_bias"], sequence=False), None


def qwen_masks(v: VisionConfig, inputs: VisionInputs, row: jax.Array, col: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(whole image, window) visibility [b, 1, n, n]: same image and a real key; the window mask also the same
    window of that image."""
    img = inputs.patch_image
    same = (img[:, :, None] == img[:, None, :]) & inputs.patch_valid[:, None, :]
    if not v.window_patches:
        return same[:, None], same[:, None]
    win = (row // v.window_patches) * HW_STRIDE + col // v.window_patches
    return same[:, None], (same & (win[:, :, None] == win[:, None, :]))[:, None]


def qwen_tower(v: VisionConfig, params: Any, inputs: VisionInputs, remat: str = "none") -> jax.Array:
    """The tower's last hidden states [b, n, D] of every patch of the batch (before the merger); ``params``: the
    model's parameters or its :class:`zoo.lora.weights.Weights` (LoRA's ``vision.layers`` adapters run beside
    their weights); ``remat`` (:data:`zoo.model.layer_scan.REMAT_POLICIES`) wraps each layer as the decoder's."""
    w = Weights.wrap(params).base["vision"]
    part = PartLora.of(params, ("vision", "layers"), TOWER_DROPOUT)
    x = dense(inputs.patches.astype(w["patch_embed"].dtype), w["patch_embed"])
    row, col = inputs.patch_pos // HW_STRIDE, inputs.patch_pos % HW_STRIDE
    full = jnp.asarray([i in v.fullatt_layers for i in range(v.num_layers)])
    layer: Callable[..., Any] = partial(_layer, v, qwen_rope(v, row, col), qwen_masks(v, inputs, row, col), part)
    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    x, _ = jax.lax.scan(layer, x, (w["layers"], full, part.adapters, part.keys(v.num_layers)))
    return x


def group_patches(v: VisionConfig, h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """Each merged token's group of patch states h [b, n, D] concatenated in slot order -> [b, n / group, group * D]
    (the patches of no token dropped)."""
    b, n, d = h.shape
    tokens = n // v.group
    group = jnp.where(inputs.patch_group >= 0, inputs.patch_group, tokens)  # patches of no token land past the end
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    grouped = jnp.zeros((b, tokens + 1, v.group, d), h.dtype).at[rows, group, inputs.patch_slot].set(h)
    return grouped[:, :tokens].reshape(b, tokens, v.group * d)


def merger_mlp(w: dict[str, jax.Array], x: jax.Array, lora: LayerLora | None) -> jax.Array:
    """A patch merger's fc1 -> gelu -> fc2 (each with its bias, and its LoRA adapter where ``lora`` has one)."""
    x = adapted_dense(x, w["fc1"], lora, "fc1") + w["fc1_bias"]
    return adapted_dense(ACTIVATIONS["gelu"](x), w["fc2"], lora, "fc2") + w["fc2_bias"]


def patch_merger(v: VisionConfig, params: Any, h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """Qwen2.5-VL's merger: ``ln_q`` on each patch state [b, n, D], each token's group concatenated in slot order,
    then fc1 -> gelu -> fc2 -> [b, n / group, hidden]; ``params``: the model's parameters or its Weights."""
    w = Weights.wrap(params).base["projector"]
    x = group_patches(v, rms_norm(h, w["norm"], NORM_EPS), inputs)
    return merger_mlp(w, x, PartLora.of(params, ("projector",), PROJECTOR_DROPOUT).whole())


def encode_qwen(v: VisionConfig, params: Any, inputs: VisionInputs, remat: str = "none") -> jax.Array:
    """The image features [b, max_patches / group, hidden] of a batch's rows, in the order of their image tokens.
    ``params``: the model's parameters or its :class:`zoo.lora.weights.Weights` (the tower's and the merger's
    adapters beside their weights)."""
    return patch_merger(v, params, qwen_tower(v, params, inputs, remat), inputs)
