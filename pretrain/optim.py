"""Optimizer and learning-rate schedule of a training config (optax)."""

from __future__ import annotations

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
