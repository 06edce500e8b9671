"""A vision-language model's input embeddings: the token embeddings with each image token's embedding replaced by
its image feature (:func:`zoo.model.vision.encode_images`).

The i-th image token of a row takes the i-th feature of that row, which is transformers' ``masked_scatter`` of
the features over the image-token positions when every row holds the features of its own images (the host
lays rows out so: :mod:`zoo.data.vision_layout`). The features replace the embeddings as the model computed them
(Gemma's already scaled by sqrt(hidden): features are not scaled). An image token id past the text vocabulary
is embedded as id 0 before it is replaced (transformers' Gemma 3 does so). Where ``VisionConfig.image_blocks``
is set (Gemma 3) each run of image tokens is one bidirectional block of the language model's attention
(:func:`image_blocks`).

Qwen3-VL's DeepStack: its tower gives one more feature a level per image token, and the language model adds level
j's to its hidden states at the image tokens after its layer j (transformers' ``_deepstack_process``). The levels
come out of :func:`embed_images` as data, [levels, b, t, hidden] (zero off the image tokens), which the forward
passes scan with their first layers: :func:`deepstack_runs` splits the layer runs where the levels end, so one scan
takes them and the rest scan as before (the program's size stays independent of the depth).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zoo.model.config import ModelConfig
from zoo.model.masks import image_block_ids
from zoo.model.vision import VisionInputs, encode_with_deepstack


def merge_features(tokens: jax.Array, x: jax.Array, features: jax.Array, image_token_id: int) -> jax.Array:
    """x [b, t, E] with the image tokens' rows (``tokens == image_token_id``) replaced, in order, by features
    [b, F, E]."""
    is_image = tokens == image_token_id
    index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
    taken = jnp.take_along_axis(features, index[..., None], axis=1)
    return jnp.where(is_image[..., None], taken.astype(x.dtype), x)


def embed_images(cfg: ModelConfig, params: Any, tokens: jax.Array, x: jax.Array, vision: VisionInputs,
                 remat: str = "none") -> tuple[jax.Array, jax.Array | None]:
    """(the token embeddings x [b, t, E] of ``tokens`` with the images of ``vision`` in place of the image tokens,
    the DeepStack levels [levels, b, t, E] to add after the first layers: each level's features at the image
    tokens, zero elsewhere; None for a model without them). ``params``: the model's parameters or its
    :class:`zoo.lora.weights.Weights` (LoRA on the tower and connector); ``remat``: the tower's layer scan's
    (:func:`zoo.model.vision.tower`)."""
    assert cfg.vision is not None, "images given to a model without a vision tower"
    features, deep = encode_with_deepstack(cfg, params, vision, remat)
    token = cfg.vision.image_token_id
    x = merge_features(tokens, x, features, token)
    if deep is None:
        return x, None
    return x, jax.vmap(lambda level: merge_features(tokens, jnp.zeros_like(x), level, token))(deep)


def deepstack_runs(runs: list[tuple[str, int, int, bool, int]],
                   levels: int) -> list[tuple[str, int, int, bool, int]]:
    """:attr:`ModelConfig.layer_runs` with the run that holds the last DeepStack level's layer (``levels`` - 1) and
    the next layer split in two, so the first ``levels`` layers are runs of their own that scan the levels."""
    out = []
    for prefix, start, stop, moe, first in runs:
        if start < levels < stop:
            out += [(prefix, start, levels, moe, first), (prefix, levels, stop, moe, first + levels - start)]
        else:
            out.append((prefix, start, stop, moe, first))
    return out


def deepstack_slice(deep: jax.Array | None, start: int, stop: int) -> jax.Array | None:
    """The DeepStack levels of layers ``start`` .. ``stop`` (a run of :func:`deepstack_runs`'s): None past them."""
    return None if deep is None or stop > deep.shape[0] else deep[start:stop]


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
