"""GKD's sampled completions: each step's batch is the dataset's rows, or their prompts with completions the
student (on-policy) or the teacher (``seq_kd``) samples, micro-batch by micro-batch, as TRL 1.16's
``GKDTrainer.training_step`` does.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(arXiv:2306.13649). TRL draws one coin per ``training_step`` call, which is one micro-batch of a gradient
accumulation: with probability ``lmbda`` the student samples the micro-batch's completions, otherwise, with
``seq_kd``, the teacher does, otherwise the dataset's stay. Here the coin of micro-batch ``a`` of loop step
``s`` is drawn from ``(seed, s)``, so a resumed run draws what the uninterrupted one drew.

A row's prompt is everything before its last trained span (the last assistant turn's answer; TRL's ChatML
collator prompts with every message but the last). The sampler is the inference engine GRPO samples on
(eval/rollout.py), at ``distill.temperature`` with no top-k or top-p cut (TRL's ``top_k=0, top_p=1``), up to
``distill.max_new_tokens`` tokens, the first EOS included and trained. Every batch, sampled or not, has rows of
``data.seq_len + distill.max_new_tokens`` tokens, so the step compiles once.

The loss divides the batch's JSD sum by the dataset rows' target count (``data_weights``), not by the sampled
tokens': TRL's trainer counts ``num_items_in_batch`` from the batch's labels before ``training_step`` replaces
them with samples. On a fully sampled batch the loss is then the JSD summed over the sampled tokens, over the
dataset's completion tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from distill.batch import DistillBatch
from eval.generate import Sampler
from eval.rollout import RolloutEngine, RolloutSpec
from eval.rollout_batch import assemble
from pretrain.batch import Rollout
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig

STREAM = 0x676B64  # folded into the seed: sampling keys and coins of their own (GRPO's and dropout's differ)


def coins(seed: int, step: int, micro_batches: int, lmbda: float) -> np.ndarray:
    """Which micro-batches of loop step ``step`` the student samples (TRL: ``random.random() <= lmbda`` per
    micro-batch), a function of the seed and the step alone."""
    return np.random.default_rng([seed, step, STREAM]).random(micro_batches) <= lmbda


def prompts(tokens: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(right-padded prompts [..., n], valid [..., n]) of dataset rows: each row's tokens before its last
    trained span (none where the row trains nothing)."""
    m = loss_mask.astype(bool) & (segment_ids > 0)
    starts = m & ~jnp.concatenate([jnp.zeros_like(m[..., :1]), m[..., :-1]], axis=-1)
    idx = jnp.arange(m.shape[-1])
    last = jnp.max(jnp.where(starts, idx, -1), axis=-1)
    valid = idx < jnp.maximum(last, 0)[..., None]
    return jnp.where(valid, tokens, 0), valid


def dataset_rows(rows: dict[str, jax.Array], width: int) -> dict[str, jax.Array]:
    """The model batch of dataset rows ([..., n] -> [..., width], padded; zoo.data.batching.to_model_batch's
    fields), its own target weights as ``data_weights`` too."""
    tok, seg, pos = rows["tokens"], rows["tokens_segment_ids"], rows["tokens_positions"]
    same = (seg[..., 1:] == seg[..., :-1]) & (seg[..., 1:] != 0) & rows["loss_mask"][..., 1:].astype(bool)
    out = {"inputs": tok[..., :-1], "targets": tok[..., 1:], "weights": same.astype(jnp.float32),
           "segment_ids": seg[..., :-1], "positions": pos[..., :-1]}
    pad = [(0, 0)] * (tok.ndim - 1) + [(0, width - tok.shape[-1] + 1)]
    out = {k: jnp.pad(v, pad).astype(jnp.float32 if k == "weights" else jnp.int32) for k, v in out.items()}
    out["data_weights"] = out["weights"]
    return out


@dataclass
class Sampling:
    """The compiled pieces of GKD's sampled batches for one run (built by the SFT task's GKD variant, sft/gkd.py)."""

    student: ModelConfig
    teacher: ModelConfig
    spec: RolloutSpec
    shape: tuple[int, int]  # (grad_accum, micro-batch rows)
    seq_len: int
    seed: int
    lmbda: float
    seq_kd: bool
    compute: Any
    mesh: jax.sharding.Mesh
    batch_sharding: NamedSharding = field(init=False)
    # The student's and the teacher's samplers (eval.rollout.RolloutEngine: the inference engine), and their
    # programs: (weights, key, rows, micro-batch index) -> (completions, their log-probabilities, lengths).
    engines: dict[str, RolloutEngine] = field(init=False)
    programs: dict[str, Any] = field(init=False)
    _sampled: Any = field(init=False)
    _dataset: Any = field(init=False)
    _stack: Any = field(init=False)

    def __post_init__(self) -> None:
        width = self.seq_len + self.spec.new_tokens
        rows_sharding = NamedSharding(self.mesh, PartitionSpec(("data", "fsdp"), None))
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(None, ("data", "fsdp"), None))

        def prompts_of(rows: dict, a: jax.Array) -> tuple[jax.Array, jax.Array]:
            return prompts(rows["tokens"][a], rows["loss_mask"][a], rows["tokens_segment_ids"][a])

        def sampled(rows: dict, a: jax.Array, completions: jax.Array, lengths: jax.Array) -> dict:
            tok, valid = prompts_of(rows, a)
            out = assemble(tok, valid, completions, lengths, {}, {}, valid.any(-1))
            out["data_weights"] = dataset_rows({k: v[a] for k, v in rows.items()}, width)["weights"]
            return out

        self.engines = {"sampler": RolloutEngine(self.student, self.compute, self.mesh),
                        "teacher_sampler": RolloutEngine(self.teacher, self.compute, self.mesh)}
        self.programs = {k: e.program(self.spec, prompts_of) for k, e in self.engines.items()}
        self._sampled = jax.jit(sampled, out_shardings=rows_sharding)
        self._dataset = jax.jit(lambda rows, a: dataset_rows({k: v[a] for k, v in rows.items()}, width),
                                out_shardings=rows_sharding)
        self._stack = jax.jit(lambda parts: DistillBatch.of({k: jnp.stack([p[k] for p in parts])
                                                             for k in parts[0]}),
                              out_shardings=self.batch_sharding)

    def lowered(self, weights: Weights, teacher: Any) -> dict[str, Any]:
        """For ``--compile-only``: the student's sampler (and with ``seq_kd`` the teacher's) lowered from
        abstract weights (the student's ``weights``, the ``teacher``'s params), for one micro-batch of the step's
        rows: each the inference engine's prefill and decoding step as one program
        (:meth:`eval.rollout.RolloutEngine.lowered`)."""
        a, m = self.shape
        rows = {k: jax.ShapeDtypeStruct((a, m, self.seq_len + 1), jnp.int32, sharding=self.batch_sharding)
                for k in ("tokens", "loss_mask", "tokens_segment_ids")}
        replicated = NamedSharding(self.mesh, PartitionSpec())
        i = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
        out = {"sampler": self.programs["sampler"].lower(weights, key, rows, i)}
        if self.seq_kd:
            out["teacher_sampler"] = self.programs["teacher_sampler"].lower(teacher, key, rows, i)
        return out

    def kv_cache_bytes(self) -> dict[str, int]:
        """Bytes a chip holds of each sampler's KV cache (:meth:`lowered`'s programs: the engine's page pool)."""
        names = ("sampler", "teacher_sampler") if self.seq_kd else ("sampler",)
        return {k: self.engines[k].kv_cache_bytes(self.shape[1], self.seq_len + 1, self.spec) for k in names}

    def key(self, step: int, a: int) -> jax.Array:
        """The sampling key of micro-batch ``a`` of loop step ``step``."""
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), STREAM), step * self.shape[0] + a)

    def rollout(self, weights: Weights, teacher: dict, rows: dict[str, jax.Array], step: int) -> Rollout[DistillBatch]:
        """Loop step ``step``'s batch from its dataset rows ([accum, micro, seq_len + 1]): each micro-batch as
        its coin says (the module docstring), the student's samples from its ``weights``, with the sampled share
        and lengths as metrics."""
        t0 = time.perf_counter()
        on = coins(self.seed, step, self.shape[0], self.lmbda)
        parts, lengths, gen = [], [], 0.0
        for a in range(self.shape[0]):
            i = np.int32(a)
            if on[a] or self.seq_kd:
                g0 = time.perf_counter()
                if on[a]:
                    completions, _, n = self.programs["sampler"](weights, self.key(step, a), rows, i)
                else:
                    completions, _, n = self.programs["teacher_sampler"](teacher, self.key(step, a), rows, i)
                lengths.append(np.asarray(jax.device_get(n)))
                gen += time.perf_counter() - g0
                parts.append(self._sampled(rows, i, completions, n))
            else:
                parts.append(self._dataset(rows, i))
        batch = self._stack(parts)
        metrics = {"on_policy_fraction": float(on.mean())}
        if lengths:
            n_all = np.concatenate(lengths)
            metrics["completions/mean_length"] = float(n_all.mean())
            metrics["completions/clipped_ratio"] = float((n_all >= self.spec.new_tokens).mean())
        tokens = int(np.asarray(jax.device_get((batch.segment_ids > 0).sum())))
        return Rollout(batch, metrics, gen, time.perf_counter() - t0, tokens)


def sampling(cfg: Any, mcfg: ModelConfig, teacher_mcfg: ModelConfig, mesh: jax.sharding.Mesh, eos_ids: tuple,
             compute: Any) -> Sampling:
    """The run's :class:`Sampling` from its config (``distill:``, batch shape, seed)."""
    d = cfg.distill
    spec = RolloutSpec(1, int(d.max_new_tokens), Sampler(float(d.temperature), 0, 1.0), eos_ids)
    return Sampling(mcfg, teacher_mcfg, spec, (cfg.grad_accum, cfg.batch_size // cfg.grad_accum), cfg.data.seq_len,
                    cfg.seed, float(d.lmbda), bool(d.seq_kd), compute, mesh)
