"""The next-token cross-entropy of the output head, fused and chunked: no [tokens, vocab] array is kept.

A plain ``logsumexp(x @ head) - target logit`` keeps the float32 logits of
every token for the backward pass (and builds their gradient, as large,
beside them): at 4,096 tokens and SmolLM2's 49,152-word vocabulary that is
0.75 GiB each, the largest activations of a training step. Here the loss is
linear in the per-token losses (a weighted sum), so the gradient with
respect to the logits is known in the forward pass up to one scalar (the
cotangent of the sum): each chunk of tokens computes its logits, its losses
and at once its contribution to the gradients of the hidden states and the
head, and drops its logits. The backward pass only scales. FLOPs are those of
the unfused loss (no recomputation), and memory holds one chunk's logits.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from zoo.kernels.choice import device_count, platform

CHUNK_ELEMENTS = 2**23  # on the CPU, logits per chunk (32 MiB of float32) over the whole batch
# On accelerators, logits per chunk on each device (512 MiB of float32: 1,024 tokens of a 128k vocabulary): the
# chunk's matmul must be thick enough for a matrix unit. CPU-sized chunks gave 64-token matmuls on an H200
# (Llama-3.1-8B, 4 x 4096 tokens: 256 sequential [64 x 4096] x [4096 x 128256] products a step).
ACCELERATOR_CHUNK_ELEMENTS = 2**27


def chunk_length(vocab: int, batch: int, seq: int) -> int:
    """Sequence positions per chunk, at most ``seq``: about :data:`CHUNK_ELEMENTS` logits over the batch on the
    CPU; on accelerators about :data:`ACCELERATOR_CHUNK_ELEMENTS` over each device's share of the batch (the
    batch axis is the one the mesh shards)."""
    if platform() == "cpu":
        return max(1, min(seq, CHUNK_ELEMENTS // (vocab * batch)))
    local = -(-batch // device_count())
    return max(1, min(seq, ACCELERATOR_CHUNK_ELEMENTS // (vocab * local)))


def next_token_nll_sum(x: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array,
                       softcap: float | None = None, head_grad: bool = True, vocab_major: bool = False) -> jax.Array:
    """``sum(weights * -log_softmax(softcap(x @ head))[targets])`` over all tokens, as a float32 scalar.

    x [batch, seq, hidden] are the final (normed) hidden states, head [hidden, vocab]
    the output weight, targets [batch, seq] int token ids, weights [batch, seq] float per-token
    weights (0 for tokens that are not trained). ``softcap`` applies Gemma 2's
    ``cap * tanh(logits / cap)`` first. With ``head_grad=False`` (LoRA: the head
    is frozen) the head's gradient is not computed at all; it is then zero.
    Differentiable in x and head; targets and weights are data.

    ``vocab_major`` takes the head as [vocab, hidden], a tied embedding as it
    is stored: read in place, where ``embed.T`` would be copied (113 MB at
    SmolLM2's size) for the matmuls.
    """
    return _nll_sum(x, head, targets, weights, softcap, head_grad, vocab_major)


def _chunks(x: jax.Array, targets: jax.Array, weights: jax.Array, vocab: int):
    """x [b, t, hidden], targets and weights [b, t] as [chunks, b, c, ...] along the sequence (zero-weight
    padding at its end). Chunking the sequence, not the flattened tokens, keeps the batch axis (the one a
    mesh shards) intact in every chunk."""
    b, t, h = x.shape
    c = chunk_length(vocab, b, t)
    pad = (-t) % c
    w = weights.astype(jnp.float32)
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        targets, w = jnp.pad(targets, ((0, 0), (0, pad))), jnp.pad(w, ((0, 0), (0, pad)))
    k = (t + pad) // c
    split = lambda a: jnp.moveaxis(a.reshape((b, k, c) + a.shape[2:]), 1, 0)  # noqa: E731
    return split(x), split(targets), split(w), t


def chunk_logits(xc: jax.Array, head: jax.Array, softcap: float | None,
            vocab_major: bool) -> tuple[jax.Array, jax.Array | None]:
    """(capped float32 logits [b, c, vocab], tanh of the cap or None) of one chunk."""
    z = jnp.einsum("bck,vk->bcv" if vocab_major else "bck,kv->bcv", xc, head, preferred_element_type=jnp.float32)
    if not softcap:
        return z, None
    t = jnp.tanh(z / softcap)
    return softcap * t, t


def _token_nll(z: jax.Array, tc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(per-token nll [b, c], logsumexp [b, c]) of logits z [b, c, vocab] for targets tc [b, c]."""
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0], lse


def head_vocab(head: jax.Array, vocab_major: bool) -> int:
    """The vocabulary size of an output head in either layout."""
    return head.shape[0] if vocab_major else head.shape[-1]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _nll_sum(x, head, targets, weights, softcap, head_grad, vocab_major):
    # The primal alone (evaluation): chunked losses, no gradient work.
    xs, ts, ws, _ = _chunks(x, targets, weights, head_vocab(head, vocab_major))

    def body(total, inp):
        xc, tc, wc = inp
        nll, _ = _token_nll(chunk_logits(xc, head, softcap, vocab_major)[0], tc)
        return total + (nll * wc).sum(), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts, ws))
    return total


def _nll_sum_fwd(x, head, targets, weights, softcap, head_grad, vocab_major):
    vocab = head_vocab(head, vocab_major)
    xs, ts, ws, t = _chunks(x, targets, weights, vocab)

    def body(carry, inp):
        total, dhead = carry
        xc, tc, wc = inp
        z, t = chunk_logits(xc, head, softcap, vocab_major)
        nll, lse = _token_nll(z, tc)
        # d(sum w * nll)/dz = w * (softmax(z) - onehot(target)); through the cap, times 1 - tanh^2.
        onehot = jnp.arange(vocab, dtype=tc.dtype) == tc[..., None]
        dz = (jnp.exp(z - lse[..., None]) - onehot) * wc[..., None]
        if t is not None:
            dz = dz * (1.0 - t * t)
        dx = jnp.einsum("bcv,vk->bck" if vocab_major else "bcv,kv->bck", dz, head,
                        preferred_element_type=jnp.float32).astype(x.dtype)
        if head_grad:  # [hidden, vocab], contracting the tokens: XLA transposes the first operand, the small xc
            dhead = dhead + jnp.einsum("bck,bcv->kv", xc.astype(jnp.float32), dz)
        return (total + (nll * wc).sum(), dhead), dx

    dhead0 = jnp.zeros((x.shape[-1], vocab), jnp.float32) if head_grad else jnp.zeros((), jnp.float32)
    (total, dhead), dx = jax.lax.scan(body, (jnp.zeros((), jnp.float32), dhead0), (xs, ts, ws))
    dx = jnp.moveaxis(dx, 0, 1).reshape(x.shape[0], -1, x.shape[-1])[:, :t]
    # The head rides along only for its dtype and shape (it is a live parameter: no copy).
    if head_grad and vocab_major:
        dhead = dhead.T  # once per step, not per chunk
    return total, (dx, dhead if head_grad else None, head)


def _nll_sum_bwd(softcap, head_grad, vocab_major, res, g):
    dx, dhead, head = res
    dh = (g * dhead).astype(head.dtype) if head_grad else jnp.zeros_like(head)
    return (g * dx).astype(dx.dtype), dh, None, None


_nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)
