"""Per-token log-probabilities of the targets from the final hidden states, in sequence chunks.

Preference losses and scoring (:func:`zoo.data.batching.score_documents`) need each
target token's log-probability (not a summed loss, so :mod:`zoo.model.loss`'s fused
kernel does not apply as it is). The logits of one
chunk of positions exist at a time. When the head is trained (full
fine-tuning) the chunk body is rematerialized in the backward pass, so no
[tokens, vocab] array is kept for it either. When the head is frozen (LoRA),
the gradient of each token's log-probability with respect to its hidden
state is known in the forward pass, up to that token's cotangent: each chunk
computes it beside its logits and keeps it ([tokens, hidden], small), and the
backward pass only scales it. That saves the chunk's recomputed logits, one
of the three [tokens, hidden] x [hidden, vocab] matmuls of the policy's head.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import jax
import jax.numpy as jnp

from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward, stored_head
from zoo.model.loss import chunk_length, chunk_logits, head_vocab
from zoo.model.vision import VisionInputs


def batch_logps(mcfg: ModelConfig, params: dict | Weights, mb: dict, remat: str = "none", temperature: float = 1.0,
                entropy: bool = False, max_segments: int | None = None,
                vision: VisionInputs | None = None) -> tuple[jax.Array, jax.Array, dict | None]:
    """(per-target log-probabilities [b, t], mean logits [b, t] (``entropy``: the entropies), MoE aux or None)
    of one forward pass over a model batch (:func:`zoo.data.batching.to_model_batch`: its segments, positions and
    shared prefixes), the logits divided by ``temperature`` (a sampler's distribution).

    ``params``: the base alone or :class:`zoo.lora.weights.Weights`; with LoRA adapters the head is frozen, so the
    fused path of :func:`token_logps` applies. ``max_segments``: :func:`zoo.model.decoder.forward`'s.
    ``vision``: a vision-language model's images of the rows (each image token's embedding its image feature).
    """
    moe = mcfg.num_experts > 0
    out = forward(mcfg, params, mb["inputs"], mb["segment_ids"], mb["positions"], return_aux=moe, remat=remat,
                  return_hidden=True, prefix_ids=mb.get("prefix_ids"), max_segments=max_segments, vision=vision)
    hidden, aux = cast(tuple[jax.Array, dict], out) if moe else (cast(jax.Array, out), None)  # by return_aux
    w = Weights.wrap(params)
    head_grad = w.adapters is None
    # The head as stored: a tied embedding read in place, where embed.T would be a [hidden, vocab] copy
    # (108 MiB at SmolLM2's size) in every step that scores a batch.
    head, vocab_major = stored_head(mcfg, w.base)
    logp, stat = token_logps(hidden, head, mb["targets"], mcfg.final_softcap, head_grad, vocab_major, temperature,
                             entropy)
    return logp, stat, aux


def token_logps(hidden: jax.Array, head: jax.Array, targets: jax.Array, softcap: float | None = None,
                head_grad: bool = True, vocab_major: bool = False, temperature: float = 1.0,
                entropy: bool = False, greedy: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log p(target) [batch, seq], a per-token statistic [batch, seq], not differentiated: the mean logit over
    the vocabulary, with ``entropy`` the entropy of the token's distribution in nats, with ``greedy`` whether
    the target is the argmax (first index on ties, as ``torch.argmax``), 1.0 or 0.0).

    ``hidden`` [batch, seq, dim] are the final normed hidden states, ``head``
    [dim, vocab] the output weight (``vocab_major``: [vocab, dim], a tied
    embedding as it is stored), ``targets`` [batch, seq] int ids. The
    (capped) logits are divided by ``temperature``: the distribution a
    sampler at that temperature draws from. With ``head_grad=False`` (a
    frozen head, as under LoRA) the head gets no gradient (zero) and the
    hidden states' gradient comes from the forward pass.
    """
    stat = "entropy" if entropy else "greedy" if greedy else "mean"
    if head_grad:
        return _remat_logps(hidden, head, targets, softcap, vocab_major, float(temperature), stat)
    return _fused_logps(hidden, head, targets, softcap, vocab_major, float(temperature), stat)


def _chunked(hidden: jax.Array, targets: jax.Array, vocab: int):
    """hidden and targets as [chunks, b, c, ...] along the sequence (padded at its end), and an unchunk."""
    b, t, _ = hidden.shape
    c = chunk_length(vocab, b, t)
    pad = (-t) % c
    x = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(targets, ((0, 0), (0, pad)))
    k = (t + pad) // c
    xs = jnp.moveaxis(x.reshape(b, k, c, -1), 1, 0)
    ys = jnp.moveaxis(y.reshape(b, k, c), 1, 0)

    def unchunk(a: jax.Array) -> jax.Array:
        return jnp.moveaxis(a, 0, 1).reshape((b, -1) + a.shape[3:])[:, :t]

    return xs, ys, unchunk


def _chunk_logps(xc: jax.Array, yc: jax.Array, head: jax.Array, softcap: float | None, vocab_major: bool,
                 temperature: float, stat: str):
    z, th = chunk_logits(xc, head, softcap, vocab_major)
    if temperature != 1.0:
        z = z / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = jnp.take_along_axis(z, yc[..., None], axis=-1)[..., 0] - lse
    if stat == "entropy":  # H = lse - sum p z
        value = lse - (jnp.exp(z - lse[..., None]) * z).sum(-1)
    elif stat == "greedy":
        value = (jnp.argmax(z, axis=-1) == yc).astype(z.dtype)
    else:
        value = z.mean(-1)
    return logp, jax.lax.stop_gradient(value), z, lse, th


def _remat_logps(hidden, head, targets, softcap, vocab_major, temperature=1.0, stat="mean"):
    xs, ys, unchunk = _chunked(hidden, targets, head_vocab(head, vocab_major))

    @jax.checkpoint
    def chunk(xc: jax.Array, yc: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _chunk_logps(xc, yc, head, softcap, vocab_major, temperature, stat)[:2]

    logp, value = jax.lax.map(lambda a: chunk(*a), (xs, ys))
    return unchunk(logp), unchunk(value)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused_logps(hidden, head, targets, softcap, vocab_major, temperature=1.0, stat="mean"):
    # The primal alone (a reference pass, evaluation): no gradient work, so the checkpoint is inert.
    return _remat_logps(hidden, head, targets, softcap, vocab_major, temperature, stat)


def _fused_logps_fwd(hidden, head, targets, softcap, vocab_major, temperature, stat):
    vocab = head_vocab(head, vocab_major)
    xs, ys, unchunk = _chunked(hidden, targets, vocab)

    def chunk(inp):
        xc, yc = inp
        logp, mean_logit, z, lse, th = _chunk_logps(xc, yc, head, softcap, vocab_major, temperature, stat)
        # d logp / d z = onehot(target) - softmax(z), z the logits over the temperature; back through the
        # temperature (1 / T) and the cap (1 - tanh^2); then to the hidden state.
        dz = (jnp.arange(vocab, dtype=yc.dtype) == yc[..., None]) - jnp.exp(z - lse[..., None])
        if temperature != 1.0:
            dz = dz / temperature
        if th is not None:
            dz = dz * (1.0 - th * th)
        dx = jnp.einsum("bcv,vd->bcd" if vocab_major else "bcv,dv->bcd", dz, head,
                        preferred_element_type=jnp.float32).astype(hidden.dtype)
        return logp, mean_logit, dx

    logp, mean_logit, dx = jax.lax.map(chunk, (xs, ys))
    return (unchunk(logp), unchunk(mean_logit)), (unchunk(dx), head)


def _fused_logps_bwd(softcap, vocab_major, temperature, stat, res, g):
    dx, head = res
    g_logp, _ = g  # the mean logit is a metric: no gradient flows from it
    return (g_logp[..., None] * dx).astype(dx.dtype), jnp.zeros_like(head), None


_fused_logps.defvjp(_fused_logps_fwd, _fused_logps_bwd)
