"""`multiple_choice` tasks: acc and acc_norm from the log-likelihood of each choice after its question's context.

A batch of questions' contexts is prefilled once into the KV cache of
:mod:`zoo.decode`, and every choice extends that same cache, so the shared
context is computed once per question. ``use_cache=False`` scores each
(context, choice) pair as its own full row instead (the plain forward pass of
:mod:`eval.loglikelihood`; the same numbers, the context recomputed per choice).
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

from eval.loglikelihood import bucket, context_continuation, loglikelihoods
from eval.progress import progress_bar
from eval.tasks import Task, field_of, format_row
from zoo.config import ModelConfig
from zoo.decode import forward_cached, init_cache
from zoo.errors import UserError


def mc_questions(tokenizer: Any, task: Task, rows: list[dict], num_fewshot: int | None = None,
                 ) -> list[tuple[list[int], list[list[int]], list[str], int]]:
    """(context ids, each choice's ids, the choices, gold index) of each row, few-shot examples in the context."""
    shots_from = task.fewshot_rows()
    k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
    delim = task.opt("target_delimiter", " ")
    sep = task.opt("fewshot_separator", "\n\n")
    template = task.opt("context", "{context}")
    out = []
    for i, row in enumerate(rows):
        choices, gold = _choices_gold(row, task)
        pool = shots_from if shots_from is not None else [r for j, r in enumerate(rows[:k + 1]) if j != i]
        shots = []
        for shot in pool[:k]:
            sc, sg = _choices_gold(shot, task)
            shots.append(format_row(template, shot, task, "context") + delim + sc[sg])
        context = sep.join(shots + [format_row(template, row, task, "context")])
        ids = [context_continuation(tokenizer, context, delim + c) for c in choices]
        ctx = ids[0][0]
        if any(c != ctx for c, _ in ids) or any(not cont for _, cont in ids):
            raise UserError(f"task {task.name} ({task.source}): row {i + 1}: a choice is empty or tokenizes into its "
                            "context; give non-empty choices")
        out.append((ctx, [cont for _, cont in ids], choices, gold))
    return out


def _choices_gold(row: dict, task: Task) -> tuple[list[str], int]:
    """(the choices, the gold index) of one row, or a UserError naming what is wrong with them."""
    choices = field_of(row, task.opt("choices", "choices"), task)
    gold = field_of(row, task.opt("gold", "gold"), task)
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise UserError(f"task {task.name} ({task.source}): choices must be a non-empty list of strings, "
                        f"not {choices!r}")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise UserError(f"task {task.name} ({task.source}): gold index {gold!r} is not in 0..{len(choices) - 1}")
    return choices, gold


def mc_metrics(lls: Sequence[Sequence[float]], choices: Sequence[Sequence[str]], golds: Sequence[int],
               ) -> dict[str, float]:
    """acc (argmax of log-likelihood) and acc_norm (argmax of log-likelihood per UTF-8 byte of the choice)."""
    hit, hit_norm = [], []
    for ll, ch, g in zip(lls, choices, golds):
        ll = np.asarray(ll, np.float64)
        nbytes = np.asarray([max(1, len(c.encode("utf-8"))) for c in ch], np.float64)
        hit.append(int(np.argmax(ll)) == g)
        hit_norm.append(int(np.argmax(ll / nbytes)) == g)
    n = len(hit)
    out = {}
    for name, h in (("acc", hit), ("acc_norm", hit_norm)):
        p = float(np.mean(h)) if n else 0.0
        out[name] = p
        out[f"{name}_stderr"] = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0
    return out


def choice_loglikelihoods(cfg: ModelConfig, params: dict[str, Any],
                          questions: Sequence[tuple[list[int], list[list[int]]]], batch_size: int = 8,
                          bar: tqdm | None = None, use_cache: bool = True,
                          max_length: int | None = None) -> list[list[float]]:
    """Summed log-likelihood of each choice's tokens given its question's context ids.

    With ``use_cache`` a batch of contexts is prefilled once into the KV cache
    (:mod:`zoo.decode`) and every choice extends that same cache; without it,
    each (context, choice) pair is one full row (the context recomputed per
    choice). Both give the same numbers.
    """
    max_length = max_length or cfg.max_position_embeddings
    if not use_cache:
        requests, where = [], []
        for q, (ctx, conts) in enumerate(questions):
            for j, cont in enumerate(conts):
                requests.append((ctx + cont, len(cont)))
                where.append((q, j))
        ll = loglikelihoods(cfg, params, requests, batch_size, max_length, bar)
        out: list[list[float]] = [[0.0] * len(conts) for _, conts in questions]
        for (q, j), v in zip(where, ll):
            out[q][j] = float(v)
        return out
    n_choices = max(len(conts) for _, conts in questions)  # fixed per task: one compiled shape per length bucket
    out = [[0.0] * len(conts) for _, conts in questions]
    order = sorted(range(len(questions)), key=lambda q: -len(questions[q][0]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        kw = bucket(max(len(c) for q in idx for c in questions[q][1]), 4)
        if kw >= max_length:
            raise UserError(f"a choice of {kw} tokens does not fit the model's {max_length}-token context")
        # Contexts too long for the model lose tokens from the left (as lm-evaluation-harness does).
        ctxs = [questions[q][0][-(max_length - kw):] for q in idx]
        cw = bucket(max(len(c) for c in ctxs))
        # The cache gets each context but its last token; each extension row is that token, then the choice
        # (less its last token): position i of the extension predicts choice token i.
        ctx = np.zeros((batch_size, cw), np.int32)
        ctx_valid = np.zeros((batch_size, cw), bool)
        ext = np.zeros((n_choices, batch_size, kw), np.int32)
        targets = np.zeros((n_choices, batch_size, kw), np.int32)
        valid = np.zeros((n_choices, batch_size, kw), bool)
        for r in range(batch_size):  # a short last batch repeats its first question: one shape, one compilation
            q, c = (idx[r], ctxs[r]) if r < len(idx) else (idx[0], ctxs[0])
            ctx[r, :len(c) - 1], ctx_valid[r, :len(c) - 1] = c[:-1], True
            for j, cont in enumerate(questions[q][1]):
                ext[j, r, :len(cont)] = [c[-1]] + cont[:-1]
                targets[j, r, :len(cont)], valid[j, r, :len(cont)] = cont, True
        sums = np.asarray(_cached_choices(cfg, params, *map(jnp.asarray, (ctx, ctx_valid, ext, targets, valid))),
                          np.float64)
        for r, q in enumerate(idx):
            out[q] = [float(sums[j, r]) for j in range(len(questions[q][1]))]
        if bar is not None:
            bar.update(sum(len(questions[q][1]) for q in idx))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _cached_choices(cfg: ModelConfig, params: dict[str, Any], ctx: jax.Array, ctx_valid: jax.Array,
                    ext: jax.Array, targets: jax.Array, valid: jax.Array) -> jax.Array:
    """Summed log p(targets) [choices, batch] of extension rows ext [choices, batch, k] after the cached ctx [batch, c].

    The contexts go through the cache once (their logits unused, so XLA drops
    the vocabulary projection); each choice's row extends that cache, which is
    never written back, so every choice sees the same context.
    """
    b, c = ctx.shape
    cache = init_cache(cfg, b, c + ext.shape[-1], params["embed"].dtype)
    _, cache = forward_cached(cfg, params, ctx, cache, ctx_valid)

    def one(xs: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        toks, tgt, ok = xs
        lg, _ = forward_cached(cfg, params, toks, cache, ok)
        lp = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(lg, axis=-1)
        return jnp.where(ok, lp, 0.0).sum(-1)

    # lax.map: one compiled body for every choice, whatever their number.
    return jax.lax.map(one, (ext, targets, valid))


def score_multiple_choice(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, task: Task, rows: list[dict],
                          batch_size: int = 8, num_fewshot: int | None = None, progress: bool = True,
                          ) -> dict[str, float]:
    """acc / acc_norm of a multiple-choice task."""
    qs = mc_questions(tokenizer, task, rows, num_fewshot)
    total = sum(len(c) for _, c, _, _ in qs)
    with progress_bar(total, task.name, "choice", progress) as bar:
        lls = choice_loglikelihoods(cfg, params, [(ctx, conts) for ctx, conts, _, _ in qs], batch_size, bar)
    return mc_metrics(lls, [ch for _, _, ch, _ in qs], [g for _, _, _, g in qs])
