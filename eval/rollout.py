"""Rollouts: G sampled completions per prompt on the inference engine.

:func:`sample_group_completions` runs a batch's rows as requests of the inference engine
(:class:`eval.engine.engine.Engine`: continuous batching over a paged KV cache): each group's G rows hold the
same prompt, whose full pages the engine computes once and the G completions share (its prefix cache), each
completion decoding up to ``max_completion_length`` tokens until its EOS. Each drawn token's log-probability
under the sampler's distribution (the logits over the temperature, before top-k/top-p cut them: the distribution
the trainer computes too) comes back with it. A vision-language model's image token is never drawn (the
engine's ban; its log-probabilities stay unmasked). Row r draws with a key folded from the step's key and r
(and the token's index), so the same step of the same run draws the same tokens, whatever ran before it.

The batch the update trains on is laid out by :mod:`eval.rollout_batch`.

:class:`RolloutEngine` is the sampler of online training (GRPO's rollouts,
GKD's sampled completions, GRPO's episodes with tools through :mod:`eval.turns`):
one engine per batch shape, its pool kept across steps, decoding with the weights
as the train step computes with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eval.engine.api import SamplingParams
from eval.engine.engine import TOKEN_BUCKET, Engine
from eval.engine.paged import abstract_pool
from eval.engine.sampling import RowSampling
from eval.generate import Sampler
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.vision import VisionInputs

PAGE_SIZE = 16  # tokens per page of the samplers' engines (the engine's default)


@dataclass(frozen=True)
class RolloutSpec:
    """The settings of a rollout."""

    group: int  # G completions per prompt
    new_tokens: int  # max_completion_length
    sampler: Sampler
    eos_ids: tuple[int, ...]
    # Token ids never drawn (a vision-language model's image token: drawn, the update's forward would read it as an
    # image slot with no image behind it). The engine bans its model's own; these are banned beside it.
    banned_ids: tuple[int, ...] = ()


def row_keys(key: jax.Array, rows: int) -> np.ndarray:
    """[rows, 2] uint32: row r's sampling key data, ``fold_in(key, r)`` (``key``: a typed key or raw key data)."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return np.asarray(jax.random.key_data(_fold_rows(key, jnp.arange(rows))), np.uint32)


@jax.jit
def _fold_rows(key: jax.Array, rows: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in, (None, 0))(key, rows)


def leaders_first(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The rows in the order they are submitted: each distinct prompt's first row, then the others (a request
    whose prompt pages another admitted request is computing waits a step, so the G rows of a group follow
    every group's first one and share its pages, and no group waits for another's)."""
    seen: set[tuple[int, ...]] = set()
    first: list[int] = []
    rest: list[int] = []
    for r, p in enumerate(prompts):
        (rest if tuple(p) in seen else first).append(r)
        seen.add(tuple(p))
    return first + rest


def run_requests(engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 keys: np.ndarray, vision: Sequence[Any] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's new tokens and their log-probabilities, its requests submitted in :func:`leaders_first`'s
    order with sampling key data ``keys[r]`` and ``vision[r]`` (a one-row :class:`zoo.model.vision.VisionInputs`
    or None), run to their ends; an empty prompt gets no request and no tokens. Deterministic: the same prompts
    and keys give the same schedule."""
    row_of = {}
    for r in leaders_first(prompts):
        if not prompts[r]:
            continue  # nothing to continue (a row with no prompt): no completion
        row_of[engine.submit(prompts[r], params[r], None if vision is None else vision[r], keys[r])] = r
    tokens: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    while engine.busy:
        for e in engine.step():
            r = row_of[e.request_id]
            tokens[r] += e.tokens
            logps[r] += e.logprobs
    return tokens, logps


def _row(x: jax.Array, r: int) -> np.ndarray:
    """Row ``r`` of a global array, read from a shard this process holds."""
    for s in x.addressable_shards:
        start, stop, _ = s.index[0].indices(x.shape[0])
        if start <= r < stop:
            return np.asarray(s.data)[r - start]
    raise ValueError(f"row {r} is not on this process")


def local_weights(weights: dict | Weights) -> Weights:
    """The weights whole on this host: a run of several processes gathers them (each process's engine decodes
    on its own devices); one process's are returned as they are."""
    w = Weights.wrap(weights)
    if jax.process_count() == 1:
        return w
    from jax.experimental import multihost_utils

    base, adapters = jax.device_put(multihost_utils.process_allgather((w.base, w.adapters), tiled=True))
    return Weights(base, adapters, w.scale)


def sampling_params(sampler: Sampler, max_tokens: int, eos_ids: Sequence[int]) -> SamplingParams:
    """The engine's settings of a rollout's request."""
    return SamplingParams(max_tokens=max_tokens, temperature=float(sampler.temperature), top_k=int(sampler.top_k),
                          top_p=float(sampler.top_p), eos_ids=tuple(eos_ids))


def sample_group_completions(cfg: ModelConfig, params: dict | Weights, tokens: Any, valid: Any,
                             spec: RolloutSpec, key: jax.Array, mesh: Mesh | None = None,
                             vision: VisionInputs | None = None, *, engine: Engine | None = None,
                             rows: Sequence[int] | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(completions [B, T] int32, their sampler log-probabilities [B, T] float32, lengths [B] int32).

    ``tokens``/``valid`` [B, P]: right-padded prompts, rows ``k*G .. k*G+G-1``
    the same prompt (only row ``k*G`` is read). A completion ends with its
    first token of ``spec.eos_ids`` (counted in its length) or at T tokens;
    entries past its length are 0. ``params``: a model's, or :class:`zoo.lora.weights.Weights`
    whose LoRA adapters run beside the base matmuls, as in the training forward pass (used as they come: cast
    them first). Row r draws with the key data ``fold_in(key, r)``. ``vision``: a vision-language model's images
    of the B rows ([B, ...] each, a group's rows alike; only row ``k*G``'s are read). ``engine``: the engine to
    run on (a :class:`RolloutEngine`'s, of B rows and P + T tokens; None: a new one); its weights are set to
    ``params`` (its cached prompts dropped) and released at the end. ``mesh``: unused (the engine lays its pool
    out on the weights' mesh), kept for the program's signature. ``rows``: the batch's rows these are (their keys'
    indices; None: 0 .. B - 1), where a process samples a part of a batch.
    """
    tok_h, valid_h = np.asarray(tokens), np.asarray(valid)
    b, p = tok_h.shape
    g, t = spec.group, spec.new_tokens
    w = Weights.wrap(params)
    if engine is None:
        engine = Engine(cfg, w.base, max_seqs=b, max_len=p + t, page_size=PAGE_SIZE)
    engine.set_weights(w)
    banned = tuple(dict.fromkeys((*engine.banned, *spec.banned_ids)))
    engine.banned = banned
    lead = [r - r % g for r in range(b)]
    prompts = [tok_h[k][valid_h[k]].tolist() for k in lead]
    rows_vision = None
    if vision is not None:
        rows_vision = [jax.tree.map(lambda a, k=k: a[k:k + 1], vision) for k in lead]
    params_ = [sampling_params(spec.sampler, t, spec.eos_ids)] * b
    try:
        keys = row_keys(key, b if rows is None else max(rows) + 1)
        drawn, logps = run_requests(engine, prompts, params_, keys if rows is None else keys[list(rows)], rows_vision)
    finally:
        engine.release_weights()
    comp = np.zeros((b, t), np.int32)
    lp = np.zeros((b, t), np.float32)
    lengths = np.array([len(d) for d in drawn], np.int32)
    for r, (d, lg) in enumerate(zip(drawn, logps)):
        comp[r, :len(d)], lp[r, :len(d)] = d, lg
    return jnp.asarray(comp), jnp.asarray(lp), jnp.asarray(lengths)


class Sample:
    """A :class:`RolloutEngine` program: ``(weights, key_input, *inputs, vision=None) -> (completions, sampler
    log-probabilities, lengths)`` (:meth:`RolloutEngine.program`), and its engine's programs lowered for
    ``--compile-only`` (:meth:`lower`)."""

    def __init__(self, owner: RolloutEngine, spec: RolloutSpec, prompts: Callable[..., tuple[jax.Array, jax.Array]],
                 key_of: Callable[[Any], jax.Array], images: Callable[[Any], VisionInputs]):
        self.owner, self.spec = owner, spec
        self.prompts, self.images, self.key_of = jax.jit(prompts), jax.jit(images), key_of

    def __call__(self, weights: dict | Weights, key_input: Any, *inputs: Any,
                 vision: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        tokens, valid = self.prompts(*inputs)
        images = None if vision is None else self.images(vision)
        if jax.process_count() > 1:
            return self._processes(weights, tokens, valid, self.key_of(key_input), images)
        b, p = tokens.shape
        w = self.owner.cast(weights)
        engine = self.owner.engine(b, p + self.spec.new_tokens, w)
        # Looked up at call time: tests replace the sampler with scripted completions.
        return globals()["sample_group_completions"](
            self.owner.mcfg, w, tokens, valid, self.spec, self.key_of(key_input), mesh=self.owner.mesh,
            vision=images, engine=engine)

    def _processes(self, weights: dict | Weights, tokens: jax.Array, valid: jax.Array, key: jax.Array,
                   vision: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A run of several processes: each samples the rows its devices hold (whole groups) on an engine of its
        own, from the weights gathered whole (the engine is one host's), and every process gets every row."""
        from jax.experimental import multihost_utils

        b, p = tokens.shape
        rows = sorted({r for s in tokens.addressable_shards for r in range(*s.index[0].indices(b))})
        local = lambda x: np.stack([_row(x, r) for r in rows])  # noqa: E731
        w = self.owner.cast(local_weights(weights))
        engine = self.owner.engine(len(rows), p + self.spec.new_tokens, w)
        images = None if vision is None else jax.tree.map(lambda a: jnp.asarray(local(a)), vision)
        out = sample_group_completions(self.owner.mcfg, w, local(tokens), local(valid), self.spec, key,
                                       vision=images, engine=engine, rows=rows)
        every = multihost_utils.process_allgather((np.asarray(rows), *(np.asarray(x) for x in out)))
        full = [np.zeros((b,) + x.shape[2:], x.dtype) for x in every[1:]]
        for i, at in enumerate(every[0]):
            for f, x in zip(full, every[1:]):
                f[at] = x[i]
        sharding = NamedSharding(self.owner._mesh(), PartitionSpec())

        def placed(f: np.ndarray) -> jax.Array:  # replicated: every process holds every row
            return jax.make_array_from_callback(f.shape, sharding, lambda idx: f[idx])

        comp, logps, lengths = full
        return placed(comp), placed(logps), placed(lengths)

    def lower(self, weights: Any, key_input: Any, *inputs: Any, vision: Any = None) -> Any:
        """For ``--compile-only``: the engine's programs lowered from abstract ``weights`` and inputs
        (``jax.ShapeDtypeStruct`` s), as one (:meth:`RolloutEngine.lowered`)."""
        tokens, _ = jax.eval_shape(self.prompts, *inputs)
        b, p = tokens.shape
        v = None if vision is None else jax.eval_shape(self.images, vision)
        return self.owner.lowered(weights, b, p, self.spec, v)


class RolloutEngine:
    """One model's sampler for online training (module docstring): engines that complete a batch of prompts (G
    completions each, :func:`sample_group_completions`) from the weights as the train step computes with them
    (cast to ``compute``, LoRA adapters beside); ``mesh``: the train step's (``--compile-only`` lays the pool out
    on it)."""

    def __init__(self, mcfg: ModelConfig, compute: Any, mesh: Mesh | None):
        self.mcfg, self.compute, self.mesh = mcfg, compute, mesh
        self._engines: dict[tuple[int, int], Engine] = {}

    def cast(self, weights: dict | Weights) -> Weights:
        """The weights as the sampler decodes with them: the base cast to the compute dtype, no dropout."""
        return Weights.wrap(weights).without_dropout().cast(self.compute)

    def engine(self, rows: int, max_len: int, weights: Weights) -> Engine:
        """The engine of ``rows`` rows of ``max_len`` tokens, made on first use with ``weights`` (cast: they decide
        its pool's dtype and mesh) and kept, its pool with it, for the next steps (which set their own weights)."""
        key = (rows, max_len)
        if key not in self._engines:
            pages, page = self._pool_shape(rows, max_len)
            self._engines[key] = Engine(self.mcfg, weights.base, max_seqs=rows, max_len=max_len, page_size=page,
                                        num_pages=pages)
            self._engines[key].release_weights()
        return self._engines[key]

    def program(self, spec: RolloutSpec, prompts: Callable[..., tuple[jax.Array, jax.Array]],
                key_of: Callable[[Any], jax.Array] = lambda key: key,
                images: Callable[[Any], VisionInputs] = lambda v: v) -> Sample:
        """The sampler ``(weights, key_input, *inputs, vision=None) -> (completions, sampler log-probabilities,
        lengths)``: ``prompts(*inputs)`` gives the right-padded prompts and their valid mask ([B, P] each: how a
        task's rows hold them), ``key_of(key_input)`` the sampling key (a step number, say), ``images(vision)``
        the prompts' images as the model reads them ([B, ...] each; vision None: none); ``weights``: a model's
        params, or :class:`zoo.lora.weights.Weights` (LoRA's adapters beside their base). A vision-language model
        never draws its image token: a completion holding one would have the update's forward read it as an image
        slot."""
        if self.mcfg.vision is not None and self.mcfg.vision.image_token_id not in spec.banned_ids:
            spec = replace(spec, banned_ids=(*spec.banned_ids, self.mcfg.vision.image_token_id))
        return Sample(self, spec, prompts, key_of, images)

    def _pool_shape(self, rows: int, max_len: int) -> tuple[int, int]:
        """(pages, page size) of an engine of ``rows`` rows of ``max_len`` tokens: every row's whole length."""
        return rows * -(-max_len // PAGE_SIZE), PAGE_SIZE

    def kv_cache_bytes(self, rows: int, prompt: int, spec: RolloutSpec) -> int:
        """Bytes a chip holds of the engine's page pool for ``rows`` rows of ``prompt``-token prompts."""
        import math

        pages, page = self._pool_shape(rows, prompt + spec.new_tokens)
        pool = abstract_pool(self.mcfg, pages, page, jnp.dtype(self.compute), self._mesh(), rows)
        return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(pool))

    def _mesh(self) -> Mesh:
        if self.mesh is not None:
            return self.mesh
        return Mesh(np.array(jax.devices()[:1]), ("data",))

    def lowered(self, weights: Any, rows: int, prompt: int, spec: RolloutSpec,
                vision: VisionInputs | None) -> Any:
        """For ``--compile-only``: the engine's prefill (every group's first row at once, as a step's first
        admission runs it: ``spec``'s groups) and then its decoding step (all ``rows`` rows at their longest
        page table), lowered as one program (its peak is the larger of the two's) from abstract ``weights`` laid
        out for decoding on the mesh (:func:`zoo.model.decode.decode_shardings`), with the pool of :meth:`engine`
        for ``rows`` rows of ``prompt + spec.new_tokens`` tokens."""
        from eval.engine.paged import decode, prefill
        from zoo.model.decode import decode_shardings

        mesh = self._mesh()
        rep = NamedSharding(mesh, PartitionSpec())
        w = Weights.wrap(weights)
        placed = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), w.base,
                              decode_shardings(self.mcfg, mesh))
        cast = jax.eval_shape(lambda x: self.cast(Weights(x, w.adapters, w.scale)), placed)
        cast = jax.tree.map(lambda s, o: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=o.sharding),
                            cast, Weights(placed, w.adapters, w.scale))
        pages, page = self._pool_shape(rows, prompt + spec.new_tokens)
        pool = abstract_pool(self.mcfg, pages, page, jnp.dtype(self.compute), mesh, rows)
        width = -(-(prompt + spec.new_tokens) // page)

        def sds(shape: tuple[int, ...], dt: Any) -> Any:  # an abstract array where the programs take arrays
            return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

        def sampling(n: int) -> RowSampling:
            return RowSampling(sds((n,), jnp.float32), sds((n,), jnp.int32), sds((n,), jnp.float32),
                               sds((n, 2), jnp.uint32), sds((n,), jnp.int32), spec.banned_ids)

        delta = sds((rows,), jnp.int32) if self.mcfg.rope.mrope_section else None
        n = 1 << max(0, (rows // spec.group - 1).bit_length())  # the first admission: every group's first row
        t = max(TOKEN_BUCKET, 1 << max(0, (prompt - 1).bit_length()))
        pv = None if vision is None else jax.tree.map(lambda a: sds((n,) + a.shape[1:], a.dtype), vision)
        cfg = self.mcfg

        def both(weights: Weights, pool: Any, prefill_in: tuple, decode_in: tuple, vision: Any) -> Any:
            # the rows' sequence slots (where a model's linear layers keep their states): the first ones
            first, pool, _, _ = prefill(cfg, weights, pool, *prefill_in, True, vision,
                                        seq_rows=jnp.arange(n, dtype=jnp.int32))
            nxt, pool = decode(cfg, weights, pool, *decode_in, seq_rows=jnp.arange(rows, dtype=jnp.int32))
            return first, nxt, pool

        prefill_in = (sds((n, t), jnp.int32), sds((n, t), jnp.bool_), sds((n, width), jnp.int32),
                      sds((n,), jnp.int32), None if delta is None else sds((n,), jnp.int32), sampling(n))
        decode_in = (sds((rows,), jnp.int32), sds((rows,), jnp.bool_), sds((rows, width), jnp.int32),
                     sds((rows,), jnp.int32), delta, sampling(rows))
        return jax.jit(both, donate_argnums=(1,)).lower(cast, pool, prefill_in, decode_in, pv)
