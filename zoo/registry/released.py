"""Released Hugging Face configs (config.json as published) of models the registry names, so that a run can be
compiled for a TPU slice (``--compile-only``) or initialized at random (``zoo init``) without the Hub: data."""

from __future__ import annotations

_LLAMA3_ROPE_8K = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "attention_bias": False,
          "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}

LLAMA_3_1_8B = {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
                "rope_scaling": _LLAMA3_ROPE_8K}

LLAMA_3_1_70B = {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
                 "rope_scaling": _LLAMA3_ROPE_8K}

LLAMA_3_2_1B = {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 32.0}}

# deepseek-ai/DeepSeek-V3's config.json (its FP8 quantization_config and the multi-token-prediction layer, which
# transformers does not build, left out): MLA, 256 routed experts (8 a token, sigmoid group-limited routing), one
# shared expert, three dense first layers, YaRN.
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
               "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
               "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
               "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16"}

# deepseek-ai/DeepSeek-V3.2-Exp's config.json (the name transformers' docs give; DeepSeek-V3.2's is the same
# architecture): V3's, with DeepSeek Sparse Attention's lightning indexer on every layer (64 heads of 128, each
# query attending to its top 2048 keys).
DEEPSEEK_V32 = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}

# Gemma 4's text configs as google/gemma-4-* publish them (Gemma4ForConditionalGeneration; the vision and audio
# towers' configs left out: these configs build the language model alone). The rest of each text config is
# Gemma4TextConfig's defaults: RoPE theta 1e4 on sliding layers, proportional RoPE (a quarter of the dims,
# theta 1e6) on full ones, GELU (tanh), final soft-cap 30, tied embeddings, vocabulary 262144.
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}
_GEMMA4_TEXT = {"model_type": "gemma4_text", "vocab_size": 262144, "head_dim": 256, "global_head_dim": 512,
                "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
                "tie_word_embeddings": True, "rope_parameters": _GEMMA4_ROPE, "attention_bias": False}


def _gemma4(text: dict, period: int) -> dict:
    """A Gemma4ForConditionalGeneration config of this text config, its layers sliding but every ``period``-th."""
    n = text["num_hidden_layers"]
    types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "tie_word_embeddings": True,
            "text_config": {**_GEMMA4_TEXT, **text, "layer_types": types}, "torch_dtype": "bfloat16"}


# E2B/E4B: per-layer inputs, the last layers reuse keys/values; E2B's reusing layers have a double-wide MLP.
GEMMA4_E2B = _gemma4({"hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
                      "num_attention_heads": 8, "num_key_value_heads": 1, "sliding_window": 512,
                      "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                      "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "attention_k_eq_v": False,
                      "max_position_embeddings": 131072}, 5)
GEMMA4_E4B = _gemma4({"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42,
                      "num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": 512,
                      "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                      "num_kv_shared_layers": 18, "use_double_wide_mlp": False, "attention_k_eq_v": False,
                      "max_position_embeddings": 131072}, 6)
# 26B-A4B: 128 experts (8 a token) beside a dense MLP in every layer; full layers take values from their keys.
GEMMA4_26B_A4B = _gemma4({"hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
                          "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
                          "attention_k_eq_v": True, "sliding_window": 1024, "hidden_size_per_layer_input": 0,
                          "num_kv_shared_layers": 0, "enable_moe_block": True, "num_experts": 128,
                          "top_k_experts": 8, "moe_intermediate_size": 704, "max_position_embeddings": 262144}, 6)
GEMMA4_31B = _gemma4({"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60,
                      "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4,
                      "attention_k_eq_v": True, "sliding_window": 1024, "hidden_size_per_layer_input": 0,
                      "num_kv_shared_layers": 0, "max_position_embeddings": 262144}, 6)
# Qwen/Qwen3-30B-A3B's config.json: 128 experts (8 a token, softmax routing, renormalized), every layer MoE
# (decoder_sparse_step 1, no mlp_only_layers), q/k norms, no sliding window.
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
              "head_dim": 128, "hidden_act": "silu", "num_key_value_heads": 4, "num_experts": 128,
              "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
              "router_aux_loss_coef": 0.001, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 40960, "use_sliding_window": False, "sliding_window": None,
              "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 151643,
              "eos_token_id": 151645, "torch_dtype": "bfloat16"}

QWEN3_30B_A3B = {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "max_window_layers": 48}

QWEN3_235B_A22B = {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_hidden_layers": 94, "num_attention_heads": 64, "max_window_layers": 94}

# zai-org/GLM-4.5's config.json (its multi-token-prediction layer, which transformers does not build, left out):
# 160 routed experts (8 a token, sigmoid routing with a selection bias), one shared expert, three dense first
# layers, q/k/v biases, q/k norms, RoPE on half of each head.
GLM_4_5 = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
           "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
           "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 160,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1,
           "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True,
           "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "tie_word_embeddings": False, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
           "torch_dtype": "bfloat16"}

# zai-org/GLM-4.6: GLM-4.5's architecture with a 200K context.
GLM_4_6 = {**GLM_4_5, "max_position_embeddings": 202752}

# zai-org/GLM-4.5-Air: 128 routed experts, one dense first layer, no q/k norms, routed weights unscaled.
GLM_4_5_AIR = {**GLM_4_5, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
               "num_hidden_layers": 46, "n_routed_experts": 128, "first_k_dense_replace": 1,
               "routed_scaling_factor": 1.0, "use_qk_norm": False}
# MiniMaxAI/MiniMax-M2's config.json, its fields that transformers' MiniMaxM2Config reads (its FP8
# quantization_config and multi-token-prediction modules, which transformers does not build, left out), written from
# the model card and the config as other projects quote it, not read from the Hub: check it against the Hub's file
# before relying on a field beyond the shapes. 256 experts (8 a token) of width 1536 on all 62 layers, sigmoid
# routing with a selection bias, 48 query heads of 128 over 8 key/value heads, q/k norms over all heads, RoPE on the
# first 64 dims of each head (rotary_dim).
MINIMAX_M2 = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
              "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
              "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "rope_theta": 5000000,
              "num_local_experts": 256, "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True,
              "use_qk_norm": True, "qk_norm_type": "per_layer", "router_aux_loss_coef": 0.001,
              "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020, "torch_dtype": "bfloat16"}

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json as its model card and other projects quote it (not read from the
# Hub: check it before relying on a field beyond the shapes). transformers' Qwen3NextConfig defaults are this model's
# shapes (48 layers, every 4th full attention: full_attention_interval 4; 512 experts, 10 a token, and a shared
# expert, all 512 wide; 16 query heads of 256 over 2 key/value heads, RoPE on the first quarter; linear layers of
# 16 key heads and 32 value heads of 128, conv 4) but not its context: RoPE theta 1e7 over 262,144 positions.
# intermediate_size (5120) is no layer's width: every layer is MoE.
QWEN3_NEXT_80B_A3B = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
                      "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
                      "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                      "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                      "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
                      "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                      "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "partial_rotary_factor": 0.25,
                      "rope_theta": 10000000, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                      "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                      "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}

# Qwen/Qwen3.5-35B-A3B's language model (the text_config of its Qwen3_5MoeForConditionalGeneration config.json, as a
# text-only config; zoo.registry.released_vision has the whole model, with the vision tower) as its model card gives it,
# not read from the Hub: check it before relying on a field beyond the shapes. transformers' Qwen3_5MoeTextConfig
# defaults are these shapes: 40 layers, every 4th full attention (16 query heads of 256 over 2 key/value heads,
# interleaved multimodal RoPE on the first quarter, sections 11, 11, 10); linear layers of 16 key heads and 32 value
# heads of 128, conv 4; 256 experts, 8 a token, and a shared expert, all 512 wide; a 248,320-token vocabulary; RoPE
# theta 1e7 over 262,144 positions.
QWEN3_5_35B_A3B = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
                   "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                   "head_dim": 256, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                   "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                   "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8,
                   "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                   "router_aux_loss_coef": 0.001, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                       "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                   "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16"}  # token ids left out: not known here

# openai/gpt-oss-20b's and gpt-oss-120b's config.json (their MXFP4 quantization_config left out: the experts are
# dequantized while converting): sliding (128) and full layers alternating, 64 query heads of 64 over 8 key/value
# heads, attention sinks, 32 or 128 experts (4 a token) with biases and the clamped SwiGLU, YaRN over 4096.
_GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
            "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
            "num_key_value_heads": 8, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
            "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "initial_context_length": 4096,
            "initializer_range": 0.02, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "swiglu_limit": 7.0, "tie_word_embeddings": False,
            "output_router_logits": False, "use_cache": True, "eos_token_id": 200002, "pad_token_id": 199999,
            "torch_dtype": "bfloat16"}

GPT_OSS_20B = {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
               "layer_types": ["sliding_attention", "full_attention"] * 12}

GPT_OSS_120B = {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
# HuggingFaceTB/SmolLM3-3B: Llama-shaped with every 4th layer NoPE (no_rope_layers), tied embeddings. Its
# pretraining_tp of 2 is a leftover that SmolLM3's transformers model never reads.
SMOLLM3_3B = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "vocab_size": 128256,
              "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
              "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 65536,
              "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "rope_scaling": None, "attention_bias": False,
              "mlp_bias": False, "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
              "no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
              "pretraining_tp": 2, "bos_token_id": 128000, "eos_token_id": 128012, "pad_token_id": 128004,
              "torch_dtype": "bfloat16"}

# meta-llama/Llama-4-Scout-17B-16E's and Llama-4-Maverick-17B-128E's text_config (the released checkpoints are
# Llama4ForConditionalGeneration: zoo.registry.released_vision has them whole, with the vision tower): 48 layers, every
# 4th NoPE with the attention temperature, the others chunked (8192) with the weightless q/k norm (Scout only); 16
# experts on every layer (Scout) or 128 on every second (Maverick), top 1, and a shared expert.
_LLAMA4 = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "vocab_size": 202048,
           "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
           "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False, "attention_chunk_size": 8192,
           "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "no_rope_layers": [],
           "num_experts_per_tok": 1, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
           "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "pad_token_id": 200018,
           "torch_dtype": "bfloat16"}
LLAMA_4_SCOUT = {**_LLAMA4, "num_local_experts": 16, "interleave_moe_layer_step": 1, "use_qk_norm": True,
                 "max_position_embeddings": 10485760,
                 "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}
LLAMA_4_MAVERICK = {**_LLAMA4, "num_local_experts": 128, "interleave_moe_layer_step": 2, "use_qk_norm": False,
                    "max_position_embeddings": 1048576, "rope_scaling": None}

# allenai/OLMo-2-1124-7B and -13B: post-norm blocks, q/k norms over all heads, no biases.
_OLMO2 = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "vocab_size": 100352, "hidden_act": "silu",
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 500000, "rope_scaling": None,
          "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 100257, "pad_token_id": 100277,
          "torch_dtype": "float32"}
OLMO_2_7B = {**_OLMO2, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32}
OLMO_2_13B = {**_OLMO2, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
              "num_attention_heads": 40, "num_key_value_heads": 40}

# allenai/Olmo-3-1025-7B: OLMo 2's blocks, three sliding-window layers (4096) to a full one, YaRN on the full ones.
OLMO_3_7B = {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "vocab_size": 100278, "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 65536,
             "rms_norm_eps": 1e-6, "rope_theta": 500000, "attention_bias": False, "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                              "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0},
             "sliding_window": 4096,
             "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(32)],
             "eos_token_id": 100257, "pad_token_id": 100277, "torch_dtype": "bfloat16"}

# microsoft/phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj, GQA 40/10, no RoPE scaling.
PHI_4 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120,
         "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
         "hidden_act": "silu", "max_position_embeddings": 16384, "original_max_position_embeddings": 16384,
         "rms_norm_eps": 1e-5, "rope_theta": 250000, "rope_scaling": None, "sliding_window": None,
         "tie_word_embeddings": False, "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100257,
         "torch_dtype": "bfloat16"}

# microsoft/Phi-4-mini-instruct: partial rotary (96 of 128 dimensions), LongRoPE from 4096 to 131072 positions.
PHI_4_MINI_LONG_FACTOR = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]
PHI_4_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
              "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
              "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
              "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                                      "long_factor": PHI_4_MINI_LONG_FACTOR},
              "sliding_window": 262144, "tie_word_embeddings": True, "bos_token_id": 199999,
              "eos_token_id": 199999, "pad_token_id": 199999, "torch_dtype": "bfloat16"}

# Qwen/Qwen2.5-VL-{3B,7B,72B}-Instruct (Qwen2_5_VLForConditionalGeneration), as published: the text fields at the
# top level (transformers 5 moves them into text_config), multimodal RoPE over (16, 24, 24) of each head's 64
# frequencies, and the same 32-layer windowed tower (full attention in layers 7, 15, 23, 31) on every size.
_QWEN2_5_VL_VISION = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "tokens_per_second": 2, "temporal_patch_size": 2}


def _qwen2_5_vl(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool,
                window_layers: int) -> dict:
    """A Qwen2.5-VL config.json of this language model's size (its tower's output at the model's width)."""
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
            "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 128000,
            "max_window_layers": window_layers, "num_attention_heads": heads,
            "num_hidden_layers": layers, "num_key_value_heads": kv, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
            "use_cache": True, "use_sliding_window": False,
            "vision_config": {**_QWEN2_5_VL_VISION, "out_hidden_size": hidden},
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": vocab}


QWEN2_5_VL_3B = _qwen2_5_vl(2048, 11008, 36, 16, 2, 151936, True, 70)
QWEN2_5_VL_7B = _qwen2_5_vl(3584, 18944, 28, 28, 4, 152064, False, 28)
QWEN2_5_VL_72B = _qwen2_5_vl(8192, 29568, 80, 64, 8, 152064, False, 80)
