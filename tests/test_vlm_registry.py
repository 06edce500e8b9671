"""The vision-language models the registry names: their released configs' parameter counts, and the image side's
arithmetic in a step's FLOPs (what `--compile-only` reports and MFU divides by)."""

import json

import pytest

from zoo.model.from_hf import model_config_from_hf
from zoo.model.params import count_params
from zoo.registry.catalogue import get

# The parameter counts the Hub's safetensors files of google/gemma-3-*-it state (each model page's "Model size").
GEMMA3_RELEASED = {"gemma3-4b-it": 4_300_079_472, "gemma3-12b-it": 12_187_325_040, "gemma3-27b-it": 27_432_406_640}
# Qwen/Qwen3-VL-*-Instruct's "Model size" as the model pages round it (billions)
QWEN3_VL_RELEASED = {"qwen3-vl-2b": 2.13, "qwen3-vl-4b": 4.44, "qwen3-vl-8b": 8.77, "qwen3-vl-32b": 33.4}
# Qwen3-VL-MoE's configs were written without the Hub (zoo/registry/released_vision.py): transformers' count only
QWEN3_VL_MOE = ["qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"]


@pytest.mark.parametrize("name", [*GEMMA3_RELEASED, "smolvlm-256m-instruct", "smolvlm-500m-instruct",
                                  "smolvlm-instruct", *QWEN3_VL_RELEASED, *QWEN3_VL_MOE])
def test_registry_vlm_param_counts_are_the_released_ones(name):
    """Each entry's whole model (tower and connector included) has the released count: Gemma 3's as its files
    state it, SmolVLM's as transformers builds the config (its cards round them: 256M, 507M, 2.25B; the 2.2B's
    config written without the Hub), Qwen3-VL's as
    transformers builds it and its model pages round it, Qwen3-VL-MoE's (experts included) as transformers builds
    it."""
    import torch
    import transformers

    hf = get(name).hf_config
    assert hf is not None
    ours = count_params(model_config_from_hf(hf))
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):  # shapes only: nothing allocated
        model = getattr(transformers, hf["architectures"][0])(config)
    assert ours == sum(p.numel() for p in model.parameters())
    if name in GEMMA3_RELEASED:
        assert ours == GEMMA3_RELEASED[name]
    if name == "smolvlm-instruct":
        assert float(f"{ours / 1e9:.3g}") == 2.25  # the model card's size
    if name in QWEN3_VL_RELEASED:
        assert float(f"{ours / 1e9:.3g}") == QWEN3_VL_RELEASED[name]
    assert abs(get(name).params - ours) / ours < 0.002  # what `zoo list` shows


def _smolvlm_patch_flops(hf: dict, tower_factor: float, connector_factor: float) -> float:
    """SmolVLM's image side per patch, written out from its config: the tower's matmuls (q, k, v, o, fc1, fc2
    per layer, the patch embedding) at 2 FLOPs a weight, attention 4 x width x patches an image per layer, and
    the connector's projection (group x width -> hidden) once a group of patches."""
    v, t, s = hf["vision_config"], hf["text_config"], hf["scale_factor"]
    d, f, n = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    tower = n * (4 * d * d + 2 * d * f) + 3 * v["patch_size"] ** 2 * d
    forward = 2 * tower + 4 * n * d * patches
    return tower_factor * forward + connector_factor * 2 * (s * s * d * t["hidden_size"]) / (s * s)


@pytest.mark.parametrize("tower,connector,factors", [(True, True, (3, 3)), (False, True, (1, 2)),
                                                     (False, False, (1, 1))])
def test_image_flops_per_patch_is_the_towers_arithmetic(tower, connector, factors):
    """Trained, frozen tower with a trained connector, all frozen (LoRA): 3x, 1x + the connector's 2x, 1x."""
    from pretrain.flops import vision_flops_per_patch

    hf = get("smolvlm-256m-instruct").hf_config
    assert hf is not None
    cfg = model_config_from_hf(hf)
    assert vision_flops_per_patch(cfg, tower, connector) == pytest.approx(_smolvlm_patch_flops(hf, *factors))


def test_text_flops_leave_the_tower_out():
    """A token's FLOPs are the language model's: the tower and connector, per patch, are not counted per token."""
    import dataclasses

    from pretrain.flops import flops_per_token

    cfg = model_config_from_hf(get("smolvlm-256m-instruct").hf_config)
    assert flops_per_token(cfg, 512) == flops_per_token(dataclasses.replace(cfg, vision=None), 512)


@pytest.mark.slow
def test_a_vlm_lora_step_compiles_for_a_slice_with_its_image_flops(tmp_path, monkeypatch):
    """`sft train --compile-only` of a tiny SmolVLM-shaped model with LoRA and 2 images' patches a row on v5e:2x2:
    the report's FLOPs are the language model's tokens plus every patch slot at the frozen tower's 1x, and each
    chip runs the tower on its own 2 rows: no chip holds the tower's MLP activations of all 8 rows (FSDP splits
    the tower's weights over the axis that splits the rows, and unconstrained the compiler gathered the rows:
    Gemma 3 27B on v5e:2x4 held bf16[8,4096,4304] a chip).
    Slow (slow lane): about 7.0 s on a quiet 2-core machine (the step compiled for a TPU slice)."""
    from pretrain.flops import flops_per_token
    from sft.cli import main
    from tests.program_checks import keep_compiled_text

    texts = keep_compiled_text(monkeypatch)

    hf = {**get("smolvlm-256m-instruct").hf_config, "vocab_size": 512, "image_token_id": 511}
    hf["text_config"] = {**hf["text_config"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    hf["vision_config"] = {**hf["vision_config"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {tmp_path / 'config.json'}\ndata:\n  path: {tmp_path / 'absent.jsonl'}\n  seq_len: 64\n"
                   f"  max_patches: 32\nbatch_size: 8\nmax_steps: 1\noutput_dir: {tmp_path / 'run'}\nlora:\n  rank: 4\n")
    report = tmp_path / "report.json"
    assert main(["train", "--config", str(run), "--compile-only", "--topology", "v5e:2x2", "--report",
                 str(report)]) == 0
    rep = json.loads(report.read_text())
    cfg = model_config_from_hf(hf)
    text = flops_per_token(cfg, 64, frozen_base=True) * 8 * 64
    assert rep["model_flops_per_step"] == pytest.approx(text + 8 * 32 * _smolvlm_patch_flops(hf, 1, 1))
    assert "f32[2,32,64]" in texts[0] and "f32[8,32,64]" not in texts[0]  # rows x patches x the tower's MLP
