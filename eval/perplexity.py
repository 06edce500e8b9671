"""`perplexity` tasks: token perplexity and bits per byte of a task's documents.

Each document is cut into windows of at most ``window`` tokens that score
every token exactly once; the windows are log-likelihood requests of
:mod:`eval.loglikelihood`.
"""

from __future__ import annotations

import math
from typing import Any

from eval.loglikelihood import Request, encode, loglikelihoods, prefix_token
from eval.progress import progress_bar
from eval.tasks import Task, field_of
from zoo.config import ModelConfig
from zoo.errors import UserError


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
    with progress_bar(len(requests), task.name, "win", progress) as bar:
        ll = loglikelihoods(cfg, params, requests, batch_size, window, bar)
    nll = -float(ll.sum())
    return {"ppl": math.exp(nll / n_tokens), "bpb": nll / (math.log(2) * n_bytes), "nll": nll,
            "tokens": n_tokens, "bytes": n_bytes, "documents": len(set(owner))}
