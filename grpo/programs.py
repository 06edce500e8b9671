"""GRPO's device programs for one run: the samplers (eval.rollout.RolloutEngine), the update's layout, the
policy's and the reference's log-probabilities and REINFORCE++'s advantages, each jitted once and laid out as the
train step reads its batch; with a vision-language model's prompt images (grpo/vision.py) in the samplers' prefill
and in the update's rows."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from eval.generate import Sampler
from eval.rollout import RolloutEngine, RolloutSpec
from eval.rollout_batch import assemble, assemble_groups
from grpo import losses
from grpo.batch import RolloutBatch, UpdateRows, completion_logps
from grpo.config import GRPOConfig
from pretrain.batch import VisionBatch
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.vision import VisionInputs

GREEDY = Sampler(0.0, 0, 1.0)


def rollout_key(seed: int, step: Any, held_out: Any = False) -> jax.Array:
    """The sampling key of a step: its own stream (LoRA dropout folds the step into key(seed)); held-out
    prompts' samples have another, so evaluating never changes what training draws. ``held_out`` may be traced
    (a bool array): one sampler program then serves both streams, with the same keys."""
    root = jax.random.fold_in(jax.random.key(seed), 0x67727)
    held = jax.random.fold_in(root, 0xE7A1)
    if isinstance(held_out, bool):
        return jax.random.fold_in(held if held_out else root, step)
    data = jnp.where(held_out, jax.random.key_data(held), jax.random.key_data(root))
    return jax.random.fold_in(jax.random.wrap_key_data(data, impl=jax.random.key_impl(root)), step)


def _step_key(seed: int, key_input: tuple[Any, Any]) -> jax.Array:
    """:func:`rollout_key` of a sampler's key input (step, held out)."""
    return rollout_key(seed, key_input[0], key_input[1])


class Programs:
    """The jitted pieces of a GRPO run's rollouts (module docstring)."""

    def __init__(self, cfg: GRPOConfig, mcfg: ModelConfig, mesh: jax.sharding.Mesh, compute: Any,
                 eos_ids: tuple[int, ...], rows: UpdateRows):
        g = cfg.grpo
        self.mcfg, self.compute, self.rows = mcfg, compute, rows
        self.temperature = float(g.temperature)
        self.spec = RolloutSpec(g.num_generations, g.max_completion_length,
                                Sampler(float(g.temperature), int(g.top_k), float(g.top_p)), eos_ids)
        self.shape = (cfg.grad_accum, cfg.batch_size // cfg.grad_accum)
        self.sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.engine = RolloutEngine(mcfg, compute, mesh)
        b = self.shape[0] * self.shape[1]

        def prompts(tokens: jax.Array, seg: jax.Array) -> tuple[jax.Array, jax.Array]:
            return tokens.reshape(b, -1), seg.reshape(b, -1) > 0

        # (weights, (step, held out), tokens, segment ids): the step's draws, and held-out prompts' (grpo/held_out.py)
        # with the run's sampling on their own key stream: one program, the stream chosen by a traced flag; and
        # greedy, one completion per prompt (a group of one).
        self.sample = self.engine.program(self.spec, prompts, partial(_step_key, cfg.seed), self._images)
        greedy = RolloutSpec(1, self.spec.new_tokens, GREEDY, eos_ids)
        self.sample_greedy = self.engine.program(greedy, prompts, partial(rollout_key, cfg.seed, held_out=True),
                                                 self._images)
        self.layout = jax.jit(self._layout, out_shardings=self.sharding)
        self.logps = jax.jit(self._logps, out_shardings=self.sharding)
        beta = float(g.beta)
        self.reinforce_pp = jax.jit(lambda r, w, kl, group, clip: losses.reinforce_pp_advantages(r, w, kl, beta,
                                                                                               group, clip),
                                    static_argnums=(3, 4))

    def _layout(self, tokens: jax.Array, seg: jax.Array, completions: jax.Array, lengths: jax.Array,
                sampler_logps: jax.Array, advantages: jax.Array, trained: jax.Array,
                model: jax.Array | None = None, vision: VisionBatch | None = None) -> RolloutBatch:
        """The update's batch of the step's prompts and completions ([grad_accum, micro, ...] rows); ``vision``:
        the prompts' images (laid out as ``tokens``), each row's with it (one row a group: its first row's)."""
        shape, b = self.shape, self.shape[0] * self.shape[1]
        args = (tokens.reshape(b, -1), seg.reshape(b, -1) > 0, completions, lengths,
                {"sampler_logps": sampler_logps}, {"advantages": advantages}, trained)
        out = assemble_groups(*args, self.spec.group, model) if self.rows.grouped else assemble(*args, model)
        batch = RolloutBatch.of({k: v.reshape(shape[:1] + (-1,) + v.shape[1:]) for k, v in out.items()})
        if vision is None:
            return batch
        g = self.spec.group if self.rows.grouped else 1  # a group's rows hold one prompt: its images once
        return dataclasses.replace(batch, vision=jax.tree.map(lambda a: a[:, ::g], vision))

    def _logps(self, params: dict | Weights, batch: RolloutBatch) -> jax.Array:
        """Per-token log-probabilities of the batch's completion tokens (0 elsewhere), no gradient taken
        (``params``: a model's, or the policy's :class:`zoo.lora.weights.Weights`), as the loss computes them
        (:func:`grpo.batch.completion_logps`: with the rows' images)."""
        flat = jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:]), batch)
        p = Weights.wrap(params).cast(self.compute)
        lp = completion_logps(self.mcfg, p, flat, self.rows, self.temperature)[0]
        return (lp * flat.weights).reshape(self.shape + lp.shape[1:])

    def _images(self, vision: VisionBatch) -> VisionInputs:
        """The step's images ([grad_accum, micro, ...] as the prompts) as the sampler reads them: one row a prompt row."""
        v = self.mcfg.vision
        assert v is not None, "images on a model without a vision tower"
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), vision).inputs(v)

    def kv_cache_bytes(self, prompt: int) -> int:
        """Bytes a chip holds of the sampler's KV cache: the step's rows, ``prompt``-token prompts."""
        return self.engine.kv_cache_bytes(self.shape[0] * self.shape[1], prompt, self.spec)
