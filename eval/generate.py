"""Text generation with a zoo model on the KV cache of :mod:`zoo.model.decode`.

One jitted prefill over the right-padded prompts, then a Python loop over a
jitted one-token step (forward with the cache, then sample) with fixed
shapes, so a batch compiles its prefill once per length bucket and its step
once per cache view (:data:`VIEW` slots) it reaches, whatever the number of
tokens. Sampling draws from ``jax.random`` keyed by the seed and the step, so
a seed reproduces its tokens.

A vision-language model's prompts may hold images (:func:`vision_inputs`): the prefill puts each image's
features in place of its image tokens (Gemma 3: each image's tokens attending within the image both ways; Gemma 4:
the same on its sliding layers), and every step after it is plain text, as transformers' ``generate`` passes the
pixels (and Gemma 3's ``token_type_ids``, Gemma 4's ``mm_token_type_ids``) at the first forward only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.decode import Cache, forward_step, init_cache, place_for_decoding
from zoo.model.vision import VisionInputs

BUCKET = 32  # prompt and cache lengths are rounded up to a multiple of this: fewer compilations
VIEW = 256  # a step reads the cache slots up to the filled length rounded up to this (one compile per bucket)


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate.

    ``temperature`` 0 is greedy (argmax); otherwise logits are divided by it
    and sampled, keeping only the ``top_k`` most likely tokens (0: all) and
    the smallest set whose probability reaches ``top_p`` (1.0: all).
    Generation stops at ``max_new_tokens``, after a token of ``eos_ids``, or
    once the decoded text contains one of ``stop`` (which needs a tokenizer).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    eos_ids: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class Sampler:
    """The static part of sampling (it shapes the compiled program): temperature (0: greedy), top-k (0: off),
    top-p (1.0: off)."""

    temperature: float
    top_k: int
    top_p: float


def sample_next(logits: jax.Array, key: jax.Array, s: Sampler) -> jax.Array:
    """Next token [b] from last-position logits [b, vocab] (float32): greedy at temperature 0, else a draw
    with ``key`` from the logits over the temperature, cut to the top-k and top-p tokens."""
    if s.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k > 0:
        kth = jax.lax.top_k(logits, min(s.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token while the mass strictly before it is under top_p (the most likely always stays).
        drop_sorted = jnp.cumsum(probs, axis=-1) - probs >= s.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return categorical(key, logits)


CATEGORICAL_BLOCK = 128  # vocabulary entries per block of :func:`categorical`'s first draw


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw [b] int32 from softmax(``logits`` [b, vocab]) per row (-inf entries never drawn), in two exact
    stages: a block of CATEGORICAL_BLOCK entries with probability its share of the mass (its logsumexp), then an
    entry of that block in proportion to its probability within it.

    The distribution is ``jax.random.categorical``'s, but its Gumbel draw over the whole vocabulary, one random
    number and two logarithms per entry, costs about 57 ms a decoding step for 64 rows of a 49,152-entry
    vocabulary on a 2-CPU machine, a quarter of a 135M model's step; this draws vocab / 128 + 128 numbers a row
    instead (about 5 ms)."""
    b, v = logits.shape
    block = min(CATEGORICAL_BLOCK, v)
    pad = (-v) % block
    blocks = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, block)
    k_block, k_entry = jax.random.split(key)
    which = jax.random.categorical(k_block, jax.nn.logsumexp(blocks, axis=-1), axis=-1)
    inside = jnp.take_along_axis(blocks, which[:, None, None], axis=1)[:, 0]
    return (which * block + jax.random.categorical(k_entry, inside, axis=-1)).astype(jnp.int32)


@partial(jax.jit, static_argnums=(0, 5), donate_argnums=(4,))
def _prefill(cfg: ModelConfig, params: dict, tokens: jax.Array, valid: jax.Array, cache: Cache,
             sampler: Sampler, key: jax.Array, vision: VisionInputs | None = None) -> tuple[jax.Array, Cache]:
    """Run the padded prompts (with their images, if any) through the (empty) cache and sample each row's first
    new token.

    The prompts attend to each other only (the cache is empty) and only each
    row's last real position goes through the output head.
    """
    last = jnp.maximum(valid.sum(1) - 1, 0)
    logits, cache = forward_step(cfg, params, tokens, cache, valid, fresh=True, last=last, vision=vision)
    return sample_next(logits, key, sampler), cache


@partial(jax.jit, static_argnums=(0, 4, 6), donate_argnums=(3,))
def _step(cfg: ModelConfig, params: dict, tokens: jax.Array, cache: Cache, sampler: Sampler,
          key: jax.Array, view: int | None = None) -> tuple[jax.Array, Cache]:
    """Append one token per row and sample the next; ``view`` (static): no row has more cached tokens."""
    logits, cache = forward_step(cfg, params, tokens[:, None], cache, view=view)
    return sample_next(logits[:, 0], key, sampler), cache


def _round_up(n: int, m: int = BUCKET) -> int:
    return -(-n // m) * m


def generate(cfg: ModelConfig, params: dict[str, Any], prompts: Sequence[Sequence[int]], gen: GenerationConfig,
             on_token: Callable[[int, int], None] | None = None, tokenizer: Any = None,
             vision: VisionInputs | None = None) -> list[list[int]]:
    """New tokens for each prompt (not the prompt), cut after EOS or after the token completing a stop string.

    The prompts (token ids, at least one each) may differ in length: they are
    right-padded and run as one batch. ``on_token(row, token)`` is called for
    every token as it is produced (for streaming). A returned row ends with
    its EOS token when it hit one; stop strings need ``tokenizer`` (anything
    with ``decode``) and leave the text containing them to be trimmed by the caller.
    ``vision``: a vision-language model's images of the prompts, a row per prompt (:func:`vision_inputs`); the
    prompts hold their image tokens, as the processor expanded them.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("generate: every prompt needs at least one token")
    if gen.stop and tokenizer is None:
        raise UserError("generate: stop strings need a tokenizer")
    if vision is not None and cfg.vision is None:
        raise UserError("generate: images given to a model without a vision tower")
    out: list[list[int]] = [[] for _ in prompts]
    if gen.max_new_tokens <= 0:
        return out
    b = len(prompts)
    plen = _round_up(max(len(p) for p in prompts))
    buf = np.zeros((b, plen), np.int32)
    valid = np.zeros((b, plen), bool)
    for r, p in enumerate(prompts):
        buf[r, :len(p)], valid[r, :len(p)] = p, True
    dtype = params["embed"].dtype
    # Parameters on a mesh (zoo.load shards them over all local devices, FSDP): decoding lays them out
    # tensor-parallel once, so no token step gathers a weight, and splits the cache like their heads.
    params, mesh = place_for_decoding(cfg, params)
    cache = init_cache(cfg, b, _round_up(plen + gen.max_new_tokens), dtype, mesh)
    sampler = Sampler(float(gen.temperature), int(gen.top_k), float(gen.top_p))
    key = jax.random.PRNGKey(gen.seed)
    eos = set(gen.eos_ids)
    done = np.zeros(b, bool)
    max_len = _round_up(plen + gen.max_new_tokens)
    nxt, cache = _prefill(cfg, params, jnp.asarray(buf), jnp.asarray(valid), cache, sampler,
                          jax.random.fold_in(key, 0), vision)
    longest = max(len(p) for p in prompts)  # the most tokens any row has in the cache before step 1
    for i in range(gen.max_new_tokens):
        # Launch the next step before reading this token (JAX dispatches asynchronously): the host work
        # below overlaps the device's; when generation ends here, that one step is wasted.
        following = None
        if i + 1 < gen.max_new_tokens:
            view = min(_round_up(longest + i, VIEW), max_len)
            following = _step(cfg, params, nxt, cache, sampler, jax.random.fold_in(key, i + 1), view)
        host = np.asarray(nxt)
        for row in np.flatnonzero(~done).tolist():
            tok = int(host[row])
            out[row].append(tok)
            if on_token is not None:
                on_token(row, tok)
            done[row] = tok in eos or _hit_stop(out[row], gen.stop, tokenizer)
        if following is None or done.all():
            break
        nxt, cache = following
    return out


Frame = tuple[np.ndarray, np.ndarray | None] | dict[str, np.ndarray]  # a frame's pixels and mask, or its patches


def vision_inputs(cfg: ModelConfig, frames: Sequence[Sequence[Frame]]) -> VisionInputs | None:
    """The images of a batch of prompts as the prefill takes them: ``frames[r]`` are prompt r's frames in the order
    of its image tokens, each (pixels [C, S, S], pixel mask [S, S] or None) as the image processor gives them
    (SmolVLM: an image's tiles, then the whole image), or already as per-patch arrays (``ProcessedImage.patches`` of
    chat/images.py, as `zoo eval`'s rows give them: any family's layout, Qwen's images at their own size and the
    multimodal positions the forward computes from them). None when no prompt has an image."""
    from zoo.data.vision_layout import image_patches

    v = cfg.vision
    assert v is not None, "vision_inputs needs a model with a vision tower"
    return patch_inputs(cfg, [[f if isinstance(f, dict) else image_patches(v, *f) for f in row] for row in frames])


def patch_inputs(cfg: ModelConfig, rows: Sequence[Sequence[dict[str, np.ndarray]]]) -> VisionInputs | None:
    """The images of a batch of prompts as the prefill takes them, from each prompt's frames as per-patch arrays
    (``ProcessedImage.patches`` of chat/images.py: any tower, Qwen2.5-VL's images at their own size). None when no
    prompt has an image."""
    from zoo.data.vision_layout import layout_rows

    v = cfg.vision
    assert v is not None, "patch_inputs needs a model with a vision tower"
    most = max((sum(len(f["patches"]) for f in row) for row in rows), default=0)
    if most == 0:
        return None
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(v, rows, most).items()})


def _hit_stop(tokens: list[int], stop: tuple[str, ...], tokenizer: Any) -> bool:
    """Whether the text of ``tokens`` now contains a stop string (only the tail can hold a new one)."""
    if not stop:
        return False
    longest = max(len(s) for s in stop)
    # Decoding the last few tokens suffices: a new match ends in the newest token, and a token is >= 1 char.
    tail = tokenizer.decode(tokens[-(longest + 8):], skip_special_tokens=True)
    return any(s in tail for s in stop)


def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int,
                 eos_ids: AbstractSet[int] = frozenset()) -> list[list[int]]:
    """Greedy continuations of several prompts at once by a :class:`zoo.model.decoder.Decoder` (each returned without
    its prompt, cut after EOS)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, eos_ids=tuple(sorted(eos_ids)))
    return generate(model.cfg, model.param_dict(), prompts, gen)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ready for the assistant's reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
