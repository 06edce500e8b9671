"""Qwen3-Next (qwen3_next) in the one decoder, against transformers: logits over several delta-rule chunks with both
layer kinds, packed documents, the export round trip and a generated config, greedy KV-cache decoding, and the
released 80B-A3B config's parameter count.

The tiny model (tests/hf_models.py FAMILIES) has Gated DeltaNet layers 0 and 2 and gated full-attention layers 1
and 3 (partial RoPE), MoE with a gated shared expert on layers 0, 1 and 3 and a dense MLP on layer 2, so its one
stack is scanned in runs split by the dense layer, with weights stacked by kind (zoo.model.layer_layout).
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests import family_checks as checks
from tests.hf_models import FAMILIES, hf_logits, mean_kl, random_tokens
from zoo.cli import main

SEQ = 150  # three chunks of the delta rule's 64, the last one partial


@pytest.fixture(scope="module")
def converted(tiny_family):
    """(transformers model, its saved folder, the zoo checkpoint, the loaded zoo model), shared read-only."""
    return checks.converted(tiny_family, "qwen3_next")


def test_logits_match_transformers(converted):
    hf, _, _, model = converted
    assert model.cfg.kinds == ("linear", "full", "linear", "full")
    checks.assert_logits_match(hf, model, SEQ)


@pytest.mark.slow
def test_packed_documents_equal_each_alone(converted):
    """A row packing two documents (the second starting mid-chunk) and padding: each document's logits are
    transformers' for that document alone (the linear layers' state and convolution restart at a document)."""
    hf, _, _, model = converted
    a, b = random_tokens(hf.config.vocab_size, batch=2, seq=90, seed=3)
    a, b = a[:90], b[:40]
    row = np.r_[a, b, np.zeros(6, np.int32)][None].astype(np.int32)
    seg = np.r_[np.full(90, 1), np.full(40, 2), np.zeros(6)][None].astype(np.int32)
    pos = np.r_[np.arange(90), np.arange(40), np.zeros(6)][None].astype(np.int32)
    got = np.asarray(model(jnp.asarray(row), jnp.asarray(seg), jnp.asarray(pos)))[0]
    for doc, part in ((a, got[:90]), (b, got[90:130])):
        ref = hf_logits(hf, doc[None])[0]
        assert np.abs(part - ref).max() <= 1e-4


def test_round_trip_is_bit_identical(converted, tmp_path):
    _, folder, ckpt, _ = converted
    checks.assert_round_trip(folder, ckpt, tmp_path / "back")


def test_generated_config_reproduces_the_model(converted, tmp_path):
    """Without the source config.json, export writes one from the zoo config; transformers builds the same model."""
    hf, _, ckpt, _ = converted
    back = checks.exported_from_generated_config(ckpt, tmp_path)
    assert type(back).__name__ == FAMILIES["qwen3_next"][1]
    tokens = random_tokens(hf.config.vocab_size, seq=24)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


def test_released_config_counts_as_transformers():
    """qwen3-next-80b-a3b's registry config: 48 layers (36 linear, every 4th full), 512 experts (10 a token) and a
    shared expert; its parameter count is transformers' for the same config (built on the meta device: nothing
    allocated): 79.7B in all (the card's 80B), 3.9B active, 3.3B of them outside the embedding and the head (the
    card's 3B)."""
    import transformers

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import param_specs
    from zoo.registry.catalogue import get, hf_config_of

    hf = hf_config_of("qwen3-next-80b-a3b", "model")
    assert get("qwen3-next-80b-a3b").family == "qwen3_next"
    cfg = model_config_from_hf(hf, "qwen3-next-80b-a3b")
    assert cfg.kinds == ("linear", "linear", "linear", "full") * 12
    assert (cfg.num_experts, cfg.experts_per_token, cfg.shared_experts, cfg.rope_dim) == (512, 10, 1, 64)
    sizes = {k: math.prod(s.shape) for k, s in param_specs(cfg).items()}
    with torch.device("meta"):  # shapes only: nothing allocated
        ref = transformers.Qwen3NextForCausalLM(transformers.AutoConfig.for_model(**hf))
    assert sum(sizes.values()) == sum(p.numel() for p in ref.parameters())
    experts = sum(n for k, n in sizes.items() if ".expert_" in k)
    active = sum(sizes.values()) - experts + experts * 10 // 512
    assert round(sum(sizes.values()) / 1e9) == 80 and round((active - sizes["embed"] - sizes["lm_head"]) / 1e9) == 3


@pytest.mark.slow
def test_cached_logits_equal_the_full_forward(converted):
    """A ragged prefill (5 and 40 tokens), a padded chunk (9 and 2 of 9), then one token at a time: every real
    token's logits equal the full forward's at its position, the linear layers carrying their state and convolution
    from call to call (the padded rows' unchanged), the full ones their keys/values. At 1e-4, the logits' contract
    with transformers, not test_decode.py's 1e-5: this tiny model's float32 noise is above 1e-5 without any cache
    (the training forward of the first 14 tokens alone differs from the 90-token one's by 1.7e-5 at a logit: sums
    in another order, amplified by the gated RMSNorm of small delta-rule outputs); the cached calls measured 1.2e-5
    and 1.3e-5 at most, and a wrong state or convolution carried over is off by orders more."""
    from zoo.model.decode import forward_cached_jit, init_cache

    _, _, _, model = converted
    cfg, params = model.cfg, model.param_dict()
    rows = random_tokens(cfg.vocab_size, batch=2, seq=90, seed=1)
    ref = np.asarray(model(jnp.asarray(rows)))
    cache = init_cache(cfg, 2, 96)
    done = np.zeros(2, int)
    for take in [(5, 40), (9, 2)] + [(1, 1)] * 6:
        t = 40 if max(take) > 9 else (9 if max(take) > 1 else 1)
        toks, valid = np.zeros((2, t), np.int32), np.zeros((2, t), bool)
        for r, n in enumerate(take):
            toks[r, :n], valid[r, :n] = rows[r, done[r]:done[r] + n], True
        logits, cache = forward_cached_jit(cfg, params, jnp.asarray(toks), cache, jnp.asarray(valid))
        for r, n in enumerate(take):
            np.testing.assert_allclose(np.asarray(logits)[r, :n], ref[r, done[r]:done[r] + n], atol=1e-4, rtol=0)
        done += take
    np.testing.assert_array_equal(np.asarray(cache.lengths), done)


@pytest.mark.slow
def test_greedy_kv_cache_decoding_equals_transformers_generate(converted):
    """Greedy decoding through the KV cache (a prefill, then one token a step) gives transformers' generate's
    tokens (its own cache: the recurrent and convolution states of transformers' linear layers). The calls have
    the shapes of test_cached_logits_equal_the_full_forward's (2 rows, 9 then 1 token, 96 slots): its programs."""
    hf, _, _, model = converted
    checks.assert_greedy_cached_equals_generate(hf, model)


@pytest.mark.slow
def test_the_inference_engine_carries_each_rows_state(converted):
    """`zoo generate`'s engine (eval.generate on the paged cache): three prompts on two sequence slots (the third
    takes the slot the first leaves, its state from zeros again), each row's linear-layer state in its own slot,
    each give transformers' greedy choices for that prompt alone (a prompt of 70 tokens: prefilled past a
    chunk)."""
    from eval.generate import GenerationConfig, generate

    hf, _, _, model = converted
    cfg, params = model.cfg, model.param_dict()
    rng = np.random.RandomState(4)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (3, 70, 11)]
    gen = GenerationConfig(max_new_tokens=8)
    together = generate(cfg, params, prompts, gen, max_seqs=2)
    assert len({tuple(x) for x in together}) == 3
    for p, got in zip(prompts, together):
        with torch.no_grad():
            logits = hf(torch.tensor([p + got])).logits[0]
        assert got == logits[len(p) - 1:len(p) + len(got) - 1].argmax(-1).tolist()


@pytest.mark.slow
def test_peft_loads_the_adapters_with_our_logits(converted, tmp_path):
    """Slow (the export, then peft + transformers): LoRA on the linear layers' in_proj_qkvz (q, k, v, z: one peft
    module over four zoo weights), in_proj_ba and out_proj, attention (q_proj: query and gate, one module) and the
    routed experts, exported with `zoo export --adapter`: peft loads every key and gives our logits (1e-4), which
    the adapter moves by far more. (peft rewrites gate_proj/up_proj/down_proj targets of a qwen3_next model to the
    fused routed experts, as for qwen3_moe: the dense MLP's and shared expert's adapters export merged only.)"""
    _, folder, ckpt, _ = converted
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj",
               "experts.gate_proj", "experts.up_proj", "experts.down_proj"]
    config = checks.assert_peft_loads_our_adapters(folder, ckpt, tmp_path, targets)
    assert {"in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj"} <= set(config["target_modules"])


# The smallest configs with every layer kind and projection the QLoRA check quantizes: Qwen3-Next a Gated DeltaNet
# layer with experts and the shared expert, then a gated full-attention layer with the dense MLP; Qwen3.5-MoE (its
# separate linear projections, interleaved M-RoPE) a linear and a full layer, experts on both. Two layers compile
# half the layer bodies of the four-layer models' (whose runs the logits and decoding tests scan).
QLORA_LAYERS = {"qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                   mlp_only_layers=[1]),
                "qwen3_5_moe": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])}


@pytest.mark.slow
@pytest.mark.parametrize("family", QLORA_LAYERS)
def test_qlora_gradients_equal_lora_on_the_dequantized_weights(family):
    """Slow (two compilations of the forward and its gradients): QLoRA with "all" targets (the linear layers'
    projections, attention and its output gate, the experts, the shared expert, Qwen3-Next's dense MLP) over NF4
    weights with double quantization: the loss and every adapter's gradient equal those of LoRA on the dequantized
    weights (1e-6, 1e-5), and every adapter gets a gradient (the conv's taps, decay and norms stay float).
    Qwen3.5-MoE (qwen3_5_moe: separate in_proj_qkv/z/b/a, converted to the same zoo weights) runs Qwen3-Next's
    code path, as is."""
    from zoo.lora.params import LoraConfig

    cfg = checks.tiny_config(family, **QLORA_LAYERS[family])
    assert cfg.kinds == ("linear", "full") and cfg.family == family
    assert [cfg.is_moe_layer(i) for i in (0, 1)] == [True, family == "qwen3_5_moe"]
    quantized = {"lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a", "lin_out", "attn_gate", "expert_gate",
                 "shared_gate"} | ({"gate"} if family == "qwen3_next" else set())
    lora, _ = checks.assert_qlora_equals_lora(cfg, LoraConfig(rank=4, alpha=8.0, targets="all"), 80, quantized)
    adapted = {name for stack in lora.values() for name in stack}  # Qwen3-Next's layer 1: the dense stack
    assert {"lin_q", "lin_z", "lin_b", "lin_a", "lin_out", "attn_gate"} <= adapted


def test_context_parallelism_and_flops_know_the_linear_layers(converted, monkeypatch):
    """A mesh that splits the sequence (mesh.context > 1) is refused in one line naming the linear layers; the
    FLOPs count the linear layers' chunked delta rule (per value head 2 x 64 x 8 + 3 x 8 x 12 + 1.5 x 64 x 12 =
    2464 multiply-adds a token, whatever the sequence) and softmax attention for the 2 full layers only."""
    from pretrain.flops import flops_per_token, linear_macs_per_token
    from zoo.errors import UserError
    from zoo.model import context

    cfg = converted[3].cfg
    monkeypatch.setattr(context, "context_size", lambda: 2)
    with pytest.raises(UserError, match=r"^mesh.context: 2 splits the sequence, but the linear-attention layers "
                                        r"\(0, 2\) carry a state along it and cannot run split; set mesh.context to 1$"):
        context.check_layers_split(cfg.kinds)
    assert linear_macs_per_token(cfg) == 4 * 2464
    # 128 more tokens a row: only the full layers' QK^T and PV grow (6 x 2 layers x 4 heads x 16 x 128).
    assert flops_per_token(cfg, 256) - flops_per_token(cfg, 128) == 6 * 2 * 64 * 128


def _byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 bytes in GPT-2's alphabet and ChatML's tokens (no merges)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, [], [1] * 256 + [3] * 3


def _gguf_tensors(state: dict, c) -> dict:
    """The tensors llama.cpp's Qwen3NextModel writes for a transformers checkpoint ``state`` (as saved: experts
    one by one): norms as w + 1 but the linear layers' gated one, the experts stacked [experts, out, in], the
    linear layers' in_proj_qkvz taken apart into q, k, v rows in blocks (attn_qkv) and z (attn_gate), the conv's
    taps squeezed, A_log as -exp(A_log), dt_bias as ssm_dt.bias."""
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"] + 1,
           "output.weight": state["lm_head.weight"]}
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
             "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.norm.weight": "ssm_norm.weight",
             "linear_attn.out_proj.weight": "ssm_out.weight", "linear_attn.dt_bias": "ssm_dt.bias",
             **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}}
    for i in range(c.num_hidden_layers):
        L = f"model.layers.{i}."
        for hf, g in names.items():
            if L + hf in state:
                x = state[L + hf]
                out[f"blk.{i}.{g}"] = x + 1 if hf.endswith("norm.weight") and "linear_attn" not in hf else x
        for p in ("gate", "up", "down"):
            out[f"blk.{i}.ffn_{p}_exps.weight"] = np.stack(
                [state[f"{L}mlp.experts.{j}.{p}_proj.weight"] for j in range(c.num_experts)])
        if L + "linear_attn.A_log" in state:
            w = state[L + "linear_attn.in_proj_qkvz.weight"].T.reshape(c.hidden_size, nk, -1)
            q, k, v, z = np.split(w, np.cumsum([dk, dk, nv // nk * dv])[:3], axis=-1)
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(
                [a.reshape(c.hidden_size, -1) for a in (q, k, v)], axis=-1).T.copy()
            out[f"blk.{i}.attn_gate.weight"] = z.reshape(c.hidden_size, -1).T.copy()
            out[f"blk.{i}.ssm_conv1d.weight"] = state[L + "linear_attn.conv1d.weight"][:, 0].copy()
            out[f"blk.{i}.ssm_a"] = -np.exp(state[L + "linear_attn.A_log"])
    return out


@pytest.mark.slow
def test_gguf_qwen3next_converts_as_the_safetensors_checkpoint(tmp_path):
    """Slow (two conversions and a forward's compilation). A tiny Qwen3-Next written as llama.cpp's ``qwen3next``
    file (convert_hf_to_gguf.py's Qwen3NextModel: its tensors as _gguf_tensors says, the linear layers' dims as its
    ssm.* keys, the full layers' interval, partial RoPE as rope.dimension_count; float32) converts to the
    safetensors conversion's parameters (bit for bit; to float32 rounding those the file stores transformed: the
    norms as w + 1, A_log as -exp(A_log)) and architecture, and so to transformers' logits."""
    import dataclasses

    import gguf
    from safetensors.numpy import load_file

    from tests.hf_models import make_hf
    from zoo.checkpoints.format import read_meta
    from zoo.checkpoints.readers import load_param_numpy

    tokens, merges, types = _byte_vocab()
    hf = make_hf(tmp_path / "hf", "qwen3_next", vocab_size=len(tokens), mlp_only_layers=[])
    c, state = hf.config, load_file(str(tmp_path / "hf" / "model.safetensors"))
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3next")
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_rope_freq_base, 10000.0),
                       (w.add_expert_count, c.num_experts), (w.add_expert_used_count, c.num_experts_per_tok),
                       (w.add_expert_feed_forward_length, c.moe_intermediate_size),
                       (w.add_expert_shared_feed_forward_length, c.shared_expert_intermediate_size),
                       (w.add_ssm_conv_kernel, c.linear_conv_kernel_dim), (w.add_ssm_state_size, c.linear_key_head_dim),
                       (w.add_ssm_group_count, c.linear_num_key_heads),
                       (w.add_ssm_time_step_rank, c.linear_num_value_heads),
                       (w.add_ssm_inner_size, c.linear_value_head_dim * c.linear_num_value_heads),
                       (w.add_full_attention_interval, 2), (w.add_rope_dimension_count, 4)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for name, x in _gguf_tensors(state, c).items():
        w.add_tensor(name, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    assert main(["convert", str(path), "--out", str(tmp_path / "from_gguf")]) == 0
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "from_hf")]) == 0
    params = read_meta(tmp_path / "from_hf")["params"]
    assert read_meta(tmp_path / "from_gguf")["params"].keys() == params.keys()
    for p in params:
        a, b = load_param_numpy(tmp_path / "from_gguf", p), load_param_numpy(tmp_path / "from_hf", p)
        if p.endswith("lin_a_log"):  # log(-(-exp(x))) in float32
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=p)
        elif p.endswith("norm") and not p.endswith("lin_norm"):  # (w + 1) - 1 in float32: within 1 + w's ulp
            np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-23, err_msg=p)
        else:
            np.testing.assert_array_equal(a, b, err_msg=p)
    a, b = zoo.read_config(tmp_path / "from_gguf"), zoo.read_config(tmp_path / "from_hf")
    assert (a.kinds, a.rope_dim, a.linear_value_head_dim) == (("linear", "full") * 2, 4, 12)
    # the file keeps its eps as float32 and no router loss coefficient (a training setting)
    assert dataclasses.replace(a, rms_norm_eps=b.rms_norm_eps, aux_loss_coef=b.aux_loss_coef) == b
    ids = random_tokens(len(tokens), seq=24)
    ref = hf_logits(hf, ids)
    got = np.asarray(zoo.load(tmp_path / "from_gguf")(jnp.asarray(ids)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6 and ref.std() > 0.5
