"""The engine's own thread: the one place :class:`eval.engine.engine.Engine` is driven from.

Request handlers (on the server's event loop) hand it submissions and cancellations through a thread-safe queue
and get back a :class:`Ticket`, whose asyncio queue receives the request's :class:`eval.engine.api.Event` s (or
an :class:`serve.errors.ApiError` where the engine refused it) through ``loop.call_soon_threadsafe``. The thread
steps the engine while it is busy, taking new commands between steps, and sleeps on the queue when it is idle.
Commands run in the order they came: a cancellation always finds its request submitted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from eval.engine.api import Event, SamplingParams
from serve.errors import ApiError
from zoo.errors import UserError

log = logging.getLogger("zoo.serve")


@dataclass(eq=False)
class Ticket:
    """One request's line back from the engine thread: ``events`` receives (this ticket, item) pairs, each item
    one of its Events (the last one finished) or one ApiError (several tickets may share a queue: one request's
    prompts); ``request_id`` is the engine's id once submitted (set on the engine's thread)."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None


_STOP = object()  # the command that ends the thread


class Runner:
    """Owns ``engine`` in a background thread (module docstring). ``start`` it, ``close`` it at shutdown."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[int, Ticket] = {}  # engine id -> ticket, from submission to its finished event
        self._cancelled = 0  # requests the engine reported cancelled (a client gone away)
        self._engine_counts: dict[str, int] = {}  # the engine's own counts, read on its thread after each step
        self._failed: str | None = None  # set when a step raised: the engine's state is unknown, nothing is served
        self._thread = threading.Thread(target=self._run, name="zoo-serve-engine", daemon=True)

    def start(self) -> None:
        """Start the engine's thread."""
        self._thread.start()

    def close(self) -> None:
        """End the thread (after the commands already queued) and wait for it."""
        self._commands.put(_STOP)
        self._thread.join()

    def submit(self, prompt: Sequence[int], params: SamplingParams, events: asyncio.Queue | None = None,
               vision: Any = None) -> Ticket:
        """Queue a request (``vision``: its images' frames, as :meth:`eval.engine.engine.Engine.submit` takes them)
        from the event loop; its events arrive on the returned ticket's queue (``events`` if given)."""
        ticket = Ticket(asyncio.get_running_loop(), *(() if events is None else (events,)))
        if self._failed is not None:
            ticket.events.put_nowait((ticket, ApiError(503, f"the engine stopped after an error ({self._failed}); restart "
                                                            "zoo serve", code="engine_failed")))
        else:
            self._commands.put(("submit", ticket, list(prompt), params, vision))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """End a request early (its client went away): its slot and pages are freed."""
        self._commands.put(("cancel", ticket))

    def counts(self) -> dict[str, int]:
        """What GET /v1/health reports: requests decoding (``running``) and waiting for a row (``queued``), the KV
        cache's ``free_pages`` of ``pages`` (as the engine's thread last read them), ``requests`` the engine holds
        (submitted, their end not yet reported), commands not yet taken (``waiting``), requests ``cancelled`` so
        far."""
        return {**self._engine_counts, "requests": len(self._live), "waiting": self._commands.qsize(),
                "cancelled": self._cancelled}

    def _count(self) -> None:
        """Read the engine's counts (on its thread: the engine is read and driven from it alone)."""
        e = self.engine
        if not isinstance(e, _Idle):
            self._engine_counts = {"running": e.running, "queued": e.queued, "free_pages": e.free_pages(),
                                   "pages": e.num_pages}

    def _run(self) -> None:
        self._count()
        while True:
            block = not self.engine.busy
            while True:  # every command waiting (the first one awaited when the engine is idle)
                try:
                    cmd = self._commands.get(block=block)
                except queue.Empty:
                    break
                if cmd is _STOP:
                    return
                self._command(cmd)
                block = False
            self._count()
            if self.engine.busy:
                self._step()

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "cancel":
            ticket = cmd[1]
            if ticket.request_id in self._live:
                self.engine.cancel(ticket.request_id)
            return
        _, ticket, prompt, params, vision = cmd
        try:
            ticket.request_id = self.engine.submit(prompt, params, vision)
        except UserError as e:  # the engine's refusal: the client's to fix
            _send(ticket, ApiError(400, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - one request's failure is its answer, the server goes on
            log.error("the engine refused a request: %s", type(e).__name__)
            _send(ticket, ApiError(500, f"the engine failed on this request ({type(e).__name__})", code="engine_error"))
            return
        self._live[ticket.request_id] = ticket

    def _step(self) -> None:
        try:
            events: list[Event] = self.engine.step()
        except Exception as e:  # noqa: BLE001 - every waiting client is told; later requests get a 503
            log.exception("the engine's step failed")
            self._failed = f"{type(e).__name__}: {e}"
            for waiting in self._live.values():
                _send(waiting, ApiError(500, f"the engine failed ({self._failed})", code="engine_error"))
            self._live.clear()
            self.engine = _Idle()
            return
        self._count()  # before the events go out: a client that has its answer sees the engine's counts after it
        for event in events:
            ticket = self._live.get(event.request_id)
            if ticket is None:
                continue
            if event.finished:
                del self._live[event.request_id]
                self._cancelled += event.reason == "cancelled"
            _send(ticket, event)


class _Idle:
    """What stands in for an engine whose step failed: never busy, so the thread only answers commands."""

    busy = False

    def submit(self, prompt: Sequence[int], params: SamplingParams, vision: Any = None) -> int:
        raise RuntimeError("the engine stopped after an error")

    def cancel(self, request_id: int) -> None:
        pass


def _send(ticket: Ticket, item: Event | ApiError) -> None:
    """Hand ``item`` to the ticket's queue on its event loop (nothing if that loop has closed: server shutdown)."""
    try:
        ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, (ticket, item))
    except RuntimeError:
        pass
