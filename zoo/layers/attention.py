"""Self-attention of one decoder layer: grouped-query attention and DeepSeek's multi-head latent attention.

The projections into heads (:func:`qkv_heads`, :func:`mla_heads`), the
head-major layout of the attention kernels (:func:`head_major`) and the
output projection (:func:`output_projection`) are separate functions so that
the cached forward of :mod:`zoo.model.decode` runs exactly the same code around its
own cache reads and writes; only attending over cache slots differs there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zoo.errors import UserError
from zoo.kernels.blockwise import blockwise_attention, query_block
from zoo.kernels.choice import cudnn_attention, kernel_for, platform
from zoo.layers.blocks import rms_norm
from zoo.lora.projections import LayerLora, adapted_dense, projections
from zoo.model.config import ModelConfig
from zoo.model.context import context_attention, context_size
from zoo.model.layer_scan import ATTENTION_PROJ
from zoo.model.masks import Visibility
from zoo.model.rope import apply_rope


def qkv_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, cfg: ModelConfig,
              norm_w: jax.Array | None = None, lora: LayerLora | None = None,
              shared_kv: tuple[jax.Array, jax.Array] | None = None, rope_on: jax.Array | None = None,
              q_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`qkv_gate_heads` without the output gate."""
    return qkv_gate_heads(x, p, cos, sin, cfg, norm_w, lora, shared_kv, rope_on, q_scale)[:3]


def qkv_gate_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, cfg: ModelConfig,
                   norm_w: jax.Array | None = None, lora: LayerLora | None = None,
                   shared_kv: tuple[jax.Array, jax.Array] | None = None, rope_on: jax.Array | None = None,
                   q_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Roped q and k, and v, [batch, seq, heads, head_dim] (biases and q/k norms applied) of one attention layer.

    With ``norm_w`` x is first RMS-normed by it (fused with the projections:
    see :func:`zoo.lora.projections.projections`); ``lora`` is this layer's
    LoRA (its q/k/v adapters, their scale and dropout). Gemma 4: a layer without a
    ``v`` weight takes its values from the key projection (before the key's
    norm and RoPE), ``cfg.v_norm`` RMS-normalizes values without a weight, and
    a KV-shared layer (no ``k``) returns ``shared_kv``, another layer's keys and values. Llama 4:
    ``cfg.qk_l2_norm`` RMS-normalizes the roped q and k without a weight where ``rope_on`` (the layer's RoPE flag,
    :func:`zoo.model.rope.rope_flags`; None: every layer) is set, and ``q_scale`` [b, t] (its attention
    temperature, :func:`zoo.model.rope.layer_query_scale`) multiplies the queries. Qwen3-Next
    (``cfg.attn_output_gate``): the fourth output is the output gate [b, t, heads * head_dim] (``attn_gate``'s
    projection, the second half of transformers' q_proj), None for every other model.
    """
    b, t, _ = x.shape
    names = tuple(n for n in ("q", "k", "v", "attn_gate") if n in p)
    ys = tuple(checkpoint_name(y, ATTENTION_PROJ)  # what remat: offload keeps in host memory
               for y in projections(x, tuple(p[n] for n in names), cfg, norm_w, lora, names))
    heads = dict(zip(names, (y.reshape(b, t, -1, cfg.head_dim) for y in ys)))
    gate = heads["attn_gate"].reshape(b, t, -1) if "attn_gate" in heads else None
    q, k = heads["q"], heads.get("k")
    v = heads.get("v", k)
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q = qk_norm(q, p["q_norm"], cfg)
        k = None if k is None else qk_norm(k, p["k_norm"], cfg)
    if shared_kv is not None:
        return apply_rope(q, cos, sin), *shared_kv, gate
    assert k is not None and v is not None, "a layer without key weights needs shared_kv"
    if cfg.v_norm:
        v = rms_norm(v, jnp.ones(v.shape[-1:], v.dtype), cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.qk_l2_norm:  # Llama 4: after RoPE, without a weight, on RoPE layers only
        q, k = _l2_norm(q, cfg, rope_on), _l2_norm(k, cfg, rope_on)
    if q_scale is not None:
        q = (q * q_scale[:, :, None, None]).astype(q.dtype)
    return q, k, v, gate


def _l2_norm(x: jax.Array, cfg: ModelConfig, rope_on: jax.Array | None) -> jax.Array:
    """Llama 4's weightless RMSNorm of q or k [b, t, heads, head_dim] over each head, where ``rope_on`` is set."""
    normed = rms_norm(x, jnp.ones(x.shape[-1:], x.dtype), cfg.rms_norm_eps)
    return normed if rope_on is None else jnp.where(rope_on > 0, normed, x)


def qk_norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RMSNorm of q or k [b, t, heads, head_dim] by w: per head (w [head_dim]), or with ``qk_norm_span`` "all"
    over all heads at once (w [heads, head_dim]: OLMo 2/3 normalize the whole projection output)."""
    if cfg.qk_norm_span == "all":
        flat = rms_norm(x.reshape(*x.shape[:2], -1), w.reshape(-1), cfg.rms_norm_eps, cfg.norm_offset)
        return flat.reshape(x.shape)
    return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)


def head_major(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [b, t, hq, d], k and v [b, t, hk, d] -> q [b, hk, group, t, d], k and v [b, hk, t, d].

    Each key/value head comes with its group of query heads, so grouped-query
    attention folds the group into the rows of one matmul per key/value head
    and never repeats K/V (see :func:`zoo.kernels.blockwise.blockwise_attention`).
    """
    b, t, hq, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, t, hk, hq // hk, d).transpose(0, 2, 3, 1, 4)
    return qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def causal_attention(qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | Visibility, cfg: ModelConfig,
                     window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention of head-major q/k/v (:func:`head_major`) under a causal ``mask``: a
    :class:`zoo.model.masks.Visibility` (each block's mask built in the block) or bool [b, 1, t, t] (the cached forward's).

    Computed in query blocks (:func:`zoo.kernels.blockwise.blockwise_attention`), so
    key blocks that the causal mask (and ``window``, the sliding window the
    mask was built with) hide are skipped. ``sinks`` [heads]: gpt-oss's attention sinks (one more logit per head
    in the softmax's denominator). Returns [b, t, heads * head_dim].
    """
    return blockwise_attention(qg, k, v, mask, cfg.attn_scale, cfg.attn_softcap, window, query_block(qg.shape[3]),
                               sinks)


def splash_heads(qg: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, cfg: ModelConfig,
                 window: int | None = None, cap: float | None = None) -> jax.Array:
    """:func:`causal_attention` through the splash kernel (:mod:`zoo.kernels.splash`), with no mask: causal by index within
    the documents of ``segment_ids`` [b, t] (None: one per row), ``window`` wide; interpreted off a TPU."""
    from zoo.kernels.splash import splash_attention

    if segment_ids is None:
        segment_ids = jnp.ones(qg.shape[:1] + qg.shape[3:4], jnp.int32)
    return splash_attention(qg, k, v, segment_ids, cfg.attn_scale, cap, window, interpret=platform() != "tpu")


def attend(qg: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility, cfg: ModelConfig,
           sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of head-major q [b, kv, g, t, d], k [b, kv, t, d], v [b, kv, t, dv] under ``vis`` (its
    window too), logits soft-capped by ``cfg.attn_softcap``, through the kernel of ``cfg.attention`` (:func:`zoo.kernels.choice.kernel_for`);
    -> [b, t, kv * g * dv]. With the mesh's ``context`` axis over 1 the sequence is split over it
    (:func:`zoo.model.context.context_attention`): each device attends its queries to the gathered keys. ``sinks``
    [heads] (gpt-oss's attention sinks) only the blockwise kernel takes (:func:`zoo.kernels.choice.sinks_obstacle`);
    Llama 4's chunked layers (``vis.chunk_ids``) always run blockwise."""
    kernel = kernel_for(cfg, qg.dtype, qg.shape[3], vis.prefix_ids is not None, vis.segments, vis.block_ids is not None)
    if vis.chunk_ids is not None:  # Llama 4's chunks are a mask only the blockwise kernel builds (its full layers: any)
        kernel = "blockwise"

    def run(qg: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility) -> jax.Array:
        if kernel == "splash" and k.shape[2] != qg.shape[3]:  # a context shard's queries, the gathered keys
            from zoo.kernels.splash import splash_shard

            return splash_shard(qg, k, v, vis, cfg.attn_scale, cfg.attn_softcap, interpret=platform() != "tpu")
        if kernel == "splash":
            return splash_heads(qg, k, v, vis.segment_ids, cfg, vis.window, cfg.attn_softcap)
        if kernel == "cudnn":
            return cudnn_attention(qg, k, v, vis, cfg.attn_scale)
        return causal_attention(qg, k, v, vis, cfg, vis.window, sinks)

    return context_attention(run, qg, k, v, vis) if context_size() > 1 else run(qg, k, v, vis)


def output_projection(out: jax.Array, p: dict, cfg: ModelConfig, lora: LayerLora | None = None,
                      gate: jax.Array | None = None) -> jax.Array:
    """The attention output [b, t, heads * head_dim] through ``o`` (plus its bias and LoRA adapter) -> [b, t, embed];
    ``gate`` (Qwen3-Next's output gate, :func:`qkv_gate_heads`) scales it by sigmoid(gate) first.

    ``o`` keeps its stored [heads, head_dim, embed] shape (``contract=2``),
    so the backward pass reads the parameter itself.
    """
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    out = adapted_dense(out, p["o"], lora, "o", contract=2)
    if cfg.o_bias:
        out = out + p["o_bias"]
    return checkpoint_name(out, ATTENTION_PROJ)  # what remat: offload keeps in host memory


def attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, vis: Visibility, cfg: ModelConfig,
              norm_w: jax.Array | None = None, lora: LayerLora | None = None,
              shared_kv: tuple[jax.Array, jax.Array] | None = None, rope_on: jax.Array | None = None,
              q_scale: jax.Array | None = None) -> jax.Array:
    """Grouped-query self-attention of one layer; x [batch, seq, embed].

    ``vis`` says which keys each query sees (:class:`zoo.model.masks.Visibility`: packed documents, the layer's
    sliding window, shared prefixes); no kernel builds it as a [seq, seq] mask (:mod:`zoo.kernels.choice`). With ``norm_w`` x is first RMS-normed by it.
    ``lora`` is this layer's LoRA: adapters by weight name (q, k, v, o), their scale and dropout. ``cfg.attention`` picks the kernel (:func:`attend`).
    ``shared_kv``: a KV-shared layer's keys and values [b, t, kv_heads, head_dim]; ``rope_on``, ``q_scale``: Llama
    4's (see :func:`qkv_heads`).
    """
    q, k, v, gate = qkv_gate_heads(x, p, cos, sin, cfg, norm_w, lora, shared_kv, rope_on, q_scale)
    out = attend(*head_major(q, k, v), vis, cfg, p["sinks"] if cfg.attn_sinks else None)
    return output_projection(out, p, cfg, lora, gate)


def mla_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array,
              cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """MLA's projections of (already normed) x [b, t, embed]: q_nope and roped q_pe [b, t, heads, .],
    the normed kv latent [b, t, kv_lora_rank] and the roped shared key k_pe [b, t, qk_rope_head_dim].

    The latent and k_pe are what a KV cache keeps (:mod:`zoo.model.decode`); the
    per-head keys and values are expanded from the latent through ``kv_b``.
    The RoPE dimensions are stored de-interleaved (the converter permutes
    them), so the usual rotate-half RoPE applies.
    """
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        # transformers hard-codes eps=1e-6 for the two latent norms.
        q = jnp.einsum("btc,chd->bthd", rms_norm(x @ p["q_a"], p["q_a_norm"], 1e-6), p["q_b"])
    else:
        q = jnp.einsum("bte,ehd->bthd", x, p["q"])
    kv = x @ p["kv_a"]
    latent = rms_norm(kv[..., :r], p["kv_a_norm"], 1e-6)
    # The shared key is one "head" for apply_rope's [b, t, heads, d] layout.
    k_pe = apply_rope(kv[..., None, r:], cos, sin)[:, :, 0]
    return q[..., :dn], apply_rope(q[..., dn:], cos, sin), latent, k_pe


def mla_attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, vis: Visibility,
                  cfg: ModelConfig) -> jax.Array:
    """DeepSeek's multi-head latent attention of (already normed) x: q and kv through low-rank latents,
    a shared RoPE key (see :func:`mla_heads`), attending under ``vis`` (:func:`attend`: blockwise, or splash,
    whose query/key heads may differ in size from its value heads; cuDNN cannot)."""
    dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope, q_pe, latent, k_pe = mla_heads(x, p, cos, sin, cfg)
    kv = jnp.einsum("btr,rhd->bthd", latent, p["kv_b"])
    k_nope, v = kv[..., :dn], kv[..., dn:]
    q = jnp.concatenate([q_nope, q_pe], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None], k_nope.shape[:-1] + (dr,))], axis=-1)
    if cfg.sparse:  # DeepSeek-V3.2: each query attends to the keys its indexer picks
        out = sparse_heads(x, p, cos, sin, q, k, v, vis, cfg)
        return jnp.einsum("bthd,hde->bte", out.reshape(v.shape), p["o"])
    # One query head per key/value head: [b, h, 1, t, d], as head_major's.
    qg = q.transpose(0, 2, 1, 3)[:, :, None]
    out = attend(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), vis, cfg)
    return jnp.einsum("bthd,hde->bte", out.reshape(v.shape), p["o"])


def sparse_heads(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                 vis: Visibility, cfg: ModelConfig) -> jax.Array:
    """DeepSeek sparse attention (:func:`zoo.kernels.sparse_topk.sparse_attention`) of MLA's q, k [b, t, h, d]
    and v [b, t, h, dv] over the keys the layer's indexer (:func:`zoo.layers.indexer.indexer_heads` of the normed
    input x) picks -> [b, t, h * dv]. Its own kernel on every platform; context parallelism is refused."""
    from zoo.kernels.sparse_topk import sparse_attention
    from zoo.layers.indexer import indexer_heads

    if context_size() > 1:
        raise UserError("DeepSeek sparse attention (index_topk) has no context parallelism: set mesh.context: 1")
    iq, ik, iw = indexer_heads(x, p, cos, sin, cfg)
    head = (0, 2, 1, 3)
    return sparse_attention(q.transpose(head), k.transpose(head), v.transpose(head), iq, ik, iw, vis,
                            cfg.attn_scale, cfg.index_topk)
