"""SmolLM3 (NoPE layers), OLMo 2/3 (post-norm blocks, full-width q/k norms, OLMo 3's sliding layers) and Phi-3/Phi-4
(fused qkv_proj/gate_up_proj, partial rotary, LongRoPE) against transformers, round trips, and the released configs.

Greedy KV-cache decoding of the tiny models against transformers' greedy choices runs in test_decode (its families are
tests.hf_models.FAMILIES); here, the one case it does not reach: LongRoPE switching factors mid-generation."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from convert.export import planned_files
from eval.generate import GenerationConfig, generate
from tests.hf_models import FAMILIES, beside, hf_logits, hf_tensors, make_hf, mean_kl, random_tokens
from zoo.cli import main
from zoo.model.decoder import forward

DENSE_2026 = ["smollm3", "olmo2", "olmo3", "phi3"]
SEQ = 40  # past OLMo 3's sliding window (7) and Phi-3's original_max_position_embeddings (24): its long factors


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_family):
    """family -> (transformers model, its folder: hf/, the converted zoo/, and room for outputs), made once
    (conftest.py's tiny_family)."""
    made = {}

    def get(family):
        if family not in made:
            hf, shared = tiny_family(family)
            made[family] = hf, beside(shared, tmp_path_factory.mktemp(family))
        return made[family]

    return get


@pytest.mark.parametrize("family", DENSE_2026)
def test_logits_match_transformers(converted, family):
    hf, root = converted(family)
    cfg = zoo.read_config(root / "zoo")
    assert cfg.family == family
    model = zoo.load(root / "zoo")
    # Phi-3 also at 20 tokens: LongRoPE's short factors (the furthest position is below 24).
    for seq in (SEQ, 20) if family == "phi3" else (SEQ,):
        tokens = random_tokens(hf.config.vocab_size, seq=seq)
        ref = hf_logits(hf, tokens)
        got = np.asarray(model(jnp.asarray(tokens)))
        assert np.abs(got - ref).max() <= 1e-4
        assert mean_kl(ref, got) <= 1e-6
        assert ref.std() > 0.5


@pytest.mark.parametrize("family", DENSE_2026)
def test_round_trip_is_bit_identical(converted, family):
    _, root = converted(family)
    assert main(["export", str(root / "zoo"), "--out", str(root / "back")]) == 0
    assert hf_tensors(root / "hf") == hf_tensors(root / "back")  # Phi-3: qkv_proj, gate_up_proj fused again
    shards = {n: size for n, size in planned_files(root / "zoo") if n.endswith(".safetensors")}
    assert shards == {n: (root / "back" / n).stat().st_size for n in shards}  # the dry run's sizes: the fused ones
    a = json.loads((root / "hf" / "config.json").read_text())
    b = json.loads((root / "back" / "config.json").read_text())
    assert {k: v for k, v in a.items() if "dtype" not in k} == {k: v for k, v in b.items() if "dtype" not in k}


@pytest.mark.parametrize("family", DENSE_2026)
def test_generated_config_reproduces_the_model(converted, family):
    """Without the source config.json, export writes one from the zoo config; transformers builds the same model."""
    import shutil

    from transformers import AutoModelForCausalLM

    hf, root = converted(family)
    shutil.copytree(root / "zoo", root / "bare", ignore=shutil.ignore_patterns("hf_config.json"))
    assert main(["export", str(root / "bare"), "--out", str(root / "bare_back")]) == 0
    # Token ids are not architecture: a config generated from the model alone has the class defaults (SmolLM3's
    # pad id 128004, past the tiny vocabulary, which torch refuses), so the source's are put back.
    gen, src = (json.loads((root / d / "config.json").read_text()) for d in ("bare_back", "hf"))
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    (root / "bare_back" / "config.json").write_text(json.dumps({**gen, **{k: src.get(k) for k in ids}}))
    back = AutoModelForCausalLM.from_pretrained(str(root / "bare_back"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    assert type(back).__name__ == FAMILIES[family][1]
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


def test_the_traits_matter(converted):
    """Guards the parity tests: switching off NoPE, the full-width q/k norm or LongRoPE's long factors changes
    the logits at SEQ (so parity with them on is no accident)."""
    for family, change in (("smollm3", dict(nope_layers=())), ("olmo2", dict(qk_norm_span="head")),
                           ("phi3", "short")):
        _, root = converted(family)
        model = zoo.load(root / "zoo")
        cfg, params = model.cfg, model.param_dict()
        if change == "short":  # the short factors at every length
            change = dict(rope=dataclasses.replace(cfg.rope, original_max_position_embeddings=SEQ))
        tokens = jnp.asarray(random_tokens(cfg.vocab_size, seq=SEQ))
        # The model as it is: test_logits_match_transformers's program (same shapes), compiled once.
        diff = np.abs(np.asarray(model(tokens)) - np.asarray(forward(dataclasses.replace(cfg, **change), params, tokens)))
        assert diff.max() > 1e-2, family


def test_longrope_switches_factors_mid_generation(tmp_path):
    """Phi-3 with original_max_position_embeddings 10: a 5-token prompt and 12 new tokens pass it, so
    transformers ropes the later tokens (and their cached keys) with the long factors, the earlier ones
    with the short: greedy decoding over the KV cache gives its tokens."""
    hf = make_hf(tmp_path / "hf", "phi3", original_max_position_embeddings=10,
                 rope_parameters={**FAMILIES["phi3"][2]["rope_parameters"], "original_max_position_embeddings": 10})
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    model = zoo.load(tmp_path / "zoo")
    prompt = random_tokens(model.cfg.vocab_size, batch=1, seq=5, seed=2)[0].tolist()
    got = generate(model.cfg, model.param_dict(), [prompt], GenerationConfig(max_new_tokens=12))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, 5:].tolist()
    assert got == ref


def test_fused_tensor_of_the_wrong_size_is_one_line(tmp_path, capsys):
    make_hf(tmp_path / "hf", "phi3")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "'model.layers.0.mlp.gate_up_proj.weight' has shape (224, 64) but the config implies 200 rows" in err
    assert not (tmp_path / "zoo").exists()


def test_peft_export_of_fused_projections_loads_in_peft_with_our_logits(converted, tmp_path):
    """Phi-3's q/k/v and gate/up are one Linear each in transformers: the parts' adapters export as one adapter of
    rank 2 x parts adapted (A stacked, B block-diagonal; k has none here, so its rows of lora_B are zero) with rank
    and alpha patterns keeping alpha / r. peft 0.21 loads every key and gives our merged forward's logits; parts
    stored in different dtypes cannot be one module's adapter without --dtype (one line)."""
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from convert.peft import adapter_meta_of
    from convert.peft_plan import plan_adapter
    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.errors import UserError
    from zoo.lora.params import LoraConfig

    hf, root = converted("phi3")
    lora = LoraConfig(rank=2, alpha=3.0, targets=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"])
    adapter = write_adapter_checkpoint(root / "zoo", tmp_path / "lora", lora)
    assert main(["export", str(adapter), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["o_proj", "gate_up_proj", "qkv_proj"]
    assert config["rank_pattern"] == {"qkv_proj": 4, "gate_up_proj": 4}
    assert config["alpha_pattern"] == {"qkv_proj": 6, "gate_up_proj": 6}
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    qkv_b = saved["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    q, kv = hf.config.num_attention_heads * 16, hf.config.num_key_value_heads * 16
    assert qkv_b.shape == (q + 2 * kv, 4) and not qkv_b[q:q + kv].any() and qkv_b[q + kv:, 2:].any()

    base = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32,
                                                attn_implementation="eager").eval()
    model = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    result = model.load_adapter(str(tmp_path / "peft"), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    tokens = random_tokens(hf.config.vocab_size, seq=20)
    ours = np.asarray(zoo.load(adapter)(jnp.asarray(tokens)))
    with model.disable_adapter():
        assert np.abs(hf_logits(model, tokens) - ours).max() > 0.1  # the adapters matter: the check has teeth
    assert np.abs(hf_logits(model, tokens) - ours).max() <= 1e-4

    meta = adapter_meta_of(adapter)
    meta["lora"]["params"]["layers.v.a"]["dtype"] = "bfloat16"
    with pytest.raises(UserError, match=r"layers.q, layers.v have dtypes \['bfloat16', 'float32'\] but peft adapts "
                                        r"qkv_proj as one module; export with --dtype"):
        plan_adapter(adapter, meta)


# Registry name -> (published parameter count, what its config must give).
RELEASED = {
    "smollm3-3b": (3.08e9, dict(nope_layers=tuple(range(3, 36, 4)), tie_word_embeddings=True)),
    "olmo-2-7b": (7.30e9, dict(pre_norms=False, post_norms=True, qk_norm_span="all")),
    "olmo-2-13b": (13.7e9, dict(pre_norms=False, qk_norm_span="all")),
    "olmo-3-7b": (7.30e9, dict(pre_norms=False, qk_norm_span="all", sliding_window=4096,
                               layer_types=("sliding", "sliding", "sliding", "full") * 8)),
    "phi-4": (14.7e9, dict(num_kv_heads=10, rope_dim=128)),
    "phi-4-mini": (3.84e9, dict(rope_dim=96, num_kv_heads=8, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_configs(name):
    """Each registry entry's released config: the model's size as published, its traits, and the config.json
    export generates for it from the model alone: every field as transformers' own config class gives it for
    the released one, and the RoPE transformers reads from it the released one's. (Left out: the token ids and
    SmolLM3's pretraining_tp, which no model reads; the RoPE's spelling, which the releases give in an older
    format.)"""
    from transformers import AutoConfig

    from convert.hf_config import export_hf_config
    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import count_params
    from zoo.registry.catalogue import REGISTRY

    entry = REGISTRY[name]
    published, traits = RELEASED[name]
    cfg = model_config_from_hf(entry.hf_config)
    assert cfg.family == entry.family
    assert count_params(cfg) == pytest.approx(published, rel=0.01)
    for field, value in traits.items():
        assert getattr(cfg, field) == value, field
    skip = {"architectures", "model_type", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id"}
    ref = AutoConfig.for_model(entry.hf_config["model_type"],
                               **{k: v for k, v in entry.hf_config.items() if k not in skip}).to_diff_dict()
    ours = export_hf_config(cfg, None, "bfloat16")
    # Phi-4-mini's release also spells partial_rotary_factor at the top level, its older place (rope_parameters
    # holds it, compared below).
    drop = skip | {"dtype", "transformers_version", "pretraining_tp", "rope_parameters", "partial_rotary_factor"}
    assert {k: v for k, v in ours.items() if k not in drop} == {k: v for k, v in ref.items() if k not in drop}
    rope = AutoConfig.for_model(ours["model_type"], **{k: v for k, v in ours.items() if k not in skip}).rope_parameters
    assert _rope_values(rope) == _rope_values(ref["rope_parameters"])


def _rope_values(params: dict) -> dict:
    """RoPE parameters by value: numbers as floats, transformers' defaults (YaRN's beta_fast 32, beta_slow 1)
    filled in, the legacy ``type`` key (``rope_type``'s old name) dropped."""
    if "full_attention" in params:
        return {k: _rope_values(v) for k, v in params.items()}
    out = {"beta_fast": 32.0, "beta_slow": 1.0} if params.get("rope_type") == "yarn" else {}
    for k, v in params.items():
        if k != "type":
            out[k] = [float(x) for x in v] if isinstance(v, list) else float(v) if isinstance(v, int | float) else v
    return out
