"""Dense families in the one decoder: Mistral, Gemma 1/2/3, Qwen 2/3 against transformers, and round trips."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import FAMILIES, hf_logits, hf_tensors, make_hf, mean_kl, random_tokens
from zoo.cli import main

DENSE = ["mistral", "gemma", "gemma2", "gemma3", "qwen2", "qwen3"]
SEQ = 40  # longer than every sliding window (7) used here


@pytest.mark.parametrize("family", DENSE)
def test_logits_match_transformers(tiny_family, family):
    hf, root = tiny_family(family)  # conftest.py: make_hf at the family's defaults, `zoo convert`ed once per run
    cfg = zoo.read_config(root / "zoo")
    assert cfg.family == family
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    ref = hf_logits(hf, tokens)
    got = np.asarray(zoo.load(root / "zoo")(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5  # peaked enough for the comparison to have teeth


@pytest.mark.parametrize("family", DENSE)
def test_round_trip_is_bit_identical(tiny_family, tmp_path, family):
    _, root = tiny_family(family)
    assert main(["export", str(root / "zoo"), "--out", str(tmp_path / "back")]) == 0
    assert hf_tensors(root / "hf") == hf_tensors(tmp_path / "back")
    a = json.loads((root / "hf" / "config.json").read_text())
    b = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in a.items() if "dtype" not in k} == {k: v for k, v in b.items() if "dtype" not in k}


@pytest.mark.parametrize("family", DENSE)
def test_generated_config_reproduces_the_model(tiny_family, tmp_path, family):
    """Without the source config.json, export writes one from the zoo config; transformers must
    build the same model from it."""
    import shutil

    from transformers import AutoModelForCausalLM

    hf, root = tiny_family(family)
    shutil.copytree(root / "zoo", tmp_path / "zoo", ignore=shutil.ignore_patterns("hf_config.json"))
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    assert type(back).__name__ == FAMILIES[family][1]
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_packed_rows_with_sliding_window(tiny_family, family):
    model = zoo.load(tiny_family(family)[1] / "zoo")
    # Two rows of SEQ tokens (past the window), each alone in a batch of two: the program (and shape) of
    # test_logits_match_transformers, compiled once; then both packed into one row of 2 * SEQ.
    a, b = random_tokens(96, seq=SEQ, seed=1)
    packed = np.concatenate([a, b])[None].astype(np.int32)
    seg = np.concatenate([np.full(SEQ, 1), np.full(SEQ, 2)])[None].astype(np.int32)
    pos = np.concatenate([np.arange(SEQ), np.arange(SEQ)])[None].astype(np.int32)
    got = np.asarray(model(jnp.asarray(packed), jnp.asarray(seg), jnp.asarray(pos)))
    alone = np.asarray(model(jnp.asarray(np.stack([a, b]).astype(np.int32))))
    np.testing.assert_allclose(got[0, :SEQ], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[0, SEQ:], alone[1], atol=1e-5, rtol=0)


def test_sliding_window_matters(tmp_path):
    """Guards the sliding-window parity tests: the window really changes the logits at this length."""
    narrow = make_hf(tmp_path / "a", "mistral", sliding_window=7)
    wide = make_hf(tmp_path / "b", "mistral", sliding_window=None)
    tokens = random_tokens(96, seq=SEQ)
    diff = np.abs(hf_logits(narrow, tokens) - hf_logits(wide, tokens))
    assert diff[:, :7].max() < 1e-5 and diff[:, 7:].max() > 1e-2


def test_gemma3_multimodal_converts_language_model_with_text_only(tmp_path, capsys):
    """`--text-only` converts a Gemma3ForConditionalGeneration's language model alone (the whole model converts
    without it: tests/test_vlm_gemma3.py), here one whose tower has SigLIP's pooling head, which the whole
    conversion refuses."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = dict(FAMILIES["gemma3"][2], vocab_size=96, hidden_size=64, intermediate_size=112,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    text.pop("final_logit_softcapping")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision.to_dict(),
                                                        mm_tokens_per_image=4, image_token_index=95)).eval()
    model.config._attn_implementation = "eager"
    from tests.hf_models import randomize

    randomize(model)
    model.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "whole")]) == 2
    assert "pooling head (vision_tower.head.*" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo"), "--text-only"]) == 0
    err = capsys.readouterr().err
    assert "vision tower" in err and "left out" in err
    tokens = random_tokens(90, seq=SEQ)  # no image tokens
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    got = np.asarray(zoo.load(tmp_path / "zoo")(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6
    meta = zoo.checkpoints.format.read_meta(tmp_path / "zoo")
    assert not any("vision" in p for p in meta["params"])
    # Exported as the text-only Gemma3ForCausalLM.
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "back")]) == 0
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
