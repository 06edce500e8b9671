"""DeepSeek-V3.2's lightning indexer: its projections of one layer's input (transformers' ``DeepseekV32Indexer``),
what :mod:`zoo.kernels.sparse_topk` scores to pick each query's keys.

The index queries come from MLA's query latent (``q_a`` then ``q_a_norm``, shared with the attention), ``heads``
of them per token; the one index key per token from the layer's input through ``idx_k`` and a LayerNorm; the head
weights from the input through ``idx_w`` (float32, as transformers keeps ``weights_proj``), times heads**-0.5. The
first ``qk_rope_head_dim`` dims of each index query and key turn by RoPE in rotate-half order (transformers' indexer
does not interleave them, unlike MLA's own rope dims). DeepSeek's reference also turns both by a Hadamard
transform before its FP8 scoring kernel; the transform is orthogonal (dot products unchanged), so transformers
skips it and so does this.

No gradient flows through the indexer (transformers runs it under ``torch.no_grad``): its outputs are stopped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.layers.blocks import layer_norm, rms_norm
from zoo.model.config import ModelConfig
from zoo.model.rope import apply_rope

EPS = 1e-6  # transformers hard-codes the indexer's k_norm eps (and MLA's latent norms')


def indexer_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The indexer's (queries [b, t, heads, dim], keys [b, t, dim], head weights float32 [b, t, heads]) of one
    layer's (already normed) input x [b, t, embed], roped by cos/sin (MLA's tables); no gradient flows back."""
    x = jax.lax.stop_gradient(x)
    p = jax.lax.stop_gradient({name: p[name] for name in ("q_a", "q_a_norm", "idx_q", "idx_k", "idx_k_norm",
                                                          "idx_k_norm_bias", "idx_w")})
    q_lat = rms_norm(x @ p["q_a"], p["q_a_norm"], EPS)  # MLA's query latent (XLA shares the matmul with it)
    iq = apply_rope(jnp.einsum("btc,chd->bthd", q_lat, p["idx_q"]), cos, sin)
    ik = layer_norm(x @ p["idx_k"], p["idx_k_norm"], p["idx_k_norm_bias"], EPS)
    ik = apply_rope(ik[:, :, None], cos, sin)[:, :, 0]
    iw = jnp.einsum("bte,eh->bth", x.astype(jnp.float32), p["idx_w"].astype(jnp.float32))
    return iq, ik, iw * cfg.index_n_heads ** -0.5
