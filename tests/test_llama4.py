"""Llama 4 (text, llama4): its own traits against transformers' Llama4ForCausalLM. Logits, the export round trip, a
generated config, KV-cache decoding and the released configs' parameter counts are the shared MoE families' tests
(tests/test_families_2026_moe.py, tests/test_decode.py); the chunked attention kernel's own check is
tests/test_blockwise.py's. Here: where the layers' kinds, RoPE and experts sit; each trait changing the logits;
greedy decoding past two chunk boundaries equal to ``generate``; LoRA on every projection, QLoRA and expert
LoRA exported for peft."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from eval.generate import GenerationConfig, generate
from tests.hf_models import hf_logits, random_tokens
from tests.llama4_gguf import write_llama4_gguf
from tests.lora_fixtures import peft_logits_against_ours, write_adapter_checkpoint
from zoo.cli import main
from zoo.lora.params import LoraConfig

SEQ = 24  # three chunks of the tiny model's 8


@pytest.fixture(scope="module")
def tiny(tiny_family):
    """(transformers model, its saved folder, the zoo checkpoint) of tests/hf_models.py's tiny Llama 4."""
    hf, root = tiny_family("llama4")
    return hf, root / "hf", root / "zoo"


def test_layers_sit_where_transformers_puts_them():
    """Chunked and full layers, NoPE layers, the q/k norm and the MoE layers read from a config as transformers'
    own decoder layers are built (an interval and a step, then explicit lists)."""
    import transformers

    from zoo.model.from_hf import model_config_from_hf

    tiny = dict(vocab_size=16, hidden_size=8, intermediate_size=4, intermediate_size_mlp=8, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4, num_local_experts=2, num_experts_per_tok=1)
    for kw in (dict(num_hidden_layers=8, interleave_moe_layer_step=2, no_rope_layer_interval=4,
                    attention_chunk_size=16),
               dict(num_hidden_layers=5, moe_layers=[0, 3, 4], no_rope_layers=[0, 1, 1, 0, 1], use_qk_norm=False,
                    attention_chunk_size=None)):
        config = transformers.Llama4TextConfig(**tiny, **kw)
        hf = transformers.Llama4ForCausalLM(config)
        cfg = model_config_from_hf({**config.to_dict(), "architectures": ["Llama4ForCausalLM"]})
        layers = hf.model.layers
        assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [layer.is_moe_layer for layer in layers]
        assert [i not in cfg.nope_layers for i in range(cfg.num_layers)] == [bool(la.self_attn.use_rope)
                                                                             for la in layers]
        assert cfg.qk_l2_norm == any(hasattr(la.self_attn, "qk_norm") for la in layers)
        want = ["chunked" if t == "chunked_attention" else "full" for t in config.layer_types]
        assert list(cfg.kinds) == want and ("chunked" in want) == bool(kw["attention_chunk_size"])
        assert cfg.intermediate_size == 8 and cfg.moe_intermediate_size == 4 and cfg.shared_experts == 1


@pytest.mark.slow
def test_each_trait_changes_the_logits(tiny):
    """Slow (four more compilations): the parity test has teeth: the tiny model without its chunks, its query
    temperature, its q/k norm, or with the router weight on the experts' outputs instead of their inputs gives
    logits that differ from transformers' by far more than the parity bound (1e-4)."""
    hf, _, ckpt = tiny
    model = zoo.load(ckpt)
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    ref = hf_logits(hf, tokens)
    full = dict(layer_types=None, attention_chunk_size=None)
    # jitted: one program a variant (eagerly, each variant's layer scans and many ops compiled apart)
    forward = jax.jit(zoo.model.decoder.forward, static_argnums=0)
    for change in (full, dict(temperature_tuning=False), dict(qk_l2_norm=False), dict(router_scales_input=False)):
        cfg = dataclasses.replace(model.cfg, **change)
        got = np.asarray(forward(cfg, model.param_dict(), jnp.asarray(tokens)))
        assert np.abs(got - ref).max() > 1e-2, change


@pytest.mark.slow
def test_greedy_decoding_equals_generate(tiny):
    """Slow (generate's prefill and step programs): a 5-token prompt and 14 new tokens cross two chunk boundaries
    (positions 8 and 16) and the NoPE layers' temperature steps (every 4 positions); the KV cache's chunked rings
    hold 8 slots. transformers' ``generate`` (its own chunked cache) chooses the same tokens."""
    hf, _, ckpt = tiny
    model = zoo.load(ckpt)
    prompt = random_tokens(hf.config.vocab_size, seq=5, seed=3)[0].tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])  # its own attention mask: the prompt holds token 0, generate's pad id
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert generate(model.cfg, model.param_dict(), [prompt], GenerationConfig(max_new_tokens=14))[0] == want


# Every projection of the text model: attention (q, k, v, o), the dense layer's MLP and the shared expert (gate,
# up, down), the routed experts (peft's target_parameters on feed_forward.experts.gate_up_proj / down_proj).
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
               "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj",
               "experts.gate_proj", "experts.up_proj", "experts.down_proj"]


@pytest.mark.slow
def test_peft_loads_the_adapters_with_our_logits(tiny, tmp_path):
    """Slow (the export, then peft + transformers): LoRA on every projection, the routed experts' too, exported
    with `zoo export --adapter`: peft loads every key (q/k's B rows put back in the checkpoint's RoPE pairs) and
    gives our logits (1e-4), which the adapter moves by far more."""
    _, folder, ckpt = tiny
    adapter = write_adapter_checkpoint(ckpt, tmp_path / "adapter", LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS))
    assert main(["export", str(adapter), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(config["target_modules"])
    diff, teeth = peft_logits_against_ours(folder, adapter, tmp_path / "peft")
    assert teeth > 0.1 and diff <= 1e-4, (diff, teeth)


@pytest.mark.slow
def test_qlora_gradients_equal_lora_on_the_dequantized_weights():
    """Slow (two compilations of the forward and its gradients): QLoRA over two layers of the tiny model's layout,
    every projection (experts, shared expert, dense MLP, attention) quantized to NF4 with double quantization: the
    loss and every adapter's gradient equal those of LoRA on the dequantized weights (1e-6, 1e-5); the adapters get
    gradients."""
    from tests.family_checks import assert_qlora_equals_lora, tiny_config

    # Two layers of the tiny model's layout: a chunked MoE layer (experts, shared expert), then a full NoPE layer
    # with the dense MLP (the four-layer model compiles twice the layer bodies; the adapters' kinds are these).
    cfg = tiny_config("llama4", num_hidden_layers=2, moe_layers=[0])
    assert cfg.kinds == ("chunked", "full") and cfg.nope_layers == (1,) and cfg.is_moe_layer(0)
    assert not cfg.is_moe_layer(1)
    assert_qlora_equals_lora(cfg, LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS), SEQ, {
        "expert_gate", "expert_up", "expert_down", "shared_gate", "q", "gate"})


@pytest.mark.slow
def test_the_hubs_multimodal_checkpoint_converts_its_language_model(tmp_path):
    """Slow (a conversion, a compilation and an export): the Hub's Llama 4 releases are Llama4ForConditionalGeneration
    (the text model under ``language_model.``): `zoo convert --text-only` takes its language model (saying what it
    leaves out), whose logits are transformers' language model's, and exports it as a Llama4ForCausalLM that
    transformers loads with the same logits. (The whole model, tower included: tests/test_vlm_llama4.py.)"""
    import transformers

    from tests.hf_models import BASE, FAMILIES, randomize

    text = transformers.Llama4TextConfig(**{**BASE, **FAMILIES["llama4"][2]})
    vision = transformers.Llama4VisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=16,
                                             projector_input_dim=16, projector_output_dim=16)
    torch.manual_seed(0)
    whole = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    randomize(whole)
    whole.save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo"), "--text-only"]) == 0
    lm = whole.language_model
    lm.config._attn_implementation = "eager"
    tokens = random_tokens(text.vocab_size, seq=SEQ)
    ref = hf_logits(lm, tokens)
    assert np.abs(np.asarray(zoo.load(tmp_path / "zoo")(jnp.asarray(tokens))) - ref).max() <= 1e-4
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    np.testing.assert_array_equal(hf_logits(back, tokens), ref)


@pytest.mark.slow
def test_the_engine_answers_greedily_past_the_chunks():
    """Slow (the engine's programs): the inference engine (paged KV cache, continuous batching) on a Llama 4-like
    model (a chunked layer of 8, a NoPE layer with the query temperature, the q/k norm): answers up to 35 tokens
    long, past four chunk boundaries, are each the training forward's greedy continuation of its prompt."""
    from functools import partial

    from flax import nnx

    from eval.engine.api import SamplingParams
    from eval.engine.engine import Engine
    from zoo.model.config import ModelConfig
    from zoo.model.decoder import Decoder, forward

    cfg = ModelConfig(family="llama4", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, layer_types=("chunked", "full"),
                      attention_chunk_size=8, nope_layers=(1,), temperature_tuning=True, temperature_floor=4.0,
                      temperature_scale=0.5, qk_l2_norm=True)
    # larger weights: continuations differ from prompt to prompt (as tests/test_engine.py's); drawn in one program
    # (eagerly, each weight's initializer and scaling compiled per shape)
    params = jax.jit(lambda: jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x,
                                          Decoder(cfg, rngs=nnx.Rngs(0)).param_dict()))()
    engine = Engine(cfg, params, max_len=64, page_size=8, max_seqs=4)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 64, n).tolist() for n in (3, 11, 20, 1, 9)]
    ids = [engine.submit(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, (13, 9, 15, 17, 4))]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.busy:
        for e in engine.step():
            out[e.request_id].extend(e.tokens)
    # The training forward of every answer in one batch, right-padded (one program, not one a length): causal
    # attention, so each row's real positions see only themselves.
    seqs = [p + out[i] for p, i in zip(prompts, ids, strict=True)]
    rows = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for r, seq in enumerate(seqs):
        rows[r, :len(seq)] = seq
    logits = np.asarray(jax.jit(partial(forward, cfg))(params, jnp.asarray(rows)))
    for r, (p, i) in enumerate(zip(prompts, ids, strict=True)):
        assert logits[r, len(p) - 1:len(seqs[r]) - 1].argmax(-1).tolist() == out[i]
    assert len({tuple(a) for a in out.values()}) == len(ids)


@pytest.mark.slow
def test_gguf_llama4_converts_as_the_safetensors_checkpoint(tmp_path):
    """Slow (two conversions, about 4 s): a tiny Llama 4 text model of the released layout llama.cpp's graph
    assumes (MoE on every second layer, NoPE every fourth, chunks of 8192, the attention temperature's floor 8192
    and scale 0.1, q/k norms: its expert count is not 128) written as llama.cpp's ``llama4`` file converts to the
    safetensors conversion's parameters, bit for bit, and architecture (a file with Scout's llama3 RoPE scaling:
    tests/test_gguf_rope_freqs.py). Its tokenizer splits as Llama 4's (``tokenizer.ggml.pre`` ``llama4``: GPT-4o's
    split, digits in threes): "12345" is "123" and "45", where GPT-2's split would keep the digits whole (and merge
    "1234")."""
    import dataclasses

    from safetensors.numpy import load_file

    from tests.hf_models import make_hf
    from zoo.checkpoints.format import read_meta
    from zoo.checkpoints.readers import load_param_numpy

    # the tiny vocabulary: digits and their merges up to "1234", then one filler token an id
    tokens = ["1", "2", "3", "4", "5", "12", "123", "1234"] + [chr(0x100 + i) for i in range(88)]
    merges = ["1 2", "12 3", "123 4"]
    hf = make_hf(tmp_path / "hf", "llama4", moe_layers=None, interleave_moe_layer_step=2, no_rope_layer_interval=4,
                 attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1)
    c, state = hf.config, load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert c.moe_layers == [1, 3] and c.no_rope_layers == [1, 1, 1, 0]
    write_llama4_gguf(tmp_path / "tiny.gguf", c, state, tokens, merges)
    assert main(["convert", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "from_gguf")]) == 0
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "from_hf")]) == 0
    params = read_meta(tmp_path / "from_hf")["params"]
    assert read_meta(tmp_path / "from_gguf")["params"].keys() == params.keys()
    assert any(".expert_gate" in p for p in params) and any(".shared_down" in p for p in params)
    for p in params:
        np.testing.assert_array_equal(load_param_numpy(tmp_path / "from_gguf", p),
                                      load_param_numpy(tmp_path / "from_hf", p))
    a, b = zoo.read_config(tmp_path / "from_gguf"), zoo.read_config(tmp_path / "from_hf")
    assert a.family == "llama4" and a.layer_types == b.layer_types
    assert dataclasses.replace(a, rms_norm_eps=b.rms_norm_eps) == b  # the file keeps its eps as float32
    from zoo.data.tokenizer import load_tokenizer

    assert load_tokenizer(tmp_path / "from_gguf")("12345", add_special_tokens=False)["input_ids"] == [6, 3, 4]
