"""Gemma 4's image tower and connector (transformers' ``Gemma4VisionModel`` and ``Gemma4MultimodalEmbedder``):
patches in, one feature per image token out.

Images come in any shape: the image processor cuts each into 16-pixel patches (already flattened,
``pixel_values`` [patches, 3 * p * p] in [0, 1]) with each patch's (column, row) in ``image_position_ids``, and
pads every image to ``max_soft_tokens * k^2`` patches. :mod:`zoo.model.vision_gemma4` runs them as
:class:`zoo.model.vision.VisionInputs` laid out by :mod:`zoo.data.gemma4_layout`: ``patch_pos`` holds
``row * pos_table + column``, ``patch_group`` the image token each patch is pooled into.

- Patch embedding: ``2 * (pixels - 0.5)`` times a bias-free projection, plus the position table's column row
  and row row (``[2, pos_table, D]``); padding patches get no position.
- Each layer: ``x + post_attn_norm(attention(attn_norm(x)))``, then ``x + post_mlp_norm(mlp(mlp_norm(x)))`` with
  Gemma 4's plain ``x * w`` RMSNorms. Attention: GQA; RMSNorm on each head's q and k (with weights) and v (without);
  2-D RoPE, the first half of each head rotated by the patch's column and the second by its row (rotate-half
  within each half); no 1/sqrt(d) scaling (the q/k norms stand in for it); bidirectional within an image, keys
  the image's real patches. MLP: ``down(gelu_tanh(gate(x)) * up(x))``.
- Clipped linears (``VisionConfig.clipped``): every projection's input and output clamped to the bounds the
  checkpoint stores (``*_in_min``, ``*_in_max``, ``*_out_min``, ``*_out_max``), which are not trained.
- Pooling: each token's k x k patches averaged, times sqrt(D) in float32, optionally standardized
  (``(x - std_bias) * std_scale``, buffers: not trained), then the connector: an RMSNorm without weight and a
  projection to the language model's width.

LoRA (``vision.*`` and ``projector.proj`` targets: :mod:`zoo.lora.vision_targets`) adds its adapters beside each
projection and the connector's, as peft does on the ``Linear`` inside transformers' clippable linear: on the
clamped input, before the output's clamp.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from zoo.layers.blocks import ACTIVATIONS, dense, rms_norm
from zoo.lora.projections import PROJECTOR_DROPOUT, TOWER_DROPOUT, LayerLora, PartLora, adapted_dense
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.layer_scan import REMAT_POLICIES
from zoo.model.rope import apply_rope
from zoo.model.sharding import batch_sharded
from zoo.model.vision_config import VisionConfig
from zoo.model.vision_inputs import VisionInputs
from zoo.model.vision_params import CLIP_BOUNDS


def _linear(v: VisionConfig, x: jax.Array, p: dict[str, jax.Array], name: str, lora: LayerLora | None,
            contract: int = 1) -> jax.Array:
    """One of the layer's projections (with its LoRA adapter, where ``lora`` has one), its input and output clamped
    to the stored bounds when clipped."""
    if not v.clipped:
        return adapted_dense(x, p[name], lora, name, contract=contract)
    lo_in, hi_in, lo_out, hi_out = (jax.lax.stop_gradient(p[f"{name}_{b}"][0]) for b in CLIP_BOUNDS)
    y = adapted_dense(jnp.clip(x, lo_in.astype(x.dtype), hi_in.astype(x.dtype)), p[name], lora, name,
                      contract=contract)
    return jnp.clip(y, lo_out.astype(y.dtype), hi_out.astype(y.dtype))


def _rope_2d(v: VisionConfig, pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """cos/sin tables [b, n, head_dim / 2] of each patch's column and of its row."""
    half = v.head_dim // 2
    inv = 1.0 / (v.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))
    col, row = pos % v.pos_table, pos // v.pos_table

    def tables(p: jax.Array) -> tuple[jax.Array, jax.Array]:
        f = p.astype(jnp.float32)[..., None] * inv
        emb = jnp.concatenate([f, f], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)

    return (*tables(col), *tables(row))


def _attention(v: VisionConfig, x: jax.Array, p: dict[str, jax.Array], visible: jax.Array,
               rope: tuple[jax.Array, ...], lora: LayerLora | None) -> jax.Array:
    """Bidirectional GQA of one tower layer over x [b, n, D] where ``visible`` [b, 1, n, n]."""
    b, n, _ = x.shape
    h, kv, d = v.num_heads, v.kv_heads, v.head_dim
    q = rms_norm(_linear(v, x, p, "q", lora).reshape(b, n, h, d), p["q_norm"], v.norm_eps)
    k = rms_norm(_linear(v, x, p, "k", lora).reshape(b, n, kv, d), p["k_norm"], v.norm_eps)
    val = rms_norm(_linear(v, x, p, "v", lora).reshape(b, n, kv, d), jnp.ones((d,), x.dtype), v.norm_eps)
    cos_c, sin_c, cos_r, sin_r = rope

    def rotate(t: jax.Array) -> jax.Array:  # the first half of each head by column, the second by row
        return jnp.concatenate([apply_rope(t[..., : d // 2], cos_c, sin_c), apply_rope(t[..., d // 2:], cos_r, sin_r)],
                               axis=-1)

    q, k = rotate(q), rotate(k)
    q = q.reshape(b, n, kv, h // kv, d)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k, preferred_element_type=jnp.float32)  # scaling 1.0
    scores = jnp.where(visible[:, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(val.dtype)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, val).reshape(b, n, h * d)
    return _linear(v, out, p, "o", lora, contract=2)


def _layer(v: VisionConfig, visible: jax.Array, rope: tuple[jax.Array, ...], part: PartLora, x: jax.Array,
           inputs: tuple[dict[str, jax.Array], dict | None, jax.Array | None]) -> tuple[jax.Array, None]:
    """One Gemma 4 tower layer (see the module docstring); ``inputs``: the layer's weights, its LoRA adapters (or
    None) and dropout key (or None). Each chip keeps its own rows' patches (zoo.model.sharding.batch_sharded)."""
    p, adapters, key = inputs
    lora = part.layer(adapters, key)
    x = batch_sharded(x, sequence=False)
    x = batch_sharded(x + rms_norm(_attention(v, rms_norm(x, p["attn_norm"], v.norm_eps), p, visible, rope, lora),
                                   p["post_attn_norm"], v.norm_eps), sequence=False)
    h = rms_norm(x, p["mlp_norm"], v.norm_eps)
    h = batch_sharded(ACTIVATIONS[v.hidden_act](_linear(v, h, p, "gate", lora)) * _linear(v, h, p, "up", lora),
                      sequence=False)
    return batch_sharded(x + rms_norm(_linear(v, h, p, "down", lora), p["post_mlp_norm"], v.norm_eps),
                         sequence=False), None


def tower(v: VisionConfig, params: Any, inputs: VisionInputs, remat: str = "none") -> jax.Array:
    """The tower's last hidden states [b, n, D] of every patch of the batch; ``params``: the model's parameters
    or its :class:`zoo.lora.weights.Weights` (LoRA's ``vision.layers`` adapters run beside their weights);
    ``remat`` wraps each layer of the scan as the decoder's are."""
    w = Weights.wrap(params).base["vision"]
    part = PartLora.of(params, ("vision", "layers"), TOWER_DROPOUT)
    pixels = 2.0 * (inputs.patches.astype(jnp.float32) - 0.5)
    x = dense(pixels.astype(w["patch_embed"].dtype), w["patch_embed"])
    col, row = inputs.patch_pos % v.pos_table, inputs.patch_pos // v.pos_table
    pos = jnp.take(w["pos_embed"][0], col, axis=0) + jnp.take(w["pos_embed"][1], row, axis=0)
    x = x + jnp.where(inputs.patch_valid[..., None], pos, 0).astype(x.dtype)
    img = inputs.patch_image
    visible = (img[:, :, None] == img[:, None, :]) & inputs.patch_valid[:, None, :]
    layer: Callable[..., Any] = partial(_layer, v, visible[:, None], _rope_2d(v, inputs.patch_pos), part)
    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
    x, _ = jax.lax.scan(layer, x, (w["layers"], part.adapters, part.keys(v.num_layers)))
    return x


def connector(v: VisionConfig, params: Any, h: jax.Array, inputs: VisionInputs) -> jax.Array:
    """Pooling and the embedder: each token's group of patch states [b, n, D] averaged, scaled by sqrt(D),
    standardized where the model says so, RMS-normalized and projected -> [b, n / group, hidden]."""
    b, n, d = h.shape
    tokens = n // v.group
    group = jnp.where(inputs.patch_group >= 0, inputs.patch_group, tokens)  # padding patches land past the end
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    summed = jnp.zeros((b, tokens + 1, d), jnp.float32).at[rows, group].add(h.astype(jnp.float32))
    pooled = summed[:, :tokens] / v.group * d**0.5
    base = Weights.wrap(params).base
    w = base["vision"]
    if v.standardize:
        pooled = (pooled - jax.lax.stop_gradient(w["std_bias"]).astype(jnp.float32)) * \
            jax.lax.stop_gradient(w["std_scale"]).astype(jnp.float32)
    pooled = pooled.astype(h.dtype)
    normed = rms_norm(pooled, jnp.ones((d,), h.dtype), v.norm_eps)
    lora = PartLora.of(params, ("projector",), PROJECTOR_DROPOUT).whole()
    return adapted_dense(normed, base["projector"]["proj"], lora, "proj")


def encode_gemma4(cfg: ModelConfig, params: Any, inputs: VisionInputs, remat: str = "none") -> jax.Array:
    """The image features [b, max_patches / group, hidden] of a batch's rows, in the order of their image tokens."""
    v = cfg.vision
    assert v is not None and v.tower == "gemma4", "encode_gemma4 needs a model with Gemma 4's vision tower"
    return connector(v, params, tower(v, params, inputs, remat), inputs)
