"""The config.json fields of SmolLM3, OLMo 2/3, Phi-3/Phi-4, Qwen3-Next and Qwen3.5 beyond the shared ones, as an
export writes them.

NoPE layers (SmolLM3's ``no_rope_layers``), OLMo 2/3's layer layout, partial
rotary and LongRoPE (Phi-3/Phi-4), written as transformers' config classes
spell them, so an exported config.json is the one ``save_pretrained`` writes
(:func:`zoo.model.from_hf.read_layer_fields` reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zoo.model.config import ModelConfig, RopeConfig


def _nope_interval(cfg: ModelConfig) -> tuple[int, bool]:
    """(no_rope_layer_interval, whether it alone gives cfg's NoPE layers): SmolLM3's config class derives
    ``no_rope_layers`` from the interval (every n-th layer NoPE); its default is 4."""
    for n in [4, *range(1, cfg.num_layers + 2)]:
        if tuple(i for i in range(cfg.num_layers) if (i + 1) % n == 0) == cfg.nope_layers:
            return n, True
    return 4, False


def _longrope_dict(cfg: ModelConfig) -> dict[str, Any]:
    r = cfg.rope
    d: dict[str, Any] = {"rope_type": "longrope", "rope_theta": r.theta, "short_factor": list(r.short_factor),
                         "long_factor": list(r.long_factor),
                         "original_max_position_embeddings": r.original_max_position_embeddings}
    if r.factor != cfg.max_position_embeddings / r.original_max_position_embeddings:
        d["factor"] = r.factor  # else transformers derives it
    if r.attention_factor is not None:
        d["attention_factor"] = r.attention_factor
    return d


def llama4_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Llama 4's config.json fields of ``cfg`` (the inverse of zoo/model/from_hf.py's ``_llama4_fields``)."""
    names = {"full": "full_attention", "chunked": "chunked_attention"}
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    # the step that derives the MoE layers, as a released config gives them (1 where none does; moe_layers is kept)
    step = next((n for n in range(1, cfg.num_layers + 1) if list(range(n - 1, cfg.num_layers, n)) == moe), 1)
    return dict(no_rope_layer_interval=_nope_interval(cfg)[0], interleave_moe_layer_step=step,intermediate_size=cfg.moe_intermediate_size, intermediate_size_mlp=cfg.intermediate_size,
                num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_layers=moe,
                no_rope_layers=[0 if i in cfg.nope_layers else 1 for i in range(cfg.num_layers)],
                attention_chunk_size=cfg.attention_chunk_size, layer_types=[names[k] for k in cfg.kinds],
                use_qk_norm=cfg.qk_l2_norm, attn_temperature_tuning=cfg.temperature_tuning,
                floor_scale=int(cfg.temperature_floor), attn_scale=cfg.temperature_scale,
                attention_bias=cfg.qkv_bias, head_dim=cfg.head_dim)


def qwen3_next_hf_fields(cfg: ModelConfig, rope_dict: Callable[[RopeConfig], dict]) -> dict[str, Any]:
    """Qwen3-Next's config.json fields of ``cfg`` (the inverse of zoo/model/from_hf.py's ``qwen3_next_fields``)."""
    names = {"full": "full_attention", "linear": "linear_attention"}
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.router_norm_topk,
                router_aux_loss_coef=cfg.aux_loss_coef, decoder_sparse_step=cfg.decoder_sparse_step,
                mlp_only_layers=list(cfg.mlp_only_layers), shared_expert_intermediate_size=cfg.shared_intermediate_size,
                layer_types=[names[k] for k in cfg.kinds], linear_num_key_heads=cfg.linear_key_heads,
                linear_num_value_heads=cfg.linear_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
                linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel,
                head_dim=cfg.head_dim,
                rope_parameters=dict(rope_dict(cfg.rope), partial_rotary_factor=cfg.partial_rotary_factor))


def qwen3_5_hf_fields(cfg: ModelConfig, rope_dict: Callable[[RopeConfig], dict]) -> dict[str, Any]:
    """Qwen3.5's config.json fields of ``cfg``, dense or MoE (the inverse of zoo/model/from_hf.py's
    ``linear_layer_fields`` and, for the MoE, ``qwen3_next_fields``): the linear layers' dims, the layer types, the
    interleaved multimodal RoPE's sections beside partial rotary; the MoE's experts and shared expert (its config
    class has no intermediate_size, decoder_sparse_step, mlp_only_layers nor norm_topk_prob)."""
    names = {"full": "full_attention", "linear": "linear_attention"}
    rope = dict(rope_dict(cfg.rope), partial_rotary_factor=cfg.partial_rotary_factor,
                mrope_section=list(cfg.rope.mrope_section), mrope_interleaved=cfg.rope.mrope_interleaved)
    out: dict[str, Any] = dict(
        layer_types=[names[k] for k in cfg.kinds], linear_num_key_heads=cfg.linear_key_heads,
        linear_num_value_heads=cfg.linear_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel,
        head_dim=cfg.head_dim, rope_parameters=rope)
    if cfg.num_experts:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.moe_intermediate_size, router_aux_loss_coef=cfg.aux_loss_coef,
                   shared_expert_intermediate_size=cfg.shared_intermediate_size)
    return out


def write_layer_fields(cfg: ModelConfig, out: dict[str, Any], rope_dict: Callable[[RopeConfig], dict]) -> None:
    """Complete (in place) the HF config fields ``out`` of ``cfg`` with this module's families' own
    (``rope_dict``: a RoPE's rope_parameters, convert.hf_config's)."""
    if cfg.family == "smollm3":
        interval, derived = _nope_interval(cfg)
        out["no_rope_layer_interval"] = interval
        if not derived:
            out["no_rope_layers"] = [0 if i in cfg.nope_layers else 1 for i in range(cfg.num_layers)]
        out["use_sliding_window"] = "sliding" in cfg.kinds
    elif cfg.family == "olmo2":  # no sliding layers in OLMo 2's config class
        out.pop("layer_types", None)
        out.pop("sliding_window", None)
    elif cfg.family == "olmo3":  # RoPE per layer type (YaRN on the full-attention layers of the releases)
        out["rope_parameters"] = {"full_attention": rope_dict(cfg.rope),
                                  "sliding_attention": rope_dict(cfg.rope_local or cfg.rope)}
    elif cfg.family == "qwen3_next":
        out.update(qwen3_next_hf_fields(cfg, rope_dict))
    elif cfg.family in ("qwen3_5", "qwen3_5_moe"):
        out.update(qwen3_5_hf_fields(cfg, rope_dict))
        out.pop("sliding_window", None)  # no sliding layers in Qwen3.5's config classes
        if cfg.num_experts and cfg.intermediate_size == cfg.moe_intermediate_size:
            out.pop("intermediate_size", None)  # the MoE's config has none: zoo.model.from_hf stood the experts' in
    elif cfg.family == "phi3":
        if cfg.rope.kind == "longrope":
            out["rope_parameters"] = _longrope_dict(cfg)
        # Phi-3's config keeps it at the top level too (Phi-4's 16384 is not the class default of 4096).
        out["original_max_position_embeddings"] = cfg.rope.original_max_position_embeddings
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor  # where transformers reads it
