"""Weight-name mapping tables, one per family and source format (data, not code).

A rule maps one zoo parameter to the Hugging Face tensor(s) it is made of.
``{i}`` in a name stands for the layer index: such a zoo parameter is the
stack of that tensor over all layers. ``when`` names a ModelConfig flag the
rule depends on (``!flag`` for its negation).
"""

from __future__ import annotations

from dataclasses import dataclass

from zoo.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """zoo parameter <- HF tensor name, through a named transform."""

    zoo: str
    hf: str
    transform: str = "identity"
    when: str | None = None

    def applies(self, cfg: ModelConfig) -> bool:
        """Whether this rule is part of a model with config ``cfg``."""
        if self.when is None:
            return True
        neg = self.when.startswith("!")
        value = bool(getattr(cfg, self.when.lstrip("!")))
        return value != neg

    @property
    def stacked(self) -> bool:
        """True for per-layer tensors stacked on the leading ``layers`` axis."""
        return "{i}" in self.hf


def decoder_table(prefix: str = "model.") -> list[Rule]:
    """The Hugging Face naming that Llama, Mistral, Gemma 1/2/3 and Qwen 2/3 share.

    Families differ only in which tensors exist, so every optional tensor is
    gated on the ModelConfig flag that creates it. Note the one name that
    changes meaning: without post-norms ``post_attention_layernorm`` is the
    pre-MLP norm; with Gemma 2/3's post-norms it normalizes the attention output.
    """
    L = prefix + "layers.{i}."
    return [
        Rule("embed", prefix + "embed_tokens.weight"),
        Rule("layers.attn_norm", L + "input_layernorm.weight"),
        Rule("layers.q", L + "self_attn.q_proj.weight", "q_in"),
        Rule("layers.k", L + "self_attn.k_proj.weight", "kv_in"),
        Rule("layers.v", L + "self_attn.v_proj.weight", "kv_in"),
        Rule("layers.o", L + "self_attn.o_proj.weight", "o_out"),
        Rule("layers.q_bias", L + "self_attn.q_proj.bias", "q_bias", when="qkv_bias"),
        Rule("layers.k_bias", L + "self_attn.k_proj.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.v_bias", L + "self_attn.v_proj.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.o_bias", L + "self_attn.o_proj.bias", when="o_bias"),
        Rule("layers.q_norm", L + "self_attn.q_norm.weight", when="qk_norm"),
        Rule("layers.k_norm", L + "self_attn.k_norm.weight", when="qk_norm"),
        Rule("layers.mlp_norm", L + "post_attention_layernorm.weight", when="!post_norms"),
        Rule("layers.post_attn_norm", L + "post_attention_layernorm.weight", when="post_norms"),
        Rule("layers.mlp_norm", L + "pre_feedforward_layernorm.weight", when="post_norms"),
        Rule("layers.post_mlp_norm", L + "post_feedforward_layernorm.weight", when="post_norms"),
        Rule("layers.gate", L + "mlp.gate_proj.weight", "transpose"),
        Rule("layers.up", L + "mlp.up_proj.weight", "transpose"),
        Rule("layers.down", L + "mlp.down_proj.weight", "transpose"),
        Rule("layers.gate_bias", L + "mlp.gate_proj.bias", when="mlp_bias"),
        Rule("layers.up_bias", L + "mlp.up_proj.bias", when="mlp_bias"),
        Rule("layers.down_bias", L + "mlp.down_proj.bias", when="mlp_bias"),
        Rule("final_norm", prefix + "norm.weight"),
        Rule("lm_head", "lm_head.weight", "transpose", when="!tie_word_embeddings"),
    ]


HF_DECODER = decoder_table()
# Gemma3ForConditionalGeneration as stored on the Hub: the text model sits under
# `language_model.model.`; the vision tower is not converted.
HF_GEMMA3_MULTIMODAL = decoder_table("language_model.model.")

_B = "blk.{i}."

# llama.cpp's names for the same model (GGUF files), q/k rows permuted for its RoPE.
LLAMA_GGUF = [
    Rule("embed", "token_embd.weight"),
    Rule("layers.attn_norm", _B + "attn_norm.weight"),
    Rule("layers.q", _B + "attn_q.weight", "gguf_q_in"),
    Rule("layers.k", _B + "attn_k.weight", "gguf_k_in"),
    Rule("layers.v", _B + "attn_v.weight", "kv_in"),
    Rule("layers.o", _B + "attn_output.weight", "o_out"),
    Rule("layers.mlp_norm", _B + "ffn_norm.weight"),
    Rule("layers.gate", _B + "ffn_gate.weight", "transpose"),
    Rule("layers.up", _B + "ffn_up.weight", "transpose"),
    Rule("layers.down", _B + "ffn_down.weight", "transpose"),
    Rule("final_norm", "output_norm.weight"),
    Rule("lm_head", "output.weight", "transpose", when="!tie_word_embeddings"),
]

# (family, source format) -> table. Every Hugging Face family shares the decoder naming.
TABLES: dict[tuple[str, str], list[Rule]] = {
    **{(f, "hf"): HF_DECODER for f in ("llama", "mistral", "gemma", "gemma2", "gemma3", "qwen2", "qwen3")},
    ("gemma3", "hf-gemma3-multimodal"): HF_GEMMA3_MULTIMODAL,
    ("llama", "gguf"): LLAMA_GGUF,
}


def table_for(family: str, fmt: str, cfg: ModelConfig) -> list[Rule]:
    """The rules that apply to a model of this family/config in source format ``fmt``."""
    return [r for r in TABLES[(family, fmt)] if r.applies(cfg)]
