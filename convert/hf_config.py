"""ModelConfig -> the Hugging Face config.json an export writes, driven by the family's traits
(:mod:`zoo.model.hf_families`); the other direction is :mod:`zoo.model.from_hf`.

The config is completed through transformers' own config classes, so every default
and derived field is written as ``save_pretrained`` writes it.
"""

from __future__ import annotations

from typing import Any

from convert.hf_layer_fields import llama4_hf_fields, write_layer_fields
from convert.tables import export_format
from zoo.errors import UserError
from zoo.model.config import ModelConfig, RopeConfig
from zoo.model.from_hf import model_config_from_hf
from zoo.model.hf_families import CLASSIFIER, FAMILIES, source_format


def gpt_oss_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The gpt-oss fields of a Hugging Face config for ``cfg`` (the inverse of :func:`zoo.model.from_hf.gpt_oss_fields`, and the
    layer kinds, which GptOssConfig would otherwise make alternate). Its YaRN parameters name beta_fast and
    beta_slow even at their defaults, as GptOssConfig's own and the released configs do."""
    rope = _rope_dict(cfg.rope)
    if cfg.rope.kind == "yarn":
        rope.update(beta_fast=cfg.rope.beta_fast, beta_slow=cfg.rope.beta_slow)
    return dict(rope_parameters=rope, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                router_aux_loss_coef=cfg.aux_loss_coef, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                layer_types=[{"full": "full_attention", "sliding": "sliding_attention"}[k] for k in cfg.kinds],
                sliding_window=cfg.sliding_window)



def minimax_m2_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """MiniMax-M2's config.json fields beyond the shared ones (the inverse of zoo/model/from_hf.py's reading): its
    experts, and partial RoPE both as ``rotary_dim`` (the released configs' field, which MiniMaxM2Config keeps) and
    as the ``partial_rotary_factor`` transformers derives from it."""
    rope = dict(_rope_dict(cfg.rope), partial_rotary_factor=cfg.partial_rotary_factor)
    return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                router_aux_loss_coef=cfg.aux_loss_coef, head_dim=cfg.head_dim, rotary_dim=cfg.rope_dim,
                rope_parameters=rope)


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
        out["layer_types"] = [{"full": "full_attention", "sliding": "sliding_attention",
                               "linear": "linear_attention"}[k] for k in kinds]
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
    elif t.moe == "minimax_m2":
        out.update(minimax_m2_hf_fields(cfg))
    elif t.moe == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.aux_loss_coef)
    elif t.moe in ("qwen3_moe", "glm4_moe"):
        out.update(_moe_hf_fields(cfg))
    elif t.moe == "llama4":
        out.update(llama4_hf_fields(cfg))
    elif t.moe in ("qwen3_next", "qwen3_5_moe"):
        pass  # convert.hf_layer_fields writes them
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
        elif t.moe == "deepseek_v32":  # always interleaved (no rope_interleave field); its indexer
            out.update(norm_topk_prob=cfg.router_norm_topk, index_topk=cfg.index_topk,
                       index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim)
        else:
            out.update(norm_topk_prob=cfg.router_norm_topk, rope_interleave=cfg.hf_rope_interleave)
    write_layer_fields(cfg, out, _rope_dict)
    return out


def _moe_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config fields of a Qwen3-MoE or GLM-4.5 model's experts, RoPE and QK norm (see
    zoo/model/from_hf.py's readers)."""
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
    """Gemma 4's config.json fields of ``cfg`` (the inverse of zoo/model/from_hf.py's reading)."""
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
            keep = source_format(source) == export_format(cfg) and model_config_from_hf(source) == cfg
        except UserError:
            keep = False
    if cfg.vision is not None and not keep:  # no generated composite config yet
        raise UserError(f"exporting a {cfg.vision.arch} needs the config.json it was converted from "
                        "(hf_config.json in the checkpoint), which is missing or no longer fits the model")
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
