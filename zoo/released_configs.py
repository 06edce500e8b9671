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

# Gemma 4's text configs as google/gemma-4-* publish them (Gemma4ForConditionalGeneration; the vision and audio
# towers' configs left out: lmzoo converts the language model). The rest of each text config is
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
