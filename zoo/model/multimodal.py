"""A vision-language model's input embeddings: the token embeddings with each image token's embedding replaced by
its image feature (:func:`zoo.model.vision.encode_images`).

The i-th image token of a row takes the i-th feature of that row, which is transformers' ``masked_scatter`` of
the features over the image-token positions when every row holds the features of its own images (the host
lays rows out so: :mod:`zoo.data.vision_layout`). The features replace the embeddings as the model computed them
(Gemma's already scaled by sqrt(hidden): features are not scaled). An image token id past the text vocabulary
is embedded as id 0 before it is replaced (transformers' Gemma 3 does so). Where ``VisionConfig.image_blocks``
is set (Gemma 3) each run of image tokens is one bidirectional block of the language model's attention
(:func:`image_blocks`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zoo.model.config import ModelConfig
from zoo.model.masks import image_block_ids
from zoo.model.vision import VisionInputs, encode_images


def merge_features(tokens: jax.Array, x: jax.Array, features: jax.Array, image_token_id: int) -> jax.Array:
    """x [b, t, E] with the image tokens' rows (``tokens == image_token_id``) replaced, in order, by features
    [b, F, E]."""
    is_image = tokens == image_token_id
    index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
    taken = jnp.take_along_axis(features, index[..., None], axis=1)
    return jnp.where(is_image[..., None], taken.astype(x.dtype), x)


def embed_images(cfg: ModelConfig, params: Any, tokens: jax.Array, x: jax.Array, vision: VisionInputs,
                 remat: str = "none") -> jax.Array:
    """The token embeddings x [b, t, E] of ``tokens`` with the images of ``vision`` in place of the image tokens.
    ``params``: the model's parameters or its :class:`zoo.lora.weights.Weights` (LoRA on the tower and connector);
    ``remat``: the tower's layer scan's (:func:`zoo.model.vision.tower`)."""
    assert cfg.vision is not None, "images given to a model without a vision tower"
    return merge_features(tokens, x, encode_images(cfg, params, vision, remat), cfg.vision.image_token_id)


def text_ids(cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """``tokens`` as the token embedding reads them: an image token as id 0 (the padding token of Gemma 3 and 4;
    its embedding is replaced by an image feature anyway, and Gemma 3's image token id lies past the vocabulary).
    Gemma 4's per-layer inputs read these ids, as transformers' ``llm_input_ids``."""
    if cfg.vision is None:
        return tokens
    return jnp.where(tokens == cfg.vision.image_token_id, 0, tokens)


def blocks_of_kind(cfg: ModelConfig, kind: str, blocks: jax.Array | None) -> jax.Array | None:
    """The image blocks layers of ``kind`` see: all of them (Gemma 3), or on sliding layers alone (Gemma 4, whose
    full-attention layers stay causal)."""
    if blocks is None or cfg.vision is None or cfg.vision.blocks_on_full or kind == "sliding":
        return blocks
    return None


def image_blocks(cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array | None, int]:
    """(block ids [b, t] or None, lookahead) of the bidirectional image blocks of rows with images
    (:class:`zoo.model.masks.Visibility`): each run of image tokens one block where the model's vision config
    says so (Gemma 3), else (None, 0). The lookahead (how far a block reaches past a query) is one image's
    tokens less one: the processor puts other tokens between images (Gemma 3's begin/end-of-image markers)."""
    v = cfg.vision
    if v is None or not v.image_blocks:
        return None, 0
    return image_block_ids(tokens, v.image_token_id), v.tokens_per_image - 1
