"""Qwen3.5 (qwen3_5 dense, qwen3_5_moe) in the one decoder, against transformers: logits over several delta-rule
chunks with both layer kinds, the export round trip and a generated config, greedy KV-cache decoding, the Hub's
multimodal checkpoints' language model, the released 35B-A3B config's parameter count, and LoRA on the separate
linear projections exported for peft. (QLoRA on the MoE model: tests/test_qwen3_next.py's QLoRA check, parametrised
by family.)

The tiny models (tests/hf_models.py FAMILIES) have Gated DeltaNet layers 0 and 2 (separate in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a) and gated full-attention layers 1 and 3 with interleaved multimodal RoPE on half the head;
dense MLPs (qwen3_5) or 4 experts (top 2) and a gated shared expert on every layer (qwen3_5_moe).
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests import family_checks as checks
from tests.hf_models import FAMILIES, hf_logits, hf_tensors, mean_kl, random_tokens
from zoo.cli import main

SEQ = 150  # three chunks of the delta rule's 64, the last one partial
QWEN35 = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=QWEN35)
def converted(request, tiny_family):
    """(transformers model, its saved folder, the zoo checkpoint, the loaded zoo model), shared read-only."""
    return checks.converted(tiny_family, request.param)


def test_logits_match_transformers(converted):
    hf, _, _, model = converted
    assert model.cfg.kinds == ("linear", "full", "linear", "full")
    assert model.cfg.rope.mrope_section == (2, 1, 1) and model.cfg.rope.mrope_interleaved
    assert bool(model.cfg.num_experts) == (model.cfg.family == "qwen3_5_moe")
    checks.assert_logits_match(hf, model, SEQ)


def test_round_trip_is_bit_identical(converted, tmp_path):
    _, folder, ckpt, _ = converted
    checks.assert_round_trip(folder, ckpt, tmp_path / "back")


def test_generated_config_reproduces_the_model(converted, tmp_path):
    """Without the source config.json, export writes one from the zoo config; transformers builds the same model
    (the same class, every field of the source's config class that shapes the model, the same logits)."""
    hf, _, ckpt, model = converted
    back = checks.exported_from_generated_config(ckpt, tmp_path)
    assert type(back).__name__ == FAMILIES[model.cfg.family][1]
    assert back.config.rope_parameters["mrope_section"] == [2, 1, 1]
    assert back.config.layer_types == hf.config.layer_types
    tokens = random_tokens(hf.config.vocab_size, seq=24)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


def test_released_config_counts_as_transformers():
    """qwen3.5-35b-a3b's registry config: 40 layers (30 linear, every 4th full), 256 experts (8 a token) and a shared
    expert; its parameter count is transformers' for the same config (built on the meta device: nothing allocated):
    34.7B in all (the card's 35B), 3.5B active (the card's A3B), 2.4B of them outside the embedding and the head."""
    import transformers

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import param_specs
    from zoo.registry.catalogue import get, hf_config_of

    hf = hf_config_of("qwen3.5-35b-a3b", "model")["text_config"]  # the whole VLM's language model
    assert get("qwen3.5-35b-a3b").family == "qwen3_5_moe"
    cfg = model_config_from_hf(hf, "qwen3.5-35b-a3b")
    assert cfg.kinds == ("linear", "linear", "linear", "full") * 10
    assert (cfg.num_experts, cfg.experts_per_token, cfg.shared_experts, cfg.rope_dim) == (256, 8, 1, 64)
    assert cfg.rope.mrope_section == (11, 11, 10) and cfg.router_norm_topk
    sizes = {k: math.prod(s.shape) for k, s in param_specs(cfg).items()}
    with torch.device("meta"):  # shapes only: nothing allocated
        ref = transformers.Qwen3_5MoeForCausalLM(transformers.AutoConfig.for_model(**hf))
    assert sum(sizes.values()) == sum(p.numel() for p in ref.parameters())
    experts = sum(n for k, n in sizes.items() if ".expert_" in k)
    active = sum(sizes.values()) - experts + experts * 8 // 256
    assert round(sum(sizes.values()) / 1e8) == 347 and round(active / 1e8) == 35
    assert round((active - sizes["embed"] - sizes["lm_head"]) / 1e8) == 24


@pytest.mark.slow
def test_greedy_kv_cache_decoding_equals_transformers_generate(converted):
    """Greedy decoding through the KV cache (a prefill of a ragged pair of rows, then one token a step) gives
    transformers' generate's tokens (its own cache: the recurrent and convolution states of its linear layers)."""
    hf, _, _, model = converted
    checks.assert_greedy_cached_equals_generate(hf, model)


def _fuse_experts_as_the_hub(folder, num_experts: int) -> None:
    """Rewrite a saved Qwen3.5-MoE's experts (one by one, as save_pretrained writes them) as the Hub's files hold
    them: per layer ``mlp.experts.gate_up_proj`` [experts, 2 x mlp, embed] (gate rows, then up) and
    ``mlp.experts.down_proj`` [experts, embed, mlp]; and add two tensors of a multi-token-prediction layer under
    ``mtp.``, as the Hub's files have (transformers builds no such module)."""
    import re

    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in sorted({m.group(1) for k in state if (m := re.match(r"(.*\.mlp\.experts)\.0\.", k))}):
        w = {p: [state[f"{layer}.{j}.{p}_proj.weight"] for j in range(num_experts)] for p in ("gate", "up", "down")}
        out[f"{layer}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(w["gate"], w["up"])])
        out[f"{layer}.down_proj"] = torch.stack(w["down"])
    assert len(out) < len(state)
    hidden = state["lm_head.weight"].shape[1]
    out.update({"mtp.fc.weight": torch.zeros(hidden, 2 * hidden), "mtp.norm.weight": torch.zeros(hidden)})
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.parametrize("family", QWEN35)
def test_multimodal_checkpoint_converts_its_language_model(family, tmp_path, capfd):
    """The Hub's releases are Qwen3_5(Moe)ForConditionalGeneration: `zoo convert --text-only` takes the language
    model under model.language_model. (the head at the top; the MoE's experts fused per layer, as the Hub's files
    hold them), leaves the vision tower out with a one-line note, and gives the multimodal model's own logits on text
    (its text positions: all three M-RoPE axes alike); `zoo export` writes the text-only *ForCausalLM (the experts
    fused as read), which transformers loads with those logits. (The whole VLM: tests/test_vlm_qwen35.py.)"""
    import transformers

    from tests.hf_models import BASE, randomize

    text = FAMILIES[family]
    top = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
           "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}[family]
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    config = getattr(transformers, top[0])(text_config={**BASE, **text[2]}, vision_config=vision)
    hf = getattr(transformers, top[1])(config).eval()
    hf.config._attn_implementation = "eager"
    randomize(hf)
    hf.save_pretrained(tmp_path / "hf")
    if family == "qwen3_5_moe":
        _fuse_experts_as_the_hub(tmp_path / "hf", config.text_config.num_experts)
    capfd.readouterr()
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo"), "--text-only"]) == 0
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note:")]
    visual = sum(name.startswith("model.visual.") for name in hf.state_dict())
    mtp = "; so is the multi-token-prediction layer (2 tensors under mtp.)" if family == "qwen3_5_moe" else ""
    assert notes == [f"note: {tmp_path / 'hf'} is multimodal: converting its language model; the vision tower and "
                     f"projector ({visual} tensors) are left out{mtp}"]
    model = zoo.load(tmp_path / "zoo")
    assert model.cfg.family == family and model.cfg.vision is None
    tokens = random_tokens(BASE["vocab_size"], seq=80)
    ref = hf_logits(hf, tokens)
    got = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6 and ref.std() > 0.5
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    assert type(back).__name__ == text[1]
    if family == "qwen3_5_moe":
        assert "model.layers.0.mlp.experts.gate_up_proj" in hf_tensors(tmp_path / "back")
    assert np.abs(hf_logits(back, tokens) - ref).max() <= 1e-4


@pytest.mark.slow
def test_peft_loads_the_adapters_with_our_logits(tiny_family, tmp_path):
    """Slow (the export, then peft + transformers): LoRA on the MoE model's linear layers' in_proj_qkv (q, k, v:
    one peft module over three zoo weights), in_proj_z, in_proj_b, in_proj_a and out_proj, attention (q_proj: query
    and gate, one module) and the routed experts, exported with `zoo export --adapter`: peft loads every key and
    gives our logits (1e-4), which the adapter moves by far more."""
    _, root = tiny_family("qwen3_5_moe")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "out_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj"]
    config = checks.assert_peft_loads_our_adapters(root / "hf", root / "zoo", tmp_path, targets)
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj"} <= set(
        config["target_modules"])
