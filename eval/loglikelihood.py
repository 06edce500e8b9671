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

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from zoo.batching import score_documents
from zoo.config import ModelConfig
from zoo.errors import UserError

Request = tuple[list[int], int]  # (tokens, how many of the last targets are scored)
MIN_BUCKET = 16


# --------------------------------------------------------------------------- scoring


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded length of a row of ``n`` tokens: the next power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def loglikelihoods(cfg: ModelConfig, params: dict[str, Any], requests: Sequence[Request], batch_size: int = 8,
                   max_length: int | None = None, bar: tqdm | None = None) -> np.ndarray:
    """Summed log-likelihood (float64) of each request's scored tokens, in batched fixed-shape forward passes
    (:func:`zoo.batching.score_documents`, each request a document whose scored tokens are its targets).

    A request longer than ``max_length`` (default: the model's context) loses
    tokens from the left; its scored tokens must fit.
    """
    max_length = max_length or cfg.max_position_embeddings
    docs = []
    for toks, n in requests:
        if n < 1 or n > len(toks) - 1:
            raise ValueError(f"a request scores {n} of {len(toks) - 1} targets")
        if n > max_length:
            raise UserError(f"a continuation of {n} tokens does not fit the model's {max_length}-token context")
        kept = np.asarray(list(toks)[-(max_length + 1):], np.int32)  # max_length inputs, their targets
        scored = np.zeros(len(kept), bool)
        scored[len(kept) - n:] = True  # the last n tokens, as targets
        docs.append({"tokens": kept, "loss_mask": scored})
    out = np.zeros(len(docs), np.float64)
    # Longest first: rows of one batch have similar lengths, so little padding is computed.
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]["tokens"]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = min(bucket(len(docs[idx[0]]["tokens"]) - 1), max_length)  # the row's inputs
        scores = score_documents(cfg, params, [docs[i] for i in idx], width + 1, batch_size,
                                 on_batch=bar.update if bar is not None else None)
        for i, lp in zip(idx, scores):
            out[i] = lp.astype(np.float64).sum()
    return out


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
