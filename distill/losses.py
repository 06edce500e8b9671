"""GKD's token loss: the generalized Jensen-Shannon divergence between student and teacher (TRL 1.16's
``GKDTrainer.generalized_jsd_loss``), as (sum, count) pairs so micro-batches combine into the batch's loss."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from pretrain.batch import TokenBatch
    from pretrain.metrics import LossOutput


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, beta: float,
                    temperature: float = 1.0) -> jax.Array:
    """Per-position generalized JSD [..., V] -> [...] in float32.

    beta 0 is KL(teacher || student) (forward KL), beta 1 is KL(student || teacher) (reverse KL), and between
    them ``beta * KL(teacher || M) + (1 - beta) * KL(student || M)`` with the mixture
    ``M = (1 - beta) * student + beta * teacher`` (TRL's order; Eq. (1) of arXiv:2306.13649). Both logits are
    divided by ``temperature`` first. The teacher gets no gradient (it is a frozen input)."""
    s = jax.nn.log_softmax(jnp.asarray(student_logits, jnp.float32) / temperature, axis=-1)
    t = jax.lax.stop_gradient(jax.nn.log_softmax(jnp.asarray(teacher_logits, jnp.float32) / temperature, axis=-1))

    def kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
        # KL(p || q) summed over the vocabulary, as torch's kl_div(input=log_q, target=log_p, log_target=True)
        return (jnp.exp(log_p) * (log_p - log_q)).sum(-1)

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = jnp.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return beta * kl(t, m) + (1.0 - beta) * kl(s, m)


def jsd_sum_count(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array, beta: float,
                  temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """One micro-batch's (masked JSD sum, masked token count), float32 scalars.

    Over a global batch ``sum(sums) / max(sum(counts), 1)`` is TRL's loss with ``num_items_in_batch`` (the
    batch's token count, gradient-accumulation-correct) or, on one micro-batch, its ``batchmean`` reduction."""
    m = jnp.asarray(mask).astype(bool)
    jsd = generalized_jsd(student_logits, teacher_logits, beta, temperature)
    return jnp.where(m, jsd, 0.0).sum(), m.sum().astype(jnp.float32)


def distill_loss_sums(mcfg: Any, weights: Any, teacher_mcfg: Any, teacher: dict, mb: TokenBatch, compute: Any,
                      remat: str, beta: float) -> LossOutput:
    """A micro-batch's GKD loss as the step's :class:`LossOutput`: the generalized JSD between the student's and
    the frozen teacher's next-token distributions at every trained target (``mb.weights`` > 0), summed (the
    student's ``weights``: a :class:`zoo.lora.weights.Weights`); the
    step divides by the global batch's target count. TRL's ``compute_loss`` calls ``generalized_jsd_loss``
    without a temperature, so the loss is at temperature 1 (``distill.temperature`` is the sampler's)."""
    from pretrain.metrics import LossOutput
    from zoo.model.decoder import forward
    from zoo.model.quant import cast_params

    # Rows with images: both models read the batch's patches (the teacher's tower takes the student's input:
    # distill.config.check_teacher_vision).
    s_vision, t_vision = ((None, None) if mb.vision is None or mcfg.vision is None or teacher_mcfg.vision is None
                          else (mb.vision.inputs(mcfg.vision), mb.vision.inputs(teacher_mcfg.vision)))
    s_logits = forward(mcfg, weights.cast(compute), mb.inputs, mb.segment_ids, mb.positions, remat=remat,
                       vision=s_vision)
    t_logits = forward(teacher_mcfg, cast_params(teacher, compute), mb.inputs, mb.segment_ids, mb.positions,
                       vision=t_vision)
    total, n = jsd_sum_count(s_logits, t_logits, mb.weights > 0, beta)  # no teacher gradient: see generalized_jsd
    data_weights = getattr(mb, "data_weights", None)
    if data_weights is not None:  # sampled completions (distill/online.py): TRL divides by the dataset's count
        n = (data_weights > 0).sum().astype(jnp.float32)
    return LossOutput(total, total, n)
