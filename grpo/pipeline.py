"""Asynchronous rollouts (``grpo.rollout: async``): a thread samples and scores the next batches while the trainer
updates, each batch tagged with the policy version that sampled it.

The trainer's version is the number of steps it has taken. Before each step the trainer *submits* the next batch's
prompt rows with its weights of now (a copy: the train step donates its own buffers; with ``grpo.rollout_devices``
a copy on the engine's devices), and the rollout thread completes the requests in order, each with the weights it
came with (:meth:`grpo.rollouts.Rollouts.complete`: sampling, tool calls, rewards). The trainer keeps
``max_staleness + 1`` batches requested ahead of it, so the batch it trains at version ``k`` was sampled at
version ``k - max_staleness`` (at 0 early on). The versions are fixed when a batch is requested, not by the
thread's timing: a run samples what the same run sampled before (a resume, another process count).

- ``max_staleness: 0`` requests batch ``k`` at step ``k``, with version ``k``: the run is the synchronous run, bit
  for bit (same weights, same key, same rows);
- ``max_staleness: 1`` samples batch ``k + 1`` while step ``k`` trains (one step off-policy, NeMo-RL's and
  verl's one-step mode); the tools' and the reward functions' latency hides behind the updates.

The trainer checks each batch's staleness when it takes it (TRL's AsyncGRPOTrainer's rule): a batch older than
``max_staleness`` is dropped, counted (``sample/dropped_stale_total``) and replaced by a new request. The
pipeline's own requests are never that old: the check is the contract. The staleness of what trains is logged
(``sample/staleness_mean``, ``sample/staleness_max``) with the time the trainer waited (``perf/rollout_wait_s``). The off-policy correction of stale samples is the sampler correction
(``grpo.importance_sampling_correction``): the trainer's log-probabilities against the sampler's.

On several processes the requests are completed in order on the trainer's thread, when taken (``inline``): every
process must run its collectives in one order, and a second thread's would interleave with the train step's
differently on each. The batches and their versions are those of the one-process run; the overlap is not.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class Produced(Generic[T]):
    """A completed request: its key index, the policy version that sampled it, and what completing it made (or
    the error it raised, re-raised where the trainer takes it)."""

    index: int
    version: int
    made: T | None = None
    error: BaseException | None = None


class RolloutThread(Generic[T]):
    """Completes requests (``complete(weights, rows, index)``) in order, each with the weights it came with (module
    docstring): on a thread of its own, or ``inline`` on the caller's when taken."""

    def __init__(self, complete: Callable[[Any, Any, int], T], inline: bool = False):
        self._complete = complete
        self._requests: queue.Queue[tuple[int, Any, int, Any] | None] = queue.Queue()
        self._done: queue.Queue[Produced[T]] = queue.Queue()
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name="grpo-rollouts", daemon=True)
            self._thread.start()

    def submit(self, index: int, rows: Any, version: int, weights: Any) -> None:
        """Request the completion of ``rows`` with key index ``index`` by ``weights`` (policy version
        ``version``)."""
        self._requests.put((index, rows, version, weights))

    def take(self) -> Produced[T]:
        """The next completed request (in request order), waiting for it; its error raised here."""
        if self._thread is None:
            request = self._requests.get_nowait()
            assert request is not None, "closed"
            got = self._completed(*request)
        else:
            got = self._done.get()
        if got.error is not None:
            self.close()
            raise got.error
        return got

    def close(self) -> None:
        """Stop the thread once its current request ends; requests not started are dropped."""
        while True:  # the thread takes no more requests: drain them
            try:
                self._requests.get_nowait()
            except queue.Empty:
                break
        self._requests.put(None)
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()

    def _completed(self, index: int, rows: Any, version: int, weights: Any) -> Produced[T]:
        try:
            return Produced(index, version, self._complete(weights, rows, index))
        except BaseException as e:  # noqa: BLE001  # the trainer re-raises it (a reward function's UserError)
            return Produced(index, version, error=e)

    def _run(self) -> None:
        while (request := self._requests.get()) is not None:
            got = self._completed(*request)
            self._done.put(got)
            if got.error is not None:
                return


@dataclass
class Taken(Generic[T]):
    """What the trainer trains at a step: the completed batch, its staleness, the batches dropped before it this
    step (stale: their completions counted) and the seconds the trainer waited."""

    made: T
    index: int
    staleness: int
    dropped: int
    waited: float


class Pipeline(Generic[T]):
    """The trainer's side of the asynchronous rollouts (module docstring): requests ahead, takes and drops.
    ``next_rows()``: the next batch of prompt rows from the data; ``total``: the run's last step + 1; ``start``: its
    first step (a resumed run's); ``snapshot(weights)``: the copy a request samples with; ``inline``: complete
    requests on the trainer's thread (several processes)."""

    def __init__(self, complete: Callable[[Any, Any, int], T], max_staleness: int, next_rows: Callable[[], Any],
                 start: int, total: int, snapshot: Callable[[Any], Any], inline: bool = False):
        self.thread = RolloutThread(complete, inline)
        self.max_staleness, self.next_rows, self.total, self.snapshot = max_staleness, next_rows, total, snapshot
        self.next_index = start  # the key index of the next request
        self.outstanding = 0  # requested, not yet taken

    def take(self, weights: Any, step: int) -> Taken[T]:
        """The batch step ``step`` trains (``weights``: the trainer's, version ``step``), once the requests ahead
        are made."""
        t0 = time.perf_counter()
        dropped = 0
        copy: list[Any] = []  # the weights' snapshot, made once, for the requests made now
        while True:
            self._request_ahead(step, weights, copy)
            got = self.thread.take()
            self.outstanding -= 1
            staleness = step - got.version
            if staleness <= self.max_staleness:
                assert got.made is not None
                return Taken(got.made, got.index, staleness, dropped, time.perf_counter() - t0)
            dropped += 1  # too old to train: replaced by a new request

    def _request_ahead(self, step: int, weights: Any, copy: list[Any]) -> None:
        """Keep ``max_staleness + 1`` batches requested (fewer near the run's end), the new ones with ``weights``."""
        while self.outstanding < min(self.max_staleness + 1, self.total - step):
            if not copy:
                copy.append(self.snapshot(weights))
            self.thread.submit(self.next_index, self.next_rows(), step, copy[0])
            self.next_index += 1
            self.outstanding += 1

    def close(self) -> None:
        """Stop the rollout thread."""
        self.thread.close()
