"""Log-likelihoods of token sequences in batched fixed-shape forward passes, and the tokenization they score.

A request is ``(tokens, n)``: the model reads ``tokens[:-1]`` and the
log-probabilities of the last ``n`` of ``tokens[1:]`` are summed. Rows are
batched ``batch_size`` at a time with lengths rounded up to a power of two, so
each shape compiles once and later calls reuse it.

Perplexity (:mod:`eval.perplexity`) and multiple choice
(:mod:`eval.multiple_choice`) score through here; generation
(:mod:`eval.generation_task`) shares the tokenization helpers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from eval.engine.images import vision_inputs
from eval.image_prompts import Frames
from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward, stored_head
from zoo.model.logps import token_logps
from zoo.model.vision import VisionInputs

Request = tuple[list[int], int]  # (tokens, how many of the last targets are scored)
MIN_BUCKET = 16


# --------------------------------------------------------------------------- scoring


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded length of a row of ``n`` tokens: the next power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def fine_bucket(n: int, minimum: int = 1) -> int:
    """The padded width of ``n`` tokens in finer steps than :func:`bucket`: ``n`` rounded up to three significant
    bits (four widths per power of two, at most 25% padding, exact below 8), at least ``minimum``."""
    step = 1 << max(0, n.bit_length() - 3)
    return max(minimum, -(-n // step) * step)


def fit_rows(requests: Sequence[Request], max_length: int | None) -> list[list[int]]:
    """Each request's tokens, checked (it scores at least one and at most all of its targets, and no more than
    ``max_length``) and cut from the left to ``max_length`` inputs and their targets (None: not cut)."""
    rows = []
    for toks, n in requests:
        if n < 1 or n > len(toks) - 1:
            raise ValueError(f"a request scores {n} of {len(toks) - 1} targets")
        if max_length is not None and n > max_length:
            raise UserError(f"a continuation of {n} tokens does not fit the model's {max_length}-token context")
        rows.append(list(toks)[-(max_length + 1):] if max_length is not None else list(toks))
    return rows


def request_scores(cfg: ModelConfig, params: dict[str, Any], requests: Sequence[Request], batch_size: int = 8,
                   max_length: int | None = None, bar: tqdm | None = None,
                   frames: Sequence[Frames] | None = None) -> list[tuple[float, bool]]:
    """(summed log-likelihood, whether every scored token is the argmax) of each request, in batched
    fixed-shape forward passes: rows longest first, ``batch_size`` at a time, each batch's width its longest
    row's rounded up to a power of two (:func:`bucket`), so each width compiles once.

    A request longer than ``max_length`` (default: the model's context) loses
    tokens from the left; its scored tokens must fit. ``frames[i]``: a vision-language model's images of request
    i (its image tokens' frames, :func:`eval.generate.vision_inputs`), in the forward; such a request is never cut.
    """
    max_length = max_length or cfg.max_position_embeddings
    rows = fit_rows(requests, max_length)
    if frames is not None and any(f and len(r) < len(q) for f, r, (q, _) in zip(frames, rows, requests)):
        raise UserError(f"a request with images is longer than the model's {max_length}-token context; its image "
                        "tokens cannot be cut")
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    # Longest first: rows of one batch have similar lengths, so little padding is computed.
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = min(bucket(len(rows[idx[0]]) - 1), max_length)  # the rows' inputs
        inputs = np.zeros((batch_size, width), np.int32)
        targets = np.zeros((batch_size, width), np.int32)
        scored = np.zeros((batch_size, width), bool)
        for r, i in enumerate(idx):  # a short last batch leaves rows empty: one shape, one compilation
            toks, n = rows[i], requests[i][1]
            inputs[r, :len(toks) - 1], targets[r, :len(toks) - 1] = toks[:-1], toks[1:]
            scored[r, len(toks) - 1 - n:len(toks) - 1] = True
        # A short last batch's empty rows take the first row's images (their tokens are padding: unread).
        vision = None if frames is None else vision_inputs(cfg, [frames[i] for i in idx]
                                                           + [frames[idx[0]]] * (batch_size - len(idx)))
        sums, greedy = jax.device_get(_row_scores(cfg, params, *map(jnp.asarray, (inputs, targets, scored)),
                                                  vision=vision))
        for r, i in enumerate(idx):
            out[i] = (float(np.float64(sums[r])), bool(greedy[r]))
        if bar is not None:
            bar.update(len(idx))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _row_scores(cfg: ModelConfig, params: dict[str, Any], inputs: jax.Array, targets: jax.Array,
                scored: jax.Array, vision: VisionInputs | None = None) -> tuple[jax.Array, jax.Array]:
    """(summed log p(target) over the scored positions [rows], all of them the argmax [rows]) of one batch of
    right-padded rows (with their images: ``vision``); the vocabulary is projected in chunks
    (:func:`zoo.model.logps.token_logps`), never whole."""
    hidden = forward(cfg, params, inputs, return_hidden=True, vision=vision)
    head, vocab_major = stored_head(cfg, params)
    logp, greedy = token_logps(hidden, head, targets, cfg.final_softcap, head_grad=False, vocab_major=vocab_major,
                               greedy=True)
    return jnp.where(scored, logp, 0.0).sum(-1), jnp.where(scored, greedy > 0, True).all(-1)


# --------------------------------------------------------------------------- tokenization


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """Token ids of ``text`` (with the tokenizer's own special tokens, e.g. BOS, when ``special``)."""
    return list(tokenizer.encode(text, add_special_tokens=special))


def prefix_token(tokenizer: Any) -> int:
    """The token a document's first token is predicted from: BOS, else EOS."""
    tok = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if tok is None:
        raise UserError("the tokenizer has neither a BOS nor an EOS token to start documents with")
    return int(tok)


def context_continuation(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split as lm-evaluation-harness does.

    Trailing whitespace of the context moves to the continuation; the
    continuation's ids are the tail of the whole string's encoding after the
    context's ids (so BPE merges at the boundary match a plain encoding of the
    whole). An empty context becomes the prefix token.
    """
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [prefix_token(tokenizer)], encode(tokenizer, continuation)
    ctx = encode(tokenizer, context, special=True)
    whole = encode(tokenizer, context + continuation, special=True)
    if whole[:len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx):]
    return ctx, encode(tokenizer, continuation)
