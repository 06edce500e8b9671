"""`multiple_choice` tasks: acc and acc_norm from the log-likelihood of each choice after its question's context.

A batch of questions' contexts is prefilled once into the KV cache of
:mod:`zoo.model.decode`, and every choice extends that same cache, so the shared
context is computed once per question; choices that differ only in their last
token (`` 65`` / `` 68``) share one extension row, scored at its last position
once per choice (lm-evaluation-harness's hf backend shares their forward pass
the same way). ``use_cache=False`` scores each
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

from eval.engine.images import vision_inputs
from eval.image_prompts import Expander, Frames, RowImages, fewshot_context, row_images
from eval.loglikelihood import bucket, context_continuation, fine_bucket, request_scores
from eval.progress import progress_bar
from eval.task_files import Task, fewshot_pool, field_of, format_row, joined
from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.decode import Cache, forward_cached, forward_step, init_cache
from zoo.model.vision import VisionInputs

Question = tuple[list[int], list[list[int]], list[str], list[int]]  # context ids, choices' ids, choices, golds


def mc_questions(tokenizer: Any, task: Task, rows: list[dict], num_fewshot: int | None = None) -> list[Question]:
    """(context ids, each choice's ids, the choices, the gold indices) of each row, the task's ``description``
    and few-shot examples (:func:`eval.task_files.fewshot_pool`) in the context."""
    return [q for q, _ in mc_image_questions(tokenizer, task, rows, num_fewshot)]


def mc_image_questions(tokenizer: Any, task: Task, rows: list[dict], num_fewshot: int | None = None,
                       images: RowImages | None = None) -> list[tuple[Question, Frames]]:
    """:func:`mc_questions` with each row's frames: with ``images``, a row with images has them in its context
    (at its ``<image>`` placeholders, else before it), expanded as the model's processor expands them; few-shot
    examples with images have theirs before them likewise (:func:`eval.image_prompts.fewshot_context`)."""
    k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
    delim = task.opt("target_delimiter", " ")
    sep = task.opt("fewshot_separator", "\n\n")
    template = task.opt("context", "{context}")
    prefix = task.opt("gen_prefix", "")
    out = []
    for i, row in enumerate(rows):
        choices, golds = choices_gold(row, task)
        shots, pool = [], fewshot_pool(task, rows, i, k)
        for shot in pool:
            sc, sg = choices_gold(shot, task)
            q = format_row(template, shot, task, "context")
            shots.append(q + delim + sc[sg[0]] if not prefix else joined(joined(q, prefix, delim), sc[sg[0]]))
        question = joined(format_row(template, row, task, "context"), prefix, delim)
        head = task.opt("prompt_description", "")
        context = head + sep.join(shots + [question])
        frames: Frames = []
        if images is not None and any(task.has_images(shot) for shot in pool):  # each example's images before it
            context, frames = fewshot_context(images, i, [*zip(shots, pool), (question, row)], sep, head)
        elif images is not None and images.wanted(row, context):
            context, frames = images.text(i, context, row)
        # After a gen_prefix ending in whitespace the choices follow it directly (lm-evaluation-harness's rule).
        lead = "" if prefix and prefix[-1].isspace() else delim
        ids = [context_continuation(tokenizer, context, lead + c) for c in choices]
        ctx = ids[0][0]
        if any(c != ctx for c, _ in ids) or any(not cont for _, cont in ids):
            raise UserError(f"task {task.name} ({task.source}): row {i + 1}: a choice is empty or tokenizes into its "
                            "context; give non-empty choices")
        if frames:  # the forward reads the context and a choice but its last token
            assert images is not None
            images.check_length(i, len(ctx) + max(len(c) for _, c in ids) - 1, "context and longest choice")
        out.append(((ctx, [cont for _, cont in ids], choices, golds), frames))
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
    for row, ch, g in zip(lls, choices, golds):
        ll = np.asarray(row, np.float64)
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
                          max_length: int | None = None, frames: Sequence[Frames] | None = None) -> list[list[float]]:
    """Summed log-likelihood of each choice's tokens given its question's context ids (:func:`choice_scores`)."""
    scores = choice_scores(cfg, params, questions, batch_size, bar, use_cache, max_length, frames)
    return [[ll for ll, _ in row] for row in scores]


def choice_scores(cfg: ModelConfig, params: dict[str, Any], questions: Sequence[tuple[list[int], list[list[int]]]],
                  batch_size: int = 8, bar: tqdm | None = None, use_cache: bool = True,
                  max_length: int | None = None, frames: Sequence[Frames] | None = None,
                  ) -> list[list[tuple[float, bool]]]:
    """(summed log-likelihood, whether every token is the argmax) of each choice given its question's context.

    With ``use_cache`` a batch of contexts is prefilled once into the KV cache
    (:mod:`zoo.model.decode`) and every choice extends that same cache; without it,
    each (context, choice) pair is one full row (the context recomputed per
    choice). Both give the same numbers. ``frames[q]``: a vision-language model's images of question q's context
    (its image tokens' frames, :func:`eval.generate.vision_inputs`), in the forward that reads the context.
    """
    max_length = max_length or cfg.max_position_embeddings
    if not use_cache:
        return _full_rows(cfg, params, questions, batch_size, bar, max_length, frames)
    out: list[list[tuple[float, bool]]] = [[(0.0, False)] * len(conts) for _, conts in questions]
    # Longest context first, and within one context width the longest choices first: a batch's rows then need
    # the same padded widths, and each (context, choice) width pair compiles once.
    order = sorted(range(len(questions)), key=lambda q: (-fine_bucket(len(questions[q][0]) - 1, 4),
                                                         -max(len(c) for c in questions[q][1]),
                                                         -len(questions[q][0])))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        # Widths in steps of a quarter of a power of two (fine_bucket): padding is computed work, each width a
        # compilation.
        kw = fine_bucket(max(len(c) for q in idx for c in questions[q][1]))  # one token for one-token choices
        if kw >= max_length:
            raise UserError(f"a choice of {kw} tokens does not fit the model's {max_length}-token context")
        # Contexts too long for the model lose tokens from the left (as lm-evaluation-harness does).
        ctxs = [questions[q][0][-(max_length - kw):] for q in idx]
        if frames is not None and any(frames[q] and len(c) < len(questions[q][0]) for q, c in zip(idx, ctxs)):
            raise UserError(f"a context with images does not fit the model's {max_length}-token context with its "
                            f"choices ({kw} tokens wide); its image tokens cannot be cut")
        cw = fine_bucket(max(len(c) for c in ctxs) - 1, 4)  # the cache's part: all but the last token
        # Choices of one question that differ only in their last token (" 65" / " 68") share one extension row
        # (as lm-evaluation-harness's hf backend shares their forward pass): the row is the context's last
        # token, then the shared tokens; its last position is scored once per member's last token. Rows read
        # their question's cache row (``owner``) and come in groups of batch_size, so a batch compiles once
        # per (context width, choice width, groups, members) bucket.
        rows: dict[tuple[int, ...], list[int]] = {}  # (question slot, *shared tokens) -> members
        for r, q in enumerate(idx):
            for j, cont in enumerate(questions[q][1]):
                rows.setdefault((r, *cont[:-1]), []).append(j)
        n_rows = -(-len(rows) // batch_size) * batch_size
        members = bucket(max(len(m) for m in rows.values()), 1)
        ctx = np.zeros((batch_size, cw), np.int32)
        ctx_valid = np.zeros((batch_size, cw), bool)
        for r in range(batch_size):  # a short last batch repeats its first context: one shape, one compilation
            c = ctxs[r] if r < len(idx) else ctxs[0]
            ctx[r, :len(c) - 1], ctx_valid[r, :len(c) - 1] = c[:-1], True
        owner = np.zeros(n_rows, np.int32)
        ext = np.zeros((n_rows, kw), np.int32)
        shared = np.zeros((n_rows, kw), np.int32)  # targets before the last: the shared tokens
        shared_ok = np.zeros((n_rows, kw), bool)
        last_pos = np.zeros(n_rows, np.int32)
        last = np.zeros((n_rows, members), np.int32)
        for row, ((r, *head), js) in enumerate(rows.items()):  # padding rows are never read back
            owner[row], last_pos[row] = r, len(head)
            ext[row, :len(head) + 1] = [ctxs[r][-1], *head]
            shared[row, :len(head)], shared_ok[row, :len(head)] = head, True
            last[row, :len(js)] = [questions[idx[r]][1][j][-1] for j in js]
        flat = FLAT if FLAT is not None else _cache_bytes(cfg, n_rows * (cw + kw)) <= FLAT_CACHE_BYTES
        per_pass = n_rows if flat else batch_size
        shaped = [a.reshape(n_rows // per_pass, per_pass, *a.shape[1:])
                  for a in (owner, ext, shared, shared_ok, last_pos, last)]
        # A short last batch's repeated first context repeats its images too.
        vision = None if frames is None else vision_inputs(cfg, [frames[q] for q in idx]
                                                           + [frames[idx[0]]] * (batch_size - len(idx)))
        sums, greedy = jax.device_get(_cached_choices(cfg, params, *map(jnp.asarray, (ctx, ctx_valid, *shaped)),
                                                      vision=vision))
        sums, greedy = sums.reshape(n_rows, members), greedy.reshape(n_rows, members)
        for row, ((r, *_), js) in enumerate(rows.items()):
            for m, j in enumerate(js):
                out[idx[r]][j] = (float(np.float64(sums[row, m])), bool(greedy[row, m]))
        if bar is not None:
            bar.update(sum(len(questions[q][1]) for q in idx))
    return out


def _full_rows(cfg: ModelConfig, params: dict[str, Any], questions: Sequence[tuple[list[int], list[list[int]]]],
               batch_size: int, bar: tqdm | None, max_length: int,
               frames: Sequence[Frames] | None) -> list[list[tuple[float, bool]]]:
    """:func:`choice_scores` without the cache: each (context, choice) pair one full row
    (:func:`eval.loglikelihood.request_scores`), with its question's frames."""
    requests, where = [], []
    for q, (context, conts) in enumerate(questions):
        for j, cont in enumerate(conts):
            requests.append((context + cont, len(cont)))
            where.append((q, j))
    got = request_scores(cfg, params, requests, batch_size, max_length, bar,
                         None if frames is None else [frames[q] for q, _ in where])
    out: list[list[tuple[float, bool]]] = [[(0.0, False)] * len(conts) for _, conts in questions]
    for (q, j), v in zip(where, got):
        out[q][j] = v
    return out


# Choices run in one pass over a copy of their context's cache each while those copies stay this small; beyond
# it, batch_size choices at a time (memory bounded, smaller matmuls).
FLAT_CACHE_BYTES = 256 << 20
FLAT: bool | None = None  # force one way (benchmarks); None: by FLAT_CACHE_BYTES


def _cache_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Bytes of a float32 KV cache of ``tokens`` entries (keys and values, every layer; MLA's latent)."""
    per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) if cfg.mla else 2 * cfg.num_kv_heads * cfg.head_dim
    return 4 * tokens * per_layer * cfg.num_layers


@functools.partial(jax.jit, static_argnums=0)
def _cached_choices(cfg: ModelConfig, params: dict[str, Any], ctx: jax.Array, ctx_valid: jax.Array,
                    owner: jax.Array, ext: jax.Array, shared: jax.Array, shared_ok: jax.Array,
                    last_pos: jax.Array, last: jax.Array, vision: VisionInputs | None = None,
                    ) -> tuple[jax.Array, jax.Array]:
    """(summed log p(choice), every choice token the argmax) [passes, rows, members] of extension rows
    ext [passes, rows, k] after the cached context ``owner`` of ctx [batch, c]: the targets ``shared`` where
    ``shared_ok``, then at ``last_pos`` each member's ``last`` token.

    The contexts go through the cache once (their logits unused, so XLA drops
    the vocabulary projection); each extension row reads a copy of its
    context's cache rows, which is never written back, so every choice sees the
    same context. One pass per leading index (``lax.map``: one compiled body,
    memory one pass's copies). ``vision``: the contexts' images, read by the prefill (the choices are text).
    """
    b, c = ctx.shape
    k = ext.shape[-1]
    cache = init_cache(cfg, b, c + k, params["embed"].dtype)
    _, cache = forward_step(cfg, params, ctx, cache, ctx_valid, fresh=True, vision=vision)

    def score(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        rows, toks, tgt, ok, pos, ends = xs
        kv = Cache(jax.tree.map(lambda a: jnp.take(a, rows, axis=1), cache.layers), cache.lengths[rows],
                   None if cache.rope_delta is None else cache.rope_delta[rows])
        at = jnp.arange(toks.shape[1])[None, :]
        lg, _ = forward_cached(cfg, params, toks, kv, at <= pos[:, None])
        logz = jax.nn.logsumexp(lg, axis=-1)
        lp = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0] - logz
        head = jnp.where(ok, lp, 0.0).sum(-1)
        head_greedy = jnp.where(ok, jnp.argmax(lg, axis=-1) == tgt, True).all(-1)
        lg_end = jnp.take_along_axis(lg, pos[:, None, None], axis=1)[:, 0]  # [rows, vocab]
        lp_end = jnp.take_along_axis(lg_end, ends, axis=-1) - jnp.take_along_axis(logz, pos[:, None], axis=1)
        greedy_end = jnp.argmax(lg_end, axis=-1)[:, None] == ends
        return head[:, None] + lp_end, head_greedy[:, None] & greedy_end

    return jax.lax.map(score, (owner, ext, shared, shared_ok, last_pos, last))


def score_multiple_choice(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, task: Task, rows: list[dict],
                          batch_size: int = 8, num_fewshot: int | None = None, progress: bool = True,
                          expander: Expander | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(acc / acc_norm / acc_bytes of a multiple-choice task, one record per row: its context, choices, gold
    indices, per-choice log-likelihoods and predictions). ``expander``: a vision-language model's image
    processor (chat/images.py's ImageExpander), which rows with images need."""
    k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
    pairs = mc_image_questions(tokenizer, task, rows, num_fewshot, row_images(task, expander, cfg, rows, k))
    qs = [q for q, _ in pairs]
    frames = [f for _, f in pairs] if any(f for _, f in pairs) else None
    total = sum(len(c) for _, c, _, _ in qs)
    with progress_bar(total, task.name, "choice", progress) as bar:
        lls = choice_loglikelihoods(cfg, params, [(ctx, conts) for ctx, conts, _, _ in qs], batch_size, bar,
                                    frames=frames)
    metrics = mc_metrics(lls, [ch for _, _, ch, _ in qs], [g for _, _, _, g in qs])
    items = []
    for i, ((ctx, _, choices, golds), ll) in enumerate(zip(qs, lls)):
        arr = np.asarray(ll, np.float64)
        items.append({"index": i, "context": tokenizer.decode(ctx), "choices": choices, "gold": golds,
                      "loglikelihoods": [float(x) for x in ll], "pred": int(np.argmax(arr)),
                      "pred_norm": int(np.argmax(arr / np.asarray([max(1, len(c)) for c in choices], np.float64)))})
    return metrics, items
