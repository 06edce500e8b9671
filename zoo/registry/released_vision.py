"""Released Hugging Face configs of the vision-language models the registry names (config.json as published,
the keys transformers fills with its defaults left out, as the Hub's files leave them), so that a run can be
compiled for a TPU slice (``--compile-only``) or initialized at random (``zoo init``) without the Hub: data.

Gemma 3 (google/gemma-3-{4b,12b,27b}-{pt,it}): the SigLIP-so400m tower at 896 pixels in 14-pixel patches,
pooled 4 x 4 into 256 tokens an image; the language models' own configs as Gemma3TextConfig completes them.
SmolVLM (HuggingFaceTB/SmolVLM-{256M,500M}-Instruct): Idefics3's architecture, a SigLIP
tower and a pixel-shuffle connector beside a SmolLM2 language model.
"""

from __future__ import annotations

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
