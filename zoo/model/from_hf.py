"""A Hugging Face config.json read as a ModelConfig, through the family's traits (:mod:`zoo.model.hf_families`).

Configs are parsed through transformers' own config classes, so every default
and derived field (Gemma's head_dim of 256, Qwen 2's sliding layers from
``max_window_layers``, Gemma 3's per-layer-type RoPE) is exactly what the
reference implementation uses. The other direction (ModelConfig -> config.json)
is the exporter's: convert/hf_config.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zoo.errors import UserError
from zoo.model.config import ModelConfig, RopeConfig
from zoo.model.hf_families import CLASSIFIER, FAMILIES, VISION_FORMATS, FamilyTraits, family_of

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope", "proportional")  # proportional: Gemma 4
# DeepSeek-V3.2's "indexed_attention" layers attend to the whole causal prefix as far as the kinds go (their
# indexer's top-k is ModelConfig.index_topk).
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
               "linear_attention": "linear", "indexed_attention": "full"}
# family -> (pre_norms, qk_norm_span): OLMo 2/3 norm only the outputs of attention and MLP, and their q/k norms
# are one RMSNorm over all heads' q (k) at once, as MiniMax-M2's (which keeps the pre-norms).
_LAYOUT = {"olmo2": (False, "all"), "olmo3": (False, "all"), "minimax_m2": (True, "all")}


def _parse(hf: dict[str, Any], where: str):
    """transformers' config object for this dict (the text config for multimodal models)."""
    from transformers import AutoConfig

    try:
        c = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    except KeyError:
        raise UserError(f"{where}: no model_type") from None
    except Exception as e:  # transformers validates strictly and raises many kinds
        raise UserError(f"{where}: invalid config ({str(e).splitlines()[0]})") from None
    text = getattr(c, "text_config", None)
    return c, text if text is not None else c


def _rope(params: dict[str, Any], c: Any, where: str) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE:
        raise UserError(f"{where}: rope type {kind!r} is not supported; supported: {SUPPORTED_ROPE}")
    # A value of the HF config, as it comes (int() turns a bad one into the caller's error).
    original_max: Any = params.get("original_max_position_embeddings") or getattr(c, "max_position_embeddings", 8192)
    rope = RopeConfig(
        theta=float(params.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original_max),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_opt_float(params.get("mscale")),
        mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        attention_factor=_opt_float(params.get("attention_factor")),
        truncate=bool(params.get("truncate", True)),
        proportional_fraction=float(params.get("partial_rotary_factor") or 1.0) if kind == "proportional" else 1.0,
        mrope_section=tuple(params.get("mrope_section") or ()),
        mrope_interleaved=bool(params.get("mrope_interleaved", False)),
    )
    return read_longrope(rope, params, c) if kind == "longrope" else rope


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _qwen3_moe_fields(c: Any, where: str, norm_topk: bool | None = None) -> dict[str, Any]:
    """ModelConfig fields of Qwen3-MoE's experts: softmax top-k routing, MoE on every ``decoder_sparse_step``-th
    layer but those of ``mlp_only_layers`` (the others dense). ``norm_topk``: the top-k renormalization where
    the family fixes it (Qwen3-VL-MoE's router always renormalizes), else the config's ``norm_topk_prob``."""
    # getattr: Qwen3.5-MoE's config class has no decoder_sparse_step, mlp_only_layers nor norm_topk_prob
    sparse_step = getattr(c, "decoder_sparse_step", None)
    step = 1 if sparse_step is None else int(sparse_step)
    if step < 1:
        raise UserError(f"{where}: decoder_sparse_step={step} must be at least 1")
    norm = bool(c.norm_topk_prob) if norm_topk is None else norm_topk
    return dict(num_experts=int(c.num_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.moe_intermediate_size), router_score="softmax",
                router_norm_topk=norm, aux_loss_coef=float(c.router_aux_loss_coef or 0.0),
                decoder_sparse_step=step,
                mlp_only_layers=tuple(sorted({int(i) for i in getattr(c, "mlp_only_layers", None) or ()})))


def linear_layer_fields(c: Any) -> dict[str, Any]:
    """The Gated DeltaNet dims of Qwen3-Next's and Qwen3.5's linear layers and the output gate of their full
    layers' attention."""
    return dict(linear_key_heads=int(c.linear_num_key_heads), linear_value_heads=int(c.linear_num_value_heads),
                linear_key_head_dim=int(c.linear_key_head_dim), linear_value_head_dim=int(c.linear_value_head_dim),
                linear_conv_kernel=int(c.linear_conv_kernel_dim), attn_output_gate=True)


def qwen3_next_fields(c: Any, where: str, norm_topk: bool | None = None) -> dict[str, Any]:
    """Qwen3-Next's ModelConfig fields (transformers' Qwen3NextConfig; Qwen3.5-MoE's with ``norm_topk`` True):
    Qwen3-MoE's experts and one shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate, and
    :func:`linear_layer_fields`."""
    return dict(**_qwen3_moe_fields(c, where, norm_topk), shared_experts=1, shared_expert_gate=True,
                shared_intermediate_size=int(c.shared_expert_intermediate_size), **linear_layer_fields(c))


def _glm4_moe_fields(c: Any) -> dict[str, Any]:
    """ModelConfig fields of GLM-4.5's experts: DeepSeek-V3's sigmoid group-limited routing with a selection
    bias, shared experts and dense first layers, on ordinary (not latent) attention."""
    return dict(num_experts=int(c.n_routed_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.moe_intermediate_size), shared_experts=int(c.n_shared_experts or 0),
                dense_layers=int(c.first_k_dense_replace or 0), router_scale=float(c.routed_scaling_factor),
                router_score="sigmoid", router_norm_topk=bool(c.norm_topk_prob), router_bias=True,
                router_groups=int(c.n_group or 1), router_topk_groups=int(c.topk_group or 1),
                router_group_score="top2")


def _minimax_m2_fields(c: Any) -> dict[str, Any]:
    """ModelConfig fields of MiniMax-M2's experts: MoE on every layer, no shared experts, DeepSeek-V3's sigmoid
    scores with a selection bias (``e_score_correction_bias``) but ungrouped and unscaled, the top k always
    renormalized (transformers' MiniMaxM2TopKRouter; its config has no norm_topk_prob)."""
    return dict(num_experts=int(c.num_local_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.intermediate_size), router_score="sigmoid", router_norm_topk=True,
                router_bias=True, aux_loss_coef=float(c.router_aux_loss_coef or 0.0))


def _moe_fields(traits: FamilyTraits, c: Any, where: str) -> dict[str, Any]:
    """ModelConfig fields of the mixture-of-experts and latent-attention families."""
    if traits.moe == "qwen3_moe":
        return _qwen3_moe_fields(c, where)
    if traits.moe == "qwen3_vl_moe":
        return _qwen3_moe_fields(c, where, norm_topk=True)
    if traits.moe == "qwen3_next":
        return qwen3_next_fields(c, where)
    if traits.moe == "qwen3_5_moe":
        return qwen3_next_fields(c, where, norm_topk=True)
    if traits.moe == "glm4_moe":
        return _glm4_moe_fields(c)
    if traits.moe == "gpt_oss":
        return gpt_oss_fields(c)
    if traits.moe == "minimax_m2":
        return _minimax_m2_fields(c)
    if traits.moe == "llama4":
        return _llama4_fields(c)
    if traits.moe == "mixtral":
        return dict(num_experts=int(c.num_local_experts), experts_per_token=int(c.num_experts_per_tok),
                    moe_intermediate_size=int(c.intermediate_size), router_score="softmax", router_norm_topk=True,
                    aux_loss_coef=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0))
    if traits.moe is None:
        return {}
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise UserError(f"{where}: attention_bias / mlp_bias are not supported for {traits.architecture}")
    out: dict[str, Any] = dict(
        num_experts=int(c.n_routed_experts), experts_per_token=int(c.num_experts_per_tok),
        moe_intermediate_size=int(c.moe_intermediate_size), shared_experts=int(c.n_shared_experts or 0),
        dense_layers=int(c.first_k_dense_replace or 0), router_scale=float(c.routed_scaling_factor),
        q_lora_rank=int(c.q_lora_rank or 0), kv_lora_rank=int(c.kv_lora_rank),
        qk_nope_head_dim=int(c.qk_nope_head_dim), qk_rope_head_dim=int(c.qk_rope_head_dim),
        v_head_dim=int(c.v_head_dim),
    )
    if traits.moe == "deepseek_v2":
        method = getattr(c, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise UserError(f"{where}: topk_method {method!r} is not supported; supported: greedy, group_limited_greedy")
        grouped = method == "group_limited_greedy"
        # transformers' DeepSeek-V2 never renormalizes the top-k weights (norm_topk_prob is ignored).
        out.update(router_score="softmax", router_norm_topk=False, hf_rope_interleave=True,
                   router_groups=int(c.n_group) if grouped else 1,
                   router_topk_groups=int(c.topk_group) if grouped else 1, router_group_score="max")
    else:
        out.update(router_score="sigmoid", router_norm_topk=bool(c.norm_topk_prob), router_bias=True,
                   router_groups=int(c.n_group or 1), router_topk_groups=int(c.topk_group or 1),
                   router_group_score="top2", hf_rope_interleave=bool(getattr(c, "rope_interleave", True)))
    if traits.moe == "deepseek_v32":
        out.update(_sparse_fields(c, where))
    return out


def _sparse_fields(c: Any, where: str) -> dict[str, Any]:
    """DeepSeek-V3.2's indexer fields; its MLP layers must be the first ``first_k_dense_replace`` dense and the rest
    MoE, as ModelConfig's dense_layers says (transformers' ``mlp_layer_types`` could say otherwise)."""
    n, dense = int(c.num_hidden_layers), min(int(c.first_k_dense_replace or 0), int(c.num_hidden_layers))
    if list(c.mlp_layer_types) != ["dense"] * dense + ["sparse"] * (n - dense):
        raise UserError(f"{where}: mlp_layer_types other than {dense} dense layers then sparse ones are not supported; "
                        "leave mlp_layer_types out and set first_k_dense_replace")
    return dict(index_topk=int(c.index_topk), index_n_heads=int(c.index_n_heads), index_head_dim=int(c.index_head_dim))


def gpt_oss_fields(c: Any) -> dict[str, Any]:
    """ModelConfig fields of a gpt-oss config (transformers' GptOssConfig): experts with biases and the clamped
    SwiGLU, a router with a bias on its logits (softmax over the top k), attention sinks."""
    return dict(num_experts=int(c.num_local_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.intermediate_size), router_score="softmax", router_norm_topk=True,
                aux_loss_coef=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0), attn_sinks=True,
                router_logits_bias=True, expert_bias=True, swiglu_limit=float(c.swiglu_limit),
                swiglu_alpha=float(c.swiglu_alpha))


def _llama4_fields(c: Any) -> dict[str, Any]:
    """Llama 4's ModelConfig fields (transformers' Llama4TextConfig), but its dense layers' width
    (``intermediate_size_mlp``, :func:`_completed`): experts and one shared expert of ``intermediate_size``
    on the ``moe_layers`` (the others dense), sigmoid top-k routing whose weight scales each expert's input, chunked
    attention, the weightless q/k norm of RoPE layers and the NoPE layers' attention temperature."""
    moe_layers = {int(i) for i in c.moe_layers}
    return dict(num_experts=int(c.num_local_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.intermediate_size), shared_experts=1, router_score="sigmoid",
                router_norm_topk=False, router_scales_input=True,
                mlp_only_layers=tuple(i for i in range(int(c.num_hidden_layers)) if i not in moe_layers),
                attention_chunk_size=int(c.attention_chunk_size) if c.attention_chunk_size else None,
                qk_l2_norm=bool(c.use_qk_norm), temperature_tuning=bool(c.attn_temperature_tuning),
                temperature_floor=float(c.floor_scale), temperature_scale=float(c.attn_scale))


def _gemma4_fields(c: Any, where: str) -> dict[str, Any]:
    """Gemma 4's ModelConfig fields: the full layers' head dims (transformers' per_layer_config), KV sharing,
    per-layer inputs, layer scalars, values normed, attention unscaled, and the MoE block beside the MLP."""
    # "vision": image tokens attend both ways on sliding layers (zoo.model.vision_from_hf); text stays causal.
    if getattr(c, "use_bidirectional_attention", None) not in (None, "vision"):
        raise UserError(f"{where}: use_bidirectional_attention={c.use_bidirectional_attention!r} is not supported; "
                        "lmzoo's Gemma 4 is causal, image tokens aside ('vision'; or leave it unset)")
    n, shared = int(c.num_hidden_layers), int(c.num_kv_shared_layers or 0)
    if shared >= n:
        raise UserError(f"{where}: num_kv_shared_layers={shared} leaves no layer to compute keys/values; "
                        f"set it below num_hidden_layers={n}")
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    lc = c.per_layer_config[full[0]] if full else c
    ple = int(c.hidden_size_per_layer_input or 0)
    out: dict[str, Any] = dict(
        query_pre_attn_scalar=1.0,  # transformers' Gemma 4 attention scales q.k by 1 (its q/k norms set the scale)
        global_head_dim=int(lc.head_dim), global_kv_heads=int(lc.num_key_value_heads),
        attention_k_eq_v=bool(c.attention_k_eq_v), v_norm=True, kv_shared_layers=shared,
        double_wide_mlp=bool(c.use_double_wide_mlp) and shared > 0, per_layer_input_size=ple,
        per_layer_vocab_size=int(c.vocab_size_per_layer_input) if ple else 0, layer_scalars=True)
    if c.enable_moe_block:
        out.update(num_experts=int(c.num_experts), experts_per_token=int(c.top_k_experts),
                   moe_intermediate_size=int(c.moe_intermediate_size), router_norm_topk=True, parallel_moe=True)
    return out


def _flag(value: str | bool, c: Any) -> bool:
    return bool(getattr(c, value, False)) if isinstance(value, str) else value


def read_layer_fields(family: str, c: Any, rope_params: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of this family's config object ``c`` (transformers' own, with its defaults and
    derived fields) beyond the shared ones; ``rope_params`` is its standardized ``rope_parameters``."""
    pre_norms, span = _LAYOUT.get(family, (True, "head"))
    out: dict[str, Any] = dict(pre_norms=pre_norms, qk_norm_span=span)
    uses_rope = getattr(c, "no_rope_layers", None)  # SmolLM3: 1 where a layer applies RoPE, 0 for NoPE
    if uses_rope is not None:
        out["nope_layers"] = tuple(i for i, on in enumerate(uses_rope) if not on)
    factor = rope_params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    if factor is not None:
        out["partial_rotary_factor"] = float(factor)
    if family == "qwen3_5":  # dense Qwen3.5: its linear layers' fields (qwen3_5_moe's come with its experts')
        out.update(linear_layer_fields(c))
    return out


def read_longrope(rope: RopeConfig, params: dict[str, Any], c: Any) -> RopeConfig:
    """``rope`` with LongRoPE's fields from its rope parameters: the short/long factors, and the scaling
    factor transformers derives when the config gives none (max_position_embeddings over the original)."""
    factor = params.get("factor")
    if factor is None:
        factor = int(c.max_position_embeddings) / rope.original_max_position_embeddings
    return dataclasses.replace(rope, factor=float(factor), short_factor=tuple(params.get("short_factor") or ()),
                               long_factor=tuple(params.get("long_factor") or ()))


def _layer_kinds(traits: FamilyTraits, c: Any, window: Any, where: str) -> tuple[str, ...]:
    """Each layer's attention ("full" or "sliding"): one window on every layer (Mistral), else the config's
    ``layer_types``, else full attention throughout."""
    n = int(c.num_hidden_layers)
    if traits.sliding_on_every_layer:
        return ("sliding",) * n if window else ("full",) * n
    raw_types = getattr(c, "layer_types", None)
    if not raw_types:
        return ("full",) * n
    unknown = sorted(set(raw_types) - set(LAYER_TYPES))
    if unknown:
        raise UserError(f"{where}: layer types {unknown} are not supported; supported: {sorted(LAYER_TYPES)}")
    return tuple(LAYER_TYPES[t] for t in raw_types)


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Translate an HF config dict into a ModelConfig; unsupported settings are UserErrors."""
    family, fmt = family_of(hf, where)
    traits = FAMILIES[family]
    top, c = _parse(hf, where)
    if family == "gemma4":
        # Its head_dim / kv heads are the sliding layers'; _gemma4_fields reads the full layers' own.
        c.allow_global_per_layer_attribute_access = True
    rp = dict(getattr(c, "rope_parameters", None) or {})
    if traits.mrope_interleaved:  # Qwen3-VL: interleaved whatever the config says, its default sections if none
        rp.update(mrope_interleaved=True, mrope_section=rp.get("mrope_section") or list(traits.mrope_default))
    if "full_attention" in rp or "sliding_attention" in rp:
        rope = _rope(rp.get("full_attention") or {}, c, where)
        local = _rope(rp.get("sliding_attention") or {}, c, where)
    else:
        rope = local = _rope(rp, c, where)
    window: Any = getattr(c, "sliding_window", None)  # int() below turns a bad one into a UserError
    n = int(c.num_hidden_layers)
    kinds = _layer_kinds(traits, c, window, where)
    sliding = "sliding" in kinds
    typed = sliding or "chunked" in kinds or "linear" in kinds  # Llama 4's chunked layers, Qwen3-Next's linear ones
    act = str(getattr(c, traits.act_field, None) or getattr(c, "hidden_act", "silu"))
    if family == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # transformers itself swaps the legacy exact GELU for the tanh one
    heads, hidden = int(c.num_attention_heads), int(c.hidden_size)
    moe = _moe_fields(traits, c, where)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    if moe.get("kv_lora_rank"):
        head_dim = moe["qk_nope_head_dim"] + moe["qk_rope_head_dim"]  # latent attention: q.k width
        kv_heads = heads
    final_cap = getattr(c, traits.final_softcap_field, None) if traits.final_softcap_field else None
    if fmt == "hf-gemma3-multimodal":
        final_cap = None  # Gemma3ForConditionalGeneration does not soft-cap its logits
    attn_cap = getattr(c, traits.attn_softcap_field, None) if traits.attn_softcap_field else None
    try:
        cfg = ModelConfig(
            family=family, vocab_size=int(c.vocab_size), hidden_size=hidden,
            # Qwen3.5-MoE's config has no intermediate_size (no dense layer): its experts' width stands in
            intermediate_size=int(getattr(c, "intermediate_size", None) or moe.get("moe_intermediate_size", 0)),
            num_layers=n, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope=rope, max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)),
            tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
            qkv_bias=_flag(traits.qkv_bias, c), o_bias=_flag(traits.o_bias, c), mlp_bias=_flag(traits.mlp_bias, c),
            hidden_act=act, norm_offset=traits.norm_offset, embed_scale=traits.embed_scale,
            post_norms=traits.post_norms, qk_norm=_flag(traits.qk_norm, c),
            query_pre_attn_scalar=float(c.query_pre_attn_scalar) if traits.uses_query_pre_attn_scalar else None,
            attn_softcap=float(attn_cap) if attn_cap else None, final_softcap=float(final_cap) if final_cap else None,
            sliding_window=int(window) if sliding else None, layer_types=kinds if typed else None,
            rope_local=local if sliding and local != rope else None, **moe, **read_layer_fields(family, c, rp),
        )
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{where}: cannot read the model config ({e})") from None
    return _completed(cfg, hf, top, c, where)


def _completed(cfg: ModelConfig, hf: dict[str, Any], top: Any, c: Any, where: str) -> ModelConfig:
    """``cfg`` with Gemma 4's own fields, a vision-language model's vision side and a reward model's score head,
    checked for what lmzoo cannot run."""
    if cfg.family == "gemma4":
        cfg = dataclasses.replace(cfg, **_gemma4_fields(c, where))
    if cfg.family == "llama4":  # its dense layers' MLP (the experts' width is intermediate_size)
        cfg = dataclasses.replace(cfg, intermediate_size=int(c.intermediate_size_mlp))
    vision = VISION_FORMATS.get(family_of(hf, where)[1])
    if vision is not None and getattr(top, "vision_config", None) is not None:  # a released text config has none
        from zoo.model.vision_from_hf import vision_config_from_hf

        reader, arch = vision
        cfg = dataclasses.replace(cfg, vision=vision_config_from_hf(reader, top, arch, where))
    if any(a.endswith(CLASSIFIER[1]) for a in hf.get("architectures") or []):  # a reward model's score head
        pad = getattr(top, "pad_token_id", None)
        cfg = dataclasses.replace(cfg, num_labels=int(getattr(top, "num_labels", 1)),
                                  pad_token_id=int(pad) if pad is not None else None)
    # SmolLM3's model never reads pretraining_tp (its release's config says 2).
    if getattr(c, "pretraining_tp", 1) not in (1, None) and cfg.family != "smollm3":
        raise UserError(f"{where}: pretraining_tp={c.pretraining_tp} is not supported; set it to 1")
    from zoo.layers.blocks import ACTIVATIONS

    if cfg.hidden_act not in ACTIVATIONS:
        raise UserError(f"{where}: activation {cfg.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return cfg
