"""llama.cpp's tensor names for the families GGUF files hold (data, not code; the rules as convert/tables.py's)."""

from __future__ import annotations

import dataclasses

from convert.rules import Rule, full_width_qk_norms

_B = "blk.{i}."


def gguf_table(rope_permuted: bool = False) -> list[Rule]:
    """llama.cpp's names for the same decoder (GGUF files of the llama, gemma, gemma2, gemma3, qwen2 and
    qwen3 architectures).

    Only the ``llama`` architecture has its q/k rows permuted for llama.cpp's RoPE (``rope_permuted``).
    Norms go through ``gguf_norm`` (Gemma's are stored as ``w + 1``). ``ffn_norm`` is always the norm
    before the MLP: with Gemma 2/3's post-norms the attention output's norm is ``post_attention_norm``.
    """
    q, k = ("gguf_q_in", "gguf_k_in") if rope_permuted else ("q_in", "kv_in")
    return [
        Rule("embed", "token_embd.weight"),
        Rule("layers.attn_norm", _B + "attn_norm.weight", "gguf_norm"),
        Rule("layers.q", _B + "attn_q.weight", q),
        Rule("layers.k", _B + "attn_k.weight", k),
        Rule("layers.v", _B + "attn_v.weight", "kv_in"),
        Rule("layers.o", _B + "attn_output.weight", "o_out"),
        Rule("layers.q_bias", _B + "attn_q.bias", "q_bias", when="qkv_bias"),
        Rule("layers.k_bias", _B + "attn_k.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.v_bias", _B + "attn_v.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.o_bias", _B + "attn_output.bias", when="o_bias"),
        Rule("layers.q_norm", _B + "attn_q_norm.weight", "gguf_norm", when="qk_norm"),
        Rule("layers.k_norm", _B + "attn_k_norm.weight", "gguf_norm", when="qk_norm"),
        Rule("layers.post_attn_norm", _B + "post_attention_norm.weight", "gguf_norm", when="post_norms"),
        Rule("layers.mlp_norm", _B + "ffn_norm.weight", "gguf_norm"),
        Rule("layers.post_mlp_norm", _B + "post_ffw_norm.weight", "gguf_norm", when="post_norms"),
        Rule("layers.gate", _B + "ffn_gate.weight", "transpose"),
        Rule("layers.up", _B + "ffn_up.weight", "transpose"),
        Rule("layers.down", _B + "ffn_down.weight", "transpose"),
        Rule("final_norm", "output_norm.weight", "gguf_norm"),
        # llama.cpp writes no output.weight for a model whose head is its embedding matrix.
        Rule("lm_head", "output.weight", "transpose", when="!tie_word_embeddings"),
    ]


def gpt_oss_gguf_table() -> list[Rule]:
    """llama.cpp's names for gpt-oss (GGUF architecture ``gpt-oss``, convert_hf_to_gguf.py's GptOssModel): the
    pre-MLP norm is ``post_attention_norm``, the sinks ``attn_sinks``, the router ``ffn_gate_inp`` with its bias,
    and gate and up are separate expert stacks [experts, out, in] (gate_up_proj's even and odd columns) with
    their biases; MXFP4 experts are dequantized by the gguf package."""
    return [
        Rule("embed", "token_embd.weight"),
        Rule("layers.attn_norm", _B + "attn_norm.weight"),
        Rule("layers.q", _B + "attn_q.weight", "q_in"),
        Rule("layers.k", _B + "attn_k.weight", "kv_in"),
        Rule("layers.v", _B + "attn_v.weight", "kv_in"),
        Rule("layers.o", _B + "attn_output.weight", "o_out"),
        Rule("layers.q_bias", _B + "attn_q.bias", "q_bias", when="qkv_bias"),
        Rule("layers.k_bias", _B + "attn_k.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.v_bias", _B + "attn_v.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.o_bias", _B + "attn_output.bias", when="o_bias"),
        Rule("layers.sinks", _B + "attn_sinks.weight", when="attn_sinks"),
        Rule("layers.mlp_norm", _B + "post_attention_norm.weight"),
        Rule("layers.router", _B + "ffn_gate_inp.weight", "transpose"),
        Rule("layers.router_logit_bias", _B + "ffn_gate_inp.bias", when="router_logits_bias"),
        Rule("layers.expert_gate", _B + "ffn_gate_exps.weight", "swap_last"),
        Rule("layers.expert_up", _B + "ffn_up_exps.weight", "swap_last"),
        Rule("layers.expert_down", _B + "ffn_down_exps.weight", "swap_last"),
        Rule("layers.expert_gate_bias", _B + "ffn_gate_exps.bias", when="expert_bias"),
        Rule("layers.expert_up_bias", _B + "ffn_up_exps.bias", when="expert_bias"),
        Rule("layers.expert_down_bias", _B + "ffn_down_exps.bias", when="expert_bias"),
        Rule("final_norm", "output_norm.weight"),
        Rule("lm_head", "output.weight", "transpose", when="!tie_word_embeddings"),
    ]


LLAMA_GGUF = gguf_table(rope_permuted=True)
GGUF_FAMILIES = ("gemma", "gemma2", "gemma3", "qwen2", "qwen3")


def gguf_moe_table() -> list[Rule]:
    """llama.cpp's names for a MoE decoder whose every layer is MoE (``qwen3moe``): :func:`gguf_table`'s, with the
    router ``ffn_gate_inp`` and each layer's experts as one 3D tensor ``ffn_{gate,up,down}_exps`` [experts, out,
    in] in place of the dense MLP (a GGUF file has no dense layers between MoE ones)."""
    dense = {"layers.gate", "layers.up", "layers.down"}
    return [r for r in gguf_table() if r.zoo not in dense] + [
        Rule("layers.router", _B + "ffn_gate_inp.weight", "transpose", when="moe"),
        Rule("layers.expert_gate", _B + "ffn_gate_exps.weight", "experts_transpose", when="moe"),
        Rule("layers.expert_up", _B + "ffn_up_exps.weight", "experts_transpose", when="moe"),
        Rule("layers.expert_down", _B + "ffn_down_exps.weight", "experts_transpose", when="moe"),
    ]


def minimax_m2_gguf_table() -> list[Rule]:
    """llama.cpp's names for MiniMax-M2 (``minimax-m2``, convert_hf_to_gguf.py's MiniMaxM2Model):
    :func:`gguf_moe_table`'s, its q/k norms over all heads, the selection bias ``exp_probs_b.bias``; q/k rows as
    transformers has them (not permuted)."""
    return full_width_qk_norms(gguf_moe_table()) + [
        Rule("layers.router_bias", _B + "exp_probs_b.bias", when="moe&router_bias")]


def qwen3next_gguf_table() -> list[Rule]:
    """llama.cpp's names for Qwen3-Next (``qwen3next``, convert_hf_to_gguf.py's Qwen3NextModel): every layer MoE
    with the shared expert (``*_shexp``, its gate ``ffn_gate_inp_shexp``), the pre-MLP norm ``post_attention_norm``,
    norms written as ``w + 1`` but the linear layers' gated one (``ssm_norm``); the full layers' ``attn_q`` holds
    each head's query and gate; the linear layers' q, k, v rows in blocks (``attn_qkv``), z as ``attn_gate``,
    b and a as ``ssm_ba``, the conv's taps squeezed [channels, kernel] (``ssm_conv1d``), ``ssm_a`` = -exp(A_log),
    ``ssm_dt.bias`` = dt_bias; the parts of fused tensors as convert.fused names them."""
    full, lin = "full", "linear"
    attention = ("layers.k", "layers.v", "layers.o", "layers.q_norm", "layers.k_norm")
    shared = [dataclasses.replace(r, kind=full) if r.zoo in attention else r
              for r in gguf_moe_table() if r.zoo not in ("layers.q", "layers.mlp_norm")]
    return shared + [
        Rule("layers.q", _B + "attn_q_query.weight", "q_in", kind=full),
        Rule("layers.attn_gate", _B + "attn_q_gate.weight", "q_in", kind=full),
        Rule("layers.mlp_norm", _B + "post_attention_norm.weight", "gguf_norm"),
        Rule("layers.lin_q", _B + "attn_qkv_q.weight", "lin_k_in", kind=lin),
        Rule("layers.lin_k", _B + "attn_qkv_k.weight", "lin_k_in", kind=lin),
        Rule("layers.lin_v", _B + "attn_qkv_v.weight", "lin_v_in", kind=lin),
        Rule("layers.lin_z", _B + "attn_gate.weight", "lin_v_in", kind=lin),
        Rule("layers.lin_b", _B + "ssm_ba_b.weight", "transpose", kind=lin),
        Rule("layers.lin_a", _B + "ssm_ba_a.weight", "transpose", kind=lin),
        Rule("layers.lin_conv", _B + "ssm_conv1d.weight", "transpose", kind=lin),
        Rule("layers.lin_dt_bias", _B + "ssm_dt.bias", kind=lin),
        Rule("layers.lin_a_log", _B + "ssm_a", "neg_exp", kind=lin),
        Rule("layers.lin_norm", _B + "ssm_norm.weight", kind=lin),
        Rule("layers.lin_out", _B + "ssm_out.weight", "lin_out", kind=lin),
        *(Rule(f"layers.shared_{part}", _B + f"ffn_{part}_shexp.weight", "transpose", when="moe")
          for part in ("gate", "up", "down")),
        Rule("layers.shared_expert_gate", _B + "ffn_gate_inp_shexp.weight", "transpose", when="moe"),
    ]


# (family, "gguf") -> table.
GGUF_TABLES: dict[tuple[str, str], list[Rule]] = {
    ("llama", "gguf"): LLAMA_GGUF,
    **{(f, "gguf"): gguf_table() for f in GGUF_FAMILIES},
    ("qwen3_moe", "gguf"): gguf_moe_table(),
    ("minimax_m2", "gguf"): minimax_m2_gguf_table(),
    ("gpt_oss", "gguf"): gpt_oss_gguf_table(),
    ("qwen3_next", "gguf"): qwen3next_gguf_table(),
}


def llama4_gguf_table() -> list[Rule]:
    """llama.cpp's names for Llama 4's text model (``llama4``, convert_hf_to_gguf.py's Llama4Model): the llama
    names with the q/k rows as transformers holds them (its ``undo_permute = False``: Llama 4's rows are already
    RoPE's interleaved pairs, llama.cpp's order; convert.transforms' rope_pairs_* as convert.tables' llama4 table),
    no q/k norm weights (Llama 4's is weightless), the MLP ``ffn_{gate,up,down}`` on dense layers alone, and on MoE
    layers the router ``ffn_gate_inp``, the experts ``ffn_{gate,up,down}_exps`` [experts, out, in] (``gate_up_proj``
    split in two) and the shared expert ``ffn_{gate,up,down}_shexp``."""
    rope_pairs = {"layers.q": "rope_pairs_q_in", "layers.k": "rope_pairs_k_in"}
    dense = ("layers.gate", "layers.up", "layers.down")
    rules = [dataclasses.replace(r, transform=rope_pairs.get(r.zoo, r.transform), when="!moe" if r.zoo in dense else r.when)
             for r in gguf_table() if r.zoo not in ("layers.q_norm", "layers.k_norm")]
    return rules + [
        Rule("layers.router", _B + "ffn_gate_inp.weight", "transpose", when="moe"),
        *(Rule(f"layers.expert_{part}", _B + f"ffn_{part}_exps.weight", "experts_transpose", when="moe")
          for part in ("gate", "up", "down")),
        *(Rule(f"layers.shared_{part}", _B + f"ffn_{part}_shexp.weight", "transpose", when="moe")
          for part in ("gate", "up", "down")),
    ]


GGUF_TABLES[("llama4", "gguf")] = llama4_gguf_table()
