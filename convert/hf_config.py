"""Hugging Face config.json <-> ModelConfig, driven by one traits table per family.

Configs are parsed through transformers' own config classes, so every default
and derived field (Gemma's head_dim of 256, Qwen 2's sliding layers from
``max_window_layers``, Gemma 3's per-layer-type RoPE) is exactly what the
reference implementation uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convert.hf_layer_fields import read_layer_fields, read_longrope, write_layer_fields
from zoo.errors import UserError
from zoo.model.config import ModelConfig, RopeConfig


@dataclass(frozen=True)
class FamilyTraits:
    """How one family's HF config maps onto ModelConfig fields (data, not code)."""

    model_type: str
    architecture: str
    norm_offset: float = 0.0
    embed_scale: bool = False
    post_norms: bool = False
    qk_norm: str | bool = False  # a config field name to read (GLM-4.5's use_qk_norm), or a fixed value
    # Bias flags: a config field name to read, or a fixed value.
    qkv_bias: str | bool = "attention_bias"
    o_bias: str | bool = "attention_bias"
    mlp_bias: str | bool = False
    act_field: str = "hidden_act"
    attn_softcap_field: str | None = None
    final_softcap_field: str | None = None
    uses_query_pre_attn_scalar: bool = False
    sliding_on_every_layer: bool = False  # Mistral: one window for all layers, no layer_types
    moe: str | None = None  # "mixtral" | "deepseek_v2" | "deepseek_v3" | "qwen3_moe" | "glm4_moe": how routing is configured


FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits("llama", "LlamaForCausalLM", mlp_bias="mlp_bias"),
    "mistral": FamilyTraits("mistral", "MistralForCausalLM", qkv_bias=False, o_bias=False,
                            sliding_on_every_layer=True),
    "gemma": FamilyTraits("gemma", "GemmaForCausalLM", norm_offset=1.0, embed_scale=True),
    "gemma2": FamilyTraits("gemma2", "Gemma2ForCausalLM", norm_offset=1.0, embed_scale=True, post_norms=True,
                           act_field="hidden_activation", attn_softcap_field="attn_logit_softcapping",
                           final_softcap_field="final_logit_softcapping", uses_query_pre_attn_scalar=True),
    # transformers' Gemma 3 never applies attn_logit_softcapping, whatever the config says.
    "gemma3": FamilyTraits("gemma3_text", "Gemma3ForCausalLM", norm_offset=1.0, embed_scale=True, post_norms=True,
                           qk_norm=True, act_field="hidden_activation", final_softcap_field="final_logit_softcapping",
                           uses_query_pre_attn_scalar=True),
    "qwen2": FamilyTraits("qwen2", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
    "qwen3": FamilyTraits("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    "mixtral": FamilyTraits("mixtral", "MixtralForCausalLM", qkv_bias=False, o_bias=False,
                            sliding_on_every_layer=True, moe="mixtral"),
    "deepseek_v2": FamilyTraits("deepseek_v2", "DeepseekV2ForCausalLM", qkv_bias=False, o_bias=False,
                                moe="deepseek_v2"),
    "deepseek_v3": FamilyTraits("deepseek_v3", "DeepseekV3ForCausalLM", qkv_bias=False, o_bias=False,
                                moe="deepseek_v3"),
    "qwen3_moe": FamilyTraits("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, sliding_on_every_layer=True,
                              moe="qwen3_moe"),
    # GLM-4.5's o_proj never has a bias, whatever attention_bias says.
    "glm4_moe": FamilyTraits("glm4_moe", "Glm4MoeForCausalLM", qk_norm="use_qk_norm", o_bias=False, moe="glm4_moe"),
    "gpt_oss": FamilyTraits("gpt_oss", "GptOssForCausalLM", moe="gpt_oss"),
    # SmolLM3 (NoPE layers), OLMo 2/3 (post-norms only, q/k norms over all heads; OLMo 3's sliding layers) and
    # Phi-3/Phi-4 (fused qkv_proj/gate_up_proj: convert.fused; partial rotary, LongRoPE): convert.hf_layer_fields.
    "smollm3": FamilyTraits("smollm3", "SmolLM3ForCausalLM", mlp_bias="mlp_bias"),
    "olmo2": FamilyTraits("olmo2", "Olmo2ForCausalLM", post_norms=True, qk_norm=True),
    "olmo3": FamilyTraits("olmo3", "Olmo3ForCausalLM", post_norms=True, qk_norm=True),
    "phi3": FamilyTraits("phi3", "Phi3ForCausalLM", qkv_bias=False, o_bias=False, sliding_on_every_layer=True),
    # Gemma 4 (text): plain x * w norms (no offset); the rest of its traits are read by _gemma4_fields.
    "gemma4": FamilyTraits("gemma4_text", "Gemma4ForCausalLM", embed_scale=True, post_norms=True, qk_norm=True,
                           act_field="hidden_activation", final_softcap_field="final_logit_softcapping"),
}

# architecture -> (family, source format of its weight names)
CLASSIFIER = ("ForCausalLM", "ForSequenceClassification")  # a family's LM class name -> its reward-model class
ARCHITECTURES: dict[str, tuple[str, str]] = {
    **{t.architecture: (f, "hf") for f, t in FAMILIES.items()},
    # reward models (rm/): the family's decoder with a scalar head ``score`` on the last token
    **{t.architecture.replace(*CLASSIFIER): (f, "hf") for f, t in FAMILIES.items() if CLASSIFIER[0] in t.architecture},
    "Gemma3ForConditionalGeneration": ("gemma3", "hf-gemma3-multimodal"),
    "Gemma4ForConditionalGeneration": ("gemma4", "hf-gemma4-multimodal"),
}
MODEL_TYPES: dict[str, tuple[str, str]] = {
    **{t.model_type: (f, "hf") for f, t in FAMILIES.items()},
    "gemma3": ("gemma3", "hf-gemma3-multimodal"),
    "gemma4": ("gemma4", "hf-gemma4-multimodal"),
}

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope", "proportional")  # proportional: Gemma 4
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def family_of(hf: dict[str, Any], where: str) -> tuple[str, str]:
    """(zoo family, weight-name format) of an HF config, or a UserError naming what is supported."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    got = ", ".join(archs) or f"model_type={hf.get('model_type')!r}"
    raise UserError(f"{where}: architecture {got} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")


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
    )
    return read_longrope(rope, params, c) if kind == "longrope" else rope


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _qwen3_moe_fields(c: Any, where: str) -> dict[str, Any]:
    """ModelConfig fields of Qwen3-MoE's experts: softmax top-k routing, MoE on every ``decoder_sparse_step``-th
    layer but those of ``mlp_only_layers`` (the others dense)."""
    step = 1 if c.decoder_sparse_step is None else int(c.decoder_sparse_step)
    if step < 1:
        raise UserError(f"{where}: decoder_sparse_step={step} must be at least 1")
    return dict(num_experts=int(c.num_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.moe_intermediate_size), router_score="softmax",
                router_norm_topk=bool(c.norm_topk_prob), aux_loss_coef=float(c.router_aux_loss_coef or 0.0),
                decoder_sparse_step=step, mlp_only_layers=tuple(sorted({int(i) for i in c.mlp_only_layers or ()})))


def _glm4_moe_fields(c: Any) -> dict[str, Any]:
    """ModelConfig fields of GLM-4.5's experts: DeepSeek-V3's sigmoid group-limited routing with a selection
    bias, shared experts and dense first layers, on ordinary (not latent) attention."""
    return dict(num_experts=int(c.n_routed_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.moe_intermediate_size), shared_experts=int(c.n_shared_experts or 0),
                dense_layers=int(c.first_k_dense_replace or 0), router_scale=float(c.routed_scaling_factor),
                router_score="sigmoid", router_norm_topk=bool(c.norm_topk_prob), router_bias=True,
                router_groups=int(c.n_group or 1), router_topk_groups=int(c.topk_group or 1),
                router_group_score="top2")


def _moe_fields(traits: FamilyTraits, c: Any, where: str) -> dict[str, Any]:
    """ModelConfig fields of the mixture-of-experts and latent-attention families."""
    if traits.moe == "qwen3_moe":
        return _qwen3_moe_fields(c, where)
    if traits.moe == "glm4_moe":
        return _glm4_moe_fields(c)
    if traits.moe == "gpt_oss":
        return gpt_oss_fields(c)
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
    return out


def gpt_oss_fields(c: Any) -> dict[str, Any]:
    """ModelConfig fields of a gpt-oss config (transformers' GptOssConfig): experts with biases and the clamped
    SwiGLU, a router with a bias on its logits (softmax over the top k), attention sinks."""
    return dict(num_experts=int(c.num_local_experts), experts_per_token=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.intermediate_size), router_score="softmax", router_norm_topk=True,
                aux_loss_coef=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0), attn_sinks=True,
                router_logits_bias=True, expert_bias=True, swiglu_limit=float(c.swiglu_limit),
                swiglu_alpha=float(c.swiglu_alpha))


def gpt_oss_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The gpt-oss fields of a Hugging Face config for ``cfg`` (the inverse of :func:`gpt_oss_fields`, and the
    layer kinds, which GptOssConfig would otherwise make alternate). Its YaRN parameters name beta_fast and
    beta_slow even at their defaults, as GptOssConfig's own and the released configs do."""
    rope = _rope_dict(cfg.rope)
    if cfg.rope.kind == "yarn":
        rope.update(beta_fast=cfg.rope.beta_fast, beta_slow=cfg.rope.beta_slow)
    return dict(rope_parameters=rope, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                router_aux_loss_coef=cfg.aux_loss_coef, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                layer_types=[{"full": "full_attention", "sliding": "sliding_attention"}[k] for k in cfg.kinds],
                sliding_window=cfg.sliding_window)


def _gemma4_fields(c: Any, where: str) -> dict[str, Any]:
    """Gemma 4's ModelConfig fields: the full layers' head dims (transformers' per_layer_config), KV sharing,
    per-layer inputs, layer scalars, values normed, attention unscaled, and the MoE block beside the MLP."""
    if getattr(c, "use_bidirectional_attention", None):
        raise UserError(f"{where}: use_bidirectional_attention={c.use_bidirectional_attention!r} is not supported; "
                        "lmzoo's Gemma 4 is causal (leave it unset)")
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


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Translate an HF config dict into a ModelConfig; unsupported settings are UserErrors."""
    family, fmt = family_of(hf, where)
    traits = FAMILIES[family]
    top, c = _parse(hf, where)
    if family == "gemma4":
        # Its head_dim / kv heads are the sliding layers'; _gemma4_fields reads the full layers' own.
        c.allow_global_per_layer_attribute_access = True
    rp = dict(getattr(c, "rope_parameters", None) or {})
    if "full_attention" in rp or "sliding_attention" in rp:
        rope = _rope(rp.get("full_attention") or {}, c, where)
        local = _rope(rp.get("sliding_attention") or {}, c, where)
    else:
        rope = local = _rope(rp, c, where)
    window: Any = getattr(c, "sliding_window", None)  # int() below turns a bad one into a UserError
    raw_types = getattr(c, "layer_types", None)
    n = int(c.num_hidden_layers)
    if traits.sliding_on_every_layer:
        kinds = ("sliding",) * n if window else ("full",) * n
    elif raw_types:
        unknown = sorted(set(raw_types) - set(LAYER_TYPES))
        if unknown:
            raise UserError(f"{where}: layer types {unknown} are not supported; supported: {sorted(LAYER_TYPES)}")
        kinds = tuple(LAYER_TYPES[t] for t in raw_types)
    else:
        kinds = ("full",) * n
    sliding = "sliding" in kinds
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
            family=family,
            vocab_size=int(c.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(c.intermediate_size),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)),
            tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
            qkv_bias=_flag(traits.qkv_bias, c),
            o_bias=_flag(traits.o_bias, c),
            mlp_bias=_flag(traits.mlp_bias, c),
            hidden_act=act,
            norm_offset=traits.norm_offset,
            embed_scale=traits.embed_scale,
            post_norms=traits.post_norms,
            qk_norm=_flag(traits.qk_norm, c),
            query_pre_attn_scalar=float(c.query_pre_attn_scalar) if traits.uses_query_pre_attn_scalar else None,
            attn_softcap=float(attn_cap) if attn_cap else None,
            final_softcap=float(final_cap) if final_cap else None,
            sliding_window=int(window) if sliding else None,
            layer_types=kinds if sliding else None,
            rope_local=local if sliding and local != rope else None,
            **moe,
            **read_layer_fields(family, c, rp),
        )
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{where}: cannot read the model config ({e})") from None
    if family == "gemma4":
        import dataclasses

        cfg = dataclasses.replace(cfg, **_gemma4_fields(c, where))
    if any(a.endswith(CLASSIFIER[1]) for a in hf.get("architectures") or []):  # a reward model's score head
        import dataclasses

        pad = getattr(top, "pad_token_id", None)
        cfg = dataclasses.replace(cfg, num_labels=int(getattr(top, "num_labels", 1)),
                                  pad_token_id=int(pad) if pad is not None else None)
    # SmolLM3's model never reads pretraining_tp (its release's config says 2).
    if getattr(c, "pretraining_tp", 1) not in (1, None) and family != "smollm3":
        raise UserError(f"{where}: pretraining_tp={c.pretraining_tp} is not supported; set it to 1")
    from zoo.layers.blocks import ACTIVATIONS

    if cfg.hidden_act not in ACTIVATIONS:
        raise UserError(f"{where}: activation {cfg.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return cfg


def source_format(hf: dict[str, Any], where: str = "config.json") -> str:
    """Which weight-name table a checkpoint with this config uses."""
    return family_of(hf, where)[1]


def _rope_dict(r: RopeConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": r.kind, "rope_theta": r.theta}
    if r.kind in ("linear", "llama3", "yarn"):
        d["factor"] = r.factor
    if r.kind == "yarn":
        # Settings at transformers' defaults (beta 32/1, truncate, no mscale) are left out, as its configs leave them.
        d["original_max_position_embeddings"] = r.original_max_position_embeddings
        for key, value, default in (("beta_fast", r.beta_fast, 32.0), ("beta_slow", r.beta_slow, 1.0),
                                    ("mscale", r.mscale, None), ("mscale_all_dim", r.mscale_all_dim, None),
                                    ("attention_factor", r.attention_factor, None), ("truncate", r.truncate, True)):
            if value != default:
                d[key] = value
    if r.kind == "llama3":
        d.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                 original_max_position_embeddings=r.original_max_position_embeddings)
    return d


def _implied_head_dim(model_type: str, hidden: int, heads: int) -> int:
    """The head_dim transformers' config class gives a model that does not set one."""
    from transformers import AutoConfig

    c = AutoConfig.for_model(model_type, hidden_size=hidden, num_attention_heads=heads)
    if model_type == "gemma4_text":
        c.allow_global_per_layer_attribute_access = True  # its head_dim: the sliding layers'
    return int(getattr(c, "head_dim", None) or hidden // heads)


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of a Hugging Face config dict for ``cfg`` (when no source config was kept, or it no
    longer fits); :func:`export_hf_config` completes them through the family's config class."""
    t = FAMILIES[cfg.family]
    out: dict[str, Any] = {
        "architectures": [t.architecture.replace(*CLASSIFIER) if cfg.num_labels else t.architecture],
        "model_type": t.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        **({"num_labels": cfg.num_labels, "pad_token_id": cfg.pad_token_id} if cfg.num_labels else {}),
        t.act_field: cfg.hidden_act,
        "rope_parameters": _rope_dict(cfg.rope),
    }
    for flag, field in ((t.qkv_bias, cfg.qkv_bias), (t.o_bias, cfg.o_bias), (t.mlp_bias, cfg.mlp_bias)):
        if isinstance(flag, str):
            out[flag] = bool(out.get(flag, False) or field)
    if t.attn_softcap_field:
        out[t.attn_softcap_field] = cfg.attn_softcap
    if t.final_softcap_field:
        out[t.final_softcap_field] = cfg.final_softcap
    if t.uses_query_pre_attn_scalar:
        q = cfg.query_pre_attn_scalar
        out["query_pre_attn_scalar"] = int(q) if q is not None and float(q).is_integer() else q  # HF types it int
    if "head_dim" in out and cfg.head_dim == _implied_head_dim(t.model_type, cfg.hidden_size, cfg.num_heads):
        out.pop("head_dim")  # as transformers writes it: derived (or null, or absent) rather than set
    kinds = cfg.kinds
    if t.sliding_on_every_layer:
        out["sliding_window"] = cfg.sliding_window
    elif cfg.family not in ("llama", "gemma") and not t.moe:
        out["layer_types"] = [{"full": "full_attention", "sliding": "sliding_attention"}[k] for k in kinds]
        out["sliding_window"] = cfg.sliding_window
        if cfg.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = "sliding" in kinds
            full = kinds.index("sliding") if "sliding" in kinds else len(kinds)
            if "sliding" in kinds and all(k == "sliding" for k in kinds[full:]):
                out["max_window_layers"] = full  # the layer_types transformers derives from it
    if cfg.family == "gemma3":
        out["rope_parameters"] = {"full_attention": _rope_dict(cfg.rope),
                                  "sliding_attention": _rope_dict(cfg.rope_local or cfg.rope)}
    if cfg.family == "gemma4":
        out.update(_gemma4_hf_fields(cfg))
    if t.moe == "gpt_oss":
        out.update(gpt_oss_hf_fields(cfg))
    elif t.moe == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.aux_loss_coef)
    elif t.moe in ("qwen3_moe", "glm4_moe"):
        out.update(_moe_hf_fields(cfg))
    elif t.moe:
        out.update(
            n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.moe_intermediate_size, n_shared_experts=cfg.shared_experts,
            first_k_dense_replace=cfg.dense_layers, routed_scaling_factor=cfg.router_scale,
            n_group=cfg.router_groups, topk_group=cfg.router_topk_groups, q_lora_rank=cfg.q_lora_rank or None,
            kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        )
        out.pop("head_dim", None)  # derived from the latent-attention dims
        if t.moe == "deepseek_v2":
            out["topk_method"] = "group_limited_greedy" if cfg.router_groups > 1 else "greedy"
        else:
            out.update(norm_topk_prob=cfg.router_norm_topk, rope_interleave=cfg.hf_rope_interleave)
    write_layer_fields(cfg, out, _rope_dict)
    return out


def _moe_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config fields of a Qwen3-MoE or GLM-4.5 model's experts, RoPE and QK norm (see
    :func:`_qwen3_moe_fields`, :func:`_glm4_moe_fields`)."""
    # Their config classes declare no head_dim (the attention reads it, else hidden / heads): always written, as
    # every released config writes it.
    shared = dict(num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.moe_intermediate_size,
                  norm_topk_prob=cfg.router_norm_topk, head_dim=cfg.head_dim)
    if cfg.family == "qwen3_moe":
        return dict(shared, num_experts=cfg.num_experts, router_aux_loss_coef=cfg.aux_loss_coef,
                    decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                    use_sliding_window="sliding" in cfg.kinds)
    rope = dict(_rope_dict(cfg.rope), partial_rotary_factor=cfg.partial_rotary_factor)
    return dict(shared, n_routed_experts=cfg.num_experts, n_shared_experts=cfg.shared_experts,
                first_k_dense_replace=cfg.dense_layers, routed_scaling_factor=cfg.router_scale,
                n_group=cfg.router_groups, topk_group=cfg.router_topk_groups, use_qk_norm=cfg.qk_norm,
                rope_parameters=rope, num_nextn_predict_layers=0)  # the model has no MTP layer (convert/mtp.py)


def _gemma4_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Gemma 4's config.json fields of ``cfg`` (inverse of :func:`_gemma4_fields`)."""
    rope = _rope_dict(cfg.rope)
    if cfg.rope.kind == "proportional":
        rope["partial_rotary_factor"] = cfg.rope.proportional_fraction
        if cfg.rope.factor != 1.0:
            rope["factor"] = cfg.rope.factor
    out: dict[str, Any] = {
        "rope_parameters": {"full_attention": rope, "sliding_attention": _rope_dict(cfg.rope_local or cfg.rope)},
        "global_head_dim": cfg.global_head_dim,
        # transformers reads num_global_key_value_heads only with attention_k_eq_v
        "num_global_key_value_heads": cfg.global_kv_heads if cfg.attention_k_eq_v else None,
        "attention_k_eq_v": cfg.attention_k_eq_v, "num_kv_shared_layers": cfg.kv_shared_layers,
        "use_double_wide_mlp": cfg.double_wide_mlp, "hidden_size_per_layer_input": cfg.per_layer_input_size,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
        "enable_moe_block": cfg.parallel_moe,
    }
    if cfg.parallel_moe:
        out.update(num_experts=cfg.num_experts, top_k_experts=cfg.experts_per_token,
                   moe_intermediate_size=cfg.moe_intermediate_size)
    return out


def _save_pretrained_dict(hf: dict[str, Any], architecture: str, dtype: str) -> dict[str, Any]:
    """The config.json transformers' ``save_pretrained`` writes for a model with config ``hf``.

    ``hf`` goes through the family's own config class (defaults, derived fields, RoPE
    standardization), ``architectures`` and ``dtype`` are set as ``PreTrainedModel.save_pretrained``
    sets them, and the result is read back from ``to_json_string()``, the text ``PreTrainedConfig.save_pretrained``
    writes (its diff against the defaults, keys sorted). Config classes need no torch.
    """
    import json

    from transformers import AutoConfig

    skip = ("model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path")
    c = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k not in skip})
    c.architectures = [architecture]
    c.dtype = dtype
    return json.loads(c.to_json_string(use_diff=True))


def export_hf_config(cfg: ModelConfig, source: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """The config.json to export: what transformers' ``save_pretrained`` writes for this model.

    The source's own file is kept as it is (only its dtype updated, so HF -> zoo -> HF gives back
    the same file) when it still describes ``cfg`` and is a save_pretrained output: it names its
    architecture and the transformers version that wrote it (a file of an older version stays in
    that version's format, which that version can still read). Any other source (a GGUF file's
    config, a hand-written or registry config for ``zoo init``) is completed through the family's
    config class; without a fitting source the config is generated from ``cfg``. Either way the
    file carries ``architectures`` and every field transformers writes for the family.
    """
    arch = FAMILIES[cfg.family].architecture
    if cfg.num_labels:
        arch = arch.replace(*CLASSIFIER)
    keep = False
    if source is not None:
        try:
            keep = source_format(source) == "hf" and model_config_from_hf(source) == cfg
        except UserError:
            keep = False
    if keep and source is not None:  # keep: source fits
        if not (source.get("architectures") and "transformers_version" in source):
            return _save_pretrained_dict(source, arch, dtype)
        out = dict(source)
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype
        if "dtype" in out or "torch_dtype" not in out:
            out["dtype"] = dtype
        return out
    gen = hf_config_from_model(cfg)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if source and k in source and not (k == "pad_token_id" and cfg.num_labels):  # a classifier's is its own
            gen[k] = source[k]
    return _save_pretrained_dict(gen, arch, dtype)
