"""Per-token log-probabilities of the targets from the final hidden states, in sequence chunks.

DPO needs each answer token's log-probability (not a summed loss, so
:mod:`zoo.loss`'s fused kernel does not apply). The logits of one chunk of
positions exist at a time; the chunk body is rematerialized in the backward
pass, so no [tokens, vocab] array is kept for it either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.loss import chunk_length


def token_logps(hidden: jax.Array, head: jax.Array, targets: jax.Array,
                softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(log p(target) [batch, seq], mean logit over the vocabulary [batch, seq], not differentiated).

    ``hidden`` [batch, seq, dim] are the final normed hidden states, ``head``
    [dim, vocab] the output weight, ``targets`` [batch, seq] int ids.
    """
    b, t, _ = hidden.shape
    c = chunk_length(head.shape[-1], b, t)
    pad = (-t) % c
    x = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(targets, ((0, 0), (0, pad)))
    k = (t + pad) // c
    xs = jnp.moveaxis(x.reshape(b, k, c, -1), 1, 0)
    ys = jnp.moveaxis(y.reshape(b, k, c), 1, 0)

    @jax.checkpoint
    def chunk(xc: jax.Array, yc: jax.Array) -> tuple[jax.Array, jax.Array]:
        z = jnp.einsum("bcd,dv->bcv", xc, head, preferred_element_type=jnp.float32)
        if softcap:
            z = softcap * jnp.tanh(z / softcap)
        logp = jnp.take_along_axis(z, yc[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(z, axis=-1)
        return logp, jax.lax.stop_gradient(z.mean(-1))

    logp, mean_logit = jax.lax.map(lambda a: chunk(*a), (xs, ys))
    unchunk = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, -1)[:, :t]  # noqa: E731
    return unchunk(logp), unchunk(mean_logit)
