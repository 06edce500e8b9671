"""What a caller of the inference engine hands it and gets back: per-request sampling settings, and the events a
step reports.

The engine (:class:`eval.engine.engine.Engine`) is driven from one thread: ``submit`` requests, call ``step``
while ``busy``, read each step's :class:`Event` s. A server runs that loop in a thread of its own and hands events to
its clients (serve/); ``Engine.generate`` runs a list of prompts to their ends (`zoo generate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature`` 0 is greedy (argmax); otherwise the logits over the temperature are cut to the ``top_k`` most
    likely tokens (0: all) and to the smallest set whose probability reaches ``top_p`` (1.0: all), then drawn with
    :func:`eval.generate.categorical`'s two-stage draw from a key of ``seed`` and the token's index (a seed
    reproduces its tokens whatever else runs beside it; None: the engine's next seed). Decoding ends after
    ``max_tokens`` new tokens (finish reason "length"), after a token of ``eos_ids``, or once the decoded text
    holds one of ``stop`` (both "stop"; the engine's tokenizer decodes). ``adapter``: the name of one of the
    engine's LoRA adapters to decode with (None: the base model).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_ids: tuple[int, ...] = field(default=())
    adapter: str | None = None


@dataclass(frozen=True)
class Event:
    """What one engine step did for one request: the ``tokens`` it drew for it (in order; a request's last event
    may have none) and their ``logprobs`` (under softmax(logits / temperature), before top-k/top-p cut it), and
    once it has ended, ``finished`` with its ``reason``. A request that ended on a stop string has its last
    token(s) holding it: the caller trims the text."""

    request_id: int
    tokens: tuple[int, ...]
    finished: bool = False
    reason: FinishReason | None = None
    logprobs: tuple[float, ...] = ()
