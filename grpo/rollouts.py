"""GRPO's rollouts, set up once a run's model and mesh are known: each step samples, scores and lays out its
batch (grpo/task.py's docstring tells the steps).

:class:`Rollouts` holds what a run set up for them (the programs, the rewards, the estimator, the reference's
source, the tokenizer) and makes a step's :class:`pretrain.batch.Rollout`; :meth:`Rollouts.complete` completes
and scores a batch of prompt rows, for training and for the held-out prompts (grpo/held_out.py) alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpo.advantages import Estimator, Scored
from grpo.agentic import Agent, Episodes
from grpo.batch import RolloutBatch
from grpo.completions_log import completion_records
from grpo.config import GRPOConfig
from grpo.pipeline import Pipeline
from grpo.programs import GREEDY, Programs, rollout_key
from grpo.rewards import RewardSet, reward_metrics
from grpo.vision import ImagePrompts
from pretrain.batch import Rollout, VisionBatch
from pretrain.task import RowSource, Tokenizer
from zoo.data.batching import replicated_batch
from zoo.data.row_origin import row_where
from zoo.lora.weights import Weights
from zoo.model.sharding import make_mesh, mesh_context


@dataclass
class Drawn:
    """A batch of prompt rows' completions as the sampler (or the episodes) drew them: on the host
    (``comp_h``, ``len_h``, ``ended``, ``n_model``: the model's tokens of each) and on the devices, laid out as
    the update reads them (``prompt_rows``, ``completions``, ``lengths``, ``sampler_logps``; ``model``: which
    completion tokens the policy chose, None: all)."""

    comp_h: np.ndarray
    len_h: np.ndarray  # [B] tokens after the prompt (an episode's tools' too)
    ended: np.ndarray  # [B] the completion (its last turn) ended with EOS
    n_model: np.ndarray
    prompt_rows: dict[str, Any]
    completions: Any
    lengths: Any
    sampler_logps: Any
    model: Any = None
    episodes: Episodes | None = None
    vision: VisionBatch | None = None  # the prompts' images (grpo/vision.py), laid out as ``prompt_rows``


@dataclass
class Completed:
    """A batch of prompts completed (:meth:`Rollouts.complete`): what the rewards read, their scores, and the
    completions as drawn."""

    prompts: list[Any]
    ids: list[list[int]]
    texts: list[str]
    per_fn: np.ndarray
    total: np.ndarray
    drawn: Drawn
    t_gen: float


def to_host(x: jax.Array) -> np.ndarray:
    """A global array whole on this host (gathered from every process in a multi-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


class Rollouts:
    """A run's rollouts (module docstring). ``reference``: where the reference's weights are ("base": LoRA's
    frozen base, adapters off; "inputs": the step's frozen inputs; None: no reference); ``agent``: episodes of
    several turns with tools (grpo/agentic.py), prepared, or None; ``images``: a vision-language model's prompts
    with images (grpo/vision.py), or None."""

    def __init__(self, cfg: GRPOConfig, programs: Programs, rewards: RewardSet, estimator: Estimator,
                 tokenizer: Tokenizer, agent: Agent | None, reference: str | None, images: ImagePrompts | None = None,
                 engine_devices: Sequence[Any] = ()):
        self.cfg, self.g, self.programs = cfg, cfg.grpo, programs
        self.rewards, self.estimator, self.tokenizer, self.agent = rewards, estimator, tokenizer, agent
        self.reference, self.images = reference, images
        self.field = cfg.data.prompt_field
        self.group_size = cfg.grpo.num_generations
        self.batch_shape = programs.shape
        self.replicated = programs.replicated
        # One completion at a time on the engines (they keep their pools across calls): asynchronous rollouts'
        # thread and the held-out prompts' evaluation on the trainer's thread take turns.
        self.engine_lock = threading.Lock()
        self.dropped_total = 0  # completions asynchronous rollouts dropped as too stale (this run's process)
        # grpo.rollout_devices: the engine's own devices; the weights it samples with are copied there (snapshot),
        # the prompts go there and the completions come back to the training mesh
        self.engine_devices = list(engine_devices)
        self.on_engine = None if not self.engine_devices else NamedSharding(
            make_mesh(data=len(self.engine_devices), fsdp=1, devices=self.engine_devices), PartitionSpec())
        self._base_copy: tuple[Any, Any] | None = None  # LoRA's frozen base on the engine's devices, copied once

    def rollout(self, weights: Weights, frozen_inputs: Any, rows: dict[str, jax.Array], step: int,
                source: RowSource) -> Rollout[RolloutBatch]:
        """The step's training batch: G completions per prompt from the current policy (``weights``), their
        rewards and advantages, laid out as prompt + completion rows; with the rollout's metrics (TRL's names) and,
        on a ``grpo.log_completions_every`` step, the completions to log."""
        t0 = time.perf_counter()
        return self.finish(self.complete(weights, rows, step, source), weights, frozen_inputs, step, t0)

    def finish(self, done: Completed, weights: Weights, frozen_inputs: Any, step: int,
               t0: float) -> Rollout[RolloutBatch]:
        """The training batch of completed and scored prompts (:meth:`complete`): their advantages, laid out as
        prompt + completion rows with the log-probabilities the step reads, computed with the trainer's current
        ``weights`` (asynchronous rollouts: the weights of a later version than the sampler's); ``t0``: when the
        step's rollout started."""
        g = self.g
        truncated = ~done.drawn.ended
        trained = ~truncated if g.mask_truncated else np.ones_like(truncated)
        adv, m = self.estimator.row_advantages(done.total)
        relayout = lambda a: self._layout(done.drawn, a, trained)  # noqa: E731
        batch = relayout(adv.astype(np.float32))
        old, ref = self._logps(weights, frozen_inputs, batch)
        batch, adv, more = self.estimator.finish(Scored(batch, adv, done.per_fn, done.total, old, ref, relayout,
                                                        self.programs.reinforce_pp, to_host))
        m.update(more)
        if g.num_iterations > 1:
            batch = dataclasses.replace(batch, old_logps=old)
        if ref is not None:
            batch = dataclasses.replace(batch, ref_logps=ref)
        t_roll = time.perf_counter() - t0
        drawn = done.drawn
        real = int(to_host(drawn.prompt_rows["tokens_segment_ids"] > 0).sum()) + int(drawn.len_h.sum())
        return Rollout(batch, self._metrics(done, m, truncated), done.t_gen, t_roll, real * g.num_iterations,
                       self._log(step, done, adv))

    def rollout_async(self, pipeline: Pipeline[Completed], weights: Weights, frozen_inputs: Any,
                      step: int) -> Rollout[RolloutBatch]:
        """The step's training batch from the rollout thread (grpo/pipeline.py: completed with an earlier policy
        version, at most ``grpo.max_staleness`` steps back), finished with the trainer's ``weights``; with the
        staleness metrics (TRL AsyncGRPOTrainer's names). Its generation time is the time the trainer waited."""
        taken = pipeline.take(weights, step)
        out = self.finish(taken.made, weights, frozen_inputs, step, time.perf_counter() - taken.waited)
        self.dropped_total += taken.dropped * self.batch_shape[0] * self.batch_shape[1]
        metrics = {**out.metrics, "sample/staleness_mean": float(taken.staleness),
                   "sample/staleness_max": float(taken.staleness),
                   "sample/dropped_stale_total": float(self.dropped_total), "perf/rollout_wait_s": taken.waited}
        return dataclasses.replace(out, metrics=metrics, generation_s=taken.waited)

    def snapshot(self, weights: Weights) -> Weights:
        """The copy of the policy's weights the rollout thread samples with: the trained params copied (the train
        step donates its own buffers), LoRA's frozen base shared (it never changes); with ``grpo.rollout_devices``
        copied onto the engine's devices (the base once)."""
        def copy(tree: Any) -> Any:
            if self.on_engine is None:
                return jax.tree.map(jnp.copy, tree)
            return jax.device_put(tree, self.on_engine)

        if weights.adapters is None:
            return dataclasses.replace(weights, base=copy(weights.base))
        if self.on_engine is not None:
            if self._base_copy is None or self._base_copy[0] is not weights.base:
                self._base_copy = (weights.base, copy(weights.base))
            weights = dataclasses.replace(weights, base=self._base_copy[1])
        return dataclasses.replace(weights, adapters=copy(weights.adapters))

    def _on_engine_devices(self) -> contextlib.AbstractContextManager[Any]:
        """Where completions are drawn: with ``grpo.rollout_devices``, arrays made without a placement (the
        engine's page pool on one device) go to the engine's first device."""
        if not self.engine_devices:
            return contextlib.nullcontext()
        return jax.default_device(self.engine_devices[0])

    def _on_engine(self, weights: Weights) -> bool:
        """Whether ``weights`` lie on the engine's devices (a :meth:`snapshot`) already."""
        leaf = jax.tree.leaves(weights.base if weights.adapters is None else weights.adapters)[0]
        return set(leaf.sharding.device_set) <= set(self.engine_devices)

    def _layout(self, drawn: Drawn, adv: np.ndarray, trained: np.ndarray) -> RolloutBatch:
        """The update's batch of the drawn completions with per-row advantages ``adv``."""
        given = replicated_batch({"adv": adv.astype(np.float32), "trained": trained}, self.replicated)
        rows = drawn.prompt_rows
        return self.programs.layout(rows["tokens"], rows["tokens_segment_ids"], drawn.completions, drawn.lengths,
                                    drawn.sampler_logps, given["adv"], given["trained"], drawn.model, drawn.vision)

    def _logps(self, weights: Weights, frozen_inputs: Any,
               batch: RolloutBatch) -> tuple[jax.Array | None, jax.Array | None]:
        """(the sampling policy's per-token log-probabilities, the reference's), each where the step reads it."""
        g, p = self.g, self.programs
        with mesh_context(p.sharding.mesh):  # traced for the mesh: splash attention shards itself (zoo.kernels.splash)
            old = ref = None
            if g.num_iterations > 1 or (self.estimator.needs_old and g.beta > 0):
                old = p.logps(weights, batch)  # the policy that sampled (RLOO: its KL's first term)
            if self.reference == "base":  # the LoRA base, adapters off
                ref = p.logps(weights.base, batch)
            elif self.reference == "inputs":  # the starting model (full fine-tuning) or a grpo.reference checkpoint
                ref = p.logps(frozen_inputs, batch)
        return old, ref

    def _metrics(self, done: Completed, m: dict[str, float], truncated: np.ndarray) -> dict[str, float]:
        """The rollout's metrics under TRL's names (``m``: the estimator's)."""
        drawn = done.drawn
        n_model = drawn.n_model
        out = {
            "reward": float(np.mean(done.total)), **m,
            "completions/mean_length": float(n_model.mean()), "completions/min_length": float(n_model.min()),
            "completions/max_length": float(n_model.max()), "completions/clipped_ratio": float(truncated.mean()),
            "rollout_tokens_per_sec": int(drawn.len_h.sum()) / max(done.t_gen, 1e-9),
        }
        out.update(reward_metrics(self.rewards.names, done.per_fn))
        if drawn.episodes is not None:
            out.update(drawn.episodes.metrics())
        return out

    def _log(self, step: int, done: Completed, adv: np.ndarray) -> list[dict[str, Any]]:
        """The completions log's records of loop step ``step`` (0-based), on a ``grpo.log_completions_every``
        step; whole episodes with tools (messages, turns, calls and answers)."""
        every = self.g.log_completions_every
        if not every or (step + 1) % every:
            return []
        log = completion_records(step + 1, done.prompts, done.texts, done.ids, self.rewards.names, done.per_fn,
                                 done.total, adv)
        if done.drawn.episodes is not None:
            log = [{**rec, **ep} for rec, ep in zip(log, done.drawn.episodes.records())]
        return log

    def complete(self, weights: Weights, rows: dict[str, Any], step: int, source: RowSource,
                 mode: str = "train") -> Completed:
        """Complete a batch of prompt rows with the policy's ``weights`` and score the completions (``mode``:
        ``train``, the step's own draws;
        ``held_out``, the run's sampling on the held-out key stream; ``greedy``, one greedy completion per row)."""
        t0 = time.perf_counter()
        if self.on_engine is not None and not self._on_engine(weights):  # the trainer's (held-out prompts')
            weights = self.snapshot(weights)
        row_h = to_host(rows["row"])[..., 0].reshape(-1)
        ds = source.ds
        records = {int(i): ds[int(i)] for i in np.unique(row_h)}
        where = lambda r: row_where(source.path, int(row_h[r]))  # noqa: E731
        with self.engine_lock, self._on_engine_devices():
            if self.agent is None:
                drawn = self._sample(weights, rows, step, mode, self._vision(source.path, records, row_h))
            else:
                drawn = self._episodes(weights, [records[int(i)] for i in row_h], step, mode, where)
        t_gen = time.perf_counter() - t0
        comp_h, len_h = drawn.comp_h, drawn.len_h
        ids = [comp_h[r, :len_h[r]].tolist() for r in range(len(row_h))]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        if drawn.episodes is None:
            prompts = [records[int(i)][self.field] for i in row_h]
            completions_in: list[Any] = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                                         for t, p in zip(texts, prompts)]
        else:  # TRL's completions of an episode: its assistant and tool messages
            prompts, completions_in = drawn.episodes.prompts, drawn.episodes.completions
        columns = {k: [records[int(i)][k] for i in row_h] for k in ds.column_names if k != self.field}
        per_fn, total = self.rewards.compute(prompts, completions_in, ids, columns, where)
        return Completed(prompts, ids, texts, per_fn, total, drawn, t_gen)

    def _vision(self, path: str, records: dict[int, Any], row_h: np.ndarray) -> VisionBatch | None:
        """The images of the prompt rows ``row_h`` (indices of ``records``, read from ``path``), laid out on the
        devices as the prompts are; None without images (grpo/vision.py)."""
        arrays = None if self.images is None else self.images.patches(path, records, row_h.tolist(), self.tokenizer)
        if arrays is None:
            return None
        shape = self.batch_shape
        return VisionBatch(**replicated_batch({k: a.reshape(shape + a.shape[1:]) for k, a in arrays.items()},
                                              self.programs.sharding))

    def _sample(self, weights: Weights, rows: dict[str, Any], step: int, mode: str,
                vision: VisionBatch | None = None) -> Drawn:
        """One completion per row from the sampler of ``mode`` (:meth:`complete`), with the prompts' images."""
        p = self.programs
        key_input: Any
        if mode == "greedy":
            sample, key_input = p.sample_greedy, np.int32(step)
        else:  # training's and held-out prompts' draws: one program, the key stream a flag (grpo/programs.py)
            sample, key_input = p.sample, (np.int32(step), np.bool_(mode == "held_out"))
        tokens, seg = rows["tokens"], rows["tokens_segment_ids"]
        if self.on_engine is not None:  # the prompts to the engine's devices, the completions back
            tokens, seg, vision = jax.device_put((tokens, seg, vision), self.on_engine)
        completions, sampler_logps, lengths = sample(weights, key_input, tokens, seg, vision=vision)
        if self.on_engine is not None:
            completions, sampler_logps, lengths = jax.device_put((completions, sampler_logps, lengths),
                                                                 self.replicated)
        comp_h, len_h = to_host(completions), to_host(lengths)
        ended = np.isin(comp_h[np.arange(len(len_h)), len_h - 1], p.spec.eos_ids)
        prompt_rows = {"tokens": rows["tokens"], "tokens_segment_ids": rows["tokens_segment_ids"]}
        return Drawn(comp_h, len_h, np.asarray(ended), np.asarray(len_h), prompt_rows, completions, lengths,
                     sampler_logps, vision=vision)

    def _episodes(self, weights: Weights, records: list[dict[str, Any]], step: int, mode: str,
                  where: Any) -> Drawn:
        """One episode of several turns with tools per row (grpo/agentic.py), laid out on the devices."""
        assert self.agent is not None
        sampler = GREEDY if mode == "greedy" else None
        episodes = self.agent.run(weights, records,
                                  rollout_key(self.cfg.seed, step, mode != "train"), where, sampler)
        shape = self.batch_shape
        placed = replicated_batch({"tokens": episodes.prompt_tokens.reshape(shape + (-1,)),
                                   "tokens_segment_ids": episodes.prompt_valid.reshape(shape + (-1,)),
                                   "completions": episodes.tokens, "sampler_logps": episodes.logps,
                                   "lengths": episodes.lengths, "model": episodes.model}, self.replicated)
        prompt_rows = {k: placed[k] for k in ("tokens", "tokens_segment_ids")}
        n_model = episodes.model.sum(1)  # TRL counts the model's tokens only
        return Drawn(episodes.tokens, episodes.lengths, np.asarray(episodes.ended), np.asarray(n_model), prompt_rows,
                     placed["completions"], placed["lengths"], placed["sampler_logps"], placed["model"], episodes)
