"""Rollouts: G sampled completions per prompt with the KV-cache decoder, and the batch a GRPO step trains on.

:func:`sample_group_completions` is one jitted program of fixed shape: the
prompts of a batch (each group's G rows hold the same prompt) are prefilled
once per group, the cache and the last logits are repeated G times, and a
``lax.while_loop`` decodes up to ``max_completion_length`` tokens for every
row, stopping early once every row has ended (EOS). Each drawn token's
log-probability under the sampler's distribution (the logits over the
temperature, before top-k/top-p cut them: the distribution the trainer
computes too) comes back with it. Sampling keys are folded from a key per
step, so the same step of the same run draws the same tokens.

:func:`assemble` lays each row out as prompt + completion (the prompt's
padding removed) and computes the model batch: inputs, targets, segments,
positions, the trained completion tokens as weights, and per-token arrays
aligned with the targets (advantages, the sampler's log-probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eval.generate import Sampler, sample_next
from zoo.config import ModelConfig
from zoo.decode import Cache, cache_shardings, forward_step, init_cache


@dataclass(frozen=True)
class RolloutSpec:
    """The static settings of a rollout (they shape the compiled program)."""

    group: int  # G completions per prompt
    new_tokens: int  # max_completion_length
    sampler: Sampler
    eos_ids: tuple[int, ...]


def _repeat_rows(cache: Cache, g: int) -> Cache:
    """Each row of a cache repeated g times (rows r*g .. r*g+g-1 continue row r)."""
    layers = jax.tree.map(lambda a: jnp.repeat(a, g, axis=1), cache.layers)  # [n, batch, ...]
    return Cache(layers, jnp.repeat(cache.lengths, g, axis=0))


def draw(logits: jax.Array, key: jax.Array, sampler: Sampler) -> tuple[jax.Array, jax.Array]:
    """(next token [b], its log-probability [b] under softmax(logits / temperature)) from logits [b, vocab]: the
    distribution the trainer computes (greedy: the plain softmax's)."""
    tok = sample_next(logits, key, sampler)
    temperature = sampler.temperature if sampler.temperature > 0 else 1.0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


@partial(jax.jit, static_argnums=(0, 4), static_argnames="mesh")
def sample_group_completions(cfg: ModelConfig, params: dict, tokens: jax.Array, valid: jax.Array,
                             spec: RolloutSpec, key: jax.Array, lora: dict | None = None,
                             lora_scale: float | jax.Array | None = None,
                             mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(completions [B, T] int32, their sampler log-probabilities [B, T] float32, lengths [B] int32).

    ``tokens``/``valid`` [B, P]: right-padded prompts, rows ``k*G .. k*G+G-1``
    the same prompt (only row ``k*G`` is read). A completion ends with its
    first token of ``spec.eos_ids`` (counted in its length) or at T tokens;
    entries past its length are 0. ``lora`` adapters (with ``lora_scale``) run
    beside the base matmuls, as in the training forward pass. With ``mesh``
    (static: the train step's) the cache is laid out as :func:`zoo.decode.init_cache`
    lays it out there (split like the kv heads), the layout ``--compile-only``
    reports. The weights stay as they come: with the rows unconstrained, the
    partitioner contracts FSDP's embed split in place (all-reduces of
    activations), gathering no weight (checked on v5e:2x4's compiled sampler).
    """
    adapters: dict[str, Any] = {"lora": lora, "lora_scale": lora_scale}
    b, p = tokens.shape
    g, t = spec.group, spec.new_tokens
    first_tokens, first_valid = tokens[::g], valid[::g]
    cache = init_cache(cfg, b // g, p + t, params["embed"].dtype, mesh)
    last = jnp.maximum(first_valid.sum(1) - 1, 0)
    logits, cache = forward_step(cfg, params, first_tokens, cache, first_valid, fresh=True, last=last, **adapters)
    logits, cache = jnp.repeat(logits, g, axis=0), _repeat_rows(cache, g)
    if mesh is not None:  # the b rows' cache, laid out as the step reads it
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cfg, b, p + t, mesh))
    eos = jnp.asarray(spec.eos_ids or (-1,), jnp.int32)

    tok, logp = draw(logits, jax.random.fold_in(key, 0), spec.sampler)
    out = jnp.zeros((b, t), jnp.int32).at[:, 0].set(tok)
    out_logp = jnp.zeros((b, t), jnp.float32).at[:, 0].set(logp)
    done = jnp.isin(tok, eos)

    def more(carry):
        i, _, _, _, _, done = carry
        return (i < t) & ~jnp.all(done)

    def step(carry):
        i, tok, cache, out, out_logp, done = carry
        logits, cache = forward_step(cfg, params, tok[:, None], cache, **adapters)
        nxt, logp = draw(logits[:, 0], jax.random.fold_in(key, i), spec.sampler)
        # Rows that have ended keep decoding (one shape for all) but write nothing.
        nxt, logp = jnp.where(done, 0, nxt), jnp.where(done, 0.0, logp)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        out_logp = jax.lax.dynamic_update_slice(out_logp, logp[:, None], (0, i))
        return i + 1, nxt, cache, out, out_logp, done | jnp.isin(nxt, eos)

    _, _, _, out, out_logp, _ = jax.lax.while_loop(more, step, (jnp.int32(1), tok, cache, out, out_logp, done))
    ended = jnp.isin(out, eos)
    first_end = jnp.argmax(ended, axis=1)
    lengths = jnp.where(ended.any(1), first_end + 1, t).astype(jnp.int32)
    keep = jnp.arange(t)[None] < lengths[:, None]
    return jnp.where(keep, out, 0), jnp.where(keep, out_logp, 0.0), lengths


def assemble(tokens: jax.Array, valid: jax.Array, completions: jax.Array, lengths: jax.Array,
             per_token: dict[str, jax.Array], per_row: dict[str, jax.Array],
             trained: jax.Array, model: jax.Array | None = None) -> dict[str, jax.Array]:
    """The model batch of prompt + completion rows ([B, P + T - 1] each, ready for the loss).

    ``tokens``/``valid`` [B, P] right-padded prompts, ``completions`` [B, T]
    with ``lengths`` [B]. ``per_token`` arrays [B, T] (one value per
    completion token) come back aligned with the targets (0 elsewhere),
    ``per_row`` arrays [B] broadcast over each row. ``trained`` [B] bool:
    rows whose completion tokens are weighted (the others weigh nothing,
    e.g. truncated completions with ``grpo.mask_truncated``). ``model`` [B, T]
    bool: which completion tokens the policy chose (the others, a tool's
    answer in an episode, weigh nothing); None: all of them.
    """
    b, p = tokens.shape
    t = completions.shape[1]
    n = p + t
    idx = jnp.arange(n)[None]
    p_len = valid.sum(1)[:, None]
    in_prompt = idx < p_len
    ci = idx - p_len  # the completion token at each position
    in_completion = (ci >= 0) & (ci < lengths[:, None])
    ci = jnp.clip(ci, 0, t - 1)
    row = jnp.where(in_prompt, jnp.take_along_axis(tokens, jnp.minimum(idx, p - 1).repeat(b, 0), axis=1),
                    jnp.where(in_completion, jnp.take_along_axis(completions, ci, axis=1), 0))
    seg = (in_prompt | in_completion).astype(jnp.int32)
    target_completion = in_completion[:, 1:]
    out = {
        "inputs": row[:, :-1].astype(jnp.int32),
        "targets": row[:, 1:].astype(jnp.int32),
        "segment_ids": seg[:, :-1],
        "positions": jnp.where(seg > 0, idx, 0)[:, :-1].astype(jnp.int32),
        "weights": (target_completion & trained[:, None]).astype(jnp.float32),
    }
    at = ci[:, 1:]
    if model is not None:
        chosen = jnp.take_along_axis(model, at, axis=1) & target_completion
        out["weights"] = out["weights"] * chosen.astype(jnp.float32)
    for name, x in per_token.items():
        out[name] = jnp.where(target_completion, jnp.take_along_axis(x, at, axis=1), 0).astype(x.dtype)
    for name, x in per_row.items():
        out[name] = jnp.broadcast_to(x[:, None], (b, n - 1)).astype(x.dtype)
    return out
