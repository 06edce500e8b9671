"""The batch an online trainer's update reads from its rollouts (GRPO's, GKD's sampled completions).

:func:`assemble` lays each row out as prompt + completion (the prompt's padding removed) and computes the model
batch: inputs, targets, segments, positions, the trained completion tokens as weights, and per-token arrays
aligned with the targets (advantages, the sampler's log-probabilities). :func:`assemble_groups` holds each group's
prompt once (DPO's shared-prompt layout); :func:`completion_view` reads a per-position array of those rows back as
their completions' tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
