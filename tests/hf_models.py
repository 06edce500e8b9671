"""Hugging Face reference models and their logits: tiny random-weight transformers models of every family
(FAMILIES, built with transformers' own config classes), their logits and log-probabilities, the distance
between two sets of logits, random tokens, a folder's raw tensors, a folder beside conftest.py's shared
``tiny_family`` model, and transformers' GGUF loading without the gguf package's slow paths."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


# Families whose tiny models set their own token ids: the config classes' defaults (SmolLM3's pad id 128004,
# Phi-3's 32000) lie past the tiny vocabulary, where torch refuses a padding index. A config generated from the
# model alone (no source config.json) has the defaults: token ids are not architecture.
OWN_TOKEN_IDS = {"smollm3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                 "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                 "minimax_m2": dict(bos_token_id=1, eos_token_id=2)}


# family -> (transformers config class, model class, defaults on top of BASE)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7, num_hidden_layers=3)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, num_hidden_layers=4, sliding_window=7, query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, num_hidden_layers=7, sliding_window=7, query_pre_attn_scalar=24,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
        + ["full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=6.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=7, max_window_layers=1, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=2,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # DeepSeek-V3.2: V3's shape with the lightning indexer on every layer (8 index heads of 16, RoPE on their first
    # 8 dims), each query attending to its top 6 keys; YaRN whose mscale/mscale_all_dim scale the indexer's RoPE too.
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        index_topk=6, index_n_heads=8, index_head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8})),
    # Gemma 4 (text): wider full-layer heads with one key/value head, per-layer inputs, the last 3 layers reusing
    # keys/values (MLP doubled), proportional partial RoPE on full layers; tests/test_gemma4.py has its MoE variant.
    # Per-layer inputs 16 wide: at 8, the RMS norm of each layer's projected input amplified float32 rounding to
    # 1.1-1.3e-5 between cached decoding and the full forward (tests/test_decode.py bounds it at 1e-5); 4.5e-6 here.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=6,
        sliding_window=7, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=96, num_kv_shared_layers=3,
        use_double_wide_mlp=True, final_logit_softcapping=6.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}})),
    # Layer 1 dense (mlp_only_layers) between MoE layers 0 and 2.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1000000.0)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        num_nextn_predict_layers=0)),
    # Alternating sliding (window 7) and full layers, sinks, biased router and experts, YaRN without truncation.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=7, swiglu_limit=1.5, router_aux_loss_coef=0.02,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    # MiniMax-M2: every layer 8 experts (3 a token) under sigmoid routing with a selection bias, q/k norms over all
    # heads at once, RoPE on the first 12 of each head's 16 dims (the released rotary_dim over head_dim is 0.5).
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        head_dim=16, intermediate_size=16, num_local_experts=8, num_experts_per_tok=3, router_aux_loss_coef=0.02,
        rotary_dim=12, rope_theta=1000000.0, **OWN_TOKEN_IDS["minimax_m2"])),
    # NoPE every 2nd layer (layer 1 of 3), tied embeddings.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        no_rope_layer_interval=2, rope_theta=50000.0, **OWN_TOKEN_IDS["smollm3"])),
    # Llama 4 (text): chunked (8) RoPE layers 0 and 2 with the weightless q/k norm, full NoPE layers 1 and 3 with the
    # attention temperature (floor_scale 4: it changes every 4 positions), MoE layers 0, 1 and 3 (4 experts, top 1,
    # a shared expert; layer 2 dense and wider).
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=112, num_local_experts=4,
        num_experts_per_tok=1, moe_layers=[0, 1, 3], no_rope_layer_interval=2, attention_chunk_size=8,
        floor_scale=4, attn_scale=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Post-norm blocks, full-width q/k norms.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=500000.0)),
    # OLMo 3: sliding layers (window 7) around a full one, YaRN on the full layer only.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=7, rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                               "original_max_position_embeddings": 32, "attention_factor": 1.2},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    # Phi-4-mini's shape of attention: fused qkv/gate_up, partial rotary (12 of 16), LongRoPE (its short factors
    # up to 24 positions, the long ones past), sliding window (16) on every layer.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=True, max_position_embeddings=256, original_max_position_embeddings=24,
        sliding_window=16, **OWN_TOKEN_IDS["phi3"], rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.2, 1.0, 1.5], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            "original_max_position_embeddings": 24})),
    # Qwen3-Next: Gated DeltaNet layers 0 and 2 (2 key heads of 8, 4 value heads of 12, conv 4) and gated full
    # attention layers 1 and 3 (RoPE on 4 of 16 dims); MoE on every layer (4 experts, top 2) with a shared expert
    # of its own width behind its sigmoid gate, but layer 2's dense MLP.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[2], router_aux_loss_coef=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    # Qwen3.5: Qwen3-Next's layer kinds with separate linear projections and interleaved multimodal RoPE (on 8 of 16
    # dims: 4 frequencies over sections 2, 1, 1); dense MLPs, or (qwen3_5_moe) experts and a shared expert throughout.
    **{family: (config, model, dict(
        num_hidden_layers=4, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                                   "mrope_interleaved": True}, **moe))
       for family, config, model, moe in (
           ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
           ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
               router_aux_loss_coef=0.02)))},
}


def randomize(model) -> None:
    """Larger-than-default weights (and non-trivial norms/biases) give peaked distributions,
    so KL and argmax comparisons actually discriminate."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma-style norms scale by (1 + w) and start at w = 0: randomize around that.
                base = 0.0 if torch.all(p == 0) else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 selection bias
                buf.copy_(0.1 * torch.randn_like(buf))
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (a buffer, saved)
                buf.copy_(1.0 + 0.2 * torch.randn_like(buf))


def make_hf(folder: Path, family: str = "llama", seed: int = 0, dtype=None, save_kwargs=None, **overrides):
    """Save a tiny random model of ``family`` (built with transformers' own config class) to ``folder``.

    ``dtype`` (a torch dtype) casts the saved weights; ``save_kwargs`` go to save_pretrained.
    Returns the fp32 (or ``dtype``) transformers model, set to eager attention.
    """
    import transformers

    cfg_name, model_name, defaults = FAMILIES[family]
    kw = {**BASE, **defaults, **overrides}
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).eval()
    model.config._attn_implementation = "eager"
    randomize(model)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, **(save_kwargs or {}))
    return model


@contextlib.contextmanager
def quick_gguf_loading() -> Iterator[None]:
    """transformers' own loading of a GGUF file (the oracle: AutoModelForCausalLM.from_pretrained(gguf_file=...)),
    its values unchanged, without two costs of the ``gguf`` package it calls: the header parsed through np.memmap
    slices (convert.readers.gguf_reader_class reads the same bytes through a plain view), and
    gguf.get_tensor_name_map, which transformers calls once per module of the model (397 times for SmolLM2-135M,
    14 s of a loaded machine) and which builds the same read-only name table for the same (architecture,
    blocks) each time: built once here."""
    from unittest import mock

    import gguf

    from convert.readers import gguf_reader_class

    with mock.patch.object(gguf, "GGUFReader", gguf_reader_class()), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


def make_llama(folder: Path, seed: int = 0, dtype=None, save_kwargs=None, **overrides):
    """A tiny random LlamaForCausalLM saved to ``folder`` (see :func:`make_hf`)."""
    return make_hf(folder, "llama", seed, dtype, save_kwargs, **overrides)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """transformers' fp32 logits for int tokens [batch, seq]."""
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


# Gemma 4's (and Llama's) weights on the residual stream, by module name: those that read it (its width their
# input: the last axis of a Linear's [out, in] and of the embeddings), those that write it (the first axis), its
# norms (their one axis).
RESIDUAL_READERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "per_layer_input_gate",
                    "per_layer_model_projection", "embed_tokens", "lm_head")
RESIDUAL_WRITERS = ("o_proj", "down_proj", "per_layer_projection")
RESIDUAL_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_per_layer_input_norm", "norm")


def float32_spread(model, tokens: np.ndarray, seed: int = 0) -> float:
    """Max-abs between transformers' float32 logits of a dense Gemma 4 (or Llama-style) ``model`` and those of the
    same model with its residual stream's dimensions permuted: the same function in exact arithmetic, summed in
    another order. What float32 itself lets two faithful implementations differ by on this model (a parity
    tolerance below it cannot hold)."""
    import copy

    perm = torch.randperm(model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in other.named_parameters():
            module = name.rsplit(".", 2)[-2]
            if module in RESIDUAL_READERS:
                p.copy_(p[:, perm])
            elif module in RESIDUAL_WRITERS or module in RESIDUAL_NORMS:
                p.copy_(p[perm])
    spread = float(np.abs(hf_logits(other, tokens) - hf_logits(model, tokens)).max())
    assert spread < 1e-2, "the permutation missed a weight on the residual stream"  # that changes logits by O(1)
    return spread


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax in float64."""
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kl(ref: np.ndarray, got: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(got))."""
    lp, lq = log_softmax(ref), log_softmax(got)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def hf_logps(model, prompt: list[int], answer: list[int]) -> float:
    """transformers' summed log-probability of ``answer`` after ``prompt`` (float64)."""
    lp = log_softmax(hf_logits(model, np.asarray([prompt + answer]))[0])
    return float(sum(lp[len(prompt) - 1 + j, a] for j, a in enumerate(answer)))


def random_tokens(vocab: int, batch: int = 2, seq: int = 48, seed: int = 0) -> np.ndarray:
    """Random int32 token ids."""
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq)).astype(np.int32)


def hf_tensors(folder):
    """name -> (dtype string, raw bytes) of every tensor in a HF folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                out[name] = (str(t.dtype), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # reshape: 0-d too
    return out


def beside(shared: Path, folder: Path) -> Path:
    """``folder`` with ``hf`` and ``zoo`` linked to the shared ``shared/hf`` and ``shared/zoo`` (conftest.py's
    ``tiny_family``), for tests that write their outputs beside the model's folders."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("hf", "zoo"):
        (folder / name).symlink_to(shared / name, target_is_directory=True)
    return folder
