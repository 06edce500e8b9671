"""The HTTP routes of `zoo serve` (FastAPI): ``GET /v1/models``, ``GET /v1/health``, ``POST /v1/completions`` and
``POST /v1/chat/completions``, in OpenAI's shapes, streamed as server-sent events on ``"stream": true``.

Every request body is read as JSON and checked field by field (serve/schema.py, serve/chat.py) before anything
reaches the engine's thread (serve/runner.py); every refusal is an OpenAI-shaped error (serve/errors.py). Prompts
and answers are never logged. A client that goes away before its answer ends has its request cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from eval.engine.api import Event
from eval.text_stream import TextStream
from serve import chat, schema
from serve.errors import ApiError, bad
from serve.model import Served
from serve.runner import Runner, Ticket

log = logging.getLogger("zoo.serve")
POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is still there
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat's: the rest of the context


def make_app(served: Served, runner: Runner) -> FastAPI:
    """The server's routes over ``served``'s engine, driven by ``runner`` (started and closed by the caller)."""
    app = FastAPI(title="zoo serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:  # unknown routes and methods
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        log.error("internal error: %s", type(e).__name__)  # the type only: a message may quote the request
        return JSONResponse(ApiError(500, f"internal error ({type(e).__name__})", code="internal_error").body(),
                            status_code=500)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "lmzoo",
             **({"parent": served.name} if name != served.name else {})}
            for name in (served.name, *served.adapters)]}

    @app.get("/v1/health")
    async def health() -> dict[str, int]:
        return runner.counts()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = schema.check_fields(await _json(request), schema.COMPLETION_FIELDS)
        dec = schema.decoding(body)
        adapter = _adapter(served, dec.model)
        ids = [p if isinstance(p, list) else list(served.tokenizer(p)["input_ids"])
               for p in schema.prompts(body, served.vocab_size)]
        params = [dec.params(schema.fits(len(p), dec.max_tokens, served.max_len, COMPLETION_MAX_TOKENS),
                             served.eos_ids, adapter) for p in ids]
        return await _answer(request, runner, served, ids, params, dec, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = schema.check_fields(await _json(request), schema.CHAT_FIELDS)
        dec = schema.decoding(body, "max_completion_tokens")
        adapter = _adapter(served, dec.model)
        tools = chat.tools_of(body)
        if tools and served.parser is None:
            raise bad("tools: this model's chat template renders no tool calls this server can read", "tools",
                      "unsupported_parameter")
        images: list[bytes] | None = [] if served.expander is not None else None
        messages = chat.messages_of(body.get("messages"), images)
        frames = None
        if images:
            ids, frames = chat.image_prompt(served.expander, served.engine.cfg.vision, served.tokenizer, messages,
                                            images, tools)
        else:
            ids = chat.prompt_ids(served.tokenizer, served.template, messages, tools)
        params = dec.params(schema.fits(len(ids), dec.max_tokens, served.max_len, None), served.eos_ids, adapter)
        return await _answer(request, runner, served, [ids], [params], dec, _chat_shapes(served, bool(tools)),
                             [frames])

    return app


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError:  # JSONDecodeError and undecodable bytes alike
        raise bad("the request body is not valid JSON", code="invalid_json") from None


def _adapter(served: Served, model: str) -> str | None:
    """The adapter ``model`` names (None: the base), or a 404 naming the models served."""
    if model == served.name:
        return None
    if model in served.adapters:
        return model
    raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                        f"{', '.join(repr(n) for n in (served.name, *served.adapters))}", "model", "model_not_found")


@dataclass(frozen=True)
class _Shapes:
    """How one endpoint words its answers: its id prefix and ``object`` names, and its choices: ``first`` the
    chunk a choice's stream opens with (None: none), ``delta`` a chunk of text, ``end`` a choice's last chunk
    (given its finish reason), ``choice`` a whole choice; ``buffered``: the text waits for the end (a tool call
    is read whole)."""

    prefix: str
    whole: str
    chunk: str
    first: Callable[[int], dict[str, Any] | None]
    delta: Callable[[int, str], dict[str, Any]]
    end: Callable[[int, TextStream, str | None], dict[str, Any]]
    choice: Callable[[int, TextStream, str | None], dict[str, Any]]
    buffered: bool = False


COMPLETION = _Shapes(
    "cmpl", "text_completion", "text_completion", first=lambda i: None,
    delta=lambda i, text: {"index": i, "text": text, "logprobs": None, "finish_reason": None},
    end=lambda i, ts, reason: {"index": i, "text": "", "logprobs": None, "finish_reason": reason},
    choice=lambda i, ts, reason: {"index": i, "text": ts.text(), "logprobs": None, "finish_reason": reason})


def _chat_shapes(served: Served, tools: bool) -> _Shapes:
    """Chat's shapes; with ``tools``, the answer read for calls by the family's parser (serve/chat.py)."""
    def message(ts: TextStream, reason: str | None) -> tuple[dict[str, Any], str | None]:
        msg, calls = chat.answer(ts.text(), ts.raw(), served.parser, tools)
        return msg, "tool_calls" if calls else reason

    def end(i: int, ts: TextStream, reason: str | None) -> dict[str, Any]:
        if not tools:
            return {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
        msg, reason = message(ts, reason)  # the whole answer in one delta, its calls with their index
        delta = {k: v for k, v in msg.items() if k != "role" and v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(delta["tool_calls"])]
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}

    def choice(i: int, ts: TextStream, reason: str | None) -> dict[str, Any]:
        msg, reason = message(ts, reason)
        return {"index": i, "message": msg, "logprobs": None, "finish_reason": reason}

    return _Shapes(
        "chatcmpl", "chat.completion", "chat.completion.chunk", buffered=tools, end=end, choice=choice,
        first=lambda i: {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None},
        delta=lambda i, text: {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None})


async def _events(runner: Runner, tickets: list[Ticket], events: asyncio.Queue, request: Request | None
                  ) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) as the engine reports them, until every ticket has finished; an ApiError raised.
    With ``request``, a client gone away ends it; ending early for any cause cancels the unfinished requests."""
    index = {id(t): i for i, t in enumerate(tickets)}
    left = set(range(len(tickets)))
    try:
        while left:
            try:
                ticket, item = await asyncio.wait_for(events.get(), POLL_S) if request else await events.get()
            except TimeoutError:
                assert request is not None
                if await request.is_disconnected():
                    return
                continue
            if isinstance(item, ApiError):
                left.discard(index[id(ticket)])
                raise item
            if item.finished:
                left.discard(index[id(ticket)])
            yield index[id(ticket)], item
    finally:
        for i in left:
            runner.cancel(tickets[i])


async def _answer(request: Request, runner: Runner, served: Served, prompts: list[list[int]], params: list,
                  dec: schema.Decoding, shapes: _Shapes, vision: list | None = None) -> Any:
    """Submit every prompt (``vision``: each one's image frames, None where it has none) and answer with the whole
    response, or stream it (``dec.stream``)."""
    events: asyncio.Queue = asyncio.Queue()
    frames = vision or [None] * len(prompts)
    tickets = [runner.submit(p, q, events, f) for p, q, f in zip(prompts, params, frames)]
    texts = [TextStream(served.tokenizer, dec.stop, served.eos_ids) for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    head = {"id": f"{shapes.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": dec.model}

    def usage() -> dict[str, int]:
        new = sum(len(t.tokens) for t in texts)
        return {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": new,
                "total_tokens": sum(map(len, prompts)) + new}

    if not dec.stream:
        async for i, event in _events(runner, tickets, events, request):
            texts[i].tokens.extend(event.tokens)
            reasons[i] = event.reason
        return {**head, "object": shapes.whole, "usage": usage(),
                "choices": [shapes.choice(i, t, reasons[i]) for i, t in enumerate(texts)]}
    stream = _events(runner, tickets, events, None)
    try:
        first = await anext(stream)  # a request the engine refuses is its error status, not a broken stream
    except StopAsyncIteration:
        first = None

    async def sse() -> AsyncIterator[str]:
        def chunk(choice: dict[str, Any]) -> str:
            return "data: " + json.dumps({**head, "object": shapes.chunk, "choices": [choice]},
                                         ensure_ascii=False) + "\n\n"

        for i in range(len(prompts)):
            opening = shapes.first(i)
            if opening is not None:
                yield chunk(opening)
        try:
            pending = [first] if first is not None else []
            async for item in _chain(pending, stream):
                i, event = item
                text = texts[i].add(event.tokens)
                if text and not shapes.buffered:
                    yield chunk(shapes.delta(i, text))
                if event.finished:
                    rest = texts[i].finish()
                    if rest and not shapes.buffered:
                        yield chunk(shapes.delta(i, rest))
                    yield chunk(shapes.end(i, texts[i], event.reason))
        except ApiError as e:  # a later prompt of the request refused: said in the stream, which then ends
            yield "data: " + json.dumps(e.body()) + "\n\n"
        if dec.include_usage:
            yield "data: " + json.dumps({**head, "object": shapes.chunk, "choices": [], "usage": usage()}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(_closing(sse(), stream), media_type="text/event-stream")


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def _closing(body: AsyncIterator[str], stream: Any) -> AsyncIterator[str]:
    """``body``, and ``stream`` closed however it ends (a client gone mid-stream: its requests cancelled)."""
    try:
        async for part in body:
            yield part
    finally:
        await stream.aclose()
