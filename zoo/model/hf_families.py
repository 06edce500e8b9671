"""The model families lmzoo reads from Hugging Face configs: how each one's config.json maps onto ModelConfig
fields (one traits table, data rather than code), and which family and weight-name format a config names.

Shared by the two directions: the import (:mod:`zoo.model.from_hf`) and the export (convert/hf_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo.errors import UserError


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
    # "mixtral" | "deepseek_v2" | "deepseek_v3" | "deepseek_v32" | "qwen3_moe" | "qwen3_vl_moe" | "glm4_moe" |
    # "gpt_oss" | "minimax_m2" | "llama4" | "qwen3_next" | "qwen3_5_moe": how routing is configured
    moe: str | None = None
    # Multimodal RoPE's frequencies interleaved over (time, row, column), whatever the config says (Qwen3-VL's
    # transformers class always interleaves); its sections when the config names none
    mrope_interleaved: bool = False
    mrope_default: tuple[int, ...] = ()


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
    # DeepSeek-V3.2: V3 with DeepSeek Sparse Attention (a lightning indexer on every layer: zoo.model.from_hf reads
    # index_topk, index_n_heads, index_head_dim).
    "deepseek_v32": FamilyTraits("deepseek_v32", "DeepseekV32ForCausalLM", qkv_bias=False, o_bias=False,
                                 moe="deepseek_v32"),
    "qwen3_moe": FamilyTraits("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, sliding_on_every_layer=True,
                              moe="qwen3_moe"),
    # GLM-4.5's o_proj never has a bias, whatever attention_bias says.
    "glm4_moe": FamilyTraits("glm4_moe", "Glm4MoeForCausalLM", qk_norm="use_qk_norm", o_bias=False, moe="glm4_moe"),
    "gpt_oss": FamilyTraits("gpt_oss", "GptOssForCausalLM", moe="gpt_oss"),
    # MiniMax-M2: q/k norms over all heads at once (zoo.model.from_hf), Mixtral's expert names, sigmoid routing with
    # a selection bias; no attention biases (its config has no such field).
    "minimax_m2": FamilyTraits("minimax_m2", "MiniMaxM2ForCausalLM", qk_norm=True, qkv_bias=False, o_bias=False,
                               moe="minimax_m2"),
    # SmolLM3 (NoPE layers), OLMo 2/3 (post-norms only, q/k norms over all heads; OLMo 3's sliding layers) and
    # Phi-3/Phi-4 (fused qkv_proj/gate_up_proj: convert.fused; partial rotary, LongRoPE): read by zoo.model.from_hf,
    # written by convert.hf_layer_fields.
    "smollm3": FamilyTraits("smollm3", "SmolLM3ForCausalLM", mlp_bias="mlp_bias"),
    "olmo2": FamilyTraits("olmo2", "Olmo2ForCausalLM", post_norms=True, qk_norm=True),
    "olmo3": FamilyTraits("olmo3", "Olmo3ForCausalLM", post_norms=True, qk_norm=True),
    "phi3": FamilyTraits("phi3", "Phi3ForCausalLM", qkv_bias=False, o_bias=False, sliding_on_every_layer=True),
    # Gemma 4 (text): plain x * w norms (no offset); the rest of its traits are read by zoo.model.from_hf._gemma4_fields.
    "gemma4": FamilyTraits("gemma4_text", "Gemma4ForCausalLM", embed_scale=True, post_norms=True, qk_norm=True,
                           act_field="hidden_activation", final_softcap_field="final_logit_softcapping"),
    # Vision-language models on a Llama language model (text_config model_type "llama"): a SigLIP tower and the
    # pixel-shuffle connector. model_type/architecture name the composite config and model class.
    # Llama 4's text model (Llama4ForCausalLM; Llama4ForConditionalGeneration adds its vision tower: VISION_FORMATS).
    "llama4": FamilyTraits("llama4_text", "Llama4ForCausalLM", moe="llama4"),
    # Qwen3-Next: Gated DeltaNet "linear" layers among gated full-attention ones, zero-centred (1 + w) norms,
    # Qwen3-MoE's routing with a shared expert behind a sigmoid gate; its own fields read by zoo.model.from_hf.
    "qwen3_next": FamilyTraits("qwen3_next", "Qwen3NextForCausalLM", norm_offset=1.0, qk_norm=True,
                               moe="qwen3_next"),
    # Qwen3.5 (Qwen3_5ForCausalLM; the Hub's Qwen3_5ForConditionalGeneration adds its vision tower: VISION_FORMATS):
    # Qwen3-Next's layers with separate linear-layer projections (in_proj_qkv in blocks, in_proj_z, in_proj_b, in_proj_a) and
    # interleaved multimodal RoPE (on text positions: plain RoPE); dense MLPs, or (qwen3_5_moe) Qwen3-Next's experts
    # on every layer with a router that always renormalizes the top k (the config has no norm_topk_prob).
    "qwen3_5": FamilyTraits("qwen3_5_text", "Qwen3_5ForCausalLM", norm_offset=1.0, qk_norm=True,
                            mrope_interleaved=True, mrope_default=(11, 11, 10)),
    "qwen3_5_moe": FamilyTraits("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", norm_offset=1.0, qk_norm=True,
                                mrope_interleaved=True, mrope_default=(11, 11, 10), moe="qwen3_5_moe"),
    "smolvlm": FamilyTraits("smolvlm", "SmolVLMForConditionalGeneration", mlp_bias="mlp_bias"),
    "idefics3": FamilyTraits("idefics3", "Idefics3ForConditionalGeneration", mlp_bias="mlp_bias"),
    # Qwen2.5-VL: a Qwen 2 language model (text_config model_type "qwen2_5_vl_text") with multimodal RoPE.
    "qwen2_5_vl": FamilyTraits("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", qkv_bias=True, o_bias=False),
    # Qwen3-VL: a Qwen 3 language model (text_config model_type "qwen3_vl_text") with interleaved multimodal RoPE.
    "qwen3_vl": FamilyTraits("qwen3_vl", "Qwen3VLForConditionalGeneration", qk_norm=True, mrope_interleaved=True,
                             mrope_default=(24, 20, 20)),
    # Qwen3-VL-MoE (30B-A3B, 235B-A22B): Qwen3-VL's with Qwen3-MoE's experts (text_config "qwen3_vl_moe_text"), stored
    # fused per layer (convert.fused); its router always renormalizes the top k (the config has no norm_topk_prob).
    "qwen3_vl_moe": FamilyTraits("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", qk_norm=True,
                                 mrope_interleaved=True, mrope_default=(24, 20, 20), moe="qwen3_vl_moe"),
}

# weight-name format of a vision-language model -> (the reader of its config's vision side in
# zoo.model.vision_from_hf, its *ForConditionalGeneration class). Gemma 3's text model is family gemma3's.
VISION_FORMATS: dict[str, tuple[str, str]] = {
    "hf-smolvlm": ("idefics3", "SmolVLMForConditionalGeneration"),
    "hf-idefics3": ("idefics3", "Idefics3ForConditionalGeneration"),
    "hf-gemma3-multimodal": ("gemma3", "Gemma3ForConditionalGeneration"),
    "hf-gemma4-multimodal": ("gemma4", "Gemma4ForConditionalGeneration"),
    "hf-qwen2_5-vl": ("qwen2_5", "Qwen2_5_VLForConditionalGeneration"),
    "hf-qwen3-vl": ("qwen3", "Qwen3VLForConditionalGeneration"),
    "hf-qwen3-vl-moe": ("qwen3", "Qwen3VLMoeForConditionalGeneration"),
    "hf-llama4-multimodal": ("llama4", "Llama4ForConditionalGeneration"),
    # Qwen3.5: Qwen3-VL's tower without DeepStack, on the Qwen3.5 language model (hybrid linear/full attention)
    "hf-qwen3_5-multimodal": ("qwen3", "Qwen3_5ForConditionalGeneration"),
    "hf-qwen3_5_moe-multimodal": ("qwen3", "Qwen3_5MoeForConditionalGeneration"),
}

# architecture -> (family, source format of its weight names)
CLASSIFIER = ("ForCausalLM", "ForSequenceClassification")  # a family's LM class name -> its reward-model class
ARCHITECTURES: dict[str, tuple[str, str]] = {
    **{t.architecture: (f, "hf") for f, t in FAMILIES.items()},
    # reward models (rm/): the family's decoder with a scalar head ``score`` on the last token
    **{t.architecture.replace(*CLASSIFIER): (f, "hf") for f, t in FAMILIES.items() if CLASSIFIER[0] in t.architecture},
    "Gemma3ForConditionalGeneration": ("gemma3", "hf-gemma3-multimodal"),
    "Gemma4ForConditionalGeneration": ("gemma4", "hf-gemma4-multimodal"),
    "Llama4ForConditionalGeneration": ("llama4", "hf-llama4-multimodal"),
    # Qwen3.5's releases: the whole VLM (`zoo convert --text-only`: the language model alone)
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "hf-qwen3_5-multimodal"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "hf-qwen3_5_moe-multimodal"),
    "SmolVLMForConditionalGeneration": ("smolvlm", "hf-smolvlm"),
    "Idefics3ForConditionalGeneration": ("idefics3", "hf-idefics3"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "hf-qwen2_5-vl"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "hf-qwen3-vl"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", "hf-qwen3-vl-moe"),
}
MODEL_TYPES: dict[str, tuple[str, str]] = {
    **{t.model_type: (f, "hf") for f, t in FAMILIES.items()},
    "gemma3": ("gemma3", "hf-gemma3-multimodal"),
    "gemma4": ("gemma4", "hf-gemma4-multimodal"),
    "llama4": ("llama4", "hf-llama4-multimodal"),
    "qwen3_5": ("qwen3_5", "hf-qwen3_5-multimodal"),
    "qwen3_5_moe": ("qwen3_5_moe", "hf-qwen3_5_moe-multimodal"),
    "smolvlm": ("smolvlm", "hf-smolvlm"),
    "idefics3": ("idefics3", "hf-idefics3"),
    "qwen2_5_vl": ("qwen2_5_vl", "hf-qwen2_5-vl"),
    "qwen3_vl": ("qwen3_vl", "hf-qwen3-vl"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "hf-qwen3-vl-moe"),
}


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


def source_format(hf: dict[str, Any], where: str = "config.json") -> str:
    """Which weight-name table a checkpoint with this config uses."""
    return family_of(hf, where)[1]
