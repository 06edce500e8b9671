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

from eval.loglikelihood import bucket, context_continuation, request_scores
from eval.progress import progress_bar
from eval.tasks import Task, fewshot_pool, field_of, format_row, joined
from zoo.config import ModelConfig
from zoo.decode import Cache, forward_cached, forward_step, init_cache
from zoo.errors import UserError


def mc_questions(tokenizer: Any, task: Task, rows: list[dict], num_fewshot: int | None = None,
                 ) -> list[tuple[list[int], list[list[int]], list[str], list[int]]]:
    """(context ids, each choice's ids, the choices, the gold indices) of each row, the task's ``description``
    and few-shot examples (:func:`eval.tasks.fewshot_pool`) in the context."""
    k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
    delim = task.opt("target_delimiter", " ")
    sep = task.opt("fewshot_separator", "\n\n")
    template = task.opt("context", "{context}")
    prefix = task.opt("gen_prefix", "")
    out = []
    for i, row in enumerate(rows):
        choices, golds = choices_gold(row, task)
        shots = []
        for shot in fewshot_pool(task, rows, i, k):
            sc, sg = choices_gold(shot, task)
            q = format_row(template, shot, task, "context")
            shots.append(q + delim + sc[sg[0]] if not prefix else joined(joined(q, prefix, delim), sc[sg[0]]))
        context = sep.join(shots + [joined(format_row(template, row, task, "context"), prefix, delim)])
        context = task.opt("prompt_description", "") + context
        # After a gen_prefix ending in whitespace the choices follow it directly (lm-evaluation-harness's rule).
        lead = "" if prefix and prefix[-1].isspace() else delim
        ids = [context_continuation(tokenizer, context, lead + c) for c in choices]
        ctx = ids[0][0]
        if any(c != ctx for c, _ in ids) or any(not cont for _, cont in ids):
            raise UserError(f"task {task.name} ({task.source}): row {i + 1}: a choice is empty or tokenizes into its "
                            "context; give non-empty choices")
        out.append((ctx, [cont for _, cont in ids], choices, golds))
    return out


def choices_gold(row: dict, task: Task) -> tuple[list[str], list[int]]:
    """(the choices, the gold indices) of one row, or a UserError naming what is wrong with them.

    ``choices:`` names the row's field holding the list, or is itself the list (the same for every row, e.g.
    ``[A, B, C, D]``); the gold field holds an index, a list of indices (several right answers), or the text of
    the right choice."""
    spec = task.opt("choices", "choices")
    choices = spec if isinstance(spec, list) else field_of(row, spec, task)
    gold = field_of(row, task.opt("gold", "gold"), task)
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise UserError(f"task {task.name} ({task.source}): choices must be a non-empty list of strings, "
                        f"not {choices!r}")
    golds = gold if isinstance(gold, list) and gold else [gold]
    out = []
    for g in golds:
        if isinstance(g, str) and g in choices:
            g = choices.index(g)
        if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < len(choices):
            raise UserError(f"task {task.name} ({task.source}): gold {gold!r} is not an index in 0..{len(choices) - 1} "
                            "(or a list of them, or one of the choices)")
        out.append(g)
    return choices, out


def mc_metrics(lls: Sequence[Sequence[float]], choices: Sequence[Sequence[str]], golds: Sequence[Sequence[int] | int],
               ) -> dict[str, float]:
    """lm-evaluation-harness's multiple-choice metrics: ``acc`` (the argmax of the summed log-likelihoods is a
    gold index), ``acc_norm`` (the same after dividing each by its choice's length in characters) and
    ``acc_bytes`` (by its length in UTF-8 bytes), each with its standard error."""
    hits: dict[str, list[bool]] = {"acc": [], "acc_norm": [], "acc_bytes": []}
    for ll, ch, g in zip(lls, choices, golds):
        ll = np.asarray(ll, np.float64)
        gold = set(g) if isinstance(g, (list, tuple, set)) else {g}
        chars = np.asarray([max(1, len(c)) for c in ch], np.float64)  # choices are never empty (mc_questions)
        nbytes = np.asarray([max(1, len(c.encode("utf-8"))) for c in ch], np.float64)
        hits["acc"].append(int(np.argmax(ll)) in gold)
        hits["acc_norm"].append(int(np.argmax(ll / chars)) in gold)
        hits["acc_bytes"].append(int(np.argmax(ll / nbytes)) in gold)
    out = {}
    for name, h in hits.items():
        n = len(h)
        p = float(np.mean(h)) if n else 0.0
        out[name] = p
        out[f"{name}_stderr"] = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0
    return out


def choice_loglikelihoods(cfg: ModelConfig, params: dict[str, Any],
                          questions: Sequence[tuple[list[int], list[list[int]]]], batch_size: int = 8,
                          bar: tqdm | None = None, use_cache: bool = True,
                          max_length: int | None = None) -> list[list[float]]:
    """Summed log-likelihood of each choice's tokens given its question's context ids (:func:`choice_scores`)."""
    scores = choice_scores(cfg, params, questions, batch_size, bar, use_cache, max_length)
    return [[ll for ll, _ in row] for row in scores]


def choice_scores(cfg: ModelConfig, params: dict[str, Any], questions: Sequence[tuple[list[int], list[list[int]]]],
                  batch_size: int = 8, bar: tqdm | None = None, use_cache: bool = True,
                  max_length: int | None = None) -> list[list[tuple[float, bool]]]:
    """(summed log-likelihood, whether every token is the argmax) of each choice given its question's context.

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
        got = request_scores(cfg, params, requests, batch_size, max_length, bar)
        out: list[list[tuple[float, bool]]] = [[(0.0, False)] * len(conts) for _, conts in questions]
        for (q, j), v in zip(where, got):
            out[q][j] = v
        return out
    n_choices = max(len(conts) for _, conts in questions)  # fixed per task: one compiled shape per length bucket
    out = [[(0.0, False)] * len(conts) for _, conts in questions]
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
        flat = FLAT if FLAT is not None else _cache_bytes(cfg, n_choices * batch_size * (cw + kw)) <= FLAT_CACHE_BYTES
        sums, greedy = jax.device_get(_cached_choices(cfg, params, *map(jnp.asarray,
                                                                        (ctx, ctx_valid, ext, targets, valid)), flat))
        for r, q in enumerate(idx):
            out[q] = [(float(np.float64(sums[j, r])), bool(greedy[j, r])) for j in range(len(questions[q][1]))]
        if bar is not None:
            bar.update(sum(len(questions[q][1]) for q in idx))
    return out


# Choices run in one pass over a copy of the context cache each while those copies stay this small; beyond it,
# one choice at a time over the one cache (memory bounded, smaller matmuls).
FLAT_CACHE_BYTES = 256 << 20
FLAT: bool | None = None  # force one way (benchmarks); None: by FLAT_CACHE_BYTES


def _cache_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Bytes of a float32 KV cache of ``tokens`` entries (keys and values, every layer; MLA's latent)."""
    per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) if cfg.mla else 2 * cfg.num_kv_heads * cfg.head_dim
    return 4 * tokens * per_layer * cfg.num_layers


@functools.partial(jax.jit, static_argnums=(0, 7))
def _cached_choices(cfg: ModelConfig, params: dict[str, Any], ctx: jax.Array, ctx_valid: jax.Array,
                    ext: jax.Array, targets: jax.Array, valid: jax.Array, flat: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
    """(summed log p(targets), every target the argmax) [choices, batch] of extension rows ext [choices, batch, k]
    after the cached ctx [batch, c].

    The contexts go through the cache once (their logits unused, so XLA drops
    the vocabulary projection); each choice's row extends that cache, which is
    never written back, so every choice sees the same context. ``flat``
    (static): all choices in one pass over a copy of the cache per choice
    (larger matmuls; memory ``choices`` times the cache), else one choice at a
    time over the one cache.
    """
    b, c = ctx.shape
    n, _, k = ext.shape
    cache = init_cache(cfg, b, c + k, params["embed"].dtype)
    _, cache = forward_step(cfg, params, ctx, cache, ctx_valid, fresh=True)

    def score(toks: jax.Array, tgt: jax.Array, ok: jax.Array, kv: Any) -> tuple[jax.Array, jax.Array]:
        lg, _ = forward_cached(cfg, params, toks, kv, ok)
        lp = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(lg, axis=-1)
        return jnp.where(ok, lp, 0.0).sum(-1), jnp.where(ok, jnp.argmax(lg, axis=-1) == tgt, True).all(-1)

    if flat:  # row j * b + r of the flattened choices reads copy j of row r's cache
        tiled = Cache(jax.tree.map(lambda a: jnp.concatenate([a] * n, axis=1), cache.layers),
                      jnp.concatenate([cache.lengths] * n))
        sums, greedy = score(ext.reshape(n * b, k), targets.reshape(n * b, k), valid.reshape(n * b, k), tiled)
        return sums.reshape(n, b), greedy.reshape(n, b)
    # lax.map: one compiled body for every choice, whatever their number.
    return jax.lax.map(lambda xs: score(*xs, cache), (ext, targets, valid))


def score_multiple_choice(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, task: Task, rows: list[dict],
                          batch_size: int = 8, num_fewshot: int | None = None, progress: bool = True,
                          ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(acc / acc_norm / acc_bytes of a multiple-choice task, one record per row: its context, choices, gold
    indices, per-choice log-likelihoods and predictions)."""
    qs = mc_questions(tokenizer, task, rows, num_fewshot)
    total = sum(len(c) for _, c, _, _ in qs)
    with progress_bar(total, task.name, "choice", progress) as bar:
        lls = choice_loglikelihoods(cfg, params, [(ctx, conts) for ctx, conts, _, _ in qs], batch_size, bar)
    metrics = mc_metrics(lls, [ch for _, _, ch, _ in qs], [g for _, _, _, g in qs])
    items = []
    for i, ((ctx, _, choices, golds), ll) in enumerate(zip(qs, lls)):
        arr = np.asarray(ll, np.float64)
        items.append({"index": i, "context": tokenizer.decode(ctx), "choices": choices, "gold": golds,
                      "loglikelihoods": [float(x) for x in ll], "pred": int(np.argmax(arr)),
                      "pred_norm": int(np.argmax(arr / np.asarray([max(1, len(c)) for c in choices], np.float64)))})
    return metrics, items
