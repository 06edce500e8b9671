"""`zoo export`: HF -> zoo -> HF is lossless, transformers loads it, bad input is refused cleanly."""

import json

import pytest
import torch
from safetensors import safe_open

from tests.hf_models import hf_tensors, make_llama
from tests.processes import kill_midway
from zoo.cli import main
from zoo.model.from_hf import model_config_from_hf

# Config fields that change what the model computes (and how it is identified).
FORWARD_FIELDS = [
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "rope_parameters", "rope_scaling",
    "rope_theta", "bos_token_id", "eos_token_id",
]

FAMILY_MODELS = {
    "llama-gqa-rope-scaling": lambda d: make_llama(d, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-tied-bias-headdim": lambda d: make_llama(d, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=24),
    "llama-bf16-sharded": lambda d: make_llama(d, dtype=torch.bfloat16, save_kwargs={"max_shard_size": "40KB"}),
}


def _config(folder):
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_round_trip_is_bit_identical(tmp_path, family):
    FAMILY_MODELS[family](tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    src, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(src) == sorted(back)
    for name in src:
        assert src[name][0] == back[name][0], name
        assert src[name][1] == back[name][1], name
    a, b = _config(tmp_path / "hf"), _config(tmp_path / "back")
    for k in FORWARD_FIELDS:
        assert a.get(k) == b.get(k), k
    assert model_config_from_hf(a) == model_config_from_hf(b)


def test_transformers_loads_export_without_missing_or_unexpected_keys(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = make_llama(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back"), "--max-shard-size", "60KB"]) == 0
    back = tmp_path / "back"
    assert (back / "model.safetensors.index.json").is_file()
    assert (back / (f"model-00001-of-{len(list(back.glob('model-*.safetensors'))):05d}.safetensors")).is_file()
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in back.glob("model-*.safetensors")}
    # The loading info is what transformers' "not used" / "newly initialized" warnings report.
    model, info = AutoModelForCausalLM.from_pretrained(str(back), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model.config._attn_implementation = hf.config._attn_implementation
    tokens = torch.arange(20).reshape(1, 20)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, hf(tokens).logits)
    for f in ("config.json", "generation_config.json", "README.md"):
        assert (back / f).is_file()
    card = (back / "README.md").read_text()
    assert "AutoModelForCausalLM.from_pretrained" in card and "lossless" in card


@pytest.mark.slow
def test_smollm2_export_has_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from zoo.registry.catalogue import bundled_gguf as smollm2_gguf

    assert main(["convert", str(smollm2_gguf()), "--out", str(tmp_path / "zoo"), "--dtype", "bfloat16"]) == 0
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "hf")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in text
    cfg = _config(tmp_path / "hf")
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as fh:
        assert fh.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16


def test_export_dtype_cast(tmp_path):
    make_llama(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "b"), "--dtype", "bfloat16"]) == 0
    assert {d for d, _ in hf_tensors(tmp_path / "b").values()} == {"torch.bfloat16"}
    assert _config(tmp_path / "b").get("torch_dtype", _config(tmp_path / "b").get("dtype")) == "bfloat16"


def _err(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["export", str(tmp_path / "x"), "--out", str(tmp_path / "o")]) == 2
    err = _err(capsys)
    assert len(err) == 1 and "not a zoo checkpoint" in err[0]
    assert not (tmp_path / "o").exists()


def test_newer_format_version(tmp_path, capsys):
    make_llama(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    meta = json.loads((tmp_path / "zoo" / "model.json").read_text())
    meta["format_version"] = 99
    (tmp_path / "zoo" / "model.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "o")]) == 2
    err = _err(capsys)
    assert len(err) == 1 and "format version 99" in err[0] and "upgrade" in err[0]
    assert not (tmp_path / "o").exists()


def test_output_not_empty_needs_overwrite(tmp_path, capsys):
    make_llama(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("old")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "zoo"), "--out", str(out)]) == 2
    err = _err(capsys)
    assert len(err) == 1 and "not empty" in err[0] and "add --overwrite to replace it" in err[0]
    assert (out / "old.txt").is_file()
    assert main(["export", str(tmp_path / "zoo"), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()


def test_killed_export_leaves_nothing_that_looks_complete(tmp_path):
    make_llama(tmp_path / "hf", hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=4096)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    out = tmp_path / "o"
    assert kill_midway(["export", str(tmp_path / "zoo"), "--out", str(out), "--max-shard-size", "1MB"], tmp_path,
                       ".o.incomplete-*/model-*"), "export never started writing"
    assert not out.exists()
    assert main(["export", str(tmp_path / "zoo"), "--out", str(out)]) == 0
    assert not list(tmp_path.glob(".o.incomplete-*"))


@pytest.mark.parametrize("path", ["row-blocks", "orbax-fallback"])
def test_streaming_read_paths_are_bit_identical(tmp_path, monkeypatch, path):
    """The big-model code paths on a tiny model: embeddings/lm_head in row blocks, and
    the Orbax restore used for checkpoints that TensorStore cannot open directly."""
    import convert.export
    import zoo.checkpoints.readers

    if path == "row-blocks":
        monkeypatch.setattr(convert.export, "_BLOCK_BYTES", 1000)  # a few rows per block
    else:
        monkeypatch.setattr(zoo.checkpoints.readers.ParamReader, "_open_store", lambda self: None)
    make_llama(tmp_path / "hf", vocab_size=101)  # untied: lm_head goes through the transpose path
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    assert hf_tensors(tmp_path / "hf") == hf_tensors(tmp_path / "back")
