"""Hugging Face Qwen3-VL reference models: a tiny random Qwen3VLForConditionalGeneration or
Qwen3VLMoeForConditionalGeneration (transformers' own classes), its image features (DeepStack's included) and
logits, and a MoE checkpoint's experts rewritten in the Hub's order. Images, rows and the processor folder are
tests/vlm_qwen_models.py's (Qwen3-VL lays its images out and expands them as Qwen2.5-VL does).

A helper like tests/vlm_models.py (reusing tests/hf_models.py's ``randomize``); no test module imports another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.hf_models import randomize

# A Qwen 3 language model 64 wide (4 heads of 16: 8 frequencies, interleaved mrope sections 4 + 2 + 2, so the last
# two frequencies turn with the time alone) of 3 layers, the first two taking DeepStack's levels; a 3-layer tower
# 32 wide (2 heads of 16) in 4-pixel patches 2 frames deep, merged 2 x 2, with a 4 x 4 position table (resampled up
# and down to the images' grids) and DeepStack levels after its first and last layers.
TEXT = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                             "rope_theta": 10000.0})
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])


def make_qwen3(folder: Path, vocab_size: int, seed: int = 0, **tokens: int):
    """Save a tiny random Qwen3-VL to ``folder``; returns the float32 transformers model (eager attention).
    ``vocab_size`` and ``tokens`` (image_token_id, vision_start_token_id, ...: tests/vlm_qwen_models.py's
    ``qwen_token_ids``) fit it to a tokenizer."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config={**TEXT, "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2},
                           vision_config=VISION, **tokens)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(folder)
    return model


# The MoE variant's language model: TEXT's, with 4 experts 24 wide, 2 a token, on layers 0 and 2; layer 1 keeps a
# dense MLP (mlp_only_layers), so DeepStack's two levels span a MoE and a dense layer.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1])
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def make_qwen3_moe(folder: Path, vocab_size: int, seed: int = 0, **tokens: int):
    """Save a tiny random Qwen3-VL-MoE (:data:`MOE`) to ``folder`` as transformers 5 saves it (experts [experts,
    out, in]); returns the float32 transformers model (eager attention). Arguments as :func:`make_qwen3`'s."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    config = Qwen3VLMoeConfig(text_config={**TEXT, **MOE, "vocab_size": vocab_size, "bos_token_id": 1,
                                           "eos_token_id": 2}, vision_config=VISION, **tokens)
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(folder)
    return model


def hub_expert_order(src: Path, dst: Path) -> None:
    """Copy the checkpoint folder ``src`` to ``dst`` with its experts' last two axes swapped: [experts, embed,
    2 x mlp] and [experts, mlp, embed], as the Hub's Qwen3-VL-MoE files hold them (transformers transposes them
    when it loads)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: np.ascontiguousarray(v.swapaxes(1, 2)) if k.endswith(EXPERTS) else v
                   for k, v in tensors.items()}, f, metadata={"format": "pt"})


def hf_qwen3_features(model, images: list[tuple[np.ndarray, tuple[int, int, int]]]
                      ) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """transformers' (image features [tokens, hidden] per image, DeepStack features per level per image) of
    ``images`` run as one batch."""
    pixels = torch.tensor(np.concatenate([p for p, _ in images]))
    with torch.no_grad():
        out = model.model.get_image_features(pixels, torch.tensor([g for _, g in images]), return_dict=True)
    return [f.numpy() for f in out.pooler_output], [[f.numpy() for f in level] for level in out.deepstack_features]


def hf_qwen3_logits(model, tokens: np.ndarray, images: list[tuple[np.ndarray, tuple[int, int, int]]]) -> np.ndarray:
    """transformers' float32 logits [rows, seq, vocab] of int tokens [rows, seq] holding the image tokens of
    ``images`` in order (its own multimodal positions from ``mm_token_type_ids``)."""
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                     pixel_values=torch.tensor(np.concatenate([p for p, _ in images])),
                     image_grid_thw=torch.tensor([g for _, g in images])).logits.float().numpy()


def image_row(seq: int, images: list[tuple[int, tuple[int, int, int]]], seed: int, ids: dict[str, int],
              text: tuple[int, int]) -> np.ndarray:
    """Int tokens [seq]: random text ids (in ``text``'s range) with, from each (start, grid), that image's
    t * h * w / 4 image tokens between its vision start and end markers, as the processor expands them; ``ids``
    are the model's token ids (``image_token_id``, ``vision_start_token_id``, ``vision_end_token_id``)."""
    row = np.random.RandomState(seed).randint(*text, seq).astype(np.int32)
    for at, (t, h, w) in images:
        n = t * h * w // 4
        row[at - 1], row[at + n] = ids["vision_start_token_id"], ids["vision_end_token_id"]
        row[at:at + n] = ids["image_token_id"]
    return row
