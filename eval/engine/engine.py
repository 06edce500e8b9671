"""The inference engine: continuous batching over a paged KV cache with shared prefixes.

At most ``max_seqs`` requests decode together, one token each per :meth:`Engine.step`, the step computing only the
rows that are decoding (padded to a power of two: :func:`decode_rows`). A request joins a free row at any step
(its prompt prefilled into pages first; a prompt of more than PREFILL_TOKENS tokens in chunks over several
steps, the other rows decoding between them) and leaves at its end, its row taken by the next queued request at
the following step: no row waits for the batch's longest. Each request holds the pages of its prompt and budget
from the moment it is admitted (so no running request ever waits for a page); a prompt's full pages stay cached
after it ends, and a later request starting with the same tokens (and the same adapter) holds those pages
instead of computing them (:class:`eval.engine.pages.PagePool`). A request whose prompt would share pages still
being computed waits for them: a GRPO group's G completions prefill their prompt once.

The device work is two jitted programs (:mod:`eval.engine.paged`) with bucketed shapes: a prefill of the
admitted rows' uncached tokens, and a step of the decoding rows, each followed by the rows' draw from their
logits (a small program of its own per batch shape); the host keeps the pages, the rows and the requests.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eval.engine.api import Event, FinishReason, SamplingParams
from eval.engine.images import vision_inputs
from eval.engine.paged import decode_logits, init_pool, prefill_logits, rerope
from eval.engine.pages import PagePool
from eval.engine.sampling import RowSampling, draw_rows, key_data
from zoo.errors import UserError
from zoo.lora.rows import stack_adapters
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decode import place_for_decoding
from zoo.model.vision import VisionInputs

TOKEN_BUCKET = 16  # a prefill's width is rounded up to a power of two of at least this many tokens
PREFILL_TOKENS = 16384  # a prefill's padded rows x width at most; a longer prompt is prefilled in chunks of this
VIEW_TOKENS = 256  # a step's page tables: a power of two of tokens up to this, then a multiple of it
DECODE_ROWS = 8  # a decoding step runs its live rows padded to a power of two of at least this many
# Each row's draw from its logits: one program per batch shape, shared by every prefill and decoding program of
# that many rows (page-table widths, prompt widths, fresh or cached), not compiled into each of them (it was about
# half of a tiny model's prefill or decoding compile: 0.7 s of CPU each).
_draw = jax.jit(draw_rows)


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    key: np.ndarray  # [2] uint32: the request's sampling key (PRNGKey(seed)'s data)
    vision: Any = None
    hashes: list = field(default_factory=list)  # the prompt's full pages' chain (empty: not cached)
    out: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens read from cached pages
    filled: int = 0  # prompt tokens in its pages so far (cached, then each prefilled chunk)
    whole: bool = False  # prefilled in one piece (images, LongRoPE's switch): not in chunks
    row: int = -1
    delta: int = 0  # multimodal RoPE's shift of every position after the prompt

    @property
    def prefilled(self) -> bool:
        """Whether its whole prompt is in its pages (it decodes; before, its prompt is prefilled a chunk a step)."""
        return self.filled == len(self.prompt)


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def view_tokens(tokens: int) -> int:
    """The tokens a program's page tables span for rows of at most ``tokens`` tokens: a power of two (at least 64)
    up to VIEW_TOKENS, past it a multiple of VIEW_TOKENS: a short row reads little, a long one at most
    VIEW_TOKENS - 1 slots more than it holds, and few programs are compiled."""
    if tokens <= VIEW_TOKENS:
        return _pow2(tokens, min(64, VIEW_TOKENS))
    return -(-tokens // VIEW_TOKENS) * VIEW_TOKENS


def decode_rows(live: int, max_seqs: int) -> int:
    """The rows a decoding step runs for ``live`` decoding requests: a power of two of at least DECODE_ROWS, at
    most ``max_seqs``. A batch whose requests end early (GRPO's completions at their EOS, a server's short answers)
    computes what is left of it, not ``max_seqs`` rows to the longest's end, from a few compiled shapes."""
    return min(max_seqs, _pow2(live, DECODE_ROWS))


def prefill_rows(max_seqs: int, tokens: int, budget: int = PREFILL_TOKENS) -> int:
    """The most prompts of ``tokens`` uncached tokens one prefill admits (its rows padded to a power of two, its
    width to one of at least TOKEN_BUCKET, their product within ``budget``; at least one: a prompt of more than
    ``budget`` tokens goes alone, in chunks)."""
    width = _pow2(tokens, TOKEN_BUCKET)
    rows = 1
    while rows < max_seqs and _pow2(rows + 1, 1) * width <= budget:
        rows += 1
    return rows


class Engine:
    """One model's decoder serving many requests at once.

    ``params``: the model's weights (as :func:`zoo.load` gives them); ``adapters``: LoRA adapters a request may name
    (name -> (adapter tree keyed like the params, as :func:`zoo.checkpoints.adapter.load_adapters` gives it, its
    scale)); ``tokenizer``: decodes for stop strings. At most ``max_seqs`` requests decode at once, each of at most
    ``max_len`` tokens (prompt and new ones); their keys and values live in pages of ``page_size`` tokens
    (``num_pages`` of them; None: enough for max_seqs requests of max_len tokens). Driven from one thread.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, Any], *, tokenizer: Any = None, max_seqs: int = 16,
                 max_len: int = 2048, page_size: int = 16, num_pages: int | None = None,
                 adapters: Mapping[str, tuple[dict, float]] | None = None, prefix_caching: bool = True):
        if max_seqs < 1 or max_len < 2 or page_size < 1:
            raise UserError(f"engine: max_seqs ({max_seqs}) >= 1, max_len ({max_len}) >= 2 and page_size "
                            f"({page_size}) >= 1 are needed")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_seqs, self.max_len, self.page_size = max_seqs, max_len, page_size
        self.pages_per_seq = -(-max_len // page_size)
        self.num_pages = num_pages or max_seqs * self.pages_per_seq
        if self.num_pages < self.pages_per_seq:
            raise UserError(f"engine: {self.num_pages} pages of {page_size} tokens cannot hold one request of "
                            f"max_len {max_len}; give at least {self.pages_per_seq} pages or a smaller max_len")
        params, mesh = place_for_decoding(cfg, params)
        self.weights = Weights(params)
        self.pool = init_pool(cfg, self.num_pages, page_size, params["embed"].dtype, mesh, max_seqs)
        self.pages = PagePool(self.num_pages, page_size)
        # A linear layer's state (Qwen3-Next) sums its whole prefix: no page of it can be shared.
        self.prefix_caching = prefix_caching and "linear" not in cfg.kinds
        # Several fine-tunes over one base: every adapter stacked once, each row reading its request's
        # (zoo.lora.rows; entry 0 the base alone).
        self._adapter_names = tuple(adapters or ())
        self.adapters = stack_adapters(cfg, list(adapters.values())) if adapters else None
        self.banned = (cfg.vision.image_token_id,) if cfg.vision is not None else ()
        self._ids = itertools.count()
        self._seeds = itertools.count(1 << 20)
        self._queue: deque[_Request] = deque()
        self._rows: list[_Request | None] = [None] * max_seqs
        self._cancelled: set[int] = set()
        self._events: list[Event] = []
        # The rows' device state, kept on the host and sent each step (a few ints a row).
        self._tables = np.zeros((max_seqs, self.pages_per_seq), np.int32)
        self._lengths = np.zeros(max_seqs, np.int32)
        self._delta = np.zeros(max_seqs, np.int32) if cfg.rope.mrope_section else None
        # Counters since the engine started: prompt tokens computed and read from cached pages, decoding steps, the
        # rows those steps computed (padding rows included) and tokens drawn.
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "steps": 0, "decode_rows": 0, "tokens": 0}

    def set_weights(self, params: dict[str, Any] | Weights) -> None:
        """Decode with other weights from the next step on (an online trainer's new policy: its base and LoRA
        adapters, :class:`zoo.lora.weights.Weights`); the cached prompts, computed by the old ones, are dropped."""
        w = Weights.wrap(params)
        base, _ = place_for_decoding(self.cfg, w.base)
        self.weights = Weights(base, w.adapters, w.scale)
        self.pages.forget()

    def release_weights(self) -> None:
        """Let go of the weights (an online trainer's between its samplings: no copy of a policy outlives its
        rollout); :meth:`set_weights` before the next step."""
        self.weights = Weights({})
        self.pages.forget()

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name."""
        return self._adapter_names

    def _index(self, reqs: Sequence[_Request | None]) -> jnp.ndarray | None:
        """Each row's adapter (0: the base alone), or None without adapters."""
        if self.adapters is None:
            return None
        names = self._adapter_names
        return jnp.asarray([0 if r is None or r.params.adapter is None else 1 + names.index(r.params.adapter)
                            for r in reqs], jnp.int32)

    def submit(self, prompt: Sequence[int], params: SamplingParams, vision: Any = None,
               key: np.ndarray | None = None) -> int:
        """Queue a request (its prompt's token ids; ``vision``: a vision-language model's frames of its images, in
        the order of its image tokens, as :func:`eval.engine.images.vision_inputs` takes a row's, or its row
        already laid out, a :class:`zoo.model.vision.VisionInputs` of one row; ``key``: its sampling key's data
        [2] uint32, in place of ``params.seed``'s); returns its id.
        Raises :class:`zoo.errors.UserError` for an
        empty prompt, one whose prompt + max_tokens exceeds ``max_len``, or an unknown adapter."""
        if len(prompt) == 0:
            raise UserError("engine: a prompt needs at least one token")
        if params.max_tokens < 1:
            raise UserError(f"engine: max_tokens must be at least 1 (got {params.max_tokens})")
        if len(prompt) + params.max_tokens > self.max_len:
            raise UserError(f"engine: the prompt's {len(prompt)} tokens and max_tokens {params.max_tokens} exceed "
                            f"the context of {self.max_len} tokens: shorten the prompt or lower max_tokens")
        if params.adapter is not None and params.adapter not in self.adapter_names:
            raise UserError(f"engine: no adapter named {params.adapter!r} (have: {list(self.adapter_names)})")
        if params.stop and self.tokenizer is None:
            raise UserError("engine: stop strings need a tokenizer")
        if vision is not None and self.cfg.vision is None:
            raise UserError("engine: images given to a model without a vision tower")
        if key is None:
            key = key_data(next(self._seeds) if params.seed is None else params.seed % (1 << 64))
        req = _Request(next(self._ids), [int(t) for t in prompt], params, np.asarray(key, np.uint32), vision)
        omax = self.cfg.rope.original_max_position_embeddings if self.cfg.rope.kind == "longrope" else None
        # A LongRoPE request that may pass original_max_position_embeddings has its keys roped again when it does
        # (eval.engine.paged.rerope): its pages are its own, never shared nor cached.
        crossing = omax is not None and len(prompt) + params.max_tokens > omax
        # Images and LongRoPE's switch are laid out over the whole prompt: never prefilled in chunks.
        req.whole = vision is not None or crossing
        if self.prefix_caching and vision is None and not crossing:
            req.hashes = self.pages.chain(req.prompt[:-1], params.adapter)  # the last token is always computed
        self._queue.append(req)
        return req.id

    def cancel(self, request_id: int) -> None:
        """End a request (queued or decoding): its pages are freed and the next step reports it "cancelled"."""
        self._cancelled.add(request_id)

    @property
    def busy(self) -> bool:
        """Whether any request is queued, decoding, or has an event still to report."""
        return bool(self._queue or any(r is not None for r in self._rows) or self._cancelled or self._events)

    @property
    def running(self) -> int:
        """Requests decoding now."""
        return sum(r is not None for r in self._rows)

    @property
    def queued(self) -> int:
        """Requests waiting for a row."""
        return len(self._queue)

    def free_pages(self) -> int:
        """Pages a new request could be given now."""
        return self.pages.available()

    def step(self) -> list[Event]:
        """Admit queued requests into free rows (prefilling their prompts), decode one token for every running
        request, and report what happened to each."""
        self._drop_cancelled()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        if any(r is not None and r.prefilled for r in self._rows):
            self._decode()
        events, self._events = self._events, []
        return events

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams], vision: Sequence[Any] | None = None
                 ) -> list[list[int]]:
        """Each prompt's new tokens, run to their ends (a stop string's tokens kept, as :class:`Event` s give them).
        ``vision``: each prompt's images (None where it has none)."""
        many = params if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.submit(p, s, None if vision is None else vision[i]) for i, (p, s) in
               enumerate(zip(prompts, many, strict=True))]
        out: dict[int, list[int]] = {i: [] for i in ids}
        while self.busy:
            for e in self.step():
                if e.request_id in out:
                    out[e.request_id].extend(e.tokens)
        return [out[i] for i in ids]

    # -- scheduling ------------------------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for req in [r for r in self._queue if r.id in self._cancelled]:
            self._queue.remove(req)
            self._events.append(Event(req.id, (), True, "cancelled"))
        for row in self._rows:
            if row is not None and row.id in self._cancelled:
                self._finish(row, "cancelled", ())
        self._cancelled.clear()

    def _admit(self) -> list[_Request]:
        """The requests this step's prefill runs: those whose prompt is being prefilled in chunks (each its next
        chunk), then queued requests given a free row and their pages, in order, while both last; a request whose
        cached prefix another one is still computing waits for a later step."""
        admitted = [r for r in self._rows if r is not None and not r.prefilled]
        computing = {h for r in admitted for h in r.hashes}
        widest = max((self._chunk(r) for r in admitted), default=0)
        while self._queue and None in self._rows:
            req = self._queue[0]
            if computing.intersection(req.hashes):
                break
            shared = self.pages.match(req.hashes)
            need = -(-(len(req.prompt) + req.params.max_tokens) // self.page_size) - len(shared)
            new = self._chunk(req, len(shared) * self.page_size)
            # The prefill's padded size stays within its budget (the activations of one prefill are its rows x
            # width): the rest wait for the next step.
            over = admitted and (_pow2(len(admitted) + 1, 1) * _pow2(max(widest, new), TOKEN_BUCKET)
                                 > PREFILL_TOKENS)
            if need > self.pages.available() or over:
                self.pages.release(shared)
                break
            widest = max(widest, new)
            self._queue.popleft()
            req.pages = shared + self.pages.allocate(need)
            req.cached = req.filled = len(shared) * self.page_size
            self.stats["cached_tokens"] += req.cached
            self.stats["prefill_tokens"] += len(req.prompt) - req.cached
            computing.update(req.hashes[len(shared):])
            req.row = self._rows.index(None)
            self._rows[req.row] = req
            self._tables[req.row] = 0
            self._tables[req.row, :len(req.pages)] = req.pages
            self._lengths[req.row] = req.cached
            admitted.append(req)
        return admitted

    def _chunk(self, req: _Request, filled: int | None = None) -> int:
        """The prompt tokens ``req``'s next prefill computes (after ``filled``, its own count by default): the rest
        of its prompt, at most PREFILL_TOKENS of it unless it goes whole."""
        rest = len(req.prompt) - (req.filled if filled is None else filled)
        return rest if req.whole else min(rest, PREFILL_TOKENS)

    def _width(self, tokens: int) -> int:
        """Page-table width (pages) of a program whose rows hold at most ``tokens`` tokens."""
        return min(-(-view_tokens(tokens) // self.page_size), self.pages_per_seq)

    def _sampling(self, reqs: Sequence[_Request | None], index: Sequence[int]) -> RowSampling:
        none = np.zeros(2, np.uint32)
        rows = [(0.0, 0, 1.0, none, 0) if r is None else
                (float(r.params.temperature), int(r.params.top_k), float(r.params.top_p), r.key, i)
                for r, i in zip(reqs, index)]
        return RowSampling.of(rows, self.banned)

    def _prefill(self, admitted: list[_Request]) -> None:
        b = _pow2(len(admitted), 1)
        chunks = [r.prompt[r.filled:r.filled + self._chunk(r)] for r in admitted]
        t = _pow2(max(map(len, chunks)), TOKEN_BUCKET)
        tokens = np.zeros((b, t), np.int32)
        valid = np.zeros((b, t), bool)
        for i, new in enumerate(chunks):
            tokens[i, :len(new)], valid[i, :len(new)] = new, True
        width = self._width(max(r.filled + t for r in admitted))
        rows = [r.row for r in admitted] + [admitted[0].row] * (b - len(admitted))  # padding rows: no valid token
        tables = self._tables[rows, :width]
        lengths = self._lengths[rows]
        delta = None if self._delta is None else jnp.asarray(self._delta[rows])
        fresh = all(r.filled == 0 for r in admitted)
        vision = self._vision(admitted, b)
        sampling = self._sampling(list(admitted) + [None] * (b - len(admitted)), [0] * b)
        logits, self.pool, new_lengths, new_delta = prefill_logits(
            self.cfg, self.weights, self.pool, jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(tables),
            jnp.asarray(lengths), delta, fresh, vision, self.adapters,
            self._index(list(admitted) + [None] * (b - len(admitted))), self._seq_rows(admitted, b))
        first, logp = _draw(logits, sampling)
        first, logp, new_lengths = np.asarray(first), np.asarray(logp), np.asarray(new_lengths)
        deltas = None if new_delta is None else np.asarray(new_delta)
        for i, r in enumerate(admitted):
            self._lengths[r.row] = new_lengths[i]
            if self._delta is not None and deltas is not None:
                self._delta[r.row] = deltas[i]
            r.filled += len(chunks[i])
            if not r.prefilled:
                continue  # a chunk of a longer prompt: its row decodes once the last chunk is in (its draw unused)
            full = len(r.hashes)  # the prompt's pages now computed join the prefix cache
            self.pages.register(r.pages[:full], r.hashes)
            self._accept(r, int(first[i]), float(logp[i]))

    def _seq_rows(self, reqs: list[_Request], b: int) -> jnp.ndarray:
        """The sequence slots of a program's b rows (``reqs``'s, then padding rows' max_seqs: out of range, so
        nothing of theirs is written): where a model's linear layers keep each row's state."""
        return jnp.asarray([r.row for r in reqs] + [self.max_seqs] * (b - len(reqs)), jnp.int32)

    def _vision(self, admitted: list[_Request], b: int) -> Any:
        if all(r.vision is None for r in admitted):
            return None
        if any(isinstance(r.vision, VisionInputs) for r in admitted):  # rows laid out alike (one batch's)
            rows = [r.vision for r in admitted]
            if any(not isinstance(v, VisionInputs) for v in rows):
                raise ValueError("one prefill mixes laid-out image rows with frames")
            rows += [jax.tree.map(jnp.zeros_like, rows[0])] * (b - len(admitted))
            return jax.tree.map(lambda *a: jnp.concatenate(a), *rows)
        frames = [list(r.vision or []) for r in admitted] + [[] for _ in range(b - len(admitted))]
        return vision_inputs(self.cfg, frames)

    def _decode(self) -> None:
        live: list[_Request] = [r for r in self._rows if r is not None and r.prefilled]
        width = self._width(max(int(self._lengths[r.row]) + 1 for r in live))
        # The live rows first, then padding rows that write nothing (row 0's state, inactive).
        b = decode_rows(len(live), self.max_seqs)
        at = [r.row for r in live] + [0] * (b - len(live))
        pad: list[_Request | None] = [None] * (b - len(live))
        tokens = np.array([r.out[-1] for r in live] + [0] * len(pad), np.int32)
        active = np.arange(b) < len(live)
        sampling = self._sampling(live + pad, [len(r.out) for r in live] + [0] * len(pad))
        delta = None if self._delta is None else jnp.asarray(self._delta[at])
        tables = self._tables[at, :width]
        if self.cfg.rope.kind == "longrope":  # rows whose next token passes the threshold: long-roped keys first
            omax = self.cfg.rope.original_max_position_embeddings
            crossing = [r.row for r in live if self._lengths[r.row] == omax]
            if crossing:
                self.pool = rerope(self.cfg, self.pool, jnp.asarray(self._tables[crossing, :width]))
        logits, self.pool = decode_logits(self.cfg, self.weights, self.pool, jnp.asarray(tokens), jnp.asarray(active),
                                          jnp.asarray(tables), jnp.asarray(self._lengths[at]), delta,
                                          self.adapters, self._index(live + pad), self._seq_rows(live, b))
        nxt, logp = _draw(logits, sampling)
        nxt, logp = np.asarray(nxt), np.asarray(logp)
        self.stats["steps"] += 1
        self.stats["decode_rows"] += b
        for i, r in enumerate(live):
            self._lengths[r.row] += 1
            self._accept(r, int(nxt[i]), float(logp[i]))

    def _accept(self, req: _Request, token: int, logp: float) -> None:
        """A request's newly drawn token: reported, and the request ended if it ends there."""
        req.out.append(token)
        self.stats["tokens"] += 1
        reason: FinishReason | None = None
        if token in req.params.eos_ids or _hit_stop(req.out, req.params.stop, self.tokenizer):
            reason = "stop"
        elif len(req.out) >= req.params.max_tokens:
            reason = "length"
        if reason is None:
            self._events.append(Event(req.id, (token,), logprobs=(logp,)))
        else:
            self._finish(req, reason, (token,), (logp,))

    def _finish(self, req: _Request, reason: FinishReason, tokens: tuple[int, ...],
                logprobs: tuple[float, ...] = ()) -> None:
        self._events.append(Event(req.id, tokens, True, reason, logprobs))
        if req.hashes and reason != "cancelled":
            # Every full page of the conversation so far (the last drawn token is not in the cache) joins the
            # prefix cache: a next turn that repeats it (a chat's history, an episode's next turn) reads it.
            held = (req.prompt + req.out)[:len(req.prompt) + len(req.out) - 1]
            hashes = self.pages.chain(held, req.params.adapter)
            self.pages.register(req.pages[:len(hashes)], hashes)
        self.pages.release(req.pages)
        self._rows[req.row] = None
        req.pages = []


def _hit_stop(tokens: list[int], stop: tuple[str, ...], tokenizer: Any) -> bool:
    """Whether the text of ``tokens`` now holds a stop string (only its tail can hold a new one)."""
    if not stop:
        return False
    longest = max(len(s) for s in stop)
    tail = tokenizer.decode(tokens[-(longest + 8):], skip_special_tokens=True)
    return any(s in tail for s in stop)

