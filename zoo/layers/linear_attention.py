"""Qwen3-Next's linear-attention layer (Gated DeltaNet), as transformers' ``Qwen3NextGatedDeltaNet`` computes it.

The (normed) input is projected to q, k (``linear_key_heads`` heads), v and the output gate z
(``linear_value_heads`` heads), and to b and a (one each per value head). q, k and v pass through a causal
depthwise convolution with SiLU (:func:`zoo.kernels.gated_delta.causal_conv`), q and k are L2-normalized (q also
scaled by 1/sqrt(k_dim)) and repeated to the value heads, and the gated delta rule runs with beta = sigmoid(b) and
the log decay g = -exp(A_log) * softplus(a + dt_bias) (:mod:`zoo.kernels.gated_delta`). Its output is
RMS-normed per head, times ``lin_norm`` and SiLU(z) (transformers' ``Qwen3NextRMSNormGated``), and projected out.

A layer's decoding state is a dict: ``conv`` [b, kernel - 1, q + k + v channels] (the last inputs of the
convolution) and ``rec`` [b, value heads, k_dim, v_dim] (the delta rule's state): fixed-size, whatever the length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.kernels.gated_delta import causal_conv, gated_delta_chunked, gated_delta_step
from zoo.lora.projections import LayerLora, adapted_dense, projections
from zoo.model.config import ModelConfig

CHUNK = 64  # the chunked delta rule's chunk (FLA's and transformers' default)
PROJECTIONS = ("lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a")


def _l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, in float32 (FLA's and transformers' l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def gated_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float, dtype: jnp.dtype) -> jax.Array:
    """RMSNorm of o [..., v_dim] (float32) cast to ``dtype``, times w, times SiLU(z) in float32; cast to ``dtype``."""
    o = o.astype(jnp.float32)
    normed = (o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)).astype(dtype)
    return ((w * normed).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)


def linear_attention(x: jax.Array, p: dict, cfg: ModelConfig, segment_ids: jax.Array,
                     norm_w: jax.Array | None = None, lora: LayerLora | None = None,
                     state: dict | None = None) -> tuple[jax.Array, dict]:
    """One Gated DeltaNet layer of x [b, t, embed] (RMS-normed by ``norm_w`` first, fused with the projections);
    returns (output [b, t, embed], the new decoding state).

    ``segment_ids`` [b, t]: packed documents and padding (0) as :mod:`zoo.kernels.gated_delta` takes them (real
    tokens before padding where a state is read or returned). ``state`` (None: zeros) is the state the row's
    first document continues (decoding); one new token per row runs the one-token step. ``lora``: the layer's
    adapters of the ``lin_*`` projections.
    """
    b, t, _ = x.shape
    nk, nv = cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q, k, v, z, bb, a = projections(x, tuple(p[n] for n in PROJECTIONS), cfg, norm_w, lora, PROJECTIONS)
    mixed = jnp.concatenate([q, k, v], axis=-1)
    mixed, conv = causal_conv(mixed, p["lin_conv"], segment_ids, None if state is None else state["conv"])
    q, k, v = jnp.split(mixed, [nk * dk, 2 * nk * dk], axis=-1)
    r = nv // nk  # value heads per key head: each q/k head serves r consecutive value heads
    q = jnp.repeat(_l2norm(q.reshape(b, t, nk, dk)) * dk**-0.5, r, axis=2)
    k = jnp.repeat(_l2norm(k.reshape(b, t, nk, dk)), r, axis=2)
    v = v.reshape(b, t, nv, dv)
    beta = jax.nn.sigmoid(bb.astype(jnp.float32))
    g = -jnp.exp(p["lin_a_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["lin_dt_bias"].astype(jnp.float32))
    if state is not None and t == 1:  # decoding: one token's step; a padded row keeps its state
        o, rec = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state["rec"])
        rec = jnp.where((segment_ids[:, 0] != 0)[:, None, None, None], rec, state["rec"].astype(rec.dtype))
        o = o[:, None]
    else:
        o, rec = gated_delta_chunked(q, k, v, g, beta, segment_ids, CHUNK, None if state is None else state["rec"])
    o = gated_norm(o, z.reshape(b, t, nv, dv), p["lin_norm"], cfg.rms_norm_eps, x.dtype)
    out = adapted_dense(o.reshape(b, t, nv * dv), p["lin_out"], lora, "lin_out", contract=2)
    return out, {"conv": conv, "rec": rec}
