"""Text generation with a zoo model: :func:`generate` runs a list of prompts on the inference engine
(:mod:`eval.engine`: continuous batching over a paged KV cache), and the batch-wide sampler the rollout programs
draw with (:func:`sample_next`).

A vision-language model's prompts may hold images (:func:`vision_inputs`): the prefill puts each image's
features in place of its image tokens (Gemma 3: each image's tokens attending within the image both ways; Gemma 4:
the same on its sliding layers), and every step after it is plain text, as transformers' ``generate`` passes the
pixels (and Gemma 3's ``token_type_ids``, Gemma 4's ``mm_token_type_ids``) at the first forward only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from eval.engine.images import Frame
from eval.engine.sampling import categorical
from zoo.errors import UserError
from zoo.model.config import ModelConfig

BUCKET = 32  # a generation's room (prompt and new tokens) is rounded up to a multiple of this: fewer compilations


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


def generate(cfg: ModelConfig, params: dict[str, Any], prompts: Sequence[Sequence[int]], gen: GenerationConfig,
             on_token: Callable[[int, int], None] | None = None, tokenizer: Any = None,
             frames: Sequence[Sequence[Frame]] | None = None, max_seqs: int = 64) -> list[list[int]]:
    """New tokens for each prompt (not the prompt), cut after EOS or after the token completing a stop string.

    The prompts (token ids, at least one each) run on the inference engine (:class:`eval.engine.engine.Engine`):
    up to ``max_seqs`` at once, each taking the row another one left. ``on_token(row, token)`` is called for every
    token as it is produced (for streaming). A returned row ends with its EOS token when it hit one; stop strings
    need ``tokenizer`` (anything with ``decode``) and leave the text containing them to be trimmed by the caller.
    Prompt r draws with seed ``gen.seed`` for r = 0 and a seed of its own from it for the others.
    ``frames``: a vision-language model's images of the prompts, a list of frames per prompt
    (:func:`eval.engine.images.vision_inputs`'s); the prompts hold their image tokens, as the processor expanded
    them.
    """
    from eval.engine.api import SamplingParams
    from eval.engine.engine import Engine

    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("generate: every prompt needs at least one token")
    if gen.stop and tokenizer is None:
        raise UserError("generate: stop strings need a tokenizer")
    if frames is not None and cfg.vision is None:
        raise UserError("generate: images given to a model without a vision tower")
    out: list[list[int]] = [[] for _ in prompts]
    if gen.max_new_tokens <= 0:
        return out
    max_len = _round_up(max(len(p) for p in prompts) + gen.max_new_tokens)
    engine = Engine(cfg, params, tokenizer=tokenizer, max_seqs=min(len(prompts), max_seqs), max_len=max_len)
    ids = [engine.submit(p, SamplingParams(max_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                           top_k=gen.top_k, top_p=gen.top_p, seed=row_seed(gen.seed, r),
                                           stop=gen.stop, eos_ids=gen.eos_ids),
                         None if frames is None or not frames[r] else frames[r])
           for r, p in enumerate(prompts)]
    row_of = {i: r for r, i in enumerate(ids)}
    while engine.busy:
        for event in engine.step():
            r = row_of[event.request_id]
            for tok in event.tokens:
                out[r].append(tok)
                if on_token is not None:
                    on_token(r, tok)
    return out


def row_seed(seed: int, row: int) -> int:
    """The seed prompt ``row`` of a batch drawn with ``seed`` draws with: ``seed`` itself for the first, a seed
    of its own (a 32-bit mix of both) for the others."""
    return seed if row == 0 else (seed * 0x9E3779B1 + row * 0x85EBCA77) % (1 << 32)


def _round_up(n: int, m: int = BUCKET) -> int:
    return -(-n // m) * m


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
