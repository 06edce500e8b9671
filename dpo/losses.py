"""Preference losses (``dpo.loss_type``), per pair, with TRL 1.16's DPOTrainer/CPOTrainer formulas.

Every loss reads the policy's and the reference's SUMMED log-probabilities of
the chosen and rejected answers and their token counts, and returns the
per-pair losses, the implicit rewards and the log-probabilities TRL logs
(:class:`PairTerms`). With ``pi_c``, ``pi_r``, ``ref_c``, ``ref_r`` the summed
log-probabilities, ``n_c``, ``n_r`` the answers' token counts,
``h = (pi_c - ref_c) - (pi_r - ref_r)``, ``beta = dpo.beta`` and
``eps = dpo.label_smoothing``:

* ``sigmoid`` — DPO, Rafailov et al. 2023, "Direct Preference Optimization: Your
  Language Model is Secretly a Reward Model" (arXiv:2305.18290):
  ``-logsigmoid(beta h)``; with ``eps > 0`` conservative DPO (cDPO, Mitchell 2023,
  "A note on DPO with noisy preferences"):
  ``-(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h)`` (TRL 1.16's DPOTrainer
  has no cDPO; ``eps = 0``, the default, is its ``sigmoid``).
* ``robust`` — rDPO, Chowdhury et al. 2024, "Provably Robust DPO: Aligning
  Language Models with Noisy Feedback" (arXiv:2403.00409), an unbiased loss
  under label noise ``eps``:
  ``(-(1 - eps) logsigmoid(beta h) + eps logsigmoid(-beta h)) / (1 - 2 eps)``.
* ``hinge`` — SLiC, Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration
  with Human Feedback" (arXiv:2305.10425): ``relu(1 - beta h)``.
* ``ipo`` — IPO, Azar et al. 2023, "A General Theoretical Paradigm to Understand
  Learning from Human Preferences" (arXiv:2310.12036), as TRL's DPOTrainer computes
  it: only the loss is length-normalized, each answer's summed log-ratio divided
  by its token count, ``((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2``;
  its rewards and logps are the summed ones, like every DPOTrainer loss's.
* ``simpo`` — SimPO, Meng et al. 2024, "SimPO: Simple Preference Optimization
  with a Reference-Free Reward" (arXiv:2405.14734), reference-free, as TRL's
  CPOTrainer ``loss_type="simpo"`` computes it: everything reads the mean
  per-token log-probabilities ``m_c = pi_c / n_c``, ``m_r = pi_r / n_r``
  (CPOTrainer's ``average_log_prob``): ``h = m_c - m_r - gamma / beta``
  (``gamma = dpo.simpo_gamma``), loss ``-(1 - eps) logsigmoid(beta h) - eps
  logsigmoid(-beta h)``, rewards ``beta * m``, logps ``m``.
* ``orpo`` — ORPO, Hong et al. 2024, "ORPO: Monolithic Preference Optimization
  without Reference Model" (arXiv:2403.07691), as TRL 1.16's
  ``trl.experimental.orpo.ORPOTrainer`` computes it: on the mean per-token
  log-probabilities ``m_c``, ``m_r``, the log odds ratio
  ``l = (m_c - m_r) - (log(1 - exp(m_c)) - log(1 - exp(m_r)))``, the per-pair
  loss ``-beta logsigmoid(l)``, rewards ``beta * m``, logps ``m``; the trainer
  adds the NLL of the chosen sequence, prompt AND answer (dpo/task.py).
* ``cpo`` — CPO, Xu et al. 2024, "Contrastive Preference Optimization: Pushing
  the Boundaries of LLM Performance in Machine Translation" (arXiv:2401.08417),
  as TRL 1.16's ``trl.experimental.cpo.CPOTrainer`` (``loss_type="sigmoid"``)
  computes it: ``-(1 - eps) logsigmoid(beta (pi_c - pi_r)) - eps logsigmoid(-beta
  (pi_c - pi_r))`` on the summed log-probabilities, no reference, rewards
  ``beta * pi``; the trainer adds ``cpo_alpha`` times the NLL of the chosen answer
  (dpo/task.py).

Rewards are ``beta * (pi - ref)`` of each answer (summed; SimPO: ``beta * m``),
detached, and the logged logps are ``pi`` (SimPO: ``m``), as TRL logs them
(``rewards/*``, ``logps/*``: means over the batch's pairs; ``rewards/accuracies``:
the share of pairs with chosen reward > rejected reward; ``rewards/margins``: the
mean of chosen minus rejected reward).

``dpo.sft_weight`` ``w`` (RPO, Pang et al. 2024, "Iterative Reasoning Preference
Optimization", arXiv:2404.19733) is TRL 1.16's ``"sft"`` loss term with weight
``w`` (DPOTrainer ``loss_type=[..., "sft"], loss_weights=[1, w]``; CPOTrainer's
``cpo_alpha``): ONE mean NLL over every chosen-answer token of the batch,
token-weighted (``sum of -log p over all chosen tokens / number of chosen tokens``,
not a mean of per-pair means), added once to the mean preference loss:
``loss = mean over pairs(losses) + w * NLL``. dpo/task.py computes it over the
whole global batch, however it is split into micro-batches and devices
(:func:`rpo_nll_scale`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "cpo")
REFERENCE_FREE = ("simpo", "orpo", "cpo")


class PairTerms(NamedTuple):
    """Per-pair results of :func:`preference_loss`, each [pairs]; all but ``losses`` detached."""

    losses: jax.Array  # the preference loss of each pair (without the RPO term)
    chosen_rewards: jax.Array  # TRL's rewards/chosen per pair
    rejected_rewards: jax.Array  # TRL's rewards/rejected per pair
    chosen_logps: jax.Array  # TRL's logps/chosen per pair: summed (SimPO: mean per token)
    rejected_logps: jax.Array  # TRL's logps/rejected per pair
    log_odds: jax.Array | None = None  # ORPO: the log odds ratio of chosen over rejected per pair (else None)


def preference_loss(loss_type: str, chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array,
                    ref_rejected: jax.Array, chosen_tokens: jax.Array, rejected_tokens: jax.Array, beta: float,
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                    at_reference: jax.Array | bool = False) -> PairTerms:
    """Per-pair losses, rewards and logged log-probabilities (see the module docstring for each formula).

    ``chosen``, ``rejected`` (policy) and ``ref_chosen``, ``ref_rejected`` are summed
    answer log-probabilities [pairs] (the reference's are ignored by reference-free
    losses); ``chosen_tokens``, ``rejected_tokens`` the answers' token counts [pairs],
    clamped to at least 1 as TRL clamps them, for the length-normalized ``ipo`` loss
    and ``simpo``.

    ``at_reference`` (a bool, or a traced one) says the policy IS the reference (e.g. step 1,
    before any update): each log-ratio is then ``pi - pi`` of the policy's own sums, exactly 0
    with ``pi``'s gradient, where the reference's separately computed sums could differ from the
    policy's in the last bits (a differentiated forward pass and a plain one compile differently).
    """
    eps = label_smoothing
    sg = jax.lax.stop_gradient
    nc, nr = jnp.maximum(chosen_tokens, 1.0), jnp.maximum(rejected_tokens, 1.0)
    if loss_type == "simpo":
        # CPOTrainer: get_batch_logps(average_log_prob=True) feeds the loss, the rewards and logps/* alike.
        mc, mr = chosen / nc, rejected / nr
        h = mc - mr - simpo_gamma / beta
        losses = -jax.nn.log_sigmoid(beta * h) * (1 - eps) - jax.nn.log_sigmoid(-beta * h) * eps
        return PairTerms(losses, beta * sg(mc), beta * sg(mr), sg(mc), sg(mr))
    if loss_type == "orpo":
        # ORPOTrainer.odds_ratio_loss on the mean per-token log-probabilities; the trainer subtracts the mean of
        # beta * logsigmoid(log_odds) from its NLL, so the per-pair loss is its negative.
        mc, mr = chosen / nc, rejected / nr
        log_odds = (mc - mr) - (log1mexp(mc) - log1mexp(mr))
        losses = -beta * jax.nn.log_sigmoid(log_odds)
        return PairTerms(losses, beta * sg(mc), beta * sg(mr), sg(mc), sg(mr), sg(log_odds))
    if loss_type == "cpo":
        # CPOTrainer.cpo_loss, loss_type "sigmoid" (alpha 0): the summed log-probabilities, no reference
        h = chosen - rejected
        losses = -jax.nn.log_sigmoid(beta * h) * (1 - eps) - jax.nn.log_sigmoid(-beta * h) * eps
        return PairTerms(losses, beta * sg(chosen), beta * sg(rejected), sg(chosen), sg(rejected))
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if at_reference is not False:
        chosen_ratio = jnp.where(at_reference, chosen - sg(chosen), chosen_ratio)
        rejected_ratio = jnp.where(at_reference, rejected - sg(rejected), rejected_ratio)
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * h) * (1 - eps) - jax.nn.log_sigmoid(-beta * h) * eps
    elif loss_type == "robust":
        losses = (-jax.nn.log_sigmoid(beta * h) * (1 - eps) + jax.nn.log_sigmoid(-beta * h) * eps) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * h)
    elif loss_type == "ipo":
        # DPOTrainer: chosen_scores / chosen_mask.sum(1).clamp(min=1) - rejected_scores / ... , the loss alone.
        losses = (chosen_ratio / nc - rejected_ratio / nr - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown dpo.loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    return PairTerms(losses, beta * sg(chosen_ratio), beta * sg(rejected_ratio), sg(chosen), sg(rejected))


def log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, branched at ``-log 2`` as TRL's ORPO ``log1mexp`` is (Maechler 2012,
    "Accurately Computing log(1 - exp(-|a|))"): ``log1p(-exp(x))`` below it, ``log(-expm1(x))`` above."""
    t = -0.6931471805599453
    safe_lo, safe_hi = jnp.minimum(x, t), jnp.maximum(x, t)  # each branch on its own domain: finite gradients
    return jnp.where(x < t, jnp.log1p(-jnp.exp(safe_lo)), jnp.log(-jnp.expm1(safe_hi)))


def rpo_nll_scale(pairs: jax.Array, chosen_tokens: jax.Array) -> jax.Array:
    """What a micro-batch's summed chosen-token NLL is multiplied by (before ``dpo.sft_weight``) so that
    its loss sums, added up over the global batch and divided by the global pair count ``pairs`` (as the
    train step does), give the global token mean ``NLL sum / chosen_tokens``: ``pairs / chosen_tokens``
    (0 where the batch has no chosen token)."""
    return pairs / jnp.maximum(chosen_tokens, 1.0)
