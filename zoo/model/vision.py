"""A vision-language model's image tower and connector: patches in, one feature per image token out.

:func:`encode_images` runs the SigLIP tower of SmolVLM/Idefics3 and Gemma 3 on a batch's patches
(:class:`VisionInputs`, laid out on the host by :mod:`zoo.data.vision_layout`): the patch embedding (a conv as one
matmul over flattened patches) plus the learned position table at each patch's row, the pre-norm encoder layers
scanned over their stacked weights, ``post_layernorm``, then the connector that ``VisionConfig.connector`` names
(:data:`CONNECTORS`: ``shuffle_linear``, ``avg_pool``; Llama 4's ``pixel_shuffle_mlp``, its tower's class
token, pre-layer norm and 2-D RoPE from :mod:`zoo.model.vision_llama4`). The tower attends bidirectionally within each image;
keys are the image's real patches only (transformers' ``patch_attention_mask``), while padding patches still run
as queries, since their outputs reach the connector as transformers' do.

LoRA (:mod:`zoo.lora.params`' ``vision.*`` and ``projector.proj`` targets) adds its adapters beside the tower's
q/k/v/o and fc1/fc2 (scanned with their layer, as the decoder's are) and the connector's projection, with LoRA
dropout keyed apart from the decoder's; ``remat`` wraps the tower's layer scan as it wraps the decoder's
(:data:`zoo.model.layer_scan.REMAT_POLICIES`).

Attention runs in blocks of queries (:func:`tower_block`), one block after another (a ``lax.map``): each block
scores every key of its row, so a layer holds one block's [block, patches] scores a head at a time, not [patches,
patches] (Gemma 3's 4,096-patch frame: blocks of 512 queries, 128 MiB of float32 scores a row instead of 1 GiB),
and the backward pass recomputes a block's probabilities from its queries (``jax.checkpoint`` around the block)
instead of keeping them. Rows of at most one block (128 patches at the default) take the plain softmax, whose
probabilities the backward pass keeps unless ``remat`` says otherwise. The language model's kernel
(:mod:`zoo.kernels.blockwise`) unrolls its blocks, which suits its causal key ranges; unrolled here, the TPU
compiler kept all of a layer's blocks' scores live at once (8 x 128 MiB for Gemma 3's frame, as much as the whole
matrix), so the tower loops instead.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zoo.kernels.blockwise import query_block
from zoo.layers.blocks import ACTIVATIONS, dense, layer_norm, rms_norm
from zoo.lora.projections import PROJECTOR_DROPOUT, TOWER_DROPOUT, LayerLora, PartLora, adapted_dense
from zoo.lora.weights import Weights
from zoo.model import vision_llama4 as llama4
from zoo.model.config import ModelConfig
from zoo.model.layer_scan import LAYER_INPUT, REMAT_POLICIES
from zoo.model.sharding import batch_sharded
from zoo.model.vision_config import VisionConfig
from zoo.model.vision_gemma4 import encode_gemma4
from zoo.model.vision_inputs import VisionInputs
from zoo.model.vision_qwen import encode_qwen
from zoo.model.vision_qwen3 import encode_qwen3

__all__ = ["VisionInputs", "encode_images", "encode_with_deepstack", "tower", "tower_block", "shuffle_linear", "avg_pool",
           "CONNECTORS"]

def tower_block(patches: int) -> int:
    """Queries a block of the tower's attention over rows of ``patches`` patches: the language model's
    (:func:`zoo.kernels.blockwise.query_block`: 128, or patches / 8 for more than 1,024)."""
    return query_block(patches)


def _block_attention(scale: float, k: jax.Array, val: jax.Array, keys: jax.Array, q: jax.Array,
                     images: jax.Array) -> jax.Array:
    """Softmax attention of one block of queries q [b, block, heads, head_dim] over every key k, val [b, n, heads,
    head_dim] of the row: a query of image ``images`` [b, block] sees the keys whose ``keys`` [b, n] is its image."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    # A finite floor, not -inf: a row's padding patches see no key, and must come out finite (then unused).
    scores = jnp.where((images[:, :, None] == keys[:, None, :])[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(val.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, val)


def _attention(v: VisionConfig, x: jax.Array, p: dict[str, jax.Array], patches: tuple[jax.Array, jax.Array],
               rope: tuple[jax.Array, jax.Array] | None, lora: LayerLora | None) -> jax.Array:
    """Bidirectional multi-head attention of one tower layer over x [b, n, D], one block of queries
    (:func:`tower_block`) at a time. ``patches``: each patch's image [b, n] (1.., 0 for the row's padding) and, as a
    key, its image if it is a real patch, else -1 (transformers' ``patch_attention_mask``). ``rope``: Llama 4's
    2-D rotation of q and k (:func:`zoo.model.vision_llama4.rope_tables`), None for SigLIP's none."""
    b, n, _ = x.shape
    images, keys = patches
    q, k, val = (adapted_dense(x, p[name], lora, name).reshape(b, n, v.num_heads, v.head_dim) + p[f"{name}_bias"]
                 for name in "qkv")
    if rope is not None:
        q, k = llama4.rotate(q, rope), llama4.rotate(k, rope)
    scale, block = v.head_dim**-0.5, tower_block(n)
    if n <= block:  # one block: the plain softmax, its probabilities kept for the backward pass unless remat
        out = _block_attention(scale, k, val, keys, q, images)
    else:
        blocks = -(-n // block)
        pad = blocks * block - n  # queries past the row (image -2: they see nothing), dropped after

        def split(a: jax.Array, fill: int = 0) -> jax.Array:  # [b, n, ...] -> [blocks, b, block, ...]
            a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
            return jnp.swapaxes(a.reshape(b, blocks, block, *a.shape[2:]), 0, 1)

        attend = jax.checkpoint(partial(_block_attention, scale))  # the backward pass recomputes a block's scores
        out = jax.lax.map(lambda qb: attend(k, val, keys, *qb), (split(q), split(images, -2)))
        out = jnp.swapaxes(out, 0, 1).reshape(b, blocks * block, v.num_heads, v.head_dim)[:, :n]
    return adapted_dense(out.reshape(b, n, v.hidden_size), p["o"], lora, "o", contract=2) + p["o_bias"]


def _layer(v: VisionConfig, patches: tuple[jax.Array, jax.Array], rope: tuple[jax.Array, jax.Array] | None,
           part: PartLora, x: jax.Array,
           inputs: tuple[dict[str, jax.Array], dict | None, jax.Array | None]) -> tuple[jax.Array, None]:
    """One SigLIP encoder layer: x + attention(LayerNorm(x)), then x + fc2(act(fc1(LayerNorm(x)))); ``inputs``
    are the layer's weights, its LoRA adapters (or None) and its LoRA dropout key (or None); ``rope`` Llama 4's."""
    p, adapters, key = inputs
    lora = part.layer(adapters, key)
    x = checkpoint_name(batch_sharded(x, sequence=False), LAYER_INPUT)  # each chip its own rows' patches
    x = batch_sharded(x + _attention(v, layer_norm(x, p["attn_norm"], p["attn_norm_bias"], v.norm_eps), p, patches,
                                     rope, lora), sequence=False)
    h = layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], v.norm_eps)
    h = batch_sharded(ACTIVATIONS[v.hidden_act](adapted_dense(h, p["up"], lora, "up") + p["up_bias"]), sequence=False)
    return batch_sharded(x + adapted_dense(h, p["down"], lora, "down") + p["down_bias"], sequence=False), None


def tower(v: VisionConfig, params: Any, inputs: VisionInputs, remat: str = "none") -> jax.Array:
    """The tower's final hidden states [b, n, D] (after ``post_layernorm``) of every patch of the batch.

    ``params``: the model's parameters, or its :class:`zoo.lora.weights.Weights` (LoRA's ``vision.layers``
    adapters run beside their weights). ``remat`` (:data:`zoo.model.layer_scan.REMAT_POLICIES`) wraps each layer
    of the scan in :func:`jax.checkpoint`, as the decoder's blocks are."""
    base = Weights.wrap(params).base["vision"]
    part = PartLora.of(params, ("vision", "layers"), TOWER_DROPOUT)
    rope = None
    if v.tower == "llama4":  # the class token, the pre-layer norm, 2-D RoPE (zoo.model.vision_llama4)
        x, rope = llama4.embed(v, base, inputs), llama4.rope_tables(v, inputs.patch_pos)
    else:
        x = dense(inputs.patches.astype(base["patch_embed"].dtype), base["patch_embed"]) + base["patch_bias"]
        x = x + jnp.take(base["pos_embed"], inputs.patch_pos, axis=0)
    patches = inputs.patch_image, jnp.where(inputs.patch_valid, inputs.patch_image, -1)  # queries', keys' images
    layer: Callable[..., Any] = partial(_layer, v, patches, rope, part)
    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    x, _ = jax.lax.scan(layer, x, (base["layers"], part.adapters, part.keys(v.num_layers)))
    return layer_norm(x, base["final_norm"], base["final_norm_bias"], v.norm_eps)


def _projection(params: Any, x: jax.Array) -> jax.Array:
    """The connector's projection ``projector.proj`` of x, with its LoRA adapter where ``params`` has one."""
    lora = PartLora.of(params, ("projector",), PROJECTOR_DROPOUT).whole()
    return adapted_dense(x, Weights.wrap(params).base["projector"]["proj"], lora, "proj")


def shuffle_linear(v: VisionConfig, params: Any, h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """The pixel-shuffle connector: each token's group of patch states [b, n, D] concatenated in slot order, then
    projected -> [b, n / group, hidden]."""
    b, n, d = h.shape
    tokens = n // v.group
    group = jnp.where(inputs.patch_group >= 0, inputs.patch_group, tokens)  # patches of no token land past the end
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    grouped = jnp.zeros((b, tokens + 1, v.group, d), h.dtype).at[rows, group, inputs.patch_slot].set(h)
    return _projection(params, grouped[:, :tokens].reshape(b, tokens, v.group * d))


def avg_pool(v: VisionConfig, params: Any, h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """Gemma 3's connector (transformers' ``Gemma3MultiModalProjector``): each token's group of patch states
    [b, n, D] averaged (``AvgPool2d`` over ``scale_factor`` x ``scale_factor`` patches), Gemma's ``(1 + w)``
    RMSNorm, then projected -> [b, n / group, hidden]."""
    b, n, d = h.shape
    tokens = n // v.group
    group = jnp.where(inputs.patch_group >= 0, inputs.patch_group, tokens)  # patches of no token land past the end
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    summed = jnp.zeros((b, tokens + 1, d), jnp.float32).at[rows, group].add(h.astype(jnp.float32))
    pooled = (summed[:, :tokens] / v.group).astype(h.dtype)
    norm = Weights.wrap(params).base["projector"]["norm"]
    return _projection(params, rms_norm(pooled, norm, v.norm_eps, 1.0))


# VisionConfig.connector -> the function from the tower's states to one feature per image token
CONNECTORS = {"shuffle_linear": shuffle_linear, "avg_pool": avg_pool, "pixel_shuffle_mlp": llama4.adapter}


def encode_with_deepstack(cfg: ModelConfig, params: Any, inputs: VisionInputs,
                          remat: str = "none") -> tuple[jax.Array, jax.Array | None]:
    """(the image features [b, max_patches / group, hidden] of a batch's rows, in the order of their image tokens;
    Qwen3-VL's DeepStack features [levels, b, max_patches / group, hidden] in that order, else None).
    ``params``: the model's parameters or its :class:`zoo.lora.weights.Weights`; ``remat``: the tower's (:func:`tower`)."""
    v = cfg.vision
    assert v is not None, "encode_images needs a model with a vision tower"
    if v.tower == "gemma4":  # its own tower and connector
        return encode_gemma4(cfg, params, inputs, remat), None
    if v.tower == "qwen2_5":  # its own tower and merger
        return encode_qwen(v, params, inputs, remat), None
    if v.tower == "qwen3":  # its own tower, merger and DeepStack mergers
        return encode_qwen3(v, params, inputs, remat)
    return CONNECTORS[v.connector](v, params, tower(v, params, inputs, remat), inputs), None


def encode_images(cfg: ModelConfig, params: Any, inputs: VisionInputs, remat: str = "none") -> jax.Array:
    """The image features [b, max_patches / group, hidden] of a batch's rows, in the order of their image tokens
    (:func:`encode_with_deepstack`'s first)."""
    return encode_with_deepstack(cfg, params, inputs, remat)[0]
