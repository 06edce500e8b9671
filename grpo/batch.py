"""GRPO's model batch (prompt + completion rows with what the clipped surrogate reads beside the tokens) and how
the update lays its rows out."""

from __future__ import annotations

import dataclasses

import jax
from jax.typing import DTypeLike

from eval.rollout_batch import completion_view
from grpo.config import GrpoSection
from pretrain.batch import FLOAT, TokenBatch
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.logps import batch_logps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutBatch(TokenBatch):
    """Prompt + completion rows of an online rollout (eval/rollout.py): the sampler's per-token
    log-probabilities, each row's advantage (broadcast over its tokens; REINFORCE++'s one per token), and, when
    computed, the policy's before the update (``old_logps``) and the reference's (``ref_logps``)."""

    sampler_logps: jax.Array
    advantages: jax.Array
    old_logps: jax.Array | None = None
    ref_logps: jax.Array | None = None

    @classmethod
    def dtypes(cls) -> dict[str, DTypeLike]:
        return {**TokenBatch.dtypes(), "sampler_logps": FLOAT, "advantages": FLOAT, "old_logps": FLOAT,
                "ref_logps": FLOAT}


@dataclasses.dataclass(frozen=True)
class UpdateRows:
    """How the update lays out a step's completions: one row per completion (prompt + completion,
    eval.rollout_batch.assemble), or, ``grouped``, one row per group with its prompt once (assemble_groups)."""

    grouped: bool
    group: int  # G completions a prompt
    prompt_slot: int  # data.seq_len + 1: the prompt's room in a row
    new_tokens: int  # grpo.max_completion_length

    @property
    def segments(self) -> int:
        """The documents a row of the update holds: a group's prompt and its completions, or one."""
        return self.group + 1 if self.grouped else 1

    def completions(self, x: jax.Array) -> jax.Array:
        """A per-position array of the update's rows as one row per completion (eval.rollout_batch.completion_view),
        aligned with the batch's per-completion arrays; as it is with one row per completion."""
        if not self.grouped:
            return x
        return completion_view(x, self.prompt_slot, self.group, self.new_tokens)

    def layout(self, grad_accum: int, micro: int, seq_len: int, fields: tuple[str, ...]) -> RolloutBatch:
        """The step's :class:`RolloutBatch` as ``jax.ShapeDtypeStruct`` s, with the optional ``fields``."""
        t = self.new_tokens
        if not self.grouped:
            return RolloutBatch.layout((grad_accum, micro, seq_len + t), fields)
        # One row per group (eval.rollout_batch.assemble_groups); the per-completion arrays one row per completion.
        G = self.group
        rows = RolloutBatch.layout((grad_accum, micro // G, seq_len + G * (t + 1)), ("prefix_ids",))
        tokens = RolloutBatch.layout((grad_accum, micro, t), fields)
        return dataclasses.replace(tokens, **{k: getattr(rows, k) for k in
                                              ("inputs", "targets", "segment_ids", "positions", "prefix_ids")})


def shares_prompts(g: GrpoSection, mcfg: ModelConfig, mesh: jax.sharding.Mesh, micro: int) -> bool:
    """Whether the update lays each group out in one row with its prompt once (``grpo.share_prompt``): not for
    models with sliding-window layers (their windows count row indices: zoo.model.masks), nor for the splash and cuDNN
    kernels (they cannot read a shared prefix: zoo.kernels.choice), and only with whole groups in every shard of a
    micro-batch (the rows are split over data and fsdp as they are)."""
    shards = int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    G = g.num_generations
    return (g.share_prompt and "sliding" not in mcfg.kinds and mcfg.attention in ("auto", "blockwise")
            and micro % G == 0 and (micro // G) % shards == 0)


def completion_logps(mcfg: ModelConfig, weights: dict | Weights, mb: RolloutBatch, rows: UpdateRows,
                     temperature: float, remat: str = "none",
                     entropy: bool = False) -> tuple[jax.Array, jax.Array, dict | None]:
    """(per-token log-probabilities, entropies (``entropy``; else mean logits), MoE aux or None) of the update's
    rows ``mb`` (one micro-batch's, or any rows laid out alike) under ``weights``, the logits over ``temperature``,
    one row per completion ([rows, T] with the grouped layout: :meth:`UpdateRows.completions`). With images (a
    vision-language model's ``mb.vision``) each image token reads its image's feature: the one pass the loss, the
    old policy's and the reference's log-probabilities all make."""
    vision = None if mb.vision is None or mcfg.vision is None else mb.vision.inputs(mcfg.vision)
    logp, stat, aux = batch_logps(mcfg, weights, mb.arrays(), remat, temperature=temperature, entropy=entropy,
                                  max_segments=rows.segments, vision=vision)
    return rows.completions(logp), rows.completions(stat), aux
