"""One model configuration for every family; family differences are fields."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UserError
from zoo.model.vision_config import VisionConfig


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    ``kind`` is the Hugging Face ``rope_type``: ``default``, ``linear``,
    ``llama3``, ``yarn`` or ``longrope``. The scaling fields are only read by the kinds that use them.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # Gemma 4's "proportional" kind: only this fraction of each head's dims rotates (the rest get frequency 0),
    # the exponents still taken over the whole head.
    proportional_fraction: float = 1.0
    # LongRoPE (Phi-3/Phi-4): per-frequency divisors of the inverse frequencies, the short ones up to
    # original_max_position_embeddings tokens, the long ones past it (``factor`` sets the attention factor).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # Multimodal RoPE (Qwen2.5-VL): how many of the head's frequencies each of the (time, row, column) position
    # axes drives, in that order (summing to rope_dim / 2); () for the 1-D RoPE of text models.
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL: the frequencies turn with the axes in turn (time, row, column, time, ...: the first 3 x section[1]
    # frequencies' every third from the second by the row, likewise the column), not in contiguous sections.
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        # JSON gives lists; the config must stay hashable (it is a static argument of jitted functions).
        for name in ("short_factor", "long_factor"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        object.__setattr__(self, "mrope_section", tuple(int(x) for x in self.mrope_section))


# chunked: Llama 4's local attention within fixed chunks; linear: Qwen3-Next's Gated DeltaNet (zoo.layers.linear_attention)
LAYER_KINDS = ("full", "sliding", "chunked", "linear")
# How the training forward attends (zoo.kernels.choice): "auto" picks by platform and model (cuDNN's flash attention on
# NVIDIA GPUs where it applies, splash's Pallas kernel on TPUs where it applies, else the blockwise XLA path); the
# others ask for one kernel.
ATTENTION_KERNELS = ("auto", "blockwise", "cudnn", "splash")


# Llama 4's fields, left out of a model.json where they have their defaults (every other family's).
LLAMA4_FIELDS = ("attention_chunk_size", "qk_l2_norm", "temperature_tuning", "temperature_floor",
                 "temperature_scale", "router_scales_input")
# Qwen3-Next's, likewise.
QWEN3_NEXT_FIELDS = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel", "attn_output_gate", "shared_expert_gate", "shared_intermediate_size")
# DeepSeek-V3.2's indexer, likewise left out where dense (every other family's).
SPARSE_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a zoo decoder; everything the forward pass depends on.

    Family differences are fields: ``norm_offset`` 1.0 gives Gemma's
    ``x * (1 + w)`` RMSNorm; ``embed_scale`` multiplies embeddings by
    sqrt(hidden); ``post_norms`` adds Gemma 2/3's norms after attention and
    MLP; ``qk_norm`` normalizes q and k per head before RoPE; soft-caps are
    ``cap * tanh(x / cap)``; ``layer_types`` marks each layer ``full`` or
    ``sliding`` (window ``sliding_window``), and ``rope_local`` is the RoPE of
    sliding layers when it differs.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    # > 0: a sequence classifier (a reward model, rm/): a head ``score`` [hidden, num_labels] read at each
    # sequence's last token (transformers' *ForSequenceClassification); 0: a causal LM
    num_labels: int = 0
    # a classifier's padding id: its score reads each sequence's last token that is not it, as transformers'
    # *ForSequenceClassification pools (None: the last token)
    pad_token_id: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    embed_scale: bool = False
    post_norms: bool = False
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local: RopeConfig | None = None
    # Mixture of experts (num_experts 0: dense). The first `dense_layers` layers keep a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    router_score: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    router_norm_topk: bool = True
    router_scale: float = 1.0
    router_groups: int = 1  # group-limited routing: keep the best `router_topk_groups` of `router_groups`
    router_topk_groups: int = 1
    router_group_score: str = "max"  # "max" (DeepSeek-V2) or "top2" (sum of the best two, V3)
    router_bias: bool = False  # V3's e_score_correction_bias: used for selection only
    capacity_factor: float | None = None  # None: dropless; else tokens over capacity are dropped
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank 0: ordinary attention.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # How the Hugging Face checkpoint orders RoPE dims (DeepSeek interleaves pairs). The zoo
    # always stores rotate-half order; only conversion and export read this.
    hf_rope_interleave: bool = False
    # How a Qwen3-VL-MoE checkpoint orders its fused experts' last two axes (convert.fused): False as the Hub's
    # files hold them ([experts, in, out]), True as transformers 5's save_pretrained writes them ([experts, out,
    # in]). Not architecture (no part in equality): conversion records it, export writes the source's order back.
    # A Qwen3.5-MoE checkpoint's: True where its experts are fused [experts, out, in] (the Hub's files), False where
    # they come one by one (transformers' save_pretrained).
    hf_experts_out_in: bool = field(default=False, compare=False)
    # Not architecture: which attention kernel the training forward runs (ATTENTION_KERNELS). It is never saved
    # (to_dict leaves it out) and set per run (model.attention, zoo.load(..., attention=)); it takes part in
    # equality and hashing, so jitted functions keyed by the config compile once per kernel.
    attention: str = "auto"
    # Gemma 4. Full layers' attention dims where they differ from the sliding layers' (0: the same); with
    # global_head_dim set, the attention weights of full layers are stacked apart (``global_q`` ...: zoo.model.layer_layout).
    global_head_dim: int = 0
    global_kv_heads: int = 0
    attention_k_eq_v: bool = False  # full layers' values are their keys' projection (no v weight: global_v absent)
    v_norm: bool = False  # values RMS-normed per head, without a weight
    kv_shared_layers: int = 0  # the last n layers attend with the keys/values of the last earlier layer of their kind
    double_wide_mlp: bool = False  # the KV-shared layers' MLP is 2 x intermediate_size wide
    per_layer_input_size: int = 0  # per-layer input embeddings (PLE) of this width per layer; 0: none
    per_layer_vocab_size: int = 0
    layer_scalars: bool = False  # each layer's output is multiplied by its own scalar
    parallel_moe: bool = False  # the MoE block runs beside the dense MLP, with its own norms and per-expert scales
    # Qwen3-MoE's placement of MoE layers: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not
    # in mlp_only_layers (and i >= dense_layers); the others keep a dense MLP, wherever they sit.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The share of each head's dimensions RoPE rotates (GLM-4.5: 0.5, Phi-4-mini 0.75: the leading ones; the rest pass through).
    partial_rotary_factor: float = 1.0
    # gpt-oss: a learned per-head logit in every softmax's denominator (attention sinks), a bias on the router's
    # logits and on every expert projection, and the clamped SwiGLU of its experts (swiglu_limit None: the plain
    # GLU of hidden_act): gate clamped above, up both sides, gate * sigmoid(alpha * gate) * (up + 1).
    attn_sinks: bool = False
    router_logits_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Layers whose attention applies no RoPE (SmolLM3's NoPE layers), by index.
    nope_layers: tuple[int, ...] = ()
    # False: no norm before attention and MLP (OLMo 2/3, whose only layer norms are the post_norms).
    pre_norms: bool = True
    # How q_norm/k_norm span a token's q and k: "head" normalizes each head (Qwen 3, Gemma 3); "all" all heads
    # at once, one RMS over heads * head_dim (OLMo 2/3).
    qk_norm_span: str = "head"
    # A vision-language model's image tower and connector (zoo.model.vision_config); None: text only.
    vision: VisionConfig | None = None
    # Llama 4. "chunked" layers attend within their chunk of attention_chunk_size positions (position // size
    # equal, causal); qk_l2_norm: q and k RMS-normed per head without a weight after RoPE, on RoPE layers only;
    # temperature_tuning: NoPE layers' queries scaled by log1p(floor((pos + 1) / temperature_floor)) *
    # temperature_scale + 1; router_scales_input: each routed expert reads its token times the router weight
    # (the weight is not applied to the expert's output).
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    temperature_tuning: bool = False
    temperature_floor: float = 8192.0
    temperature_scale: float = 0.1
    router_scales_input: bool = False
    # Qwen3-Next. "linear" layers are Gated DeltaNet (zoo.layers.linear_attention): q and k of linear_key_heads
    # heads (linear_key_head_dim wide), values and their output gate of linear_value_heads (a multiple of them),
    # a causal convolution linear_conv_kernel wide before the gated delta rule (zoo.kernels.gated_delta).
    # attn_output_gate: the full layers' q projection also yields a gate, sigmoid(gate) * attention before o
    # (stored apart: attn_gate). shared_expert_gate: the shared expert's output scaled by sigmoid(x @ w), w
    # [embed, 1]; shared_intermediate_size: its width (0: moe_intermediate_size x shared_experts).
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False
    shared_expert_gate: bool = False
    shared_intermediate_size: int = 0
    # DeepSeek-V3.2's sparse attention (DSA; zoo.kernels.sparse_topk): on every MLA layer a lightning indexer of
    # index_n_heads heads of index_head_dim scores the keys, and each query attends to its index_topk best.
    # 0: dense attention.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "nope_layers", tuple(int(i) for i in self.nope_layers))
        if self.qk_norm_span not in ("head", "all"):
            raise UserError(f"model config: qk_norm_span {self.qk_norm_span!r} is not one of head, all")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise UserError(f"model config: nope_layers must be layer indices below {self.num_layers}")
        if self.attention not in ATTENTION_KERNELS:
            raise UserError(f"model config: attention {self.attention!r} is not one of {', '.join(ATTENTION_KERNELS)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.index_topk and not (self.mla and self.q_lora_rank and self.index_n_heads
                                    and self.qk_rope_head_dim <= self.index_head_dim):
            raise UserError("model config: index_topk (sparse attention) needs MLA with a q_lora_rank, index_n_heads "
                            "and an index_head_dim of at least qk_rope_head_dim")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_KINDS):
                raise UserError(f"model config: layer_types must list {self.num_layers} of {LAYER_KINDS}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise UserError("model config: sliding layers need a sliding_window")
            if "chunked" in self.layer_types and not self.attention_chunk_size:
                raise UserError("model config: chunked layers need an attention_chunk_size")
            if "linear" in self.layer_types and not (self.linear_key_heads and self.linear_value_heads
                                                     and self.linear_value_heads % self.linear_key_heads == 0
                                                     and self.linear_conv_kernel):
                raise UserError("model config: linear layers need linear_key_heads, linear_value_heads (a multiple "
                                "of them) and linear_conv_kernel")

    @property
    def mla(self) -> bool:
        """Whether attention is DeepSeek's multi-head latent attention."""
        return self.kv_lora_rank > 0

    @property
    def sparse(self) -> bool:
        """Whether attention is DeepSeek's sparse attention (an indexer picks each query's top-k keys)."""
        return self.index_topk > 0

    @property
    def rope_dim(self) -> int:
        """How many dimensions of each head RoPE rotates (the leading ones, under ``partial_rotary_factor``)."""
        if self.mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        """Softmax scale applied to q·k (YaRN's mscale enters squared, as in DeepSeek)."""
        if self.mla:
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            r = self.rope
            if r.kind == "yarn" and r.mscale_all_dim and r.factor > 1:
                m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
                scale *= m * m
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i runs the routed experts (else a dense MLP): past the first ``dense_layers``, on every
        ``decoder_sparse_step``-th layer, not in ``mlp_only_layers``."""
        return (bool(self.num_experts) and i >= self.dense_layers and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def layer_stacks(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """(parameter prefix, the layers it stacks in order, is MoE) of each stack, ordered by first layer.

        Dense models have one stack, ``layers``; MoE models keep their MoE
        layers in ``layers`` and their dense ones (first layers, or any
        layers: Qwen3-MoE's ``mlp_only_layers``) in ``dense_layers``. Gemma 4's
        last ``kv_shared_layers`` layers have no key/value weights (and maybe a
        wider MLP): a stack of their own, ``shared_layers`` (:mod:`zoo.model.layer_layout`).
        """
        stacks: dict[str, tuple[list[int], bool]] = {}
        for i in range(self.num_layers):
            moe = self.is_moe_layer(i)
            prefix = "dense_layers" if self.num_experts and not moe else "layers"
            if i >= self.num_layers - self.kv_shared_layers:
                prefix = "shared_layers"
            stacks.setdefault(prefix, ([], moe))[0].append(i)
        return [(prefix, tuple(layers), moe) for prefix, (layers, moe) in stacks.items()]

    @property
    def layer_runs(self) -> list[tuple[str, int, int, bool, int]]:
        """(parameter prefix, first layer, end layer, is MoE, index of the first layer in its stack) of each run of
        consecutive layers of one stack, in layer order: one run per stack unless dense layers sit between MoE
        ones. The forward passes scan each run over its slice of the stack."""
        runs: list[tuple[str, int, int, bool, int]] = []
        for prefix, layers, moe in self.layer_stacks:
            for k, i in enumerate(layers):
                if k == 0 or layers[k - 1] != i - 1:
                    runs.append((prefix, i, i + 1, moe, k))
                else:
                    runs[-1] = (prefix, runs[-1][1], i + 1, moe, runs[-1][4])
        return sorted(runs, key=lambda r: r[1])

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kind of every layer (``full`` unless ``layer_types`` says otherwise)."""
        return self.layer_types or ("full",) * self.num_layers

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (nested dataclasses become dicts) of the architecture: ``attention``, a run's
        choice, is left out, and ``vision`` when there is none."""
        d = dataclasses.asdict(self)
        d.pop("attention")
        if not self.hf_experts_out_in:  # only a Qwen3-VL-MoE converted from transformers 5's files records it
            d.pop("hf_experts_out_in")
        if self.vision is None:  # a text model's model.json stays as it was
            d.pop("vision")
        # so are those of every model but Llama 4 (Qwen3-Next, DeepSeek-V3.2)
        for name in LLAMA4_FIELDS + QWEN3_NEXT_FIELDS + SPARSE_FIELDS:
            if d[name] == _DEFAULTS[name]:
                d.pop(name)
        return d

    def architecture(self) -> ModelConfig:
        """This config with the run's choices (``attention``) at their defaults: compare these to ask whether
        two configs are one model."""
        return dataclasses.replace(self, attention="auto")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UserError(f"model config: unknown fields {sorted(unknown)}")
        rope = d.pop("rope", {}) or {}
        local = d.pop("rope_local", None)
        types = d.pop("layer_types", None)
        vision = d.pop("vision", None)
        if "mlp_only_layers" in d:
            d["mlp_only_layers"] = tuple(d["mlp_only_layers"])  # JSON lists; configs are hashed (jit keys)
        return cls(rope=RopeConfig(**rope), rope_local=RopeConfig(**local) if local else None,
                   layer_types=tuple(types) if types is not None else None,
                   vision=VisionConfig(**vision) if vision else None, **d)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
