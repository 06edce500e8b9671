"""The parameter layout of the zoo decoder: shape and logical axes of every weight.

Paths are dotted (``layers.q``). Layer weights are stacked on a leading
``layers`` axis so that the forward pass can scan over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo.model.config import ModelConfig
from zoo.model.vision_params import vision_specs


@dataclass(frozen=True)
class ParamSpec:
    """Shape, logical axis names and initializer kind of one parameter."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # None: never sharded
    init: str  # "normal" | "ones" | "zeros"


def _layer_specs(cfg: ModelConfig, L: int, moe: bool) -> dict[str, ParamSpec]:
    """The weights of one stack of L layers (suffixes after the stack prefix)."""
    E, F = cfg.hidden_size, cfg.intermediate_size
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    unit = "ones" if cfg.norm_offset == 0 else "zeros"  # norms scale by (norm_offset + w)
    lay = ("layers",)
    s: dict[str, ParamSpec] = {"attn_norm": ParamSpec((L, E), lay + ("embed",), unit)}
    if cfg.mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            s["q_a"] = ParamSpec((L, E, cfg.q_lora_rank), lay + ("embed", None), "normal")
            s["q_a_norm"] = ParamSpec((L, cfg.q_lora_rank), lay + (None,), "ones")
            s["q_b"] = ParamSpec((L, cfg.q_lora_rank, H, qk), lay + (None, "heads", "head_dim"), "normal")
        else:
            s["q"] = ParamSpec((L, E, H, qk), lay + ("embed", "heads", "head_dim"), "normal")
        s["kv_a"] = ParamSpec((L, E, cfg.kv_lora_rank + cfg.qk_rope_head_dim), lay + ("embed", None), "normal")
        s["kv_a_norm"] = ParamSpec((L, cfg.kv_lora_rank), lay + (None,), "ones")
        s["kv_b"] = ParamSpec((L, cfg.kv_lora_rank, H, cfg.qk_nope_head_dim + cfg.v_head_dim),
                              lay + (None, "heads", "head_dim"), "normal")
        s["o"] = ParamSpec((L, H, cfg.v_head_dim, E), lay + ("heads", "head_dim", "embed"), "normal")
        if cfg.sparse:  # DeepSeek-V3.2's lightning indexer (its k norm is a LayerNorm: weight and bias)
            IH, ID = cfg.index_n_heads, cfg.index_head_dim
            s["idx_q"] = ParamSpec((L, cfg.q_lora_rank, IH, ID), lay + (None, None, None), "normal")
            s["idx_k"] = ParamSpec((L, E, ID), lay + ("embed", None), "normal")
            s["idx_k_norm"] = ParamSpec((L, ID), lay + (None,), "ones")
            s["idx_k_norm_bias"] = ParamSpec((L, ID), lay + (None,), "zeros")
            s["idx_w"] = ParamSpec((L, E, IH), lay + ("embed", None), "normal")
    else:
        s["q"] = ParamSpec((L, E, H, D), lay + ("embed", "heads", "head_dim"), "normal")
        s["k"] = ParamSpec((L, E, K, D), lay + ("embed", "kv_heads", "head_dim"), "normal")
        s["v"] = ParamSpec((L, E, K, D), lay + ("embed", "kv_heads", "head_dim"), "normal")
        s["o"] = ParamSpec((L, H, D, E), lay + ("heads", "head_dim", "embed"), "normal")
    s["mlp_norm"] = ParamSpec((L, E), lay + ("embed",), unit)
    if moe:
        X, M = cfg.num_experts, cfg.moe_intermediate_size
        s["router"] = ParamSpec((L, E, X), lay + ("embed", None), "normal")
        if cfg.router_bias:
            s["router_bias"] = ParamSpec((L, X), lay + (None,), "zeros")
        s["expert_gate"] = ParamSpec((L, X, E, M), lay + ("expert", "embed", "mlp"), "normal")
        s["expert_up"] = ParamSpec((L, X, E, M), lay + ("expert", "embed", "mlp"), "normal")
        s["expert_down"] = ParamSpec((L, X, M, E), lay + ("expert", "mlp", "embed"), "normal")
        if cfg.router_logits_bias:
            s["router_logit_bias"] = ParamSpec((L, X), lay + (None,), "zeros")
        if cfg.expert_bias:
            s["expert_gate_bias"] = ParamSpec((L, X, M), lay + ("expert", "mlp"), "zeros")
            s["expert_up_bias"] = ParamSpec((L, X, M), lay + ("expert", "mlp"), "zeros")
            s["expert_down_bias"] = ParamSpec((L, X, E), lay + ("expert", "embed"), "zeros")
        if cfg.shared_experts:
            S = cfg.shared_intermediate_size or M * cfg.shared_experts
            if cfg.shared_expert_gate:  # Qwen3-Next: sigmoid(x @ w) scales the shared expert's output
                s["shared_expert_gate"] = ParamSpec((L, E, 1), lay + ("embed", None), "normal")
            s["shared_gate"] = ParamSpec((L, E, S), lay + ("embed", "mlp"), "normal")
            s["shared_up"] = ParamSpec((L, E, S), lay + ("embed", "mlp"), "normal")
            s["shared_down"] = ParamSpec((L, S, E), lay + ("mlp", "embed"), "normal")
    else:
        s["gate"] = ParamSpec((L, E, F), lay + ("embed", "mlp"), "normal")
        s["up"] = ParamSpec((L, E, F), lay + ("embed", "mlp"), "normal")
        s["down"] = ParamSpec((L, F, E), lay + ("mlp", "embed"), "normal")
    if cfg.qkv_bias:
        s["q_bias"] = ParamSpec((L, H, D), lay + ("heads", "head_dim"), "zeros")
        s["k_bias"] = ParamSpec((L, K, D), lay + ("kv_heads", "head_dim"), "zeros")
        s["v_bias"] = ParamSpec((L, K, D), lay + ("kv_heads", "head_dim"), "zeros")
    if cfg.o_bias:
        s["o_bias"] = ParamSpec((L, E), lay + ("embed",), "zeros")
    if cfg.qk_norm and cfg.qk_norm_span == "all":  # one weight per element of all heads (OLMo 2/3)
        s["q_norm"] = ParamSpec((L, H, D), lay + ("heads", "head_dim"), unit)
        s["k_norm"] = ParamSpec((L, K, D), lay + ("kv_heads", "head_dim"), unit)
    elif cfg.qk_norm:
        s["q_norm"] = ParamSpec((L, D), lay + ("head_dim",), unit)
        s["k_norm"] = ParamSpec((L, D), lay + ("head_dim",), unit)
    if cfg.attn_output_gate:  # Qwen3-Next: the q projection's second half, sigmoid(gate) * attention before o
        s["attn_gate"] = ParamSpec((L, E, H, D), lay + ("embed", "heads", "head_dim"), "normal")
    if "linear" in cfg.kinds:
        s.update(_linear_specs(cfg, L))
    if cfg.attn_sinks:
        s["sinks"] = ParamSpec((L, H), lay + ("heads",), "zeros")
    if cfg.post_norms:
        s["post_attn_norm"] = ParamSpec((L, E), lay + ("embed",), unit)
        s["post_mlp_norm"] = ParamSpec((L, E), lay + ("embed",), unit)
    if cfg.mlp_bias and not moe:
        s["gate_bias"] = ParamSpec((L, F), lay + ("mlp",), "zeros")
        s["up_bias"] = ParamSpec((L, F), lay + ("mlp",), "zeros")
        s["down_bias"] = ParamSpec((L, E), lay + ("embed",), "zeros")
    if not cfg.pre_norms:  # OLMo 2/3: the post-norms are a layer's only norms
        del s["attn_norm"], s["mlp_norm"]
    s.update(_gemma4_layer_specs(cfg, L, moe))
    return s


def _linear_specs(cfg: ModelConfig, L: int) -> dict[str, ParamSpec]:
    """Qwen3-Next's Gated DeltaNet weights of L layers (zoo.layers.linear_attention): q/k/v/z and b/a projections
    (transformers' in_proj_qkvz and in_proj_ba split), the causal convolution's taps over the q, k, v channels,
    the decay's dt_bias and A_log, the gated norm's weight (a plain ``w * x``: ones) and the output projection."""
    E, nk, nv = cfg.hidden_size, cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv, lay = cfg.linear_key_head_dim, cfg.linear_value_head_dim, ("layers",)
    return {
        "lin_q": ParamSpec((L, E, nk, dk), lay + ("embed", "kv_heads", "head_dim"), "normal"),
        "lin_k": ParamSpec((L, E, nk, dk), lay + ("embed", "kv_heads", "head_dim"), "normal"),
        "lin_v": ParamSpec((L, E, nv, dv), lay + ("embed", "heads", "head_dim"), "normal"),
        "lin_z": ParamSpec((L, E, nv, dv), lay + ("embed", "heads", "head_dim"), "normal"),
        "lin_b": ParamSpec((L, E, nv), lay + ("embed", "heads"), "normal"),
        "lin_a": ParamSpec((L, E, nv), lay + ("embed", "heads"), "normal"),
        "lin_conv": ParamSpec((L, cfg.linear_conv_kernel, 2 * nk * dk + nv * dv), lay + (None, None), "normal"),
        "lin_dt_bias": ParamSpec((L, nv), lay + ("heads",), "ones"),
        "lin_a_log": ParamSpec((L, nv), lay + ("heads",), "zeros"),
        "lin_norm": ParamSpec((L, dv), lay + ("head_dim",), "ones"),
        "lin_out": ParamSpec((L, nv, dv, E), lay + ("heads", "head_dim", "embed"), "normal"),
    }


def _gemma4_layer_specs(cfg: ModelConfig, L: int, moe: bool) -> dict[str, ParamSpec]:
    """Gemma 4's weights of a stack of L layers: layer scalars, the per-layer input's gate, projection and norm,
    and the MoE block's dense MLP beside it, extra norms, router scale, per-expert scale and fused gate/up stack."""
    E, F, lay = cfg.hidden_size, cfg.intermediate_size, ("layers",)
    unit = "ones" if cfg.norm_offset == 0 else "zeros"
    s: dict[str, ParamSpec] = {}
    if cfg.layer_scalars:
        s["layer_scalar"] = ParamSpec((L, 1), lay + (None,), "ones")
    if cfg.per_layer_input_size:
        P = cfg.per_layer_input_size
        s["ple_gate"] = ParamSpec((L, E, P), lay + ("embed", None), "normal")
        s["ple_proj"] = ParamSpec((L, P, E), lay + (None, "embed"), "normal")
        s["ple_norm"] = ParamSpec((L, E), lay + ("embed",), unit)
    if cfg.parallel_moe and moe:
        X, M = cfg.num_experts, cfg.moe_intermediate_size
        s["gate"] = ParamSpec((L, E, F), lay + ("embed", "mlp"), "normal")
        s["up"] = ParamSpec((L, E, F), lay + ("embed", "mlp"), "normal")
        s["down"] = ParamSpec((L, F, E), lay + ("mlp", "embed"), "normal")
        s["expert_gate_up"] = ParamSpec((L, X, E, 2 * M), lay + ("expert", "embed", "mlp"), "normal")
        for name in ("mlp_post_norm", "moe_norm", "moe_post_norm"):
            s[name] = ParamSpec((L, E), lay + ("embed",), unit)
        s["router_scale"] = ParamSpec((L, E), lay + ("embed",), "ones")
        s["expert_scale"] = ParamSpec((L, X), lay + (None,), "ones")
    return s


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every parameter of a model with this config, by dotted path."""
    E, V = cfg.hidden_size, cfg.vocab_size
    unit = "ones" if cfg.norm_offset == 0 else "zeros"
    s: dict[str, ParamSpec] = {"embed": ParamSpec((V, E), ("vocab", "embed"), "normal")}
    for prefix, layers, moe in cfg.layer_stacks:
        group = _layer_specs(cfg, len(layers), moe)
        if cfg.global_head_dim or cfg.kv_shared_layers or "linear" in cfg.kinds:
            from zoo.model.layer_layout import group_specs

            group = group_specs(cfg, group, tuple(cfg.kinds[i] for i in layers), prefix,
                                lambda c, n: _layer_specs(c, n, False))
        if cfg.parallel_moe and moe:
            group.pop("expert_gate")  # Gemma 4 stores them fused: expert_gate_up
            group.pop("expert_up")
        for name, spec in group.items():
            s[f"{prefix}.{name}"] = spec
    if cfg.per_layer_input_size:
        P = cfg.num_layers * cfg.per_layer_input_size
        # Its width (layers x per-layer width: 8960 for E2B, 2.35B parameters in all) is split like embed's, over
        # fsdp: left whole, every chip held the table (9.4 GB in float32 on each chip of a v5e:2x2 compile).
        s["ple_embed"] = ParamSpec((cfg.per_layer_vocab_size, P), ("vocab", "embed"), "normal")
        s["ple_model_proj"] = ParamSpec((E, P), ("embed", None), "normal")
        s["ple_proj_norm"] = ParamSpec((cfg.per_layer_input_size,), (None,), unit)
    s["final_norm"] = ParamSpec((E,), ("embed",), unit)
    if not cfg.tie_word_embeddings and not cfg.num_labels:  # a reward model has no LM head (its score instead)
        s["lm_head"] = ParamSpec((E, V), ("embed", "vocab"), "normal")
    if cfg.num_labels:  # a reward model's scalar head (rm/)
        s["score"] = ParamSpec((E, cfg.num_labels), ("embed", None), "normal")
    s.update({path: ParamSpec(*spec) for path, spec in vision_specs(cfg).items()})  # a VLM's tower and connector
    return s


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{'layers.q': x} -> {'layers': {'q': x}}."""
    out: dict[str, Any] = {}
    for path, v in flat.items():
        *parents, leaf = path.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`nest`."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def count_params(cfg: ModelConfig) -> int:
    """Total number of parameters of a model with this config."""
    total = 0
    for spec in param_specs(cfg).values():
        n = 1
        for d in spec.shape:
            n *= d
        total += n
    return total


def init_params(cfg: ModelConfig, key: Any, dtype: Any = "float32", std: float = 0.02) -> dict[str, Any]:
    """Random parameters (nested dict of jax arrays): matrices ~ N(0, std), norms at identity, biases 0.

    Pure, so ``jax.jit(..., out_shardings=...)`` creates them already sharded.
    """
    import jax
    import jax.numpy as jnp

    flat = {}
    for i, (path, spec) in enumerate(sorted(param_specs(cfg).items())):
        if spec.init == "normal":
            flat[path] = (std * jax.random.normal(jax.random.fold_in(key, i), spec.shape)).astype(dtype)
        else:
            flat[path] = jnp.full(spec.shape, 1.0 if spec.init == "ones" else 0.0, dtype)
    return nest(flat)
