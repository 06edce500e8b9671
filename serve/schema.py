"""Request bodies checked field by field: every type and range, unknown fields refused, and what can be served
turned into the engine's :class:`eval.engine.api.SamplingParams`.

A field this server does not implement (``logprobs``, ``n`` > 1, ``echo``, penalties) is a 400 naming it rather
than an answer that silently ignores it; fields that change nothing here (``user``, ``parallel_tool_calls``) are
accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from eval.engine.api import SamplingParams
from serve.errors import ApiError, bad

# Fields both endpoints read.
_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                     "stream_options", "user", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"})
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                         "top_logprobs", "response_format"}
MAX_STOPS = 16  # stop strings a request may give (OpenAI allows 4; lm-eval may send a few more)


@dataclass(frozen=True)
class Decoding:
    """What a request asks of decoding, checked: ``max_tokens`` None leaves the endpoint's default."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool

    def params(self, max_tokens: int, eos_ids: tuple[int, ...], adapter: str | None) -> SamplingParams:
        """The engine's settings for one prompt of this request."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=self.stop, eos_ids=eos_ids, adapter=adapter)


def check_fields(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """``body`` as a dict with only ``allowed`` fields (400 naming the first other one)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    for key in body:
        if key not in allowed:
            raise bad(f"unknown parameter {key!r}; this server reads {', '.join(sorted(allowed))}", key,
                      "unknown_parameter")
    return body


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(f"{key} must be a number from {lo} to {hi}, got {v!r}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise bad(f"{key} must be an integer {span}, got {v!r}", key)
    return v


def _unsupported(body: dict[str, Any], key: str, allowed: tuple[Any, ...], what: str) -> None:
    """A field this server cannot honour unless it holds one of ``allowed`` (its neutral values)."""
    v = body.get(key)
    if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
        raise bad(f"{key} is not supported by this server ({what}); leave it out", key, "unsupported_parameter")


def decoding(body: dict[str, Any], max_tokens_key: str = "max_tokens") -> Decoding:
    """The decoding fields of a checked body (:func:`check_fields`); 400s name the field at fault."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a non-empty string (GET /v1/models lists them)", "model")
    max_tokens = _int(body, max_tokens_key, 1)
    if max_tokens_key != "max_tokens" and max_tokens is None:  # chat: the older name too
        max_tokens = _int(body, "max_tokens", 1)
    top_k = _int(body, "top_k", -1, 2 ** 31 - 1)  # -1: all (vLLM's spelling), as 0
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else stop if stop is not None else ()
    if (not isinstance(stops, list | tuple) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad('stream_options must be {"include_usage": true|false}', "stream_options")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad(f"n must be 1 (one choice per prompt; send the request again for more), got {n!r}", "n",
                  "unsupported_parameter")
    for key in ("presence_penalty", "frequency_penalty"):
        _unsupported(body, key, (0, 0.0), "no penalties")
    _unsupported(body, "logit_bias", ({},), "no logit bias")
    _unsupported(body, "logprobs", (False,), "no log-probabilities")
    _unsupported(body, "top_logprobs", (0,), "no log-probabilities")
    _unsupported(body, "echo", (False,), "the prompt is never echoed")
    _unsupported(body, "suffix", ("",), "no insertion")
    _unsupported(body, "best_of", (1,), "one sample per prompt")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user must be a string", "user")
    return Decoding(model=model, max_tokens=max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 1e-9, 1.0), top_k=max(top_k or 0, 0),
                    seed=_int(body, "seed", -(2 ** 63), 2 ** 63 - 1), stop=tuple(stops), stream=bool(stream),
                    include_usage=bool((options or {}).get("include_usage", False)))


def prompts(body: dict[str, Any], vocab_size: int) -> list[str | list[int]]:
    """/v1/completions' ``prompt``: a string, a list of strings, a list of token ids, or a list of such lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [_ids(p, vocab_size)]
    if isinstance(p, list) and p and all(isinstance(x, str) or isinstance(x, list) for x in p):
        return [x if isinstance(x, str) else _ids(x, vocab_size) for x in p]
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of such lists "
              "(none empty)", "prompt")


def _ids(ids: list[Any], vocab_size: int) -> list[int]:
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise bad(f"a prompt of token ids must be a non-empty list of integers from 0 to {vocab_size - 1}", "prompt")
    return list(ids)


def fits(prompt_len: int, max_tokens: int | None, max_len: int, default: int | None) -> int:
    """The request's max_tokens (``default`` where it gave none; None: the rest of the context), once its prompt
    and answer fit in ``max_len`` tokens (a 400 otherwise, as OpenAI's context_length_exceeded)."""
    room = max_len - prompt_len
    want = max_tokens if max_tokens is not None else min(default, room) if default is not None else room
    if want < 1 or prompt_len + want > max_len:
        raise ApiError(400, f"this model's context is {max_len} tokens; the prompt has {prompt_len} and max_tokens "
                            f"asks {want} more; shorten the prompt or lower max_tokens", "max_tokens",
                       "context_length_exceeded")
    return want
