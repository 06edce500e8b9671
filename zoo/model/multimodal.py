"""A vision-language model's input embeddings: the token embeddings with each image token's embedding replaced by
its image feature (:func:`zoo.model.vision.encode_images`).

The i-th image token of a row takes the i-th feature of that row, which is transformers' ``masked_scatter`` of
the features over the image-token positions when every row holds the features of its own images (the host
lays rows out so: :mod:`zoo.data.vision_layout`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zoo.model.config import ModelConfig
from zoo.model.vision import VisionInputs, encode_images


def merge_features(tokens: jax.Array, x: jax.Array, features: jax.Array, image_token_id: int) -> jax.Array:
    """x [b, t, E] with the image tokens' rows (``tokens == image_token_id``) replaced, in order, by features
    [b, F, E]."""
    is_image = tokens == image_token_id
    index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
    taken = jnp.take_along_axis(features, index[..., None], axis=1)
    return jnp.where(is_image[..., None], taken.astype(x.dtype), x)


def embed_images(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array, x: jax.Array,
                 vision: VisionInputs) -> jax.Array:
    """The token embeddings x [b, t, E] of ``tokens`` with the images of ``vision`` in place of the image tokens."""
    assert cfg.vision is not None, "images given to a model without a vision tower"
    return merge_features(tokens, x, encode_images(cfg, params, vision), cfg.vision.image_token_id)
