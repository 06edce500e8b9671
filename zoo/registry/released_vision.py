"""Released Hugging Face configs of the vision-language models the registry names (config.json as published,
the keys transformers fills with its defaults left out, as the Hub's files leave them), so that a run can be
compiled for a TPU slice (``--compile-only``) or initialized at random (``zoo init``) without the Hub: data.

Gemma 3 (google/gemma-3-{4b,12b,27b}-{pt,it}): the SigLIP-so400m tower at 896 pixels in 14-pixel patches,
pooled 4 x 4 into 256 tokens an image; the language models' own configs as Gemma3TextConfig completes them.
SmolVLM (HuggingFaceTB/SmolVLM-{256M,500M}-Instruct, HuggingFaceTB/SmolVLM-Instruct): Idefics3's architecture, a
SigLIP tower and a pixel-shuffle connector beside a SmolLM2 language model (the 2.2B's written without the Hub).
Qwen3-VL (Qwen/Qwen3-VL-{2B,4B,8B,32B}-Instruct): a Qwen3 language model of the same size's shape with interleaved
multimodal RoPE, and a tower in 16-pixel patches with DeepStack (written from the released config.json files as
transformers 4.57 wrote them: the vision_config's model_type "qwen3_vl", the text's RoPE as rope_scaling and
rope_theta, which transformers 5 reads as rope_parameters).
Qwen3-VL-MoE (Qwen/Qwen3-VL-{30B-A3B,235B-A22B}-Instruct): Qwen3-VL's larger tower beside a Qwen3-MoE language model
of 128 experts, 8 a token. Written without the Hub (no network where they were added) from the model cards and
the dense configs' shape, as transformers 4.57 wrote the released files: check them against the Hub's config.json
before relying on a field beyond the shapes (the parameter counts are transformers' own count of these configs).
"""

from __future__ import annotations

from zoo.registry import released

_GEMMA3_VISION = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                  "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "image_size": 896,
                  "vision_use_head": False}


def _gemma3(text: dict) -> dict:
    """A Gemma3ForConditionalGeneration config with this text config (Gemma 3's linear RoPE scaling by 8 and
    1,024-token windows on every size with images)."""
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
            "mm_tokens_per_image": 256, "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
            "text_config": {"model_type": "gemma3_text", "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                            "sliding_window": 1024, **text},
            "vision_config": _GEMMA3_VISION}


GEMMA3_4B = _gemma3({"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34})
GEMMA3_12B = _gemma3({"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                      "num_attention_heads": 16, "num_key_value_heads": 8})
GEMMA3_27B = _gemma3({"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                      "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                      "query_pre_attn_scalar": 168})


def _smolvlm(text: dict, vision: dict, scale_factor: int, image_token_id: int) -> dict:
    """An Idefics3ForConditionalGeneration config (SmolVLM's): a Llama language model, untied embeddings."""
    text = {"model_type": "llama", "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
            "head_dim": 64, **text}
    return {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3",
            "image_token_id": image_token_id, "scale_factor": scale_factor, "tie_word_embeddings": False,
            "vocab_size": text["vocab_size"], "torch_dtype": "bfloat16", "text_config": text,
            "vision_config": {"model_type": "idefics3_vision", **vision}}


# SmolVLM-256M and -500M: a 93M SigLIP (base, 16-pixel patches at 512 pixels), 64 tokens an image (4 x 4 shuffled).
_SIGLIP_B16 = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "patch_size": 16, "image_size": 512}
SMOLVLM_256M = _smolvlm({"vocab_size": 49280, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                         "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000.0,
                         "max_position_embeddings": 8192}, _SIGLIP_B16, 4, 49190)
SMOLVLM_500M = _smolvlm({"vocab_size": 49280, "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                         "num_attention_heads": 15, "num_key_value_heads": 5, "rope_theta": 100000.0,
                         "max_position_embeddings": 8192}, _SIGLIP_B16, 4, 49190)
# SmolVLM-Instruct (2.2B): SigLIP-so400m at 384 pixels in 14-pixel patches (27 x 27: the conv drops 6 pixels a
# side), 81 tokens an image (3 x 3 shuffled), a SmolLM2-1.7B-shaped language model. Written without the Hub (the
# shapes from the model card; <image> is 49153 of a 49,155-token vocabulary): check it against the Hub's
# config.json before relying on a field beyond the shapes (the parameter count is transformers' own).
SMOLVLM_2B = _smolvlm({"vocab_size": 49155, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                       "num_attention_heads": 32, "num_key_value_heads": 32, "rope_theta": 273768.0,
                       "max_position_embeddings": 16384},
                      {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                       "num_attention_heads": 16, "patch_size": 14, "image_size": 384}, 3, 49153)


# Qwen3-VL's towers: 24 layers 1024 wide beside the 2B and 4B, 27 layers 1152 wide (SigLIP-so400m's shape) beside
# the 8B and 32B; DeepStack levels from a third, two thirds and the end of the way down, less one.
_QWEN3_VL_SMALL_TOWER = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                         "deepstack_visual_indexes": [5, 11, 17]}
_QWEN3_VL_LARGE_TOWER = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                         "deepstack_visual_indexes": [8, 16, 24]}


def _qwen3_vl(hidden: int, inter: int, layers: int, heads: int, tied: bool, tower: dict) -> dict:
    """A Qwen3VLForConditionalGeneration config.json of this language model's size (8 KV heads of 128 on every
    size; the tower's output at the model's width)."""
    text = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
            "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 262144,
            "model_type": "qwen3_vl_text", "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
            "rope_theta": 5000000, "tie_word_embeddings": tied, "use_cache": True, "vocab_size": 151936}
    vision = {"hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "initializer_range": 0.02, "model_type": "qwen3_vl",
              "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": hidden, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, **tower}
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "dtype": "bfloat16",
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "tie_word_embeddings": tied, "text_config": text, "vision_config": vision}


QWEN3_VL_2B = _qwen3_vl(2048, 6144, 28, 16, True, _QWEN3_VL_SMALL_TOWER)
QWEN3_VL_4B = _qwen3_vl(2560, 9728, 36, 32, True, _QWEN3_VL_SMALL_TOWER)
QWEN3_VL_8B = _qwen3_vl(4096, 12288, 36, 32, False, _QWEN3_VL_LARGE_TOWER)
QWEN3_VL_32B = _qwen3_vl(5120, 25600, 64, 64, False, _QWEN3_VL_LARGE_TOWER)


def _qwen3_vl_moe(hidden: int, inter: int, layers: int, heads: int, experts_inter: int) -> dict:
    """A Qwen3VLMoeForConditionalGeneration config.json: the dense config's shape (untied, 4 KV heads of 128),
    every layer MoE (128 experts of ``experts_inter``, 8 a token, renormalized), the larger tower."""
    config = _qwen3_vl(hidden, inter, layers, heads, False, _QWEN3_VL_LARGE_TOWER)
    text = {**config["text_config"], "model_type": "qwen3_vl_moe_text", "num_key_value_heads": 4,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": experts_inter,
            "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001}
    text.pop("tie_word_embeddings")
    return {**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
            "text_config": text, "vision_config": {**config["vision_config"], "model_type": "qwen3_vl_moe"}}


QWEN3_VL_30B_A3B = _qwen3_vl_moe(2048, 6144, 48, 32, 768)
QWEN3_VL_235B_A22B = _qwen3_vl_moe(4096, 12288, 94, 64, 1536)


# Llama 4 Scout and Maverick (meta-llama/Llama-4-{Scout-17B-16E,Maverick-17B-128E}[-Instruct]): the released
# Llama4ForConditionalGeneration configs, whose text_config is zoo.registry.released's; both carry the same tower
# (34 layers 1408 wide, 16 heads, 336-pixel tiles in 14-pixel patches: 576 patches and a class token, shuffled
# 2 x 2 into 144 tokens a tile; the adapter MLP and the projector 4096 wide), and the image tokens of the Llama 4
# tokenizer (<|image_start|> 200080, <|image_end|> 200081, <|patch|> 200092, the features' placeholder).
_LLAMA4_VISION = {"model_type": "llama4_vision_model", "hidden_act": "gelu", "hidden_size": 1408, "image_size": 336,
                  "intermediate_size": 5632, "multi_modal_projector_bias": False, "norm_eps": 1e-5,
                  "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 34, "patch_size": 14,
                  "pixel_shuffle_ratio": 0.5, "projector_dropout": 0.0, "projector_input_dim": 4096,
                  "projector_output_dim": 4096, "rope_theta": 10000, "vision_feature_layer": -1,
                  "vision_feature_select_strategy": "default", "vision_output_dim": 4096}


def _llama4(text: dict) -> dict:
    """A Llama4ForConditionalGeneration config.json around this Llama4ForCausalLM text config."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "boi_token_index": 200080,
            "eoi_token_index": 200081, "image_token_index": 200092, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "text_config": text, "vision_config": _LLAMA4_VISION}


LLAMA_4_SCOUT = _llama4(released.LLAMA_4_SCOUT)
LLAMA_4_MAVERICK = _llama4(released.LLAMA_4_MAVERICK)


# Qwen/Qwen3.5-35B-A3B: the released Qwen3_5MoeForConditionalGeneration config as its model card and config.json give
# it (not read from the Hub: check it before relying on a field beyond the shapes). Its text_config is
# zoo.registry.released's QWEN3_5_35B_A3B; its tower is Qwen3-VL's 2B-8B one without DeepStack (the config lists no
# deepstack_visual_indexes: transformers' Qwen3_5VisionConfig has none): 27 layers 1152 wide (16 heads of 72, MLP
# 4304, gelu_pytorch_tanh), 16-pixel patches 2 frames deep merged 2 x 2, a 48 x 48 position table (2304 rows), the
# merger out to the language model's 2048 (out_hidden_size: the text hidden_size). These are transformers'
# Qwen3_5MoeVisionConfig defaults but out_hidden_size (3584 there). The token ids are the Qwen3.5 tokenizer's
# (<|vision_start|> 248053, <|vision_end|> 248054, <|image_pad|> 248056, <|video_pad|> 248057: transformers'
# Qwen3_5MoeConfig defaults); the head is untied.
_QWEN3_5_VISION = {"model_type": "qwen3_5_moe_vision", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                   "num_heads": 16, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
                   "out_hidden_size": 2048, "initializer_range": 0.02}
QWEN3_5_35B_A3B = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                   "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                   "vision_end_token_id": 248054, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                   "text_config": {k: v for k, v in released.QWEN3_5_35B_A3B.items() if k != "architectures"},
                   "vision_config": _QWEN3_5_VISION}
