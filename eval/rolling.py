"""Log-likelihoods of rows longer than one forward pass: read ``chunk`` tokens at a time through the KV cache.

A rolling-perplexity window (lm-evaluation-harness's ``max_length``: by default
the model's whole context, 8k to 128k tokens) need not be one forward row. Here
each row goes through :func:`zoo.model.decode.forward_step` ``chunk`` tokens at a
time: every chunk attends to the keys and values the earlier chunks left in
the cache, so the row's scores are those of one full-length pass (the same
numbers as lm-eval's ``hf`` backend reading the window whole), while a pass's
activations are those of ``chunk`` tokens and attention reads only the filled
part of the cache. The vocabulary is projected in pieces
(:func:`zoo.model.logps.token_logps`), never whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from eval.loglikelihood import Request, bucket, fine_bucket, fit_rows, request_scores
from zoo.model.config import ModelConfig
from zoo.model.decode import Cache, forward_step, init_cache
from zoo.model.decoder import stored_head
from zoo.model.logps import token_logps


def chunked_scores(cfg: ModelConfig, params: dict[str, Any], requests: Sequence[Request], chunk: int,
                   batch_size: int = 8, bar: tqdm | None = None) -> list[tuple[float, bool]]:
    """(summed log-likelihood, whether every scored token is the argmax) of each request ``(tokens, n)``, its
    inputs read at most ``chunk`` tokens per forward pass through the KV cache (:func:`chunk_widths`); rows
    longest first, ``batch_size`` at a time, the cache of each batch as long as its longest row (rounded up to a
    power of two)."""
    if chunk < 1:
        raise ValueError(f"chunk {chunk}: must be at least 1")
    rows_in = fit_rows(requests, None)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -len(rows_in[i]))
    dtype = params["embed"].dtype
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        longest = len(rows_in[idx[0]]) - 1
        slots = bucket(longest)  # every position has its own slot: the ring never wraps
        step, width = chunk_widths(longest, chunk)
        rows = min(batch_size, bucket(len(idx), 1))  # a short last batch: fewer rows (a power of two)
        inputs = np.zeros((rows, width), np.int32)
        targets = np.zeros((rows, width), np.int32)
        scored = np.zeros((rows, width), bool)
        valid = np.zeros((rows, width), bool)
        for r, i in enumerate(idx):
            toks, n = rows_in[i], requests[i][1]
            m = len(toks) - 1
            inputs[r, :m], targets[r, :m], valid[r, :m] = toks[:-1], toks[1:], True
            scored[r, m - n:m] = True
        cache = init_cache(cfg, rows, slots, dtype)
        sums = np.zeros(rows, np.float64)
        greedy = np.ones(rows, bool)
        for a in range(0, width, step):
            part = slice(a, a + step)
            # Before chunk a every row holds at most a tokens: only the first bucket(a) slots are read.
            s, g, cache = _chunk_scores(cfg, params, *map(jnp.asarray, (inputs[:, part], targets[:, part],
                                                                        scored[:, part], valid[:, part])),
                                        cache, fresh=a == 0, view=None if a == 0 else min(slots, bucket(a)))
            s, g = jax.device_get((s, g))
            sums += np.float64(s)
            greedy &= g
        for r, i in enumerate(idx):
            out[i] = (float(sums[r]), bool(greedy[r]))
        if bar is not None:
            bar.update(len(idx))
    return out


def chunk_widths(n: int, chunk: int) -> tuple[int, int]:
    """(tokens per pass, padded row width) for a row of ``n`` inputs read at most ``chunk`` per pass: as few
    passes as ``chunk`` allows, of equal width rounded up to three significant bits
    (:func:`eval.loglikelihood.fine_bucket`), so a row pads at most about an eighth, not up to a whole chunk."""
    passes = math.ceil(n / chunk)
    step = min(chunk, fine_bucket(math.ceil(n / passes)))
    passes = math.ceil(n / step)
    return step, passes * step


@functools.partial(jax.jit, static_argnums=0, static_argnames=("fresh", "view"), donate_argnames="cache")
def _chunk_scores(cfg: ModelConfig, params: dict[str, Any], inputs: jax.Array, targets: jax.Array,
                  scored: jax.Array, valid: jax.Array, cache: Cache, *, fresh: bool,
                  view: int | None) -> tuple[jax.Array, jax.Array, Cache]:
    """(summed log p(target) over the chunk's scored positions [rows], all of them the argmax [rows], the cache
    with the chunk's keys/values written) of one chunk of every row."""
    hidden, cache = forward_step(cfg, params, inputs, cache, valid, fresh=fresh, view=view, hidden=True)
    head, vocab_major = stored_head(cfg, params)
    logp, greedy = token_logps(hidden, head, targets, cfg.final_softcap, head_grad=False, vocab_major=vocab_major,
                               greedy=True)
    return jnp.where(scored, logp, 0.0).sum(-1), jnp.where(scored, greedy > 0, True).all(-1), cache


DEFAULT_CHUNK = 2048  # tokens per forward pass for longer rows: activations bounded, the cache carries the rest


def window_scores(cfg: ModelConfig, params: dict[str, Any], requests: Sequence[Request], batch_size: int = 8,
                  max_length: int | None = None, chunk: int | None = DEFAULT_CHUNK,
                  bar: tqdm | None = None) -> list[tuple[float, bool]]:
    """(summed log-likelihood, all argmax) of each request, in order: rows of at most ``chunk`` inputs as plain
    batched rows (:func:`eval.loglikelihood.request_scores`), longer ones through the cache
    (:func:`chunked_scores`). A request longer than ``max_length`` (default: the model's context) loses tokens
    from the left, as in :func:`eval.loglikelihood.request_scores`; ``chunk`` None never chunks."""
    cut = list(zip(fit_rows(requests, max_length or cfg.max_position_embeddings), (n for _, n in requests)))
    is_long = [chunk is not None and len(t) - 1 > chunk for t, _ in cut]
    long = [i for i, x in enumerate(is_long) if x]
    short = [i for i, x in enumerate(is_long) if not x]
    out: list[tuple[float, bool]] = [(0.0, False)] * len(cut)
    if long and chunk is not None:  # (rows are long only with a chunk)
        for i, s in zip(long, chunked_scores(cfg, params, [cut[i] for i in long], chunk, batch_size, bar)):
            out[i] = s
    for i, s in zip(short, request_scores(cfg, params, [cut[i] for i in short], batch_size, max_length, bar)):
        out[i] = s
    return out
