"""Scorers of `zoo eval` tasks: perplexity / bits per byte, multiple-choice log-likelihood, generation.

Everything runs on a config and a parameter tree (not a checkpoint path), so the
training loop can call :func:`evaluate` on its live parameters. Forward passes
are batched into fixed shapes -- ``batch_size`` rows, lengths rounded up to a
power of two -- so each shape compiles once and later calls reuse it.

Log-likelihood requests are ``(tokens, n)``: the model reads ``tokens[:-1]``
and the log-probabilities of the last ``n`` of ``tokens[1:]`` are summed.

Multiple choice: a batch of questions' contexts is prefilled once into the
KV cache of :mod:`zoo.decode`, and every choice extends that same cache, so
the shared context is computed once per question. ``use_cache=False`` scores
each (context, choice) pair as its own full row instead (the plain forward
pass; the same numbers, the context recomputed per choice).
"""

from __future__ import annotations

import functools
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from eval.tasks import Task, field_of, format_row, resolve_tasks
from zoo.config import ModelConfig
from zoo.errors import UserError
from zoo.model import forward

Request = tuple[list[int], int]  # (tokens, how many of the last targets are scored)
MIN_BUCKET = 16


# --------------------------------------------------------------------------- forward passes


@functools.partial(jax.jit, static_argnums=0)
def _target_logprobs(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array, targets: jax.Array,
                     segment_ids: jax.Array) -> jax.Array:
    """log p(targets[b, i] | tokens[b, :i+1]) [batch, seq], float32."""
    logits = forward(cfg, params, tokens, segment_ids)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded length of a row of ``n`` tokens: the next power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def loglikelihoods(cfg: ModelConfig, params: dict[str, Any], requests: Sequence[Request], batch_size: int = 8,
                   max_length: int | None = None, bar: tqdm | None = None) -> np.ndarray:
    """Summed log-likelihood (float64) of each request's scored tokens, in batched fixed-shape forward passes.

    A request longer than ``max_length`` (default: the model's context) loses
    tokens from the left; its scored tokens must fit.
    """
    max_length = max_length or cfg.max_position_embeddings
    rows = []
    for toks, n in requests:
        if n < 1 or n > len(toks) - 1:
            raise ValueError(f"a request scores {n} of {len(toks) - 1} targets")
        if n > max_length:
            raise UserError(f"a continuation of {n} tokens does not fit the model's {max_length}-token context")
        rows.append((list(toks[:-1])[-max_length:], list(toks[1:])[-max_length:], n))
    out = np.zeros(len(rows), np.float64)
    # Longest first: rows of one batch have similar lengths, so little padding is computed.
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = min(bucket(len(rows[idx[0]][0])), max(max_length, len(rows[idx[0]][0])))
        tokens = np.zeros((batch_size, width), np.int32)
        targets = np.zeros((batch_size, width), np.int32)
        segs = np.zeros((batch_size, width), np.int32)  # 0: padding (attention never crosses into it)
        scored = np.zeros((batch_size, width), bool)
        for r, i in enumerate(idx):
            inp, tgt, n = rows[i]
            tokens[r, :len(inp)], targets[r, :len(tgt)], segs[r, :len(inp)] = inp, tgt, 1
            scored[r, len(tgt) - n:len(tgt)] = True
        lp = np.asarray(_target_logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(segs)))
        sums = np.where(scored, lp.astype(np.float64), 0.0).sum(-1)
        out[idx] = sums[:len(idx)]
        if bar is not None:
            bar.update(len(idx))
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


# --------------------------------------------------------------------------- perplexity


def document_requests(tokens: list[int], prefix: int, window: int, overlap: int = 0) -> list[Request]:
    """Windows covering a document: every token scored exactly once, each row at most ``window`` tokens long.

    The first window predicts the first token from ``prefix``; each later one
    re-reads ``overlap`` tokens of context before its new tokens (at least the
    one token just before them).
    """
    s = [prefix] + list(tokens)
    out, a = [], 1  # a: index in s of the first token not yet scored
    while a < len(s):
        c = max(0, a - 1 - overlap)
        b = min(len(s), c + 1 + window)
        out.append((s[c:b], b - a))
        a = b
    return out


def score_perplexity(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, task: Task, rows: list[dict],
                     batch_size: int = 8, progress: bool = True) -> dict[str, float]:
    """Token perplexity and bits per byte of the task's documents."""
    field = task.opt("text_field", "text")
    window = min(task.opt("window", 512), cfg.max_position_embeddings)
    overlap = task.opt("overlap", 0)
    prefix = prefix_token(tokenizer)
    requests, owner, n_tokens, n_bytes = [], [], 0, 0
    for d, row in enumerate(rows):
        text = field_of(row, field, task)
        ids = encode(tokenizer, text)
        if not ids:
            continue
        n_tokens += len(ids)
        n_bytes += len(text.encode("utf-8"))
        reqs = document_requests(ids, prefix, window, overlap)
        requests += reqs
        owner += [d] * len(reqs)
    if not requests:
        raise UserError(f"task {task.name} ({task.source}): no text to score")
    with _bar(len(requests), task.name, "win", progress) as bar:
        ll = loglikelihoods(cfg, params, requests, batch_size, window, bar)
    nll = -float(ll.sum())
    return {"ppl": math.exp(nll / n_tokens), "bpb": nll / (math.log(2) * n_bytes), "nll": nll,
            "tokens": n_tokens, "bytes": n_bytes, "documents": len(set(owner))}


# --------------------------------------------------------------------------- multiple choice


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
    from zoo.decode import forward_cached, init_cache

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
    with _bar(total, task.name, "choice", progress) as bar:
        lls = choice_loglikelihoods(cfg, params, [(ctx, conts) for ctx, conts, _, _ in qs], batch_size, bar)
    return mc_metrics(lls, [ch for _, _, ch, _ in qs], [g for _, _, _, g in qs])


# --------------------------------------------------------------------------- generation


def generation_examples(tokenizer: Any, task: Task, rows: list[dict], num_fewshot: int | None = None,
                        chat_template: bool | None = None) -> list[tuple[list[int], str]]:
    """(prompt ids, reference answer) of each row."""
    use_chat = task.opt("chat_template", bool(task.opt("messages"))) if chat_template is None else chat_template
    k = task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot
    shots_from = task.fewshot_rows()
    out = []
    for i, row in enumerate(rows):
        pool = shots_from if shots_from is not None else [r for j, r in enumerate(rows[:k + 1]) if j != i]
        turns, ref = _turns(row, task)
        shots = [_turns(s, task) for s in pool[:k]]
        if use_chat:
            if not getattr(tokenizer, "chat_template", None):
                raise UserError(f"task {task.name} ({task.source}) applies the chat template, but the tokenizer has "
                                "none; set chat_template: false in the task or pass --no-chat-template")
            conv = [m for st, sr in shots for m in st + [{"role": "assistant", "content": sr}]] + turns
            ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
        else:
            delim, sep = task.opt("target_delimiter", " "), task.opt("fewshot_separator", "\n\n")
            text = sep.join([_plain(st) + delim + sr for st, sr in shots] + [_plain(turns)])
            ids = encode(tokenizer, text, special=True)
        out.append((ids, ref))
    return out


def _turns(row: dict, task: Task) -> tuple[list[dict[str, str]], str]:
    """(the conversation before the answer, the reference answer) of one row."""
    if task.opt("messages"):
        msgs = field_of(row, task.opt("messages"), task)
        last = [i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"]
        if not last:
            raise UserError(f"task {task.name} ({task.source}): a row's {task.opt('messages')} has no assistant "
                            "turn to use as the reference")
        return msgs[:last[-1]], str(msgs[last[-1]]["content"])
    prompt = format_row(task.opt("prompt"), row, task, "prompt")
    return [{"role": "user", "content": prompt}], format_row(task.opt("target"), row, task, "target")


def _plain(turns: list[dict[str, str]]) -> str:
    """A conversation as plain text (no chat template): its turns' contents, one per line."""
    return "\n".join(str(m["content"]) for m in turns)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    ends = [text.find(s) for s in stop if s in text]
    return text[:min(ends)] if ends else text


def extract(answer: str, pattern: str) -> str:
    """The last match of ``pattern`` in ``answer`` (its first group if it has one), or "" without a match."""
    matches = list(re.finditer(pattern, answer))
    if not matches:
        return ""
    m = matches[-1]
    return m.group(1) if m.re.groups else m.group(0)


def scored_answer(answer: str, task: Task) -> str:
    """The part of a generated answer that is compared: cut at the first stop string, then the regex's pick."""
    answer = cut_at_stop(answer, task.opt("stop", []))
    if task.opt("scorer", "exact_match") == "regex":
        answer = extract(answer, task.opt("regex"))
    return answer.strip()


def is_correct(answer: str, reference: str, task: Task) -> bool:
    """Whether one generated answer matches its reference under the task's scorer (whitespace around both ignored)."""
    a, r = scored_answer(answer, task), reference.strip()
    if task.opt("ignore_case", False):
        a, r = a.lower(), r.lower()
    return a == r


Generator = Callable[[list[list[int]]], list[list[int]]]


def greedy_generator(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, max_new_tokens: int,
                     stop: Sequence[str] = ()) -> Generator:
    """prompts -> greedy new tokens (eval.generate on the KV cache; stops at EOS or a stop string)."""
    from eval.generate import GenerationConfig, generate

    eos = (int(tokenizer.eos_token_id),) if tokenizer.eos_token_id is not None else ()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop=tuple(stop), eos_ids=eos)
    return lambda prompts: generate(cfg, params, prompts, gen, tokenizer=tokenizer if stop else None)


def score_generation(tokenizer: Any, task: Task, rows: list[dict], generator: Generator, batch_size: int = 8,
                     num_fewshot: int | None = None, chat_template: bool | None = None, progress: bool = True,
                     ) -> tuple[dict[str, float], list[dict[str, str]]]:
    """(exact_match metric, the first few samples) of a generation task, with ``generator`` producing the tokens."""
    examples = generation_examples(tokenizer, task, rows, num_fewshot, chat_template)
    answers: list[str] = [""] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i][0]))
    with _bar(len(examples), task.name, "ex", progress) as bar:
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            # A short last batch is filled up with copies of its first prompt: one batch shape, one compilation.
            prompts = [examples[i][0] for i in idx] + [examples[idx[0]][0]] * (batch_size - len(idx))
            for i, new in zip(idx, generator(prompts)):
                answers[i] = tokenizer.decode(new, skip_special_tokens=True)
            bar.update(len(idx))
    correct = [is_correct(a, ref, task) for a, (_, ref) in zip(answers, examples)]
    samples = [{"answer": a, "scored": scored_answer(a, task), "reference": ref, "correct": c}
               for a, (_, ref), c in list(zip(answers, examples, correct))[:3]]
    return {"exact_match": float(np.mean(correct)) if correct else 0.0}, samples


# --------------------------------------------------------------------------- all tasks


def _bar(total: int, desc: str, unit: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, file=sys.stderr, leave=False)


def evaluate(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, tasks: str | Sequence[str | Task],
             limit: int | None = None, batch_size: int = 8, num_fewshot: int | None = None,
             chat_template: bool | None = None, progress: bool = True) -> dict[str, Any]:
    """Score ``params`` on ``tasks`` (Task objects, shipped task names or YAML paths; a comma-separated string works).

    ``limit`` caps each task's examples; ``num_fewshot`` and ``chat_template``
    (None: each task's own setting) override the tasks'. Returns
    ``{"tasks": {name: {name, version, kind, source, data, examples, metrics, settings, seconds}}}``.
    """
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be at least 1")
    if isinstance(tasks, str):
        tasks = resolve_tasks(tasks)
    else:
        tasks = [t if isinstance(t, Task) else resolve_tasks([t])[0] for t in tasks]
    results: dict[str, Any] = {}
    for task in tasks:
        t0 = time.perf_counter()
        rows = task.rows(limit)
        settings: dict[str, Any] = {"limit": limit, "batch_size": batch_size}
        samples = None
        if task.kind == "perplexity":
            metrics = score_perplexity(cfg, params, tokenizer, task, rows, batch_size, progress)
            settings.update(window=min(task.opt("window", 512), cfg.max_position_embeddings),
                            overlap=task.opt("overlap", 0))
        elif task.kind == "multiple_choice":
            metrics = score_multiple_choice(cfg, params, tokenizer, task, rows, batch_size, num_fewshot, progress)
            settings.update(num_fewshot=task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot,
                            kv_cache=True)
        else:
            max_new = task.opt("max_new_tokens", 32)
            gen = greedy_generator(cfg, params, tokenizer, max_new, task.opt("stop", []))
            metrics, samples = score_generation(tokenizer, task, rows, gen, batch_size, num_fewshot, chat_template,
                                                progress)
            use_chat = task.opt("chat_template", bool(task.opt("messages"))) if chat_template is None else chat_template
            settings.update(num_fewshot=task.opt("num_fewshot", 0) if num_fewshot is None else num_fewshot,
                            chat_template=use_chat, max_new_tokens=max_new, greedy=True,
                            scorer=task.opt("scorer", "exact_match"), regex=task.opt("regex"),
                            stop=task.opt("stop", []))
        results[task.name] = {"name": task.name, "version": task.version, "kind": task.kind, "source": task.source,
                              "data": task.data, "examples": len(rows), "metrics": metrics, "settings": settings,
                              "seconds": round(time.perf_counter() - t0, 3)}
        if samples is not None:
            results[task.name]["samples"] = samples
    return {"tasks": results}
