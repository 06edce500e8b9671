"""Preference losses (``dpo.loss_type``), per pair, with TRL's DPOTrainer/CPOTrainer formulas.

Every loss reads the policy's and the reference's summed log-probabilities of
the chosen and rejected answers (``ipo`` and ``simpo``: their per-token means,
see :data:`LENGTH_NORMALIZED`), and returns per-pair losses and the implicit
rewards TRL logs. With ``h = (pi_c - pi_r) - (ref_c - ref_r)`` and
``beta = dpo.beta``, ``eps = dpo.label_smoothing``:

* ``sigmoid`` — DPO, Rafailov et al. 2023, "Direct Preference Optimization: Your
  Language Model is Secretly a Reward Model" (arXiv:2305.18290):
  ``-logsigmoid(beta h)``; with ``eps > 0`` conservative DPO (cDPO, Mitchell 2023,
  "A note on DPO with noisy preferences"):
  ``-(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h)``.
* ``robust`` — rDPO, Chowdhury et al. 2024, "Provably Robust DPO: Aligning
  Language Models with Noisy Feedback" (arXiv:2403.00409), an unbiased loss
  under label noise ``eps``:
  ``(-(1 - eps) logsigmoid(beta h) + eps logsigmoid(-beta h)) / (1 - 2 eps)``.
* ``hinge`` — SLiC, Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration
  with Human Feedback" (arXiv:2305.10425): ``relu(1 - beta h)``.
* ``ipo`` — IPO, Azar et al. 2023, "A General Theoretical Paradigm to Understand
  Learning from Human Preferences" (arXiv:2310.12036): ``(h - 1 / (2 beta))^2``
  with length-normalized (mean per-token) log-probabilities, as TRL computes it.
* ``simpo`` — SimPO, Meng et al. 2024, "SimPO: Simple Preference Optimization
  with a Reference-Free Reward" (arXiv:2405.14734), reference-free:
  ``h = mean_c - mean_r - gamma / beta`` (``gamma = dpo.simpo_gamma``), loss
  ``-(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h)``, rewards
  ``beta * mean logp`` (TRL's CPOTrainer ``loss_type="simpo"``).

``dpo.sft_weight`` (RPO, Pang et al. 2024, "Iterative Reasoning Preference
Optimization", arXiv:2404.19733; TRL's ``rpo_alpha``) adds ``weight *`` the
chosen answer's mean per-token NLL to each pair's loss (see dpo/task.py).
Rewards are ``beta * (pi - ref)`` of each answer (SimPO: ``beta * pi``),
detached, as TRL logs them.
"""

from __future__ import annotations

import jax

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
LENGTH_NORMALIZED = ("ipo", "simpo")  # these compare mean per-token log-probabilities
REFERENCE_FREE = ("simpo",)


def preference_loss(loss_type: str, chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array,
                    ref_rejected: jax.Array, beta: float, label_smoothing: float = 0.0,
                    simpo_gamma: float = 0.5) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(per-pair losses, chosen rewards, rejected rewards), each [pairs], for policy and reference
    log-probabilities [pairs] (summed, or means for :data:`LENGTH_NORMALIZED` losses)."""
    eps = label_smoothing
    if loss_type == "simpo":
        h = chosen - rejected - simpo_gamma / beta
        losses = -jax.nn.log_sigmoid(beta * h) * (1 - eps) - jax.nn.log_sigmoid(-beta * h) * eps
        rewards = beta * jax.lax.stop_gradient(chosen), beta * jax.lax.stop_gradient(rejected)
        return losses, *rewards
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * h) * (1 - eps) - jax.nn.log_sigmoid(-beta * h) * eps
    elif loss_type == "robust":
        losses = (-jax.nn.log_sigmoid(beta * h) * (1 - eps) + jax.nn.log_sigmoid(-beta * h) * eps) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown dpo.loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    chosen_rewards = beta * jax.lax.stop_gradient(chosen - ref_chosen)
    rejected_rewards = beta * jax.lax.stop_gradient(rejected - ref_rejected)
    return losses, chosen_rewards, rejected_rewards

