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


_L = "model.layers.{i}."

LLAMA_HF = [
    Rule("embed", "model.embed_tokens.weight"),
    Rule("layers.attn_norm", _L + "input_layernorm.weight"),
    Rule("layers.q", _L + "self_attn.q_proj.weight", "q_in"),
    Rule("layers.k", _L + "self_attn.k_proj.weight", "kv_in"),
    Rule("layers.v", _L + "self_attn.v_proj.weight", "kv_in"),
    Rule("layers.o", _L + "self_attn.o_proj.weight", "o_out"),
    Rule("layers.q_bias", _L + "self_attn.q_proj.bias", "q_bias", when="attention_bias"),
    Rule("layers.k_bias", _L + "self_attn.k_proj.bias", "kv_bias", when="attention_bias"),
    Rule("layers.v_bias", _L + "self_attn.v_proj.bias", "kv_bias", when="attention_bias"),
    Rule("layers.o_bias", _L + "self_attn.o_proj.bias", when="attention_bias"),
    Rule("layers.mlp_norm", _L + "post_attention_layernorm.weight"),
    Rule("layers.gate", _L + "mlp.gate_proj.weight", "transpose"),
    Rule("layers.up", _L + "mlp.up_proj.weight", "transpose"),
    Rule("layers.down", _L + "mlp.down_proj.weight", "transpose"),
    Rule("layers.gate_bias", _L + "mlp.gate_proj.bias", when="mlp_bias"),
    Rule("layers.up_bias", _L + "mlp.up_proj.bias", when="mlp_bias"),
    Rule("layers.down_bias", _L + "mlp.down_proj.bias", when="mlp_bias"),
    Rule("final_norm", "model.norm.weight"),
    Rule("lm_head", "lm_head.weight", "transpose", when="!tie_word_embeddings"),
]

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

TABLES: dict[tuple[str, str], list[Rule]] = {
    ("llama", "hf"): LLAMA_HF,
    ("llama", "gguf"): LLAMA_GGUF,
}


def table_for(family: str, fmt: str, cfg: ModelConfig) -> list[Rule]:
    """The rules that apply to a model of this family/config in source format ``fmt``."""
    return [r for r in TABLES[(family, fmt)] if r.applies(cfg)]
