"""The gated MLP of one decoder layer (SwiGLU / GeGLU), run over sequence chunks for long batches.

Mixture-of-experts layers use :mod:`zoo.layers.moe` instead; both share the
activations and LoRA pieces of :mod:`zoo.layers.blocks` and :mod:`zoo.lora.projections`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.kernels.choice import platform
from zoo.layers.blocks import ACTIVATIONS, glu_dense, glu_down
from zoo.lora.projections import LayerLora, adapter_of, lora_out, projections
from zoo.model.config import ModelConfig
from zoo.model.sharding import batch_sharded

MLP_CHUNK_TOKENS = 1024  # tokens per MLP chunk (see mlp): [1024, mlp] buffers instead of [batch * seq, mlp]


def mlp_chunks(batch: int, seq: int) -> int:
    """How many sequence chunks :func:`mlp` runs in: on the CPU the largest divisor n of ``seq`` with
    batch * seq / n >= MLP_CHUNK_TOKENS (1 when the whole batch is that small); on accelerators 1.

    On a TPU slice the chunks cost memory rather than save it: the scan's saved gate and up came out with the
    global batch on every chip (Llama-3.1-8B, 8 chips, 2048 tokens a chip: two 14 GiB buffers a chip, by the
    compiler's memory report), and a chip's own [tokens, mlp] buffers are small beside its HBM."""
    if platform() != "cpu":
        return 1
    most = batch * seq // MLP_CHUNK_TOKENS
    return max([n for n in range(1, min(most, seq) + 1) if seq % n == 0], default=1)


def mlp(x: jax.Array, p: dict, cfg: ModelConfig, norm_w: jax.Array | None = None,
        lora: LayerLora | None = None) -> jax.Array:
    """Gated MLP (SwiGLU / GeGLU): down(act(gate(x)) * up(x)); with ``norm_w`` x is first RMS-normed by it.

    ``lora`` is this layer's LoRA: adapters by weight name (gate, up, down), their scale and dropout.

    The MLP works on each token alone, so a long batch runs as a scan over
    chunks of the sequence (:func:`mlp_chunks`), each about MLP_CHUNK_TOKENS
    tokens: the backward pass's [tokens, mlp]-wide temporaries (the gate and
    up gradients, the activation's, the recomputed products) then exist for
    one chunk at a time, where they were the step's largest buffers. The
    batch axis is never split, so the chunks keep x's data sharding. Results
    are those of one pass up to float summation order of the weight gradients.
    """
    b, t, _ = x.shape
    dropout = lora is not None and lora.drop is not None
    n = 1 if dropout else mlp_chunks(b, t)  # dropout masks are drawn for x's whole shape
    if n == 1:
        return _mlp(x, p, cfg, norm_w, lora)
    xs = jnp.moveaxis(x.reshape(b, n, t // n, -1), 1, 0)
    ys = jax.lax.map(lambda xc: _mlp(xc, p, cfg, norm_w, lora), xs)  # no dropout here: one chunk above
    return jnp.moveaxis(ys, 0, 1).reshape(b, t, -1)


def _mlp(x: jax.Array, p: dict, cfg: ModelConfig, norm_w: jax.Array | None, lora: LayerLora | None) -> jax.Array:
    """:func:`mlp` in one pass over x; the LoRA adapter of ``down`` joins :func:`zoo.layers.blocks.glu_dense` when it can."""
    names = ("gate", "up")
    gate, up = projections(x, (p["gate"], p["up"]), cfg, norm_w, lora, names)
    gate, up = batch_sharded(gate), batch_sharded(up)  # kept for the backward pass: each chip its own rows
    if cfg.mlp_bias:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    down = adapter_of(lora, "down")
    if lora is None or down is None:
        out = glu_down(gate, up, p["down"], cfg.hidden_act)
    elif lora.drop is not None or lora.rows:
        # The adapter reads a dropped copy of act(gate) * up, or each row its own adapter (a batched matmul), so
        # it cannot share glu_dense's product.
        out = glu_down(gate, up, p["down"], cfg.hidden_act)
        h = ACTIVATIONS[cfg.hidden_act](gate) * up
        out = out + lora.apart(h, "down", out.dtype)
    else:
        out, u = glu_dense(gate, up, (p["down"], down["a"]), cfg.hidden_act)
        out = out + lora_out(u, down["b"], lora.scale, out.dtype)
    if cfg.mlp_bias:
        out = out + p["down_bias"]
    return out
