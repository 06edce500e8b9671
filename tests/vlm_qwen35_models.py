"""Hugging Face Qwen3.5 reference VLMs: a tiny random Qwen3_5ForConditionalGeneration or
Qwen3_5MoeForConditionalGeneration (transformers' own classes: tests/hf_models.py's tiny Qwen3.5 language model
beside Qwen3-VL's tiny tower without DeepStack), saved as the Hub's files are (the MoE's experts fused per layer and
a multi-token-prediction layer under ``mtp.``), and its image features. Images, rows, logits and the processor
folder are tests/vlm_qwen_models.py's and tests/vlm_qwen3_models.py's (Qwen3.5 lays its images out and expands them
as Qwen3-VL does).

A helper like tests/vlm_models.py (reusing tests/hf_models.py's ``randomize``); no test module imports another."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tests.hf_models import BASE, FAMILIES, randomize

# Qwen3-VL's tiny tower (tests/vlm_qwen3_models.py) without DeepStack: 3 layers 32 wide (2 heads of 16) in 4-pixel
# patches 2 frames deep, merged 2 x 2 into the language model's 64, with a 4 x 4 position table.
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
CLASSES = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
           "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}
MTP = ("mtp.fc.weight", "mtp.norm.weight")  # two tensors of the Hub's multi-token-prediction layer


def make_qwen35_vlm(folder: Path, family: str, vocab_size: int, seed: int = 0, **tokens: int):
    """Save a tiny random Qwen3.5 VLM of ``family`` (qwen3_5 or qwen3_5_moe; its language model tests/hf_models.py
    FAMILIES': Gated DeltaNet layers 0 and 2, gated full attention with interleaved M-RoPE on layers 1 and 3) to
    ``folder`` as the Hub's files hold it (:func:`as_the_hub`); returns the float32 transformers model (eager
    attention). ``vocab_size`` and ``tokens`` (image_token_id, vision_start_token_id, ...: tests/vlm_qwen_models.py's
    ``qwen_token_ids``) fit it to a tokenizer."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    text = {**BASE, **FAMILIES[family][2], "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2}
    config = config_class(text_config=text, vision_config=VISION, **tokens)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(folder)
    as_the_hub(folder, config.text_config.num_experts if family == "qwen3_5_moe" else 0)
    return model


def as_the_hub(folder: Path, num_experts: int) -> None:
    """Rewrite a saved Qwen3.5 VLM as the Hub's files hold it: with ``num_experts``, each layer's experts (one by one,
    as save_pretrained writes them) as ``mlp.experts.gate_up_proj`` [experts, 2 x mlp, embed] (gate rows, then up)
    and ``mlp.experts.down_proj`` [experts, embed, mlp]; and the two :data:`MTP` tensors (transformers builds no
    such module)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in sorted({m.group(1) for k in state if (m := re.match(r"(.*\.mlp\.experts)\.0\.", k))}):
        w = {p: [state[f"{layer}.{j}.{p}_proj.weight"] for j in range(num_experts)] for p in ("gate", "up", "down")}
        out[f"{layer}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(w["gate"], w["up"], strict=True)])
        out[f"{layer}.down_proj"] = torch.stack(w["down"])
    hidden = state["lm_head.weight"].shape[1]
    out.update({MTP[0]: torch.zeros(hidden, 2 * hidden), MTP[1]: torch.zeros(hidden)})
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


def hf_qwen35_features(model, images: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[np.ndarray]:
    """transformers' image features [tokens, hidden] per image of ``images`` run as one batch (the merger's output:
    Qwen3.5 has no DeepStack features)."""
    pixels = torch.tensor(np.concatenate([p for p, _ in images]))
    with torch.no_grad():
        out = model.model.get_image_features(pixels, torch.tensor([g for _, g in images]), return_dict=True)
    assert getattr(out, "deepstack_features", None) is None
    return [f.numpy() for f in out.pooler_output]
