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
