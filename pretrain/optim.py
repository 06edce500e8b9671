"""Optimizer and learning-rate schedule of a training config (optax)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from pretrain.config import TrainConfig


def lr_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """The learning-rate schedule of the config (warmup, then constant/cosine/linear/wsd)."""
    s, peak = cfg.schedule, cfg.optimizer.learning_rate
    floor = peak * s.min_lr_ratio
    decay_steps = max(1, total_steps - s.warmup_steps)
    if s.name == "constant":
        main = optax.constant_schedule(peak)
    elif s.name == "cosine":
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=s.min_lr_ratio)
    elif s.name == "linear":
        main = optax.linear_schedule(peak, floor, decay_steps)
    else:  # wsd: warmup, stable, then decay over the last 20% of steps
        stable = int(0.8 * decay_steps)
        main = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, max(1, decay_steps - stable))], [stable]
        )
    if s.warmup_steps <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, s.warmup_steps), main], [s.warmup_steps])


def build_optimizer(cfg: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Global-norm clipping followed by the configured optax optimizer; with ``model.freeze`` (full fine-tuning),
    the frozen parts of the model get zero updates and no optimizer state (and no gradient:
    pretrain/jit_step.py)."""
    tx = _optimizer(cfg, schedule)
    if not cfg.model.freeze or cfg.lora.rank:  # LoRA trains its adapters alone: the rest is frozen anyway
        return tx
    return _frozen(tx, frozenset(cfg.model.freeze))


def _frozen(tx: optax.GradientTransformation, names: frozenset[str]) -> optax.GradientTransformation:
    """``tx`` on the params' top-level parts not in ``names``; the others get zero updates. The optimizer sees
    each frozen weight as one zero: its state keeps the params' tree (the train state's sharding maps one onto the
    other, pretrain/jit_step.py) with one number a frozen weight in place of its moments (one, not none: Orbax
    saves no empty array), and the clip's norm gets nothing from them."""

    def hide(tree: Any) -> Any:
        if not isinstance(tree, dict):  # optax.tree_map_params's placeholder for the whole params tree
            return tree
        return {k: jax.tree.map(lambda x: jnp.zeros((1,), x.dtype), v) if k in names else v for k, v in tree.items()}

    def init(params: Any) -> optax.OptState:
        return tx.init(hide(params))

    def update(updates: Any, state: optax.OptState, params: Any = None) -> tuple[Any, optax.OptState]:
        out, state = tx.update(hide(updates), state, hide(params))
        return {k: jax.tree.map(jnp.zeros_like, updates[k]) if k in names else v for k, v in out.items()}, state

    return optax.GradientTransformation(init, update)


def _optimizer(cfg: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Global-norm clipping followed by the configured optax optimizer."""
    o = cfg.optimizer
    if o.name == "adamw":
        opt = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    elif o.name == "lion":
        opt = optax.lion(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    elif o.name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(o.weight_decay), optax.sgd(schedule, momentum=o.b1))
    else:
        opt = optax.adafactor(schedule, weight_decay_rate=o.weight_decay or None)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), opt) if o.grad_clip > 0 else opt
