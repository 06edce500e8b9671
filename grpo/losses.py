"""GRPO's advantages, per-token policy loss, KL and clip metrics, with TRL 1.16's GRPOTrainer formulas.

Pure ``jax.numpy`` functions in float32, jit-friendly (every shape is static; the
string and ``beta`` arguments are Python values of the config). They follow
``GRPOTrainer._generate_and_score_completions`` (advantages) and
``GRPOTrainer._compute_loss`` (loss, KL, metrics) of TRL 1.16 term by term.

Papers:

* GRPO — Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical
  Reasoning in Open Language Models" (arXiv:2402.03300): group-relative
  advantages ``(r - mean_group) / std_group``, the PPO-style clipped ratio, a k3
  KL penalty to a reference, and the per-sequence token mean
  (``loss_type: grpo``).
* Dr. GRPO — Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective" (arXiv:2503.20783): no std division (``scale_rewards: none``) and
  a constant normalizer ``batch * max_completion_length`` instead of each
  sequence's length, removing GRPO's length and difficulty biases
  (``loss_type: dr_grpo``).
* DAPO — Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
  at Scale" (arXiv:2503.14476): the token-level loss (every completion token of
  the batch weighs the same, ``loss_type: dapo``) and clip-higher (a larger
  upper clip ``epsilon_high``).
* BNPO — Xiao et al. 2025, "BNPO: Beta Normalization Policy Optimization"
  (arXiv:2506.02864); TRL's ``bnpo`` is a token mean per (local) batch
  (``loss_type: bnpo``, see :func:`loss_sum_count`).
* GSPO — Zheng et al. 2025, "Group Sequence Policy Optimization"
  (arXiv:2507.18071): one importance ratio per sequence, the exponential of the
  mean per-token log-ratio (``importance_sampling_level: sequence``).
* CISPO — MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
  Lightning Attention" (arXiv:2506.13585): the importance weight itself clipped
  (above at ``epsilon_high``) and detached, times ``A * logp``: every token keeps
  a gradient (``loss_type: cispo``, normalized as dapo).
* SAPO — Gao et al. 2025, "Soft Adaptive Policy Optimization"
  (arXiv:2511.20347): a sigmoid gate ``sigmoid(tau (ratio - 1)) * 4 / tau``
  instead of the hard clip, ``tau`` by the advantage's sign (``loss_type:
  sapo``, normalized as grpo).
* LUSPO — the clipped surrogate summed over each completion's tokens and averaged
  over completions, no length normalization (``loss_type: luspo``; TRL
  recommends ``importance_sampling_level: sequence``).
* VESPO — a gamma weight ``phi(w) = exp(lambda + k log w - lambda w)`` of the
  sequence's importance ratio ``w`` (its summed log-ratio), ``k`` and ``lambda`` by
  the advantage's sign, detached, times ``A * logp`` (``loss_type: vespo``,
  normalized as dapo).
* The KL estimator k3 — Schulman 2020, "Approximating KL Divergence"
  (http://joschu.net/blog/kl-approx.html): ``exp(ref - logp) - (ref - logp) - 1``,
  unbiased for KL(pi || ref) on samples of pi and never negative.

A global batch is processed in micro-batches: :func:`loss_sum_count` and
:func:`masked_mean_sums` return a (sum, count) pair per micro-batch, and the
caller divides the sums of the pairs, ``sum / max(count, 1)``, which is TRL's
whole-batch value (``bnpo``: TRL's per-micro-batch mean, see there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from grpo.config import IMPORTANCE_LEVELS, LOSS_TYPES, SCALE_REWARDS, GrpoSection

STD_EPS = 1e-4  # TRL adds it to the std before dividing (not a max): a zero-std group's advantages stay 0
# The loss types whose surrogate is PPO's clipped ratio (TRL logs its clip_ratio/* metrics for these only).
CLIPPED = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")
VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's floor of the sequence's log importance weight


@dataclass(frozen=True)
class LossKnobs:
    """The surrogate's settings beyond the clip range (TRL 1.16 GRPOConfig's names; their defaults are
    grpo/config.py ``GrpoSection``'s): which loss, and the SAPO temperatures and VESPO gamma parameters (read by
    those loss types only)."""

    loss_type: str
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float

    @classmethod
    def of(cls, section: Any = None) -> LossKnobs:
        """The knobs of a ``grpo:`` config section (grpo/config.py ``GrpoSection``; None: its defaults)."""
        section = GrpoSection() if section is None else section
        return cls(**{k: getattr(section, k) for k in cls.__dataclass_fields__})


def _nan_mean_std(x: jax.Array, axis: int | None) -> tuple[jax.Array, jax.Array]:
    """Mean and unbiased (Bessel-corrected) std over ``axis``, NaN entries left out (TRL's nanmean and nanstd;
    NaN where fewer than two values are left, as there).

    The values are shifted by one of them first (the largest) before averaging: equal rewards then give
    exactly zero deviations, so a tied group's std is exactly 0 and its advantages exactly 0, whatever the
    rewards' values (0.1 summed four times is not 4 * 0.1 in float32); otherwise the same mean and std."""
    valid = ~jnp.isnan(x)
    shift = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis, keepdims=True)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)  # an all-NaN group: anything finite
    d = jnp.where(valid, x - shift, 0.0)
    n = valid.sum(axis=axis, keepdims=True).astype(jnp.float32)
    mean_d = d.sum(axis=axis, keepdims=True) / n  # NaN for an all-NaN group, as torch.nanmean
    var = jnp.where(valid, (d - mean_d) ** 2, 0.0).sum(axis=axis, keepdims=True) / (n - 1.0)
    std = jnp.where(n > 1, jnp.sqrt(var), jnp.nan)
    return shift + mean_d, std


def advantages(rewards: jax.Array, group: int, scale: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Group-relative advantages of a batch's completions (TRL's ``sum_then_normalize``).

    ``rewards`` [B], B a multiple of ``group``; consecutive ``group`` rows are one prompt's completions.
    ``adv = r - mean(group)``, divided by ``std + 1e-4`` unless ``scale == "none"``; std is the unbiased std
    of the row's group (``scale`` "group" or "none") or of the whole batch ("batch"). NaN rewards (a completion
    no reward function could score) are left out of the means and stds and get advantage 0, as in TRL.

    Returns per-row [B] float32 arrays: ``(adv, std, zero_std)``; ``zero_std`` is ``isclose(std, 0)`` with
    torch's defaults (rtol 1e-5, atol 1e-8), the rows whose group carries no learning signal (logged)."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale!r}")
    r = jnp.asarray(rewards, jnp.float32)
    (b,) = r.shape
    if b % group:
        raise ValueError(f"{b} rewards are not a whole number of groups of {group}")
    grouped = r.reshape(b // group, group)
    mean, group_std = _nan_mean_std(grouped, axis=1)
    mean = jnp.repeat(mean[:, 0], group)
    if scale == "batch":
        # TRL: one std for the whole batch (0 for a single reward, never the case with group >= 2)
        std = _nan_mean_std(r, axis=None)[1].reshape(()) if b > 1 else jnp.float32(0.0)
        std = jnp.broadcast_to(std, (b,))
    else:  # "group", and "none" where it only feeds the zero-std flag
        std = jnp.repeat(group_std[:, 0], group) if group > 1 else jnp.zeros((b,), jnp.float32)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + STD_EPS)
    zero_std = jnp.isclose(std, 0.0, rtol=1e-5, atol=1e-8)
    return jnp.nan_to_num(adv, nan=0.0), std, zero_std


def token_terms(logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None, adv: jax.Array,
                mask: jax.Array, epsilon_low: float, epsilon_high: float, beta: float,
                level: str, knobs: LossKnobs | None = None,
                is_ratio: jax.Array | None = None) -> dict[str, jax.Array]:
    """The per-token terms of GRPO's loss for a micro-batch: [B, T] float32 arrays in a dict.

    ``logp``, ``old_logp``, ``ref_logp`` [B, T]: each completion token's log-probability under the policy
    being trained, the policy that sampled it (``jax.lax.stop_gradient(logp)`` at num_iterations 1: the ratio
    is then 1 with the gradient of ``logp``) and the reference; ``adv`` [B] (or [B, T]); ``mask`` [B, T], 1 on
    the tokens that train. ``level`` "token": the ratio of each token, ``exp(logp - old_logp)``; "sequence"
    (GSPO): ``exp`` of the row's masked mean log-ratio (count clamped at 1), the same for every token of the row.

    * ``loss``, not yet masked nor normalized (:func:`loss_sum_count`), by ``knobs.loss_type`` (TRL 1.16's
      ``_compute_loss``): the clipped types (:data:`CLIPPED`) ``-min(ratio * A, clip(ratio, 1 - epsilon_low,
      1 + epsilon_high) * A)``; cispo ``-sg(min(ratio, epsilon_high)) * A * logp``; sapo ``-sigmoid(tau (ratio
      - 1)) * 4 / tau * A``; vespo ``-sg(phi) * A * logp`` (:func:`vespo_weights`); each times ``is_ratio``
      (the sampler correction, :func:`sampler_ratio`, [B, T] or [B, 1]; vespo folds it into its weight instead),
      then ``+ beta * kl``;
    * ``kl``: k3, ``exp(ref - logp) - (ref - logp) - 1`` on the completion tokens, 0 on padding (zeros when
      ``beta == 0`` or ``ref_logp`` is None; ``beta`` is the config's Python float, not a traced value);
    * the loss type's clip metrics, 1.0 where TRL counts one: clipped types ``low_clip``, ``high_clip``,
      ``region_clip`` (``ratio < 1 - epsilon_low`` with ``A < 0``, ``ratio > 1 + epsilon_high`` with ``A > 0``,
      either); cispo ``cispo_clip`` (``ratio > epsilon_high`` with ``A > 0``); vespo ``phi`` (the row's weight on
      each of its tokens). At the sequence level TRL logs the clip metrics per sequence, not per token:
      :func:`masked_mean_sums` of ``x[:, :1]`` with a mask of ones reproduces it (``phi``: always so)."""
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_LEVELS}, got {level!r}")
    knobs = LossKnobs.of() if knobs is None else knobs  # the config's defaults (dapo)
    loss_type = knobs.loss_type
    logp = jnp.asarray(logp, jnp.float32)
    old_logp = jnp.asarray(old_logp, jnp.float32)
    mask = jnp.asarray(mask)
    m = mask.astype(bool)
    adv = jnp.asarray(adv, jnp.float32)
    a = adv[:, None] if adv.ndim == 1 else adv
    # Padding positions may hold anything (even -inf): where, not a product with the mask, keeps them out.
    token_log_ratio = jnp.where(m, logp - old_logp, 0.0)
    log_ratio = token_log_ratio
    if level == "sequence":
        count = jnp.maximum(m.sum(-1, keepdims=True).astype(jnp.float32), 1.0)
        log_ratio = jnp.broadcast_to(log_ratio.sum(-1, keepdims=True) / count, logp.shape)
    ratio = jnp.exp(log_ratio)
    out: dict[str, jax.Array] = {}
    if loss_type == "cispo":
        loss = -jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high)) * a * jnp.where(m, logp, 0.0)
        out["cispo_clip"] = ((ratio > epsilon_high) & (a > 0)).astype(jnp.float32)
    elif loss_type == "sapo":
        tau = jnp.where(a > 0, knobs.sapo_temperature_pos, knobs.sapo_temperature_neg)
        loss = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * a
    elif loss_type == "vespo":
        phi = jax.lax.stop_gradient(vespo_weights(token_log_ratio, m, a, knobs, is_ratio))
        loss = -phi * a * jnp.where(m, logp, 0.0)
        out["phi"] = jnp.broadcast_to(phi, logp.shape)
    elif loss_type in CLIPPED:
        clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        loss = -jnp.minimum(ratio * a, clipped * a)
        low = (ratio < 1.0 - epsilon_low) & (a < 0)
        high = (ratio > 1.0 + epsilon_high) & (a > 0)
        out |= {"low_clip": low.astype(jnp.float32), "high_clip": high.astype(jnp.float32),
                "region_clip": (low | high).astype(jnp.float32)}
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if is_ratio is not None and loss_type != "vespo":
        loss = loss * jax.lax.stop_gradient(is_ratio)
    if ref_logp is None or beta == 0:
        kl = jnp.zeros_like(logp)
    else:
        diff = jnp.where(m, jnp.asarray(ref_logp, jnp.float32) - logp, 0.0)  # float32 even for bf16 inputs
        kl = jnp.exp(diff) - diff - 1.0
        loss = loss + beta * kl
    return {"loss": loss, "kl": kl, **out}


def vespo_weights(log_ratio: jax.Array, mask: jax.Array, adv: jax.Array, knobs: LossKnobs,
                  is_ratio: jax.Array | None = None) -> jax.Array:
    """VESPO's gamma weight of each row (TRL 1.16 ``GRPOTrainer.get_gamma_weights``): ``w = exp(clip(sum of the
    row's token log-ratios, each clipped to [-20, 20], plus the sum of the token sampler corrections' logs
    ``is_ratio`` [B, T], each clipped to [log 1e-8, 20]), log 1e-8, 20))``,
    ``phi = exp(lambda + k log w - lambda w)`` (1 at w = 1), ``k`` and ``lambda`` (at least 1e-4) the ``_pos``
    knobs where ``A >= 0``, else the ``_neg`` ones; NaN and infinities become 0. ``log_ratio`` [B, T] (0 off the
    mask), ``mask`` [B, T] bool, ``adv`` [B, 1] or [B, T]. Returns [B, 1] (or [B, T] for per-token advantages)."""
    seq = jnp.where(mask, jnp.clip(log_ratio, -20.0, 20.0), 0.0).sum(-1, keepdims=True)
    if is_ratio is not None:  # TRL sums them over every position (the padding's ratio is 1: log 0)
        seq = seq + jnp.clip(jnp.log(is_ratio), VESPO_LOG_W_MIN, 20.0).sum(-1, keepdims=True)
    log_w = jnp.clip(seq, VESPO_LOG_W_MIN, 20.0)
    nonneg = adv >= 0
    k = jnp.where(nonneg, knobs.vespo_k_pos, knobs.vespo_k_neg)
    lam = jnp.maximum(jnp.where(nonneg, knobs.vespo_lambda_pos, knobs.vespo_lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def sampler_ratio(old_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array, mode: str,
                  clip_min: float | None, clip_max: float | None) -> jax.Array:
    """The importance weights that correct for the sampler's distribution (TRL 1.16 GRPOTrainer's
    ``vllm_importance_sampling_correction``): ``exp(old - sampler)`` of each completion token (0 off ``mask``; a NaN
    difference counts as 0), or of each completion's summed difference (``sequence_*`` modes, [B, 1]); ``*_truncate``
    clips them to ``[clip_min, clip_max]``, ``*_mask`` sets those outside it to 0 (None: no bound)."""
    m = jnp.asarray(mask).astype(bool)
    diff = jnp.where(m, jnp.asarray(old_logp, jnp.float32) - jnp.asarray(sampler_logp, jnp.float32), 0.0)
    diff = jnp.nan_to_num(diff, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    ratio = jnp.exp(diff)
    if mode.endswith("truncate"):
        return jnp.clip(ratio, clip_min, clip_max)
    low = -jnp.inf if clip_min is None else clip_min
    high = jnp.inf if clip_max is None else clip_max
    return jnp.where((ratio < low) | (ratio > high), 0.0, ratio)


def loss_sum_count(loss: jax.Array, mask: jax.Array, loss_type: str,
                   max_completion_length: int) -> tuple[jax.Array, jax.Array]:
    """One micro-batch's share of the loss as a (sum, count) pair of float32 scalars.

    Over the micro-batches of a global batch, ``sum(sums) / max(sum(counts), 1)`` is the loss as TRL defines it
    on the whole batch (``loss`` [B, T] from :func:`token_terms`, ``mask`` [B, T]):

    * ``grpo``: the mean over rows of each row's masked token mean (count clamped at 1): sum = the row means'
      sum, count = rows;
    * ``dr_grpo``: the masked token sum over ``rows * max_completion_length``: sum = token sum, count = rows *
      max_completion_length;
    * ``dapo``: the masked token sum over the number of completion tokens: sum = token sum, count = mask sum;
    * ``luspo``: the masked token sum over rows (each completion's token sum, averaged over completions): sum =
      token sum, count = rows;
    * ``cispo``, ``vespo``: as ``dapo``; ``sapo``: as ``grpo``;
    * ``bnpo``: TRL normalizes by the tokens of its LOCAL batch (one micro-batch of one process) and averages
      the micro-batches' losses over gradient accumulation; so sum = this micro-batch's token mean (its token
      sum over its mask sum, clamped at 1), count = 1, and the combination is the mean over micro-batches of
      per-micro-batch token means, which changes with the micro-batching (``dapo`` is the batch-wide version).
      A micro-batch here is the global one, over every device (TRL's local batch is one process's)."""
    m = jnp.asarray(mask).astype(bool)
    per_token = jnp.where(m, jnp.asarray(loss, jnp.float32), 0.0)
    tokens = m.sum().astype(jnp.float32)
    rows = float(m.shape[0])
    if loss_type in ("grpo", "sapo"):
        row_tokens = jnp.maximum(m.sum(-1).astype(jnp.float32), 1.0)
        return (per_token.sum(-1) / row_tokens).sum(), jnp.float32(rows)
    if loss_type == "dr_grpo":
        return per_token.sum(), jnp.float32(rows * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        return per_token.sum(), tokens
    if loss_type == "luspo":
        return per_token.sum(), jnp.float32(rows)
    if loss_type == "bnpo":
        return per_token.sum() / jnp.maximum(tokens, 1.0), jnp.float32(1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def masked_mean_sums(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A token-mean metric's (sum, count) for one micro-batch: the float32 sum of ``x`` over the masked tokens
    and their number. The caller adds the pairs of the micro-batches and divides, ``sum / max(count, 1)``, the
    global token mean TRL logs (kl, entropy, clip ratios)."""
    m = jnp.asarray(mask).astype(bool)
    return jnp.where(m, jnp.asarray(x, jnp.float32), 0.0).sum(), m.sum().astype(jnp.float32)


def rloo_advantages(rewards: jax.Array, group: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """RLOO's leave-one-out advantages (TRL 1.16 ``RLOOTrainer._generate_and_score_completions``): each
    completion's reward minus the mean of its group's OTHER scorable completions.

    ``rewards`` [B] (consecutive ``group`` rows a prompt's completions; NaN: unscorable, left out of every
    baseline: the divisor is the group's scorable count - 1). A group with one scorable completion has no
    baseline (0/0) and, like the unscorable rows, gets advantage 0. ``normalize``: ``(A - nanmean(A)) /
    (nanstd(A) + 1e-4)`` over the batch's scorable rows first. Returns (advantages [B], each group's unbiased
    std [B / group], the zero-std flag TRL logs as ``frac_reward_zero_std``)."""
    r = jnp.asarray(rewards, jnp.float32)
    grouped = r.reshape(-1, group)
    valid = ~jnp.isnan(grouped)
    scorable = valid.sum(1, keepdims=True).astype(jnp.float32)
    total = jnp.where(valid, grouped, 0.0).sum(1, keepdims=True)
    adv = r - ((total - grouped) / (scorable - 1.0)).reshape(-1)  # NaN rows stay NaN; one scorable: 0/0
    if normalize:
        mean, std = _nan_mean_std(adv, axis=None)
        adv = (adv - mean.reshape(())) / (std.reshape(()) + STD_EPS)
    group_std = _nan_mean_std(grouped, axis=1)[1][:, 0] if group > 1 else jnp.zeros(grouped.shape[:1])
    return jnp.nan_to_num(adv, nan=0.0), group_std


def rloo_sequence_terms(logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array,
                        epsilon_low: float, epsilon_high: float) -> dict[str, jax.Array]:
    """RLOO's per-sequence loss (TRL 1.16 ``RLOOTrainer._compute_loss``): one importance ratio per completion,
    ``exp`` of its SUMMED log-ratio (``logps - old_logps`` of the masked sums), clipped as PPO clips,
    ``-min(ratio * A, clip(ratio) * A)``; the trainer averages it over the completions. Returns [B] arrays:
    ``loss`` and TRL's per-sequence clip flags ``low_clip``, ``high_clip``, ``region_clip``."""
    m = jnp.asarray(mask).astype(bool)
    log_ratio = jnp.where(m, jnp.asarray(logp, jnp.float32) - jnp.asarray(old_logp, jnp.float32), 0.0).sum(-1)
    ratio = jnp.exp(log_ratio)
    a = jnp.asarray(adv, jnp.float32)
    loss = -jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * a)
    low, high = (ratio < 1.0 - epsilon_low) & (a < 0), (ratio > 1.0 + epsilon_high) & (a > 0)
    return {"loss": loss, "low_clip": low.astype(jnp.float32), "high_clip": high.astype(jnp.float32),
            "region_clip": (low | high).astype(jnp.float32)}


def reinforce_pp_advantages(rewards: jax.Array, weights: jax.Array, kl: jax.Array | None, beta: float,
                            baseline_group: int | None, clip: tuple[float, float] | None = None) -> jax.Array:
    """REINFORCE++'s per-token advantages (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models", arXiv:2501.03262), as OpenRLHF computes them
    (openrlhf/trainer/ppo_utils/experience_maker.py: ``advantage_estimator`` "reinforce" and, with
    ``baseline_group``, "reinforce_baseline"; ``compute_reward`` in openrlhf/models/utils.py):

    1. "reinforce_baseline": each reward minus its group's mean (``baseline_group`` rows a group);
    2. clipped to ``clip`` (``reward_clip_range``);
    3. a per-token reward: ``-beta * kl`` on every completion token (``kl`` [B, T], the k1 estimate
       ``old - ref``; None: 0), plus the sequence's reward on its last completion token;
    4. returns: the reverse cumulative sum over the completion (gamma 1);
    5. whitened over every completion token of the batch: ``(G - mean) * rsqrt(max(var, 1e-8))`` with the
       token-weighted mean and (population) variance.

    ``rewards`` [B] (NaN: unscorable, taken as 0), ``weights`` [B, T] the completion tokens (aligned with the
    targets). Returns [B, T] float32, 0 off the completion."""
    r = jnp.nan_to_num(jnp.asarray(rewards, jnp.float32), nan=0.0)
    if baseline_group:
        g = r.reshape(-1, baseline_group)
        r = (g - g.mean(1, keepdims=True)).reshape(-1)
    if clip is not None:
        r = jnp.clip(r, clip[0], clip[1])
    w = jnp.asarray(weights, jnp.float32)
    on = w > 0
    t = w.shape[1]
    last = t - 1 - jnp.argmax(on[:, ::-1], axis=1)  # each row's last completion token
    tok = jnp.where(on.any(1, keepdims=True) & (jnp.arange(t)[None] == last[:, None]), r[:, None], 0.0)
    if kl is not None and beta > 0:
        tok = tok - beta * jnp.where(on, jnp.asarray(kl, jnp.float32), 0.0)
    returns = jnp.cumsum(tok[:, ::-1], axis=1)[:, ::-1]
    n = jnp.maximum(w.sum(), 1.0)
    mean = (returns * w).sum() / n
    var = (((returns - mean) ** 2) * w).sum() / n
    return jnp.where(on, (returns - mean) * jax.lax.rsqrt(jnp.maximum(var, 1e-8)), 0.0)
