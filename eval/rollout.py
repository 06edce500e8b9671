"""Rollouts: G sampled completions per prompt with the KV-cache decoder, and the batch a GRPO step trains on.

:func:`sample_group_completions` is one jitted program of fixed shape: the
prompts of a batch (each group's G rows hold the same prompt) are prefilled
once per group, the cache and the last logits are repeated G times, and a
``lax.while_loop`` decodes up to ``max_completion_length`` tokens for every
row, stopping early once every row has ended (EOS). Each drawn token's
log-probability under the sampler's distribution (the logits over the
temperature, before top-k/top-p cut them: the distribution the trainer
computes too) comes back with it. A vision-language model's image token is
never drawn (:func:`draw`'s mask; its log-probabilities stay unmasked). Sampling keys are folded from a key per
step, so the same step of the same run draws the same tokens.

:func:`assemble` lays each row out as prompt + completion (the prompt's
padding removed) and computes the model batch: inputs, targets, segments,
positions, the trained completion tokens as weights, and per-token arrays
aligned with the targets (advantages, the sampler's log-probabilities).

:class:`RolloutEngine` is the sampler of online training (GRPO's rollouts,
GKD's sampled completions): its programs run :func:`sample_group_completions`
on the weights as the train step computes with them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eval.generate import Sampler, sample_next
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decode import Cache, cache_shardings, forward_step, init_cache, kv_cache_bytes
from zoo.model.vision import VisionInputs

VIEW_BLOCK = 16  # decoding steps per block of the rollout's loop: each block reads the cache slots it can have filled


@dataclass(frozen=True)
class RolloutSpec:
    """The static settings of a rollout (they shape the compiled program)."""

    group: int  # G completions per prompt
    new_tokens: int  # max_completion_length
    sampler: Sampler
    eos_ids: tuple[int, ...]
    # Token ids never drawn (a vision-language model's image token: drawn, the update's forward would read it as an
    # image slot with no image behind it). :class:`RolloutEngine` adds its model's; :func:`draw` masks them.
    banned_ids: tuple[int, ...] = ()


def _repeat_rows(cache: Cache, g: int) -> Cache:
    """Each row of a cache repeated g times (rows r*g .. r*g+g-1 continue row r)."""
    layers = jax.tree.map(lambda a: jnp.repeat(a, g, axis=1), cache.layers)  # [n, batch, ...]
    delta = None if cache.rope_delta is None else jnp.repeat(cache.rope_delta, g, axis=0)
    return Cache(layers, jnp.repeat(cache.lengths, g, axis=0), delta)


def draw(logits: jax.Array, key: jax.Array, sampler: Sampler,
         banned: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """(next token [b], its log-probability [b] under softmax(logits / temperature)) from logits [b, vocab]: the
    distribution the trainer computes (greedy: the plain softmax's). The ``banned`` ids are never drawn (their
    logits -inf, greedy too); like top-k's and top-p's cuts, the mask shapes the draw, not the log-probability,
    which stays the unmasked distribution's, as the update computes it (the masked mass of an image token is
    what the policy puts there, and its gradient is the update's to see)."""
    cut = logits.at[:, jnp.asarray(banned, jnp.int32)].set(-jnp.inf) if banned else logits
    tok = sample_next(cut, key, sampler)
    temperature = sampler.temperature if sampler.temperature > 0 else 1.0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


@partial(jax.jit, static_argnums=(0, 4), static_argnames="mesh")
def sample_group_completions(cfg: ModelConfig, params: dict | Weights, tokens: jax.Array, valid: jax.Array,
                             spec: RolloutSpec, key: jax.Array, mesh: Mesh | None = None,
                             vision: VisionInputs | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(completions [B, T] int32, their sampler log-probabilities [B, T] float32, lengths [B] int32).

    ``tokens``/``valid`` [B, P]: right-padded prompts, rows ``k*G .. k*G+G-1``
    the same prompt (only row ``k*G`` is read). A completion ends with its
    first token of ``spec.eos_ids`` (counted in its length) or at T tokens;
    entries past its length are 0. ``params``: a model's, or :class:`zoo.lora.weights.Weights`
    whose LoRA adapters run beside the base matmuls, as in the training forward pass. With ``mesh``
    (static: the train step's) the cache is laid out as :func:`zoo.model.decode.init_cache`
    lays it out there (split like the kv heads), the layout ``--compile-only``
    reports. The weights stay as they come: with the rows unconstrained, the
    partitioner contracts FSDP's embed split in place (all-reduces of
    activations), gathering no weight (checked on v5e:2x4's compiled sampler). ``vision``: a vision-language
    model's images of the B rows ([B, ...] each, a group's rows alike; only row ``k*G``'s are read), in the
    prefill as the training forward reads them.
    """
    b, p = tokens.shape
    g, t = spec.group, spec.new_tokens
    first_tokens, first_valid = tokens[::g], valid[::g]
    cache = init_cache(cfg, b // g, p + t, Weights.wrap(params).base["embed"].dtype, mesh)
    last = jnp.maximum(first_valid.sum(1) - 1, 0)
    first_vision = None if vision is None else jax.tree.map(lambda a: a[::g], vision)
    logits, cache = forward_step(cfg, params, first_tokens, cache, first_valid, fresh=True, last=last,
                                 vision=first_vision)
    logits, cache = jnp.repeat(logits, g, axis=0), _repeat_rows(cache, g)
    if mesh is not None:  # the b rows' cache, laid out as the step reads it
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cfg, b, p + t, mesh))
    eos = jnp.asarray(spec.eos_ids or (-1,), jnp.int32)

    tok, logp = draw(logits, jax.random.fold_in(key, 0), spec.sampler, spec.banned_ids)
    out = jnp.zeros((b, t), jnp.int32).at[:, 0].set(tok)
    out_logp = jnp.zeros((b, t), jnp.float32).at[:, 0].set(logp)
    done = jnp.isin(tok, eos)

    def block(end: int):
        # Steps i < end append token i - 1: no row holds more than p + end - 1 tokens, so the cache slots past them
        # are not read (zoo.model.decode.forward_step's view).
        view = min(p + end - 1, p + t)

        def more(carry):
            i, _, _, _, _, done = carry
            return (i < end) & ~jnp.all(done)

        def step(carry):
            i, tok, cache, out, out_logp, done = carry
            logits, cache = forward_step(cfg, params, tok[:, None], cache, view=view)
            nxt, logp = draw(logits[:, 0], jax.random.fold_in(key, i), spec.sampler, spec.banned_ids)
            # Rows that have ended keep decoding (one shape for all) but write nothing.
            nxt, logp = jnp.where(done, 0, nxt), jnp.where(done, 0.0, logp)
            out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
            out_logp = jax.lax.dynamic_update_slice(out_logp, logp[:, None], (0, i))
            return i + 1, nxt, cache, out, out_logp, done | jnp.isin(nxt, eos)

        return lambda carry: jax.lax.while_loop(more, step, carry)

    carry = (jnp.int32(1), tok, cache, out, out_logp, done)
    # The loop in blocks of VIEW_BLOCK steps, each reading only the slots its steps can have filled; a block whose
    # rows have all ended runs no step.
    for end in range(min(VIEW_BLOCK, t), t + VIEW_BLOCK, VIEW_BLOCK):
        carry = block(min(end, t))(carry)
    _, _, _, out, out_logp, _ = carry
    ended = jnp.isin(out, eos)
    first_end = jnp.argmax(ended, axis=1)
    lengths = jnp.where(ended.any(1), first_end + 1, t).astype(jnp.int32)
    keep = jnp.arange(t)[None] < lengths[:, None]
    return jnp.where(keep, out, 0), jnp.where(keep, out_logp, 0.0), lengths


class RolloutEngine:
    """One model's sampler for online training: jitted programs that complete a batch of prompts (G completions
    each, :func:`sample_group_completions`) from the weights as the train step computes with them (cast to
    ``compute``, LoRA adapters beside), the KV cache laid out on ``mesh`` as the step's batch is."""

    def __init__(self, mcfg: ModelConfig, compute: Any, mesh: Mesh):
        self.mcfg, self.compute, self.mesh = mcfg, compute, mesh

    def program(self, spec: RolloutSpec, prompts: Callable[..., tuple[jax.Array, jax.Array]],
                key_of: Callable[[Any], jax.Array] = lambda key: key,
                images: Callable[[Any], VisionInputs] = lambda v: v) -> Any:
        """The jitted ``(weights, key_input, *inputs, vision=None) -> (completions, sampler log-probabilities,
        lengths)``: ``prompts(*inputs)`` gives the right-padded prompts and their valid mask ([B, P] each: how a
        task's rows hold them), ``key_of(key_input)`` the sampling key (derived inside the program: a step number,
        say), ``images(vision)`` the prompts' images as the model reads them ([B, ...] each; vision None: none);
        ``weights``: a model's params, or :class:`zoo.lora.weights.Weights` (LoRA's adapters beside their base).
        A vision-language model never draws its image token (``spec.banned_ids`` gains it): a completion holding
        one would have the update's forward read it as an image slot."""
        if self.mcfg.vision is not None and self.mcfg.vision.image_token_id not in spec.banned_ids:
            spec = replace(spec, banned_ids=(*spec.banned_ids, self.mcfg.vision.image_token_id))

        def run(weights: dict | Weights, key_input: Any, *inputs: Any,
                vision: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
            tokens, valid = prompts(*inputs)
            return sample_group_completions(self.mcfg, Weights.wrap(weights).cast(self.compute), tokens, valid, spec,
                                            key_of(key_input), mesh=self.mesh,
                                            vision=None if vision is None else images(vision))

        return jax.jit(run)

    def kv_cache_bytes(self, rows: int, prompt: int, spec: RolloutSpec) -> int:
        """Bytes a chip holds of a program's KV cache for ``rows`` rows of ``prompt``-token prompts."""
        return kv_cache_bytes(self.mcfg, rows, prompt + spec.new_tokens, self.compute, self.mesh)


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


def assemble_groups(tokens: jax.Array, valid: jax.Array, completions: jax.Array, lengths: jax.Array,
                    per_token: dict[str, jax.Array], per_row: dict[str, jax.Array], trained: jax.Array,
                    group: int, model: jax.Array | None = None) -> dict[str, jax.Array]:
    """The model batch of :func:`assemble` with each group's prompt in its row once: one row per group,
    ``[prompt[:-1] | prompt[-1] + completion 1 | ... | prompt[-1] + completion G]`` (DPO's shared-prompt layout,
    prefs/pairs.py).

    The prompt's tokens but its last are segment ``G + 1``, at the row's start; completion j is segment j + 1 in
    a slot of its own at the fixed offset ``P - 1 + j (T + 1)``, opened by the prompt's last token (whose output
    predicts the completion's first), with positions continuing the prompt's. Each completion attends to the
    prompt segment as its shared prefix (``prefix_ids``) and to its own earlier tokens, never to another
    completion, so its tokens see exactly the context of its own :func:`assemble` row, and a group costs
    ``P - 1 + G (T + 1)`` tokens instead of ``G (P + T - 1)``.

    The row arrays (inputs, targets, segments, positions, prefix ids) are [B / G, P - 1 + G (T + 1)]; the
    per-completion arrays (``weights``, ``per_token``, ``per_row``) are [B, T], completion token k of row r
    at [r, k]: what :func:`completion_view` makes of a per-position array of the rows. Arguments as
    :func:`assemble`'s; rows ``k G .. k G + G - 1`` hold the same prompt (only row ``k G``'s is read).
    """
    b, p = tokens.shape
    t = completions.shape[1]
    groups = b // group
    tok, ok = tokens[::group], valid[::group]
    p_len = ok.sum(1)  # [groups]
    # The prompt's first p_len - 1 tokens (right-padded prompts: they are the first ones), then its padding.
    head_idx = jnp.arange(p - 1)[None]
    in_head = head_idx < (p_len[:, None] - 1)
    head = jnp.where(in_head, tok[:, :p - 1], 0)
    last = jnp.take_along_axis(tok, jnp.maximum(p_len - 1, 0)[:, None], axis=1)  # [groups, 1]
    comp = completions.reshape(groups, group, t)
    k = jnp.arange(t + 1)[None, None]  # the slot's index: 0 the prompt's last token, k the completion's k-th
    in_slot = k <= lengths.reshape(groups, group)[..., None]
    slot_tok = jnp.concatenate([jnp.broadcast_to(last[:, None], (groups, group, 1)), comp], axis=2)
    slot_tok = jnp.where(in_slot, slot_tok, 0)
    slot_seg = jnp.where(in_slot, jnp.arange(1, group + 1)[None, :, None], 0)
    slot_pos = jnp.where(in_slot, p_len[:, None, None] - 1 + k, 0)
    prompt_seg = group + 1
    row = jnp.concatenate([head, slot_tok.reshape(groups, -1), jnp.zeros((groups, 1), head.dtype)], axis=1)
    seg = jnp.concatenate([jnp.where(in_head, prompt_seg, 0), slot_seg.reshape(groups, -1)], axis=1)
    pos = jnp.concatenate([jnp.where(in_head, head_idx, 0), slot_pos.reshape(groups, -1)], axis=1)
    prefix = jnp.concatenate([jnp.zeros_like(head), jnp.where(in_slot, prompt_seg, 0).reshape(groups, -1)], axis=1)
    completion = jnp.arange(t)[None] < lengths[:, None]  # [B, T]
    weights = completion & trained[:, None]
    if model is not None:
        weights = weights & model
    out = {
        "inputs": row[:, :-1].astype(jnp.int32),
        "targets": row[:, 1:].astype(jnp.int32),
        "segment_ids": seg.astype(jnp.int32),
        "positions": pos.astype(jnp.int32),
        "prefix_ids": prefix.astype(jnp.int32),
        "weights": weights.astype(jnp.float32),
    }
    for name, x in per_token.items():
        out[name] = jnp.where(completion, x, 0).astype(x.dtype)
    for name, x in per_row.items():
        out[name] = jnp.broadcast_to(x[:, None], (b, t)).astype(x.dtype)
    return out


def completion_view(x: jax.Array, prompt_slot: int, group: int, new_tokens: int) -> jax.Array:
    """A per-position array of :func:`assemble_groups`' rows ([groups, P - 1 + G (T + 1)], P = ``prompt_slot``)
    as its completions' tokens [groups * G, T]: the value at the position whose target is completion token k."""
    groups = x.shape[0]
    slots = x[:, prompt_slot - 1:].reshape((groups, group, new_tokens + 1) + x.shape[2:])
    return slots[:, :, :new_tokens].reshape((groups * group, new_tokens) + x.shape[2:])
