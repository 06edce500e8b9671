"""Weight-name tables of vision-language models' image towers and connectors (data, not code).

Each entry is (zoo parameter, Hugging Face tensor, transform); ``{i}`` in a tensor name stands for the tower's
layer index, and such a parameter stacks those tensors over the tower's layers (``vision.layers.*``).
:func:`convert.tables.table_for` binds them beside the language model's rules (this module cannot import
convert.tables, which imports it). The language models themselves use convert.tables' decoder tables.
"""

from __future__ import annotations

from zoo.model.config import ModelConfig

Entry = tuple[str, str, str]  # (zoo parameter, HF tensor, transform name)


def siglip_rules(V: str) -> list[Entry]:
    """A SigLIP tower under the prefix ``V`` (``model.vision_model.`` in SmolVLM/Idefics3)."""
    L = V + "encoder.layers.{i}."
    A = L + "self_attn."
    return [
        ("vision.patch_embed", V + "embeddings.patch_embedding.weight", "conv_patch"),
        ("vision.patch_bias", V + "embeddings.patch_embedding.bias", "identity"),
        ("vision.pos_embed", V + "embeddings.position_embedding.weight", "identity"),
        ("vision.layers.attn_norm", L + "layer_norm1.weight", "identity"),
        ("vision.layers.attn_norm_bias", L + "layer_norm1.bias", "identity"),
        ("vision.layers.q", A + "q_proj.weight", "vq_in"),
        ("vision.layers.k", A + "k_proj.weight", "vq_in"),
        ("vision.layers.v", A + "v_proj.weight", "vq_in"),
        ("vision.layers.q_bias", A + "q_proj.bias", "vq_bias"),
        ("vision.layers.k_bias", A + "k_proj.bias", "vq_bias"),
        ("vision.layers.v_bias", A + "v_proj.bias", "vq_bias"),
        ("vision.layers.o", A + "out_proj.weight", "vo_out"),
        ("vision.layers.o_bias", A + "out_proj.bias", "identity"),
        ("vision.layers.mlp_norm", L + "layer_norm2.weight", "identity"),
        ("vision.layers.mlp_norm_bias", L + "layer_norm2.bias", "identity"),
        ("vision.layers.up", L + "mlp.fc1.weight", "transpose"),
        ("vision.layers.up_bias", L + "mlp.fc1.bias", "identity"),
        ("vision.layers.down", L + "mlp.fc2.weight", "transpose"),
        ("vision.layers.down_bias", L + "mlp.fc2.bias", "identity"),
        ("vision.final_norm", V + "post_layernorm.weight", "identity"),
        ("vision.final_norm_bias", V + "post_layernorm.bias", "identity"),
    ]


# SmolVLM / Idefics3: the tower under model.vision_model., the pixel-shuffle connector's one Linear (no bias)
_IDEFICS3 = siglip_rules("model.vision_model.") + [
    ("projector.proj", "model.connector.modality_projection.proj.weight", "transpose"),
]

# source format -> the vision side's entries
VISION_TABLES: dict[str, list[Entry]] = {"hf-smolvlm": _IDEFICS3, "hf-idefics3": _IDEFICS3}


def vision_entries(fmt: str, cfg: ModelConfig) -> list[tuple[str, str, str, tuple[int, ...] | None]]:
    """(zoo parameter, HF tensor, transform, the tower layers it stacks or None) of the vision side of a model of
    this config in source format ``fmt``; [] for a text model."""
    if cfg.vision is None:
        return []
    layers = tuple(range(cfg.vision.num_layers))
    return [(zoo, hf, t, layers if "{i}" in hf else None) for zoo, hf, t in VISION_TABLES[fmt]]
