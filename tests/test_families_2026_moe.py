"""Qwen3-MoE (qwen3_moe), GLM-4.5 (glm4_moe), MiniMax-M2 (minimax_m2) and Llama 4 (llama4, text) in the one decoder,
against transformers: logits, the variants' greedy KV-cache decoding (the tiny models' own: tests/test_decode.py over
FAMILIES), the export round trip, a generated config; the released configs' parameter counts; GGUF qwen3moe and
minimax-m2.

The tiny Qwen3-MoE (tests/hf_models.py FAMILIES) has a dense layer between two MoE layers (``mlp_only_layers``), so
its MoE stack is scanned in two runs; the tiny GLM-4.5 has a dense first layer, sigmoid group-limited routing
with a selection bias, a shared expert, q/k/v biases, q/k norms and RoPE on half of each head; the tiny MiniMax-M2
MoE on every layer, ungrouped sigmoid routing with a selection bias, q/k norms over all heads, RoPE on 12 of 16 dims.
"""

import dataclasses
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers.convert_slow_tokenizer import bytes_to_unicode

import zoo
from eval.generate import GenerationConfig, generate
from tests import family_checks as checks
from tests.hf_models import FAMILIES, hf_logits, make_hf, mean_kl, random_tokens
from zoo.checkpoints.format import read_meta
from zoo.checkpoints.readers import load_param_numpy
from zoo.cli import main

MOE_2026 = ["qwen3_moe", "glm4_moe", "minimax_m2", "llama4"]
SEQ = 24


@pytest.fixture(scope="module")
def converted(tiny_family):
    """family -> (transformers model, its saved folder, the zoo checkpoint, the loaded zoo model), shared
    read-only (conftest.py's tiny_family, tests/family_checks.py)."""
    return lambda family: checks.converted(tiny_family, family)


@pytest.mark.parametrize("family", MOE_2026)
def test_logits_match_transformers(converted, family):
    hf, _, _, model = converted(family)
    assert model.cfg.family == family
    checks.assert_logits_match(hf, model, SEQ)


@pytest.mark.parametrize("family", MOE_2026)
def test_round_trip_is_bit_identical(converted, family, tmp_path):
    _, folder, ckpt, _ = converted(family)
    checks.assert_round_trip(folder, ckpt, tmp_path / "back")


@pytest.mark.parametrize("family", MOE_2026)
def test_generated_config_reproduces_the_model(converted, family, tmp_path):
    """Without the source config.json, export writes one from the zoo config; transformers builds the same model."""
    hf, _, ckpt, _ = converted(family)
    back = checks.exported_from_generated_config(ckpt, tmp_path)
    assert type(back).__name__ == FAMILIES[family][1]
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


def test_moe_layers_sit_where_transformers_puts_them():
    """decoder_sparse_step and mlp_only_layers (Qwen3-MoE) and first_k_dense_replace (GLM-4.5) place the MoE
    layers as transformers' own decoder layers do; the stacks and the runs scanned follow."""
    import transformers

    from zoo.model.from_hf import model_config_from_hf

    tiny = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                head_dim=4, moe_intermediate_size=4, num_experts_per_tok=2)
    for name, kw, sparse in (
        ("Qwen3Moe", dict(num_hidden_layers=7, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3]),
         "Qwen3MoeSparseMoeBlock"),
        ("Qwen3Moe", dict(num_hidden_layers=4, num_experts=4, mlp_only_layers=[0, 2]), "Qwen3MoeSparseMoeBlock"),
        ("Glm4Moe", dict(num_hidden_layers=4, n_routed_experts=4, first_k_dense_replace=2), "Glm4MoeMoE"),
    ):
        config = getattr(transformers, f"{name}Config")(**tiny, **kw)
        hf = getattr(transformers, f"{name}ForCausalLM")(config)
        want = tuple(type(layer.mlp).__name__ == sparse for layer in hf.model.layers)
        hf_dict = {**config.to_dict(), "architectures": [f"{name}ForCausalLM"]}
        cfg = model_config_from_hf(hf_dict)
        assert tuple(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) == want
        stacks = {prefix: (layers, moe) for prefix, layers, moe in cfg.layer_stacks}
        assert stacks["layers"] == (tuple(i for i, m in enumerate(want) if m), True)
        assert stacks["dense_layers"] == (tuple(i for i, m in enumerate(want) if not m), False)
        runs = cfg.layer_runs
        assert [i for _, start, stop, _, _ in runs for i in range(start, stop)] == list(range(cfg.num_layers))
        for prefix, start, stop, moe, first in runs:
            assert stacks[prefix][0][first:first + stop - start] == tuple(range(start, stop))
            assert all(want[i] == moe for i in range(start, stop))
        if kw.get("decoder_sparse_step") == 2:  # dense 0, MoE 1, dense 2-4 (3 by mlp_only_layers), MoE 5, dense 6
            assert [(p, a, b, f) for p, a, b, _, f in runs] == [
                ("dense_layers", 0, 1, 0), ("layers", 1, 2, 0), ("dense_layers", 2, 5, 1), ("layers", 5, 6, 1),
                ("dense_layers", 6, 7, 4)]


def test_decoder_sparse_step_below_one_is_one_line():
    from zoo.errors import UserError
    from zoo.model.from_hf import model_config_from_hf
    from zoo.registry.catalogue import hf_config_of

    bad = dict(hf_config_of("qwen3-30b-a3b", "model"), decoder_sparse_step=0)
    with pytest.raises(UserError, match=r"^x/config.json: decoder_sparse_step=0 must be at least 1$"):
        model_config_from_hf(bad, "x/config.json")


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [
    ("qwen3_moe", dict(num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)),
    ("glm4_moe", dict(num_hidden_layers=2, use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1,
                      n_shared_experts=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25})),
])
def test_variants_match_transformers(tmp_path, family, overrides):
    """Slow (slow lane: one more conversion and three compiles each: the forward, generate's prefill and step):
    Qwen3-MoE with every second layer MoE (dense 0, MoE 1, dense 2: the dense stack's second run starts at its
    second layer) and unnormalized top-k weights; GLM-4.5 (a dense layer, an MoE one) without q/k norms and
    biases, ungrouped routing, two shared experts and a quarter of each head rotated. As few layers as show each
    trait: every layer run is its own piece of the programs (a scan of several MoE layers:
    test_logits_match_transformers's)."""
    hf = make_hf(tmp_path / "hf", family, **overrides)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    model = zoo.load(tmp_path / "zoo")
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    ref = hf_logits(hf, tokens)
    got = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6 and ref.std() > 0.5
    prompt = tokens[0, :5].tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, 5:].tolist()
    assert generate(model.cfg, model.param_dict(), [prompt], GenerationConfig(max_new_tokens=8))[0] == want


# (registry name, published total, active parameters, whether the publisher counts the embedding and head as
# active, the unit of the figures' last digit: published figures are the counts cut to it). Qwen publishes 30.5B total / 3.3B activated and 235B / 22B
# (embeddings counted); Z.ai 32B / 12B active for GLM-4.5 / GLM-4.5-Air, which equal the non-embedding ones.
# GLM's totals (355B, 106B) are not checked: they are rounded loosely and count the multi-token-prediction layer
# that transformers (and lmzoo) do not build. Meta publishes 17B active for both Llama 4 models (the text model's,
# embeddings counted) and 400B total for Maverick's text model (the language models' counts: the registry's Llama 4
# configs are whole, their vision towers counted apart in tests/test_vlm_llama4.py; Scout's text model: 107.8B).
RELEASED = [
    ("llama-4-scout", None, 17e9, True, 1e9),
    ("llama-4-maverick", 400e9, 17e9, True, 1e9),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, True, 0.1e9),
    ("qwen3-235b-a22b", 235e9, 22e9, True, 1e9),
    ("glm-4.5", None, 32e9, False, 1e9),
    ("glm-4.6", None, 32e9, False, 1e9),
    ("glm-4.5-air", None, 12e9, False, 1e9),
]


@pytest.mark.parametrize("name,total,active,embeddings_active,last_digit", RELEASED)
def test_released_configs_have_their_published_parameter_counts(name, total, active, embeddings_active, last_digit):
    import math

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import param_specs
    from zoo.registry.catalogue import get, hf_config_of

    assert get(name).family in MOE_2026
    cfg = model_config_from_hf(hf_config_of(name, "model"), name)
    sizes = {k: math.prod(s.shape) for k, s in param_specs(cfg).items()
             if not k.startswith(("vision.", "projector."))}  # the language model's (Llama 4's tower apart)
    everything = sum(sizes.values())
    experts = sum(n for k, n in sizes.items() if ".expert_" in k)
    embeddings = sizes["embed"] + sizes.get("lm_head", 0)
    used = everything - experts + experts * cfg.experts_per_token // cfg.num_experts
    if not embeddings_active:
        used -= embeddings
    if total is not None:
        assert total <= everything < total + last_digit
    assert active <= used < active + last_digit


def test_minimax_m2_released_config_counts_as_transformers_and_the_card():
    """MiniMax-M2's registry config has transformers' count of the same config (its parameters, and the selection
    biases, which it keeps as buffers), and the model card's rounded figures: 230B total, 10B active (the active
    count without the embedding and head, 9.80B; with them 11.0B)."""
    import math

    import transformers

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import param_specs
    from zoo.registry.catalogue import get, hf_config_of

    hf = hf_config_of("minimax-m2", "model")
    assert get("minimax-m2").family == "minimax_m2"
    cfg = model_config_from_hf(hf, "minimax-m2")
    assert (cfg.rope_dim, cfg.qk_norm_span, cfg.router_score, cfg.router_bias) == (64, "all", "sigmoid", True)
    sizes = {k: math.prod(s.shape) for k, s in param_specs(cfg).items()
             if not k.startswith(("vision.", "projector."))}  # the language model's (Llama 4's tower apart)
    with torch.device("meta"):  # shapes only: nothing allocated
        ref = transformers.MiniMaxM2ForCausalLM(transformers.AutoConfig.for_model(**hf))
    biases = [b for name, b in ref.named_buffers() if name.endswith("e_score_correction_bias")]
    assert sum(sizes.values()) == sum(p.numel() for p in ref.parameters()) + sum(b.numel() for b in biases)
    experts = sum(n for k, n in sizes.items() if ".expert_" in k)
    active = sum(sizes.values()) - experts + experts * 8 // 256 - sizes["embed"] - sizes["lm_head"]
    assert round(sum(sizes.values()) / 10e9) == 23 and round(active / 1e9) == 10


# --- GGUF qwen3moe, written by hand as llama.cpp's convert_hf_to_gguf.py writes it


def _byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 bytes in GPT-2's alphabet, a few merges, ChatML's tokens."""
    spell = bytes_to_unicode()
    tokens, merges = [spell[b] for b in range(256)], []
    for word in ("the", "cat", "sat"):
        chars = [spell[b] for b in (" " + word).encode()]
        cur = chars[0]
        for ch in chars[1:]:
            merges.append(f"{cur} {ch}")
            cur += ch
            tokens.append(cur)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens + specials, merges, [1] * len(tokens) + [3] * len(specials)


_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def _both_conversions(path: Path, tmp_path: Path) -> tuple[zoo.ModelConfig, zoo.ModelConfig]:
    """`zoo convert` of the GGUF file ``path`` (to from_gguf/) and of tmp_path/hf (to from_hf/): the same
    parameters, bit for bit; their configs (GGUF's, safetensors')."""
    assert main(["convert", str(path), "--out", str(tmp_path / "from_gguf")]) == 0
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "from_hf")]) == 0
    params = read_meta(tmp_path / "from_hf")["params"]
    assert read_meta(tmp_path / "from_gguf")["params"].keys() == params.keys()
    for p in params:
        np.testing.assert_array_equal(load_param_numpy(tmp_path / "from_gguf", p), load_param_numpy(tmp_path / "from_hf", p))
    return zoo.read_config(tmp_path / "from_gguf"), zoo.read_config(tmp_path / "from_hf")


def _logits_match(hf: torch.nn.Module, ckpt: Path, vocab: int) -> None:
    """The checkpoint's logits are transformers' (1e-4, KL 1e-6) on random tokens."""
    ids = random_tokens(vocab, seq=SEQ)
    ref = hf_logits(hf, ids)
    got = np.asarray(zoo.load(ckpt)(jnp.asarray(ids)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6 and ref.std() > 0.5


def test_gguf_qwen3moe_converts_as_the_safetensors_checkpoint(tmp_path):
    """A tiny Qwen3-MoE written as a llama.cpp ``qwen3moe`` file (each layer's experts stacked into one
    ``ffn_*_exps`` tensor [experts, out, in], quantized to Q8_0) converts to the parameters and logits of the
    safetensors conversion of the same model (its expert weights set to the Q8_0 values)."""
    tokens, merges, types = _byte_vocab()
    hf = make_hf(tmp_path / "unused", "qwen3_moe", vocab_size=len(tokens), mlp_only_layers=[], num_hidden_layers=2,
                 moe_intermediate_size=32)
    c = hf.config
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    m = c.moe_intermediate_size
    for i in range(c.num_hidden_layers):
        for module, name in _GGUF_LAYER.items():
            w.add_tensor(f"blk.{i}.{name}.weight", state[f"model.layers.{i}.{module}.weight"])
        # transformers keeps each layer's experts fused: gate_up_proj [experts, 2 * moe, hidden] (gate rows first)
        # and down_proj [experts, hidden, moe]; llama.cpp writes gate, up and down stacks [experts, out, in].
        fused = f"model.layers.{i}.mlp.experts."
        stacks = {"ffn_gate_exps": state[fused + "gate_up_proj"][:, :m], "ffn_up_exps": state[fused + "gate_up_proj"][:, m:],
                  "ffn_down_exps": state[fused + "down_proj"]}
        for name, stack in stacks.items():
            raw = gguf.quants.quantize(stack, Q.Q8_0)
            w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=Q.Q8_0)
            values = gguf.quants.dequantize(raw, Q.Q8_0).reshape(stack.shape)
            assert np.abs(values - stack).max() > 0  # the file's values are not the model's: the test can tell
            stacks[name] = values
        state[fused + "gate_up_proj"] = np.concatenate([stacks["ffn_gate_exps"], stacks["ffn_up_exps"]], axis=1)
        state[fused + "down_proj"] = stacks["ffn_down_exps"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    hf.save_pretrained(tmp_path / "hf")

    a, b = _both_conversions(path, tmp_path)
    # The same model: the same parameters and architecture (the file keeps its eps as float32, and no
    # max_position_embeddings the model reads), so the same logits; checked once, against transformers'.
    assert a.router_norm_topk and a.rms_norm_eps == float(np.float32(b.rms_norm_eps))
    assert dataclasses.replace(a, rms_norm_eps=b.rms_norm_eps, max_position_embeddings=b.max_position_embeddings,
                               rope=dataclasses.replace(a.rope, original_max_position_embeddings=b.rope.original_max_position_embeddings)) == b
    _logits_match(hf, tmp_path / "from_gguf", len(tokens))


@pytest.mark.slow
def test_gguf_minimax_m2_converts_as_the_safetensors_checkpoint(tmp_path):
    """Slow (two conversions and a forward's compilation, 4 to 15 s on a loaded machine). A tiny MiniMax-M2
    written as llama.cpp's ``minimax-m2`` file (convert_hf_to_gguf.py's MiniMaxM2Model: each layer's w1/w3/w2
    stacked into ``ffn_*_exps`` [experts, out, in], the selection bias ``exp_probs_b.bias``, q/k norms over all
    heads, rotary_dim as rope.dimension_count; float32) converts to the safetensors conversion's parameters and
    architecture, and so to transformers' logits. Its tokenizer (``tokenizer.ggml.pre`` ``minimax-m2``) splits text
    as GPT-4o's does, digits in threes, where GPT-2's split (a reader's fallback) keeps them whole."""
    from safetensors.numpy import load_file

    from zoo.data.tokenizer import load_tokenizer

    tokens, merges, types = _byte_vocab()
    hf = make_hf(tmp_path / "hf", "minimax_m2", vocab_size=len(tokens), num_hidden_layers=2)
    c, state = hf.config, load_file(str(tmp_path / "hf" / "model.safetensors"))
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "minimax-m2")
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_rope_freq_base, 1000000.0),
                       (w.add_expert_count, c.num_local_experts), (w.add_expert_used_count, c.num_experts_per_tok),
                       (w.add_expert_feed_forward_length, c.intermediate_size), (w.add_rope_dimension_count, 12)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("minimax-m2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for name, hf_name in (("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"), ("output", "lm_head")):
        w.add_tensor(f"{name}.weight", state[f"{hf_name}.weight"])
    layer = {**{k: v for k, v in _GGUF_LAYER.items() if k != "mlp.gate"}, "block_sparse_moe.gate": "ffn_gate_inp"}
    for i in range(c.num_hidden_layers):
        for module, name in layer.items():
            w.add_tensor(f"blk.{i}.{name}.weight", state[f"model.layers.{i}.{module}.weight"])
        moe = f"model.layers.{i}.block_sparse_moe."
        w.add_tensor(f"blk.{i}.exp_probs_b.bias", state[moe + "e_score_correction_bias"])
        for name, part in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            w.add_tensor(f"blk.{i}.{name}.weight",
                         np.stack([state[f"{moe}experts.{j}.{part}.weight"] for j in range(c.num_local_experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    a, b = _both_conversions(path, tmp_path)
    assert (a.partial_rotary_factor, a.qk_norm_span, a.router_bias) == (0.75, "all", True)
    # the file keeps its eps as float32 and no router loss coefficient (a training setting)
    assert dataclasses.replace(a, rms_norm_eps=b.rms_norm_eps, aux_loss_coef=b.aux_loss_coef) == b
    _logits_match(hf, tmp_path / "from_gguf", len(tokens))
    split = load_tokenizer(tmp_path / "from_gguf").backend_tokenizer.pre_tokenizer.pre_tokenize_str("12345")
    assert [piece for piece, _ in split] == ["123", "45"]
