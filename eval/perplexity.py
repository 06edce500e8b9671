"""`perplexity` tasks: perplexities and bits per byte of a task's documents, by lm-evaluation-harness's definitions.

Each document (encoded as lm-eval encodes it: with the tokenizer's special
tokens) is cut into windows of at most ``window`` tokens that score every token
exactly once; the windows are log-likelihood requests of :mod:`eval.loglikelihood`.
By default they are lm-eval's rolling windows: each full window re-reads the one
token before its new ones, and the last window re-reads as many earlier tokens
as fill it (``get_rolling_token_windows`` with one token of context, made
disjoint). ``overlap: N`` instead re-reads N tokens before every window. A
window longer than ``chunk`` tokens is read ``chunk`` at a time through the KV
cache (:mod:`eval.rolling`): the same scores, a chunk's activation memory.
"""

from __future__ import annotations

import math
import re
from typing import Any

from eval.loglikelihood import Request, encode, prefix_token
from eval.progress import progress_bar
from eval.rolling import DEFAULT_CHUNK, window_scores
from eval.task_files import Task, field_of
from zoo.errors import UserError
from zoo.model.config import ModelConfig


def document_requests(tokens: list[int], prefix: int, window: int, overlap: int | None = None) -> list[Request]:
    """Windows covering a document: every token scored exactly once, each row at most ``window`` tokens long.

    The first window predicts the first token from ``prefix``. With ``overlap``
    None (lm-eval's rolling windows) each later window reads the one token
    before its new ones, and the last one as many earlier tokens as fit the
    window; with ``overlap`` N each later window re-reads N tokens of context
    (at least the one token just before them).
    """
    s = [prefix] + list(tokens)
    out, a = [], 1  # a: index in s of the first token not yet scored
    while a < len(s):
        c = max(0, a - 1 - (overlap or 0))
        b = min(len(s), c + 1 + window)
        if overlap is None:
            b = min(len(s), a + window)
            c = max(0, b - 1 - window)
        out.append((s[c:b], b - a))
        a = b
    return out


def count_words(text: str) -> int:
    """Words as lm-evaluation-harness counts them for word perplexity (pieces between runs of whitespace)."""
    return len(re.split(r"\s+", text))


def score_perplexity(cfg: ModelConfig, params: dict[str, Any], tokenizer: Any, task: Task, rows: list[dict],
                     batch_size: int = 8, progress: bool = True, chunk: int | None = DEFAULT_CHUNK,
                     ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(the metrics, one record per document: its log-likelihood, tokens, bytes and words).

    ``word_perplexity``, ``byte_perplexity`` and ``bits_per_byte`` are
    lm-evaluation-harness's (summed over documents, then divided); ``ppl`` is the
    token perplexity and ``bpb`` the same as ``bits_per_byte``."""
    field = task.opt("text_field", "text")
    window = min(task.opt("window", 512), cfg.max_position_embeddings)
    overlap = task.options.get("overlap")
    prefix = prefix_token(tokenizer)
    requests: list[Request] = []
    owner: list[int] = []
    docs: list[dict[str, Any]] = []
    for row in rows:
        text = field_of(row, field, task)
        ids = encode(tokenizer, text, special=True)
        if not ids:
            continue
        reqs = document_requests(ids, prefix, window, overlap)
        requests += reqs
        owner += [len(docs)] * len(reqs)
        docs.append({"index": len(docs), "tokens": len(ids), "bytes": len(text.encode("utf-8")),
                     "words": count_words(text), "loglikelihood": 0.0})
    if not requests:
        raise UserError(f"task {task.name} ({task.source}): no text to score")
    with progress_bar(len(requests), task.name, "win", progress) as bar:
        ll = window_scores(cfg, params, requests, batch_size, window, chunk, bar)
    for d, (v, _) in zip(owner, ll):
        docs[d]["loglikelihood"] += float(v)
    nll = -sum(d["loglikelihood"] for d in docs)
    n_tokens, n_bytes, n_words = (sum(d[k] for d in docs) for k in ("tokens", "bytes", "words"))
    bpb = nll / (math.log(2) * n_bytes)
    return {"ppl": math.exp(nll / n_tokens), "bpb": bpb, "word_perplexity": math.exp(nll / n_words),
            "byte_perplexity": math.exp(nll / n_bytes), "bits_per_byte": bpb, "nll": nll, "tokens": n_tokens,
            "bytes": n_bytes, "words": n_words, "documents": len(docs)}, docs
