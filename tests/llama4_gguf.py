"""Tiny Llama 4 GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them (its Llama4Model), with the
``gguf`` package: independent of convert/'s tables, transforms and RoPE reading, so those cannot agree with it by
construction."""

from __future__ import annotations

import math

import numpy as np


def llama_cpp_rope_freqs(rope: dict, head_dim: int, original: int = 8192) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's LlamaModel.generate_extra_tensors (which Llama4Model inherits) writes
    for a config's llama3 ``rope_parameters``: each frequency's divisor, computed as it does (float32 frequencies;
    the original context ``original``: it reads the config's top-level original_max_position_embeddings, which
    the released configs lack, else 8192)."""
    import torch

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = original
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def write_llama4_gguf(path, c, state: dict, tokens: list[str], merges: list[str],
                      rope_freqs: np.ndarray | None = None) -> None:
    """Write a tiny Llama4ForCausalLM (config ``c``, tensors ``state``) as llama.cpp's convert_hf_to_gguf.py does
    (Llama4Model, arch ``llama4``): feed_forward_length the dense MLP's width and expert_feed_forward_length the
    experts', q/k rows as transformers holds them (undo_permute = False), each MoE layer's gate_up_proj [experts,
    embed, 2 x mlp] transposed and split into ``ffn_gate_exps`` / ``ffn_up_exps`` [experts, mlp, embed], down_proj
    transposed into ``ffn_down_exps``; float32, a byte-level vocabulary. ``rope_freqs``: the llama3 RoPE scaling's
    per-frequency factors (:func:`llama_cpp_rope_freqs`), written as ``rope_freqs.weight``."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama4")
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size_mlp),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]), (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_expert_count, c.num_local_experts), (w.add_expert_used_count, c.num_experts_per_tok),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim), (w.add_vocab_size, c.vocab_size),
                       (w.add_rope_dimension_count, c.head_dim),
                       (w.add_interleave_moe_layer_step, c.interleave_moe_layer_step),
                       (w.add_expert_feed_forward_length, c.intermediate_size)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama4")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    for name, hf_name in (("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"), ("output", "lm_head")):
        w.add_tensor(f"{name}.weight", state[f"{hf_name}.weight"])
    attention = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output"}
    for i in range(c.num_hidden_layers):
        L, F = f"model.layers.{i}.", f"model.layers.{i}.feed_forward."
        for module, name in attention.items():
            w.add_tensor(f"blk.{i}.{name}.weight", state[f"{L}{module}.weight"])
        if i not in c.moe_layers:
            for part in ("gate", "up", "down"):
                w.add_tensor(f"blk.{i}.ffn_{part}.weight", state[f"{F}{part}_proj.weight"])
            continue
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", state[F + "router.weight"])
        gate, up = np.split(state[F + "experts.gate_up_proj"].swapaxes(-1, -2), 2, axis=-2)
        for name, data in (("gate", gate), ("up", up), ("down", state[F + "experts.down_proj"].swapaxes(-1, -2))):
            w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", np.ascontiguousarray(data))
        for part in ("gate", "up", "down"):
            w.add_tensor(f"blk.{i}.ffn_{part}_shexp.weight", state[f"{F}shared_expert.{part}_proj.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
