"""Mixture-of-experts MLP: routing (softmax/sigmoid, group-limited top-k), dropless or capacity dispatch.

Experts are stacked ``[experts, ...]`` in one parameter per projection and
sharded over the ``expert`` mesh axis. The default dispatch is exact
(dropless): assignments are sorted by expert and run through one grouped
matmul (``jax.lax.ragged_dot`` on TPUs, blocks of one expert elsewhere: :mod:`zoo.layers.grouped`). With ``capacity_factor`` set, each expert
takes at most ``ceil(capacity_factor * tokens * k / experts)`` tokens in
fixed-size buffers (GShard-style dispatch/combine einsums: static shapes,
faster on accelerators) and the tokens over capacity are dropped and counted.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zoo.layers.blocks import ACTIVATIONS, dense
from zoo.layers.grouped import grouped_matmul, grouped_matmul_lora
from zoo.lora.projections import LayerLora, LoraDropout, adapter_of, drop_of, lora_out
from zoo.model.config import ModelConfig
from zoo.model.quant import QuantizedWeight, materialize

STAT_KEYS = ("expert_counts", "router_prob_sum", "router_lse_sq_sum", "dropped_tokens", "tokens")


def route(x: jax.Array, p: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k expert ids [N, k], their weights [N, k] and the raw router logits [N, X] for tokens x [N, E]."""
    logits = jnp.dot(x.astype(jnp.float32), p["router"].astype(jnp.float32))
    if cfg.router_logits_bias:  # gpt-oss: a bias on the logits themselves (selection and weights)
        logits = logits + p["router_logit_bias"].astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if cfg.router_score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    select = scores + p["router_bias"].astype(jnp.float32) if cfg.router_bias else scores
    if cfg.router_groups > 1:
        n, x_ = select.shape
        grouped = select.reshape(n, cfg.router_groups, x_ // cfg.router_groups)
        if cfg.router_group_score == "top2":
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_score = grouped.max(-1)
        _, keep = jax.lax.top_k(group_score, cfg.router_topk_groups)
        keep_mask = jnp.zeros_like(group_score, dtype=bool).at[jnp.arange(n)[:, None], keep].set(True)
        select = jnp.where(jnp.repeat(keep_mask, x_ // cfg.router_groups, axis=-1), select, -jnp.inf)
    _, ids = jax.lax.top_k(select, cfg.experts_per_token)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.router_norm_topk:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.router_scale, logits


def expert_glu(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The experts' gated activation: act(gate) * up, or with ``swiglu_limit`` gpt-oss's clamped SwiGLU
    (transformers' GptOssExperts._apply_gate: gate clamped above, up both sides, (up + 1) * gate * sigmoid(alpha
    * gate))."""
    if cfg.swiglu_limit is None:
        return ACTIVATIONS[cfg.hidden_act](gate) * up
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def _with_bias(y: jax.Array, p: dict, name: str, experts: jax.Array, cfg: ModelConfig) -> jax.Array:
    """y [N, out], rows sorted by expert (``experts`` [N], each row's expert), plus each row's expert's bias of
    weight ``name`` where the model has expert biases (gpt-oss)."""
    if not cfg.expert_bias:
        return y
    b = p[name + "_bias"]
    return y + b[jnp.clip(experts, 0, b.shape[0] - 1)].astype(y.dtype)


def _adapter_input(x: jax.Array, name: str, drop: LoraDropout | None) -> jax.Array:
    """What the adapter of weight ``name`` reads: x, or x with LoRA dropout (the base weight still reads x)."""
    return x if drop is None else drop(x, name)


def _ragged(xs: jax.Array, p: dict, name: str, sizes: jax.Array, lora: LayerLora | None) -> jax.Array:
    """xs [N, in] through each row's expert's weight ``name`` (rows sorted by expert, ``sizes`` per expert),
    plus the expert's LoRA adapter, ``scale * (xs @ A) @ B``, when the layer's ``lora`` has one.

    With LoRA dropout each row (one token's assignment to one expert) gets its own dropout mask, as each
    expert's own dropout would give it."""
    w = p[name]
    ad, drop = adapter_of(lora, name), drop_of(lora)
    if lora is None or ad is None:
        return _frozen_ragged_dot(xs, w, sizes) if isinstance(w, QuantizedWeight) else grouped_matmul(xs, w, sizes)
    scale = lora.scale
    if drop is None and not isinstance(w, QuantizedWeight):
        return grouped_matmul_lora(xs, w, ad["a"], ad["b"], scale, sizes)  # off TPUs, in the base's own loop
    y = _frozen_ragged_dot(xs, w, sizes) if isinstance(w, QuantizedWeight) else grouped_matmul(xs, w, sizes)
    xs = _adapter_input(xs, name, drop)
    # One dtype: the adapter path runs in the adapters' (float32 adapters on a bf16 base).
    u = grouped_matmul(xs.astype(ad["a"].dtype), ad["a"], sizes)
    return y + (scale * grouped_matmul(u, ad["b"].astype(u.dtype), sizes)).astype(y.dtype)


@jax.custom_vjp
def _frozen_ragged_dot(xs: jax.Array, qw: QuantizedWeight, sizes: jax.Array) -> jax.Array:
    """ragged_dot with a quantized (QLoRA) expert stack [X, in, out]: dequantized here and again in the
    backward pass, which keeps the quantized stack rather than a float copy and gives it no gradient."""
    return grouped_matmul(xs, materialize(qw).astype(xs.dtype), sizes)


def _frozen_ragged_dot_fwd(xs, qw, sizes):
    return _frozen_ragged_dot(xs, qw, sizes), (qw, sizes)


def _frozen_ragged_dot_bwd(res, g):
    import numpy as np

    from zoo.model.quant import zero_cotangent

    qw, sizes = res
    w = jnp.swapaxes(materialize(qw), -1, -2).astype(g.dtype)
    return grouped_matmul(g, w, sizes), zero_cotangent(qw), np.zeros(sizes.shape, jax.dtypes.float0)


_frozen_ragged_dot.defvjp(_frozen_ragged_dot_fwd, _frozen_ragged_dot_bwd)


def _experts_dropless(x: jax.Array, ids: jax.Array, weights: jax.Array, p: dict, cfg: ModelConfig,
                      lora: LayerLora | None = None) -> jax.Array:
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = x[token]
    rows = flat[order]
    h = expert_glu(*_gate_up(xs, p, sizes, lora, rows, cfg), cfg)
    y = _with_bias(_ragged(h, p, "expert_down", sizes, lora), p, "expert_down", rows, cfg)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y)


EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")
EXPERT_BIASES = ("expert_gate_bias", "expert_up_bias", "expert_down_bias")  # gpt-oss (cfg.expert_bias)
FUSED_GATE_UP = "expert_gate_up"  # Gemma 4's experts' gate and up in one stack [X, embed, 2 * moe_mlp], gate first


def _gate_up(xs: jax.Array, p: dict, sizes: jax.Array, lora: LayerLora | None, rows: jax.Array,
             cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(gate, up) of rows xs [N, in] (sorted by expert, ``rows`` each row's expert) through their experts: one
    grouped matmul per stack (plus its adapter and bias), or one of the fused stack (Gemma 4), whose adapter is one
    on the fused weight, as peft's on transformers' ``experts.gate_up_proj``."""
    if FUSED_GATE_UP in p:
        y = _ragged(xs, p, FUSED_GATE_UP, sizes, lora)
        return y[:, :y.shape[-1] // 2], y[:, y.shape[-1] // 2:]
    return (_with_bias(_ragged(xs, p, "expert_gate", sizes, lora), p, "expert_gate", rows, cfg),
            _with_bias(_ragged(xs, p, "expert_up", sizes, lora), p, "expert_up", rows, cfg))


def _stack_names(p: dict, cfg: ModelConfig) -> tuple[str, ...]:
    """The names of one layer's expert stacks (weights and biases) in ``p``."""
    if FUSED_GATE_UP in p:
        return FUSED_GATE_UP, "expert_down"
    return EXPERT_WEIGHTS + (EXPERT_BIASES if cfg.expert_bias else ())


def _expert_mesh(p: dict, drop: LoraDropout | None) -> jax.sharding.AbstractMesh | None:
    """The context mesh (:func:`zoo.model.sharding.mesh_context`, set while a train step is lowered) when it splits the
    experts (an ``expert`` axis over 1, dividing the experts) and the experts can run split (float or QLoRA's
    quantized stacks alike; no LoRA dropout); else None (the dropless path as written, partitioned by the
    compiler)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("expert", 1) == 1 or drop is not None:
        return None
    if _num_experts(p["expert_down"]) % mesh.shape["expert"]:
        return None
    return mesh


def _num_experts(w: jax.Array | QuantizedWeight) -> int:
    """The expert count of one layer's expert stack, float [experts, in, out] or quantized (QLoRA: its fields
    keep the leading expert axis, so expert parallelism splits them as it splits a float stack)."""
    return w.lead[0] if isinstance(w, QuantizedWeight) else w.shape[0]


def _experts_parallel(x: jax.Array, ids: jax.Array, weights: jax.Array, p: dict, cfg: ModelConfig,
                      mesh: jax.sharding.AbstractMesh, lora: LayerLora | None = None) -> jax.Array:
    """:func:`_experts_dropless`, expert-parallel: each device of the ``expert`` axis keeps its own experts
    (the stacks' expert axis split over it) and runs, for the tokens of its (data, fsdp) rows, only the
    assignments to them; the experts' outputs are summed over the axis (a psum).

    Left to the compiler, the dropless path's sort and grouped matmul over every expert were not split: each chip
    held every expert's weights of a layer and the rows of the global batch (DeepSeek-V3 on 64 v5p chips:
    seven 7 GiB [tokens x 8, 7168] buffers a chip). Here a chip holds its experts and its rows' assignments.
    Exact: the same sums as :func:`_experts_dropless` (rows of other experts are zeroed, not approximated).
    A QLoRA stack goes in the same way (each quantized field split on its leading expert axis) and each device
    dequantizes only its own experts; LoRA adapters, stacked on the expert axis, are split with their experts."""
    from jax.sharding import PartitionSpec as P

    from zoo.model.sharding import logical_to_spec

    n, k = ids.shape
    local_x = cfg.num_experts // mesh.shape["expert"]
    rows = logical_to_spec(("batch", None), x.shape, mesh)
    stacks = {name: p[name] for name in _stack_names(p, cfg)}
    adapters = {name: ad for name, ad in (lora.adapters if lora else {}).items() if name in stacks}
    scale = 1.0 if lora is None else lora.scale
    expert_split = P("expert")  # the other axes of a stack gathered, as FSDP gathers a layer's weights

    # a Python float stays one (weakly typed, closed over), as in _experts_dropless; a traced scale goes in
    static_scale = scale if isinstance(scale, (int, float)) else None

    def local(xb, ids, wb, stacks, adapters, scale):
        x, weights = xb[0], wb[0]
        scale = scale if static_scale is None else static_scale
        first = jax.lax.axis_index("expert") * local_x
        mine = (ids >= first) & (ids < first + local_x)
        flat = jnp.where(mine, ids - first, local_x).reshape(-1)  # other experts' assignments sort last
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=local_x).astype(jnp.int32)
        # Rows past the local experts' groups (assignments to other experts) are in no group of the grouped
        # matmul, whose outputs there (and gradients into them) are not defined: zeroed on the way in and out.
        ours = (flat[order] < local_x)[:, None]
        xs = jnp.where(ours, x[token], 0)
        ex = flat[order]  # past the local experts for other experts' rows: zeroed below, whatever bias they get
        local_lora = LayerLora(adapters, scale)  # no dropout: it runs dropless (_expert_mesh)
        h = expert_glu(*_gate_up(xs, stacks, sizes, local_lora, ex, cfg), cfg)
        y = _with_bias(_ragged(h, stacks, "expert_down", sizes, local_lora), stacks, "expert_down", ex, cfg)
        w = jnp.where(mine, weights, 0).reshape(-1)[order]
        y = jnp.where(ours, y * w[:, None].astype(y.dtype), 0)
        return jax.lax.psum(jnp.zeros_like(x).at[token].add(y), "expert")

    # x and the routing weights go in as one copy per expert device (a broadcast over a leading axis split over
    # ``expert``), not as inputs the expert axis shares: the gradient of a shared input used through the varying
    # gather x[token] came back as one device's share (jax 0.10.2's shard_map), the broadcast's sums all of them.
    per_device = P("expert", *rows)
    run = jax.shard_map(local, mesh=mesh,
                        in_specs=(per_device, rows, per_device, {n_: expert_split for n_ in stacks},
                                  {n_: {"a": expert_split, "b": expert_split} for n_ in adapters}, P()),
                        out_specs=rows)
    nx = mesh.shape["expert"]
    return run(jnp.broadcast_to(x, (nx, *x.shape)), ids, jnp.broadcast_to(weights, (nx, *weights.shape)), stacks,
               adapters, jnp.zeros((), jnp.float32) if static_scale is not None else scale)


def _per_expert(buf: jax.Array, p: dict, name: str, lora: LayerLora | None) -> jax.Array:
    """Each expert's buffer buf [X, C, in] through its weight ``name`` (plus its LoRA adapter, if any)."""
    y = jnp.einsum("xci,xio->xco", buf, materialize(p[name]))
    ad = adapter_of(lora, name)
    if lora is None or ad is None:
        return y
    u = jnp.einsum("xci,xir->xcr", _adapter_input(buf, name, lora.drop), ad["a"])
    return y + (lora.scale * jnp.einsum("xcr,xro->xco", u, ad["b"])).astype(y.dtype)


def _experts_capacity(x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array, p: dict,
                      cfg: ModelConfig, lora: LayerLora | None = None) -> tuple[jax.Array, jax.Array]:
    n, k = ids.shape
    X = cfg.num_experts
    assert cfg.capacity_factor is not None  # moe_mlp routes dropless without one
    cap = max(1, math.ceil(cfg.capacity_factor * n * k / X))
    onehot = jax.nn.one_hot(ids, X, dtype=jnp.int32) * valid[:, None, None].astype(jnp.int32)  # [N, k, X]
    # Slot of each assignment in its expert's buffer: earlier tokens (and earlier choices) first.
    flat = onehot.transpose(1, 0, 2).reshape(n * k, X)
    slot = (jnp.cumsum(flat, axis=0) - 1).reshape(k, n, X).transpose(1, 0, 2)
    kept = (slot < cap) & (onehot > 0)
    dropped = ((onehot > 0) & ~kept).sum()
    dispatch = (kept[..., None] & (slot[..., None] == jnp.arange(cap))).astype(x.dtype)  # [N, k, X, C]
    buf = jnp.einsum("nkxc,ne->xce", dispatch, x)
    bias = {n: p[n + "_bias"][:, None].astype(x.dtype) if cfg.expert_bias else 0 for n in EXPERT_WEIGHTS}
    if FUSED_GATE_UP in p:  # Gemma 4 (no expert biases)
        gate, up = jnp.split(_per_expert(buf, p, FUSED_GATE_UP, lora), 2, axis=-1)
    else:
        gate = _per_expert(buf, p, "expert_gate", lora) + bias["expert_gate"]
        up = _per_expert(buf, p, "expert_up", lora) + bias["expert_up"]
    h = expert_glu(gate, up, cfg)
    out = _per_expert(h, p, "expert_down", lora) + bias["expert_down"]
    combine = dispatch * weights[..., None, None].astype(x.dtype)
    return jnp.einsum("nkxc,xce->ne", combine, out), dropped


def _shared(x: jax.Array, p: dict, name: str, lora: LayerLora | None) -> jax.Array:
    """x @ the shared experts' weight ``name`` (plus its LoRA adapter, if any)."""
    y = dense(x, p[name]) if isinstance(p[name], QuantizedWeight) else x @ p[name]
    ad = adapter_of(lora, name)
    if lora is None or ad is None:
        return y
    return y + lora_out(dense(_adapter_input(x, name, lora.drop), ad["a"]), ad["b"], lora.scale, y.dtype)


def moe_mlp(x: jax.Array, p: dict, cfg: ModelConfig, valid: jax.Array,
            lora: LayerLora | None = None) -> tuple[jax.Array, dict]:
    """Routed experts (+ shared experts) for x [batch, seq, embed]; returns output and router statistics.

    ``valid`` [batch, seq] marks real tokens (padding is routed but not counted).
    ``lora`` is this layer's LoRA: adapters by weight name (expert_gate ...
    shared_down), each expert's adapter stacked on the expert axis like its weight, their scale and
    dropout.
    """
    b, t, e = x.shape
    xf = x.reshape(-1, e)
    vf = valid.reshape(-1)
    ids, weights, logits = route(xf, p, cfg)
    if cfg.router_scales_input:
        out, dropped = _dispatch_scaled_inputs(xf, ids, weights, vf, p, cfg, lora)
    else:
        out, dropped = _dispatch(xf, ids, weights, vf, p, cfg, lora)
    if cfg.shared_experts:
        act = ACTIVATIONS[cfg.hidden_act]
        h = act(_shared(xf, p, "shared_gate", lora)) * _shared(xf, p, "shared_up", lora)
        shared = _shared(h, p, "shared_down", lora)
        if cfg.shared_expert_gate:  # Qwen3-Next: sigmoid(x @ w) [tokens, 1] scales the shared expert
            shared = shared * jax.nn.sigmoid(dense(xf, p["shared_expert_gate"]).astype(jnp.float32)).astype(shared.dtype)
        out = out + shared
    stats = _router_stats(logits, ids, dropped, vf, cfg)
    return out.reshape(b, t, e), stats


def aux_losses(stats: dict, cfg: ModelConfig) -> dict:
    """Training signals from per-layer router statistics (arrays stacked over MoE layers).

    ``load_balancing_loss`` is Switch/Mixtral's ``X * sum_e f_e * P_e`` with
    layers pooled (f_e: share of assignments to expert e, not divided by k;
    P_e: mean router probability), exactly transformers' load_balancing_loss_func.
    ``router_z_loss`` is the mean squared log-sum-exp of the router logits.
    ``loss`` weights them by ``aux_loss_coef`` and ``z_loss_coef``.
    """
    total = stats["tokens"].sum()
    f = stats["expert_counts"].sum(0) / total
    prob = stats["router_prob_sum"].sum(0) / total
    lb = cfg.num_experts * jnp.sum(f * prob)
    z = stats["router_lse_sq_sum"].sum() / total
    return {
        "load_balancing_loss": lb,
        "router_z_loss": z,
        "loss": cfg.aux_loss_coef * lb + cfg.z_loss_coef * z,
        "expert_counts": stats["expert_counts"],
        "dropped_tokens": stats["dropped_tokens"].sum(),
    }


def parallel_moe_block(x: jax.Array, p: dict, cfg: ModelConfig, valid: jax.Array,
                       lora: LayerLora | None = None) -> tuple[jax.Array, dict]:
    """Gemma 4's MoE block for the residual stream x [batch, seq, embed]: the dense MLP of ``mlp_norm(x)`` (normed
    by ``mlp_post_norm``) plus the routed experts of ``moe_norm(x)`` (normed by ``moe_post_norm``); returns their
    sum and the router statistics (as :func:`moe_mlp`'s).

    The router reads x RMS-normed without a weight, times ``router_scale`` and 1/sqrt(embed); the top-k softmax
    weights are renormalized, then multiplied by each chosen expert's ``expert_scale``. The experts' gate and up
    are stored fused (``expert_gate_up`` [X, embed, 2 * moe_mlp], gate first) and run fused, a LoRA adapter on
    them as on one weight (``lora["expert_gate_up"]``: A [X, embed, r], B [X, r, 2 * moe_mlp]); the router is not
    adapted."""
    from zoo.layers.blocks import rms_norm
    from zoo.layers.mlp import mlp

    b, t, e = x.shape
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    dense_out = rms_norm(mlp(x, p, cfg, norm_w=p["mlp_norm"], lora=lora),
                         p["mlp_post_norm"], eps, off)
    xf, vf = x.reshape(-1, e), valid.reshape(-1)
    r = rms_norm(xf, jnp.ones((e,), xf.dtype), eps) * p["router_scale"] * e**-0.5
    ids, weights, logits = route(r, p, cfg)
    weights = weights * p["expert_scale"].astype(weights.dtype)[ids]
    xe = rms_norm(xf, p["moe_norm"], eps, off)
    out, dropped = _dispatch(xe, ids, weights, vf, p, cfg, lora)
    routed = rms_norm(out.reshape(b, t, e), p["moe_post_norm"], eps, off)
    return dense_out + routed, _router_stats(logits, ids, dropped, vf, cfg)


def _dispatch(x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array, p: dict, cfg: ModelConfig,
              lora: LayerLora | None) -> tuple[jax.Array, jax.Array]:
    """(the experts' weighted sum for tokens x [N, E], tokens dropped over capacity): expert-parallel under a mesh
    with an expert axis, else dropless, or capacity-bound with ``capacity_factor``."""
    mesh = _expert_mesh(p, drop_of(lora)) if cfg.capacity_factor is None else None
    if mesh is not None:
        return _experts_parallel(x, ids, weights, p, cfg, mesh, lora), jnp.zeros((), jnp.int32)
    if cfg.capacity_factor is None:
        return _experts_dropless(x, ids, weights, p, cfg, lora), jnp.zeros((), jnp.int32)
    return _experts_capacity(x, ids, weights, valid, p, cfg, lora)


def _dispatch_scaled_inputs(x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array, p: dict,
                            cfg: ModelConfig, lora: LayerLora | None) -> tuple[jax.Array, jax.Array]:
    """:func:`_dispatch` where each expert reads its token times the router weight and its output is summed as it is
    (Llama 4: transformers' Llama4TextMoe multiplies the routed input by the score): each of a token's k
    assignments is dispatched as a token of its own, with weight 1."""
    n, k = ids.shape
    scaled = (x[:, None, :] * weights[..., None].astype(x.dtype)).reshape(n * k, -1)
    ones = jnp.ones((n * k, 1), weights.dtype)
    out, dropped = _dispatch(scaled, ids.reshape(n * k, 1), ones, jnp.repeat(valid, k), p, cfg, lora)
    return out.reshape(n, k, -1).sum(1), dropped


def _router_stats(logits: jax.Array, ids: jax.Array, dropped: jax.Array, vf: jax.Array,
                  cfg: ModelConfig) -> dict[str, jax.Array]:
    """One layer's router statistics (:data:`STAT_KEYS`) over its real tokens (``vf`` [N])."""
    m = vf.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    stats = {
        "expert_counts": (jax.nn.one_hot(ids, cfg.num_experts).sum(1) * m[:, None]).sum(0),
        "router_prob_sum": (probs * m[:, None]).sum(0),
        "router_lse_sq_sum": (jax.nn.logsumexp(logits, axis=-1) ** 2 * m).sum(),
        "dropped_tokens": dropped.astype(jnp.float32),
        "tokens": m.sum(),
    }
    return stats
