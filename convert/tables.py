"""Weight-name mapping tables, one per family and source format (data, not code).

A rule maps one zoo parameter (its name inside a stack of layers, or a
top-level name) to the Hugging Face tensor(s) it is made of. ``{i}`` in a
name stands for the layer index and ``{j}`` for the expert index: such a
parameter is the stack of those tensors over the layers of its stack (and
over the experts). ``when`` names ModelConfig flags the rule depends on
(``!flag`` negates, ``a&b`` needs both); ``moe`` is true inside a stack of
mixture-of-experts layers.
"""

from __future__ import annotations

import dataclasses

from convert.gguf_tables import GGUF_TABLES
from convert.rules import BoundRule, Rule, full_width_qk_norms
from convert.vision_tables import vision_entries
from zoo.model.config import ModelConfig
from zoo.model.hf_families import ARCHITECTURES


def _moe_rules(L: str, style: str | None) -> list[Rule]:
    if style == "mixtral":
        E = L + "block_sparse_moe."
        return [
            Rule("layers.router", E + "gate.weight", "transpose", when="moe"),
            Rule("layers.expert_gate", E + "experts.{j}.w1.weight", "transpose", when="moe"),
            Rule("layers.expert_up", E + "experts.{j}.w3.weight", "transpose", when="moe"),
            Rule("layers.expert_down", E + "experts.{j}.w2.weight", "transpose", when="moe"),
        ]
    if style == "minimax_m2":  # Mixtral's names, and DeepSeek-V3's selection bias beside the router
        return [*_moe_rules(L, "mixtral"),
                Rule("layers.router_bias", L + "block_sparse_moe.e_score_correction_bias", when="moe&router_bias")]
    if style == "deepseek":
        M = L + "mlp."
        return [
            Rule("layers.router", M + "gate.weight", "transpose", when="moe"),
            Rule("layers.router_bias", M + "gate.e_score_correction_bias", when="moe&router_bias"),
            Rule("layers.expert_gate", M + "experts.{j}.gate_proj.weight", "transpose", when="moe"),
            Rule("layers.expert_up", M + "experts.{j}.up_proj.weight", "transpose", when="moe"),
            Rule("layers.expert_down", M + "experts.{j}.down_proj.weight", "transpose", when="moe"),
            Rule("layers.shared_gate", M + "shared_experts.gate_proj.weight", "transpose", when="moe&shared_experts"),
            Rule("layers.shared_up", M + "shared_experts.up_proj.weight", "transpose", when="moe&shared_experts"),
            Rule("layers.shared_down", M + "shared_experts.down_proj.weight", "transpose", when="moe&shared_experts"),
        ]
    if style == "gpt_oss":
        # transformers' GptOssExperts: one [experts, embed, 2 x mlp] gate_up_proj per layer, gate and up
        # interleaved column by column (convert.fused names its parts gate_proj / up_proj), and per-expert
        # biases; the router's bias is on its logits.
        M, X = L + "mlp.", L + "mlp.experts."
        return [
            Rule("layers.sinks", L + "self_attn.sinks", when="attn_sinks"),
            Rule("layers.router", M + "router.weight", "transpose", when="moe"),
            Rule("layers.router_logit_bias", M + "router.bias", when="moe&router_logits_bias"),
            Rule("layers.expert_gate", X + "gate_proj", when="moe"),
            Rule("layers.expert_up", X + "up_proj", when="moe"),
            Rule("layers.expert_gate_bias", X + "gate_proj_bias", when="moe&expert_bias"),
            Rule("layers.expert_up_bias", X + "up_proj_bias", when="moe&expert_bias"),
            Rule("layers.expert_down", X + "down_proj", when="moe"),
            Rule("layers.expert_down_bias", X + "down_proj_bias", when="moe&expert_bias"),
        ]
    if style == "qwen3_vl_moe":
        # Qwen3-VL-MoE's experts: one fused gate_up_proj and one down_proj per layer (convert.fused names gate_up's
        # parts gate_proj / up_proj), [experts, in, out] as the Hub holds them, [experts, out, in] as transformers 5
        # saves them (ModelConfig.hf_experts_out_in); no shared experts, the router is Qwen3-MoE's.
        M, X = L + "mlp.", L + "mlp.experts."
        return [Rule("layers.router", M + "gate.weight", "transpose", when="moe"),
                *(Rule(f"layers.expert_{part}", X + f"{part}_proj", t, when=f"moe&{flag}hf_experts_out_in")
                  for flag, t in (("!", "identity"), ("", "swap_last")) for part in ("gate", "up", "down"))]
    return []


def decoder_table(prefix: str = "model.", moe: str | None = None, head: str = "lm_head.weight") -> list[Rule]:
    """The Hugging Face naming that Llama, Mistral, Gemma 1/2/3, Qwen 2/3, Mixtral and DeepSeek share.

    Families differ only in which tensors exist, so every optional tensor is
    gated on the ModelConfig flag that creates it. Note the one name that
    changes meaning: without post-norms ``post_attention_layernorm`` is the
    pre-MLP norm; with Gemma 2/3's post-norms it normalizes the attention output. ``head``: an untied output
    head's tensor.
    """
    L = prefix + "layers.{i}."
    A = L + "self_attn."
    return [
        Rule("embed", prefix + "embed_tokens.weight"),
        Rule("layers.attn_norm", L + "input_layernorm.weight"),
        Rule("layers.q", A + "q_proj.weight", "q_in", when="!mla"),
        Rule("layers.k", A + "k_proj.weight", "kv_in", when="!mla"),
        Rule("layers.v", A + "v_proj.weight", "kv_in", when="!mla"),
        Rule("layers.o", A + "o_proj.weight", "o_out", when="!mla"),
        Rule("layers.q_bias", A + "q_proj.bias", "q_bias", when="qkv_bias"),
        Rule("layers.k_bias", A + "k_proj.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.v_bias", A + "v_proj.bias", "kv_bias", when="qkv_bias"),
        Rule("layers.o_bias", A + "o_proj.bias", when="o_bias"),
        Rule("layers.q_norm", A + "q_norm.weight", when="qk_norm"),
        Rule("layers.k_norm", A + "k_norm.weight", when="qk_norm"),
        # DeepSeek's multi-head latent attention
        Rule("layers.q", A + "q_proj.weight", "mla_q_in", when="mla&!q_lora_rank"),
        Rule("layers.q_a", A + "q_a_proj.weight", "transpose", when="mla&q_lora_rank"),
        Rule("layers.q_a_norm", A + "q_a_layernorm.weight", when="mla&q_lora_rank"),
        Rule("layers.q_b", A + "q_b_proj.weight", "mla_q_in", when="mla&q_lora_rank"),
        Rule("layers.kv_a", A + "kv_a_proj_with_mqa.weight", "mla_kv_a_in", when="mla"),
        Rule("layers.kv_a_norm", A + "kv_a_layernorm.weight", when="mla"),
        Rule("layers.kv_b", A + "kv_b_proj.weight", "mla_kv_b_in", when="mla"),
        Rule("layers.o", A + "o_proj.weight", "mla_o_out", when="mla"),
        Rule("layers.mlp_norm", L + "post_attention_layernorm.weight", when="!post_norms"),
        Rule("layers.post_attn_norm", L + "post_attention_layernorm.weight", when="post_norms"),
        Rule("layers.mlp_norm", L + "pre_feedforward_layernorm.weight", when="post_norms"),
        Rule("layers.post_mlp_norm", L + "post_feedforward_layernorm.weight", when="post_norms"),
        Rule("layers.gate", L + "mlp.gate_proj.weight", "transpose", when="!moe"),
        Rule("layers.up", L + "mlp.up_proj.weight", "transpose", when="!moe"),
        Rule("layers.down", L + "mlp.down_proj.weight", "transpose", when="!moe"),
        Rule("layers.gate_bias", L + "mlp.gate_proj.bias", when="mlp_bias&!moe"),
        Rule("layers.up_bias", L + "mlp.up_proj.bias", when="mlp_bias&!moe"),
        Rule("layers.down_bias", L + "mlp.down_proj.bias", when="mlp_bias&!moe"),
        *_moe_rules(L, moe),
        Rule("final_norm", prefix + "norm.weight"),
        Rule("lm_head", head, "transpose", when="!tie_word_embeddings&!num_labels"),
        Rule("score", "score.weight", "transpose", when="num_labels"),  # *ForSequenceClassification's head
    ]


def post_norm_table() -> list[Rule]:
    """OLMo 2/3's naming: the shared decoder's without the pre-norms (``input_layernorm``, the pre-MLP norm),
    whose blocks norm only attention's and the MLP's outputs (``post_attention_layernorm``,
    ``post_feedforward_layernorm``), and whose q/k norms span all heads."""
    return full_width_qk_norms([r for r in decoder_table() if r.zoo not in ("layers.attn_norm", "layers.mlp_norm")])


def indexer_rules(prefix: str = "model.") -> list[Rule]:
    """DeepSeek-V3.2's lightning indexer (zoo.layers.indexer): wq_b by heads, wk and weights_proj transposed, the
    LayerNorm of its keys; its rope dims are rotate-half already (no permutation, unlike MLA's)."""
    A = prefix + "layers.{i}.self_attn.indexer."
    return [
        Rule("layers.idx_q", A + "wq_b.weight", "index_q_in", when="sparse"),
        Rule("layers.idx_k", A + "wk.weight", "transpose", when="sparse"),
        Rule("layers.idx_k_norm", A + "k_norm.weight", when="sparse"),
        Rule("layers.idx_k_norm_bias", A + "k_norm.bias", when="sparse"),
        Rule("layers.idx_w", A + "weights_proj.weight", "transpose", when="sparse"),
    ]


HF_DECODER = decoder_table()

# (family, source format) -> table. Every Hugging Face family shares the decoder naming.
TABLES: dict[tuple[str, str], list[Rule]] = {
    **{(f, "hf"): HF_DECODER for f in ("llama", "mistral", "gemma", "gemma2", "gemma3", "qwen2", "qwen3")},
    # Gemma3ForConditionalGeneration: the text model sits under `language_model.model.`; the tower and projector's
    # names are convert.vision_tables'. An untied head (no released Gemma 3 has one) is saved beside it.
    ("gemma3", "hf-gemma3-multimodal"): decoder_table("language_model.model.", head="language_model.lm_head.weight"),
    ("mixtral", "hf"): decoder_table(moe="mixtral"),
    **{(f, "hf"): decoder_table(moe="deepseek") for f in ("deepseek_v2", "deepseek_v3")},
    # DeepSeek-V3.2: V3's names and its lightning indexer's (self_attn.indexer.*)
    ("deepseek_v32", "hf"): decoder_table(moe="deepseek") + indexer_rules(),
    # Qwen3-MoE and GLM-4.5 name their experts, router (and GLM's selection bias, shared experts) as DeepSeek does.
    **{(f, "hf"): decoder_table(moe="deepseek") for f in ("qwen3_moe", "glm4_moe")},
    # SmolLM3 shares the naming; Phi-3/Phi-4 too once their fused qkv_proj / gate_up_proj are split (convert.fused).
    **{(f, "hf"): HF_DECODER for f in ("smollm3", "phi3")},
    **{(f, "hf"): post_norm_table() for f in ("olmo2", "olmo3")},
    ("gpt_oss", "hf"): decoder_table(moe="gpt_oss"),
    # MiniMax-M2: Mixtral's expert names (block_sparse_moe.experts.{j}.w1/w2/w3, as the Hub holds them and
    # transformers 5 saves them), the selection bias beside them, q/k norms over all heads.
    ("minimax_m2", "hf"): full_width_qk_norms(decoder_table(moe="minimax_m2")),
    **GGUF_TABLES,  # llama.cpp's names (convert/gguf_tables.py)
}


def gemma4_table(prefix: str = "model.") -> list[Rule]:
    """Gemma 4's text decoder (Gemma4ForCausalLM; ``model.language_model.`` inside Gemma4ForConditionalGeneration).

    The attention weights of sliding and full layers are stacked apart (:mod:`zoo.model.layer_layout`): a rule with
    ``kind`` stacks the layers of that kind only. KV-shared layers have no key/value weights and full layers of a
    model with attention_k_eq_v no value weight: :func:`table_for` binds only the parameters the model has.
    """
    L = prefix + "layers.{i}."
    A = L + "self_attn."
    attn = []
    for kind, pre, g in (("sliding", "", ""), ("full", "global_", "global_")):
        attn += [
            Rule(f"layers.{pre}q", A + "q_proj.weight", g + "q_in", kind=kind),
            Rule(f"layers.{pre}k", A + "k_proj.weight", g + "kv_in", kind=kind),
            Rule(f"layers.{pre}v", A + "v_proj.weight", g + "kv_in", kind=kind),
            Rule(f"layers.{pre}o", A + "o_proj.weight", g + "o_out", kind=kind),
            Rule(f"layers.{pre}q_norm", A + "q_norm.weight", kind=kind),
            Rule(f"layers.{pre}k_norm", A + "k_norm.weight", kind=kind),
        ]
    ple, moe = "per_layer_input_size", "moe"
    return [
        Rule("embed", prefix + "embed_tokens.weight"),
        Rule("layers.attn_norm", L + "input_layernorm.weight"),
        *attn,
        Rule("layers.post_attn_norm", L + "post_attention_layernorm.weight"),
        Rule("layers.mlp_norm", L + "pre_feedforward_layernorm.weight"),
        Rule("layers.post_mlp_norm", L + "post_feedforward_layernorm.weight"),
        Rule("layers.gate", L + "mlp.gate_proj.weight", "transpose"),
        Rule("layers.up", L + "mlp.up_proj.weight", "transpose"),
        Rule("layers.down", L + "mlp.down_proj.weight", "transpose"),
        Rule("layers.layer_scalar", L + "layer_scalar", when="layer_scalars"),
        Rule("layers.ple_gate", L + "per_layer_input_gate.weight", "transpose", when=ple),
        Rule("layers.ple_proj", L + "per_layer_projection.weight", "transpose", when=ple),
        Rule("layers.ple_norm", L + "post_per_layer_input_norm.weight", when=ple),
        Rule("layers.router", L + "router.proj.weight", "transpose", when=moe),
        Rule("layers.router_scale", L + "router.scale", when=moe),
        Rule("layers.expert_scale", L + "router.per_expert_scale", when=moe),
        Rule("layers.expert_gate_up", L + "experts.gate_up_proj", "experts_transpose", when=moe),
        Rule("layers.expert_down", L + "experts.down_proj", "experts_transpose", when=moe),
        Rule("layers.mlp_post_norm", L + "post_feedforward_layernorm_1.weight", when=moe),
        Rule("layers.moe_norm", L + "pre_feedforward_layernorm_2.weight", when=moe),
        Rule("layers.moe_post_norm", L + "post_feedforward_layernorm_2.weight", when=moe),
        Rule("ple_embed", prefix + "embed_tokens_per_layer.weight", when=ple),
        Rule("ple_model_proj", prefix + "per_layer_model_projection.weight", "transpose", when=ple),
        Rule("ple_proj_norm", prefix + "per_layer_projection_norm.weight", when=ple),
        Rule("final_norm", prefix + "norm.weight"),
        Rule("lm_head", "lm_head.weight", "transpose", when="!tie_word_embeddings"),
    ]


TABLES[("gemma4", "hf")] = gemma4_table()
# Gemma4ForConditionalGeneration as stored on the Hub (every released Gemma 4): the text model sits under
# `model.language_model.`; the vision and audio towers are not converted.
TABLES[("gemma4", "hf-gemma4-multimodal")] = gemma4_table("model.language_model.")
# SmolVLM / Idefics3: a Llama under `model.text_model.`, the head at the top; the tower and connector's names are
# convert.vision_tables'.
TABLES[("smolvlm", "hf-smolvlm")] = TABLES[("idefics3", "hf-idefics3")] = decoder_table("model.text_model.")
# Qwen2.5-VL as transformers saves it and the Hub holds it: the Qwen 2 decoder's own names (`model.`), the tower
# under `visual.` (convert.vision_tables').
TABLES[("qwen2_5_vl", "hf-qwen2_5-vl")] = HF_DECODER
# Qwen3-VL as the Hub holds it and transformers 5 saves it: the Qwen 3 decoder under `model.language_model.`, the
# head at the top, the tower under `model.visual.` (convert.vision_tables').
TABLES[("qwen3_vl", "hf-qwen3-vl")] = decoder_table("model.language_model.")
# Qwen3-VL-MoE: the same places, with fused experts (convert.fused) in the MoE layers.
TABLES[("qwen3_vl_moe", "hf-qwen3-vl-moe")] = decoder_table("model.language_model.", moe="qwen3_vl_moe")


def llama4_table(prefix: str = "model.", head: str = "lm_head.weight") -> list[Rule]:
    """Llama 4's text decoder (Llama4ForCausalLM; under ``language_model.`` in Llama4ForConditionalGeneration, as the
    Hub's releases are, whose vision tower is not converted): the shared naming with ``feed_forward.`` for ``mlp.``, q and k
    rows in RoPE's interleaved pairs (convert.transforms' rope_pairs_*: llama.cpp's order), and its MoE layers' router,
    experts (``gate_up_proj`` split by convert.fused, [experts, in, out] as the zoo's) and shared expert."""
    F = prefix + "layers.{i}.feed_forward."
    rope_pairs = {"layers.q": "rope_pairs_q_in", "layers.k": "rope_pairs_k_in"}
    shared = [r for r in decoder_table(prefix, head=head) if r.zoo not in ("layers.q_norm", "layers.k_norm")]
    rules = [dataclasses.replace(r, hf=r.hf.replace(".mlp.", ".feed_forward."),
                                 transform=rope_pairs.get(r.zoo, r.transform) if r.when == "!mla" else r.transform)
             for r in shared]
    return rules + [
        Rule("layers.router", F + "router.weight", "transpose", when="moe"),
        Rule("layers.expert_gate", F + "experts.gate_proj", when="moe"),
        Rule("layers.expert_up", F + "experts.up_proj", when="moe"),
        Rule("layers.expert_down", F + "experts.down_proj", when="moe"),
        *(Rule(f"layers.shared_{part}", F + f"shared_expert.{part}_proj.weight", "transpose", when="moe")
          for part in ("gate", "up", "down")),
    ]


TABLES[("llama4", "hf")] = llama4_table()
TABLES[("llama4", "hf-llama4-multimodal")] = llama4_table("language_model.model.", "language_model.lm_head.weight")


def qwen3_next_table(prefix: str = "model.", head: str = "lm_head.weight", separate: bool = False) -> list[Rule]:
    """Qwen3-Next (Qwen3NextForCausalLM): the shared naming with Qwen3-MoE's experts, its full layers' attention
    (q_proj's query and gate halves split by convert.fused) and its linear layers' Gated DeltaNet, each stacked over
    the layers of its kind (zoo.model.layer_layout), and the shared expert behind its sigmoid gate. ``separate``:
    Qwen3.5's linear projections (in_proj_qkv's q, k, v rows in blocks, split by convert.fused; in_proj_z,
    in_proj_b and in_proj_a apart) instead of Qwen3-Next's head-grouped in_proj_qkvz and in_proj_ba; ``prefix``
    and ``head``: where the decoder and the head sit (Qwen3_5ForConditionalGeneration's language model)."""
    L, M = prefix + "layers.{i}.", prefix + "layers.{i}.mlp."
    A, N = L + "self_attn.", L + "linear_attn."
    attention = ("layers.q", "layers.k", "layers.v", "layers.o", "layers.q_norm", "layers.k_norm")
    shared = [dataclasses.replace(r, kind="full") if r.zoo in attention else r
              for r in decoder_table(prefix, head=head, moe="deepseek") if "shared_experts" not in r.hf]
    shared = [dataclasses.replace(r, hf=A + "q_proj_query.weight") if r.zoo == "layers.q" and r.when == "!mla" else r
              for r in shared]
    if separate:  # Qwen3.5-MoE: experts one by one (transformers' save_pretrained) or fused (the Hub's files)
        experts = ("layers.expert_gate", "layers.expert_up", "layers.expert_down")
        shared = [dataclasses.replace(r, when="moe&!hf_experts_out_in") if r.zoo in experts else r for r in shared]
        shared += [Rule(f"layers.expert_{part}", M + f"experts.{part}_proj", "swap_last", when="moe&hf_experts_out_in")
                   for part in ("gate", "up", "down")]
    return shared + [
        Rule("layers.attn_gate", A + "q_proj_gate.weight", "q_in", kind="full"),
        *(Rule(f"layers.lin_{n}", N + (f"in_proj_qkv_{n}" if separate and n in "qkv" else f"in_proj_{n}") + ".weight",
               t, kind="linear")
          for n, t in (("q", "lin_k_in"), ("k", "lin_k_in"), ("v", "lin_v_in"), ("z", "lin_v_in"),
                       ("b", "transpose"), ("a", "transpose"))),
        Rule("layers.lin_conv", N + "conv1d.weight", "conv_taps", kind="linear"),
        Rule("layers.lin_dt_bias", N + "dt_bias", kind="linear"),
        Rule("layers.lin_a_log", N + "A_log", kind="linear"),
        Rule("layers.lin_norm", N + "norm.weight", kind="linear"),
        Rule("layers.lin_out", N + "out_proj.weight", "lin_out", kind="linear"),
        *(Rule(f"layers.shared_{part}", M + f"shared_expert.{part}_proj.weight", "transpose", when="moe")
          for part in ("gate", "up", "down")),
        Rule("layers.shared_expert_gate", M + "shared_expert_gate.weight", "transpose", when="moe"),
    ]


TABLES[("qwen3_next", "hf")] = qwen3_next_table()
# Qwen3.5, dense and MoE: Qwen3_5ForCausalLM's names, and Qwen3_5ForConditionalGeneration's (the Hub's releases:
# the decoder under `model.language_model.`, the head at the top; the vision tower under `model.visual.`:
# convert.vision_tables', unless --text-only).
for _family in ("qwen3_5", "qwen3_5_moe"):
    TABLES[(_family, "hf")] = qwen3_next_table(separate=True)
    TABLES[(_family, f"hf-{_family}-multimodal")] = qwen3_next_table("model.language_model.", separate=True)


def table_for(family: str, fmt: str, cfg: ModelConfig) -> list[BoundRule]:
    """The rules of a model of this family/config in source format ``fmt``, placed in its layer stacks."""
    out: list[BoundRule] = []
    specs = _specs(cfg) if cfg.global_head_dim or cfg.kv_shared_layers or "linear" in cfg.kinds else {}
    for rule in TABLES[(family, fmt)]:
        if not rule.stacked:
            if rule.applies(cfg):
                out.append(BoundRule(rule.zoo, rule.hf, rule.transform))
            continue
        name = rule.zoo.split(".", 1)[1]
        for prefix, layers, moe in cfg.layer_stacks:
            if rule.applies(cfg, moe):
                experts = cfg.num_experts if "{j}" in rule.hf else 0
                if (rule.kind is not None or cfg.kv_shared_layers) and f"{prefix}.{name}" not in specs:
                    continue  # Gemma 4: no such weight in this stack (no layer of the kind; KV-shared; k_eq_v)
                # A kind-split rule stacks the layers of its kind only.
                own = layers if rule.kind is None else tuple(i for i in layers if cfg.kinds[i] == rule.kind)
                out.append(BoundRule(f"{prefix}.{name}", rule.hf, rule.transform, own, experts))
    # A vision-language model's tower (stacked over its own layers) and connector.
    out += [BoundRule(zoo, hf, t, layers) for zoo, hf, t, layers in vision_entries(fmt, cfg)]
    return out


def _specs(cfg: ModelConfig) -> dict:
    """The model's parameter specs (which stacked weights exist)."""
    from zoo.model.params import param_specs

    return param_specs(cfg)


def export_format(cfg: ModelConfig) -> str:
    """The weight-name format an export writes: a vision-language model's (its composite class's), else "hf"."""
    return "hf" if cfg.vision is None else ARCHITECTURES[cfg.vision.arch][1]
