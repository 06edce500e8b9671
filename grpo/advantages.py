"""How a completion's advantage is estimated (``grpo.advantage``): one small class per estimator, chosen by name
from :data:`ESTIMATORS`.

An estimator answers, at three points of a step:

1. before the update's batch is laid out, each completion's advantage from the rewards alone
   (:meth:`Estimator.row_advantages`: GRPO's group-relative one; the others wait for the log-probabilities);
2. after the policy's and the reference's log-probabilities are computed, the final batch
   (:meth:`Estimator.finish`: RLOO and REINFORCE++ put the KL to the reference into the reward);
3. in the loss, the objective of a micro-batch (:meth:`Estimator.loss`: GRPO's and REINFORCE++'s clipped
   per-token surrogate, RLOO's per-sequence one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from grpo import losses
from grpo.batch import RolloutBatch
from grpo.config import GrpoSection
from pretrain.metrics import Max, Metric, Min, Ratio

SAMPLER_DIFF = "logps/sampler_max_diff"  # max |sampler log p - trainer log p| over the batch's completion tokens


@dataclass
class Scored:
    """A step's laid-out batch with what an estimator's :meth:`Estimator.finish` reads: the rewards (``per_fn``
    [B, functions], NaN: did not apply; ``total`` [B]), the sampling policy's (``old``) and the reference's
    (``ref``) per-token log-probabilities (None where not computed), ``adv`` the advantages it was laid out with
    (:meth:`Estimator.row_advantages`') and ``relayout``, the batch laid out again with other ones [B]."""

    batch: RolloutBatch
    adv: np.ndarray
    per_fn: np.ndarray
    total: np.ndarray
    old: jax.Array | None
    ref: jax.Array | None
    relayout: Callable[[np.ndarray], RolloutBatch]
    reinforce_pp: Callable[..., jax.Array]  # the jitted losses.reinforce_pp_advantages (grpo/programs.py)
    to_host: Callable[[jax.Array], np.ndarray]


@cache
def _jitted(fn: Callable) -> Callable:
    """``fn`` (an advantage of grpo/losses.py, on the host's rewards each step) jitted, its settings static: one
    program per batch shape, where eagerly each of its couple of dozen operations compiled its own."""
    return jax.jit(fn, static_argnums=(1, 2))


class Estimator:
    """An advantage estimator (module docstring); ``g``: the run's ``grpo:`` section."""

    name: ClassVar[str]
    needs_old: ClassVar[bool] = False  # reads the sampling policy's log-probabilities with beta > 0 (its KL)

    def __init__(self, g: GrpoSection):
        self.g = g

    def row_advantages(self, total: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        """Each completion's advantage [B] from its total reward before the layout, with their metrics; 0 (the
        default) where :meth:`finish` decides them."""
        return np.zeros(len(total), np.float32), {}

    def finish(self, s: Scored) -> tuple[RolloutBatch, np.ndarray, dict[str, float]]:
        """The step's batch, each completion's advantage for the log [B], and the estimator's metrics; the laid-out
        batch as it is by default."""
        return s.batch, s.adv, {}

    def loss(self, logp: jax.Array, old: jax.Array, ref: jax.Array | None, mb: RolloutBatch, entropy: jax.Array,
             sampler_diff: Metric) -> tuple[jax.Array, jax.Array, dict[str, Metric]]:
        """A micro-batch's (loss sum, its count, metrics) from the policy's per-token log-probabilities."""
        raise NotImplementedError

    def _kl_metrics(self, s: Scored) -> tuple[jax.Array | None, dict[str, float], tuple[float, float] | None]:
        """(k1 KL per token, old - ref: the first-order estimate RLOO and REINFORCE++ both use, or None; its
        metric, TRL's mean over the completion tokens; ``grpo.reward_clip_range``)."""
        g, w = self.g, s.batch.weights
        clip = (float(g.reward_clip_range[0]), float(g.reward_clip_range[1])) if g.reward_clip_range else None
        kl_tok = None if s.old is None or s.ref is None else s.old - s.ref
        m: dict[str, float] = {}
        if kl_tok is not None:
            m["kl"] = float(s.to_host((kl_tok * w).sum() / jnp.maximum(w.sum(), 1.0)))
        return kl_tok, m, clip


class TokenSurrogate(Estimator):
    """The clipped per-token surrogate (grpo/losses.py ``token_terms``), normalized as ``loss_type`` says; the
    advantage is one value per row (``per_row``), broadcast over its tokens, or one per token."""

    per_row: ClassVar[bool] = False
    beta_in_loss: ClassVar[bool] = False  # the k3 KL term in the loss (GRPO's); else the KL is in the reward

    def loss(self, logp: jax.Array, old: jax.Array, ref: jax.Array | None, mb: RolloutBatch, entropy: jax.Array,
             sampler_diff: Metric) -> tuple[jax.Array, jax.Array, dict[str, Metric]]:
        g, mask = self.g, mb.weights
        eps_high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        adv = mb.advantages[:, 0] if self.per_row else mb.advantages
        is_ratio, is_metrics = self._sampler_correction(old, mb, sampler_diff)
        terms = losses.token_terms(logp, old, ref, adv, mask, g.epsilon, eps_high,
                                   g.beta if self.beta_in_loss else 0.0, g.importance_sampling_level,
                                   losses.LossKnobs.of(g), is_ratio)
        total, n = losses.loss_sum_count(terms["loss"], mask, g.loss_type, g.max_completion_length)
        if g.importance_sampling_level == "sequence":  # one ratio per completion: TRL counts clipped sequences
            clip_of = lambda x: Ratio(*losses.masked_mean_sums(x[:, :1], jnp.ones_like(x[:, :1])))  # noqa: E731
        else:
            clip_of = lambda x: Ratio(*losses.masked_mean_sums(x, mask))  # noqa: E731
        # TRL 1.16's names: the clip ratios of the clipped surrogates, CISPO's share of clipped weights, VESPO's
        # mean weight (one a completion), none for SAPO's soft gate
        named = {"low_clip": "clip_ratio/low_mean", "high_clip": "clip_ratio/high_mean",
                 "region_clip": "clip_ratio/region_mean", "cispo_clip": "cispo_clip_ratio"}
        extras: dict[str, Metric] = {"entropy": Ratio(*losses.masked_mean_sums(entropy, mask)),
                                     **{named[k]: clip_of(v) for k, v in terms.items() if k in named}}
        if "phi" in terms:
            phi = terms["phi"][:, :1]
            extras["vespo/phi_seq_mean"] = Ratio(*losses.masked_mean_sums(phi, jnp.ones_like(phi)))
        extras |= {SAMPLER_DIFF: sampler_diff, **is_metrics}
        if g.beta > 0 and self.beta_in_loss:  # as TRL: no reference, no kl metric (it would be a constant 0)
            extras["kl"] = Ratio(*losses.masked_mean_sums(jax.lax.stop_gradient(terms["kl"]), mask))
        return total, n, extras

    def _sampler_correction(self, old: jax.Array, mb: RolloutBatch,
                            sampler_diff: Metric) -> tuple[jax.Array | None, dict[str, Metric]]:
        """With ``grpo.importance_sampling_correction``: the sampler-correction weights (grpo/losses.py
        ``sampler_ratio``, from the policy's log-probabilities before the update and the sampler's) and TRL 1.16's
        metrics of them: ``sampling/importance_sampling_ratio/min|mean|max`` (over the completion tokens, or the
        completions in the ``sequence_*`` modes) and ``sampling/sampling_logp_difference/mean|max`` (the max is
        ``sampler_diff``, the gap every run logs)."""
        g, mask = self.g, mb.weights
        if not g.importance_sampling_correction:
            return None, {}
        sg = jax.lax.stop_gradient
        ratio = losses.sampler_ratio(sg(old), mb.sampler_logps, mask, g.importance_sampling_mode,
                                     g.importance_sampling_clip_min, g.importance_sampling_clip_max)
        flat_on = jnp.ones(ratio.shape, bool) if ratio.shape[1] == 1 else mask > 0
        delta = jnp.abs(sg(old) - mb.sampler_logps)
        name = "sampling/importance_sampling_ratio/"
        return ratio, {name + "min": Min(jnp.min(jnp.where(flat_on, ratio, jnp.inf))),
                       name + "mean": Ratio(jnp.where(flat_on, ratio, 0.0).sum(), flat_on.sum().astype(jnp.float32)),
                       name + "max": Max(jnp.max(jnp.where(flat_on, ratio, -jnp.inf))),
                       "sampling/sampling_logp_difference/mean": Ratio(*losses.masked_mean_sums(delta, mask)),
                       "sampling/sampling_logp_difference/max": sampler_diff}


class Group(TokenSurrogate):
    """GRPO's group-relative advantage: each reward less its group's mean, scaled as ``grpo.scale_rewards`` says;
    the KL to the reference a term of the loss."""

    name = "group"
    per_row = True
    beta_in_loss = True

    def row_advantages(self, total: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        g = self.g
        adv, std, zero_std = (np.asarray(x) for x in
                              _jitted(losses.advantages)(jnp.asarray(total, jnp.float32), g.num_generations,
                                                         g.scale_rewards))
        # TRL 1.16 logs the std of the batch's rewards, not the groups' mean
        return adv, {"reward_std": batch_std(total), "frac_reward_zero_std": float(np.mean(zero_std))}


class ReinforcePP(TokenSurrogate):
    """REINFORCE++ (OpenRLHF's ``reinforce``): per-token returns of the reward less the KL, whitened over the batch
    (grpo/losses.py ``reinforce_pp_advantages``)."""

    name = "reinforce_pp"
    needs_old = True
    baseline: ClassVar[bool] = False  # each reward less its group's mean first

    def finish(self, s: Scored) -> tuple[RolloutBatch, np.ndarray, dict[str, float]]:
        g, w = self.g, s.batch.weights
        kl_tok, m, clip = self._kl_metrics(s)
        group = g.num_generations if self.baseline else None
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
        adv_tok = s.reinforce_pp(jnp.asarray(s.total, jnp.float32), flat(w),
                                 None if kl_tok is None else flat(kl_tok), group, clip)
        batch = dataclasses.replace(s.batch, advantages=adv_tok.reshape(w.shape))
        grouped = s.total.reshape(-1, g.num_generations)
        m.update({"reward_std": float(np.mean(grouped.std(1, ddof=1))),
                  "frac_reward_zero_std": float(np.mean(np.isclose(grouped.std(1, ddof=1), 0.0)))})
        w_h, adv_h = s.to_host(flat(w)), s.to_host(adv_tok)
        return batch, (adv_h * w_h).sum(-1) / np.maximum(w_h.sum(-1), 1.0), m  # each row's mean, for the log


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++ with its group-mean baseline (OpenRLHF's ``reinforce_baseline``)."""

    name = "reinforce_pp_baseline"
    baseline = True


class RLOO(Estimator):
    """RLOO (TRL's RLOOTrainer): each reward, less the sequence's summed KL, minus the mean of its group's other
    scorable completions; its own loss, one summed-log-ratio importance ratio per completion."""

    name = "rloo"
    needs_old = True

    def finish(self, s: Scored) -> tuple[RolloutBatch, np.ndarray, dict[str, float]]:
        g, w, per_fn, total = self.g, s.batch.weights, s.per_fn, s.total
        kl_tok, m, clip = self._kl_metrics(s)
        r = total.astype(np.float64).copy()
        if per_fn.shape[1]:
            r[np.isnan(per_fn).all(1)] = np.nan  # unscorable: out of every baseline, advantage 0
        if clip is not None:
            r = np.clip(r, clip[0], clip[1])
        if kl_tok is not None:  # the sequence's summed KL, subtracted from its reward
            r = r - g.beta * s.to_host((kl_tok * w).sum(-1)).reshape(-1)
        adv_j, group_std = _jitted(losses.rloo_advantages)(jnp.asarray(r, jnp.float32), g.num_generations,
                                                           g.normalize_advantages)
        adv = np.asarray(adv_j)
        shown = np.where(np.isnan(per_fn).all(1), np.nan, total) if per_fn.shape[1] else total
        m.update({"reward_std": batch_std(shown),
                  "frac_reward_zero_std": float(np.mean(np.isclose(np.asarray(group_std), 0.0)))})
        return s.relayout(adv.astype(np.float32)), adv, m

    def loss(self, logp: jax.Array, old: jax.Array, ref: jax.Array | None, mb: RolloutBatch, entropy: jax.Array,
             sampler_diff: Metric) -> tuple[jax.Array, jax.Array, dict[str, Metric]]:
        g, mask = self.g, mb.weights
        eps_high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        seq = losses.rloo_sequence_terms(logp, old, mb.advantages[:, 0], mask, g.epsilon, eps_high)
        total, n = seq["loss"].sum(), jnp.float32(seq["loss"].shape[0])
        one = lambda x: Ratio(x.sum(), jnp.float32(x.shape[0]))  # noqa: E731
        extras: dict[str, Metric] = {"entropy": Ratio(*losses.masked_mean_sums(entropy, mask)),
                                     "clip_ratio/low_mean": one(seq["low_clip"]),
                                     "clip_ratio/high_mean": one(seq["high_clip"]),
                                     "clip_ratio/region_mean": one(seq["region_clip"]),
                                     SAMPLER_DIFF: sampler_diff}
        return total, n, extras


def batch_std(rewards: np.ndarray) -> float:
    """TRL's ``reward_std``: the unbiased std of the batch's rewards, NaN (unscorable) ones left out; 0 with fewer
    than two."""
    return float(np.nanstd(rewards, ddof=1)) if np.isfinite(rewards).sum() > 1 else 0.0


ESTIMATORS: dict[str, type[Estimator]] = {c.name: c for c in (Group, RLOO, ReinforcePP, ReinforcePPBaseline)}


def estimator_of(g: GrpoSection) -> Estimator:
    """The estimator ``grpo.advantage`` names."""
    return ESTIMATORS[g.advantage](g)


