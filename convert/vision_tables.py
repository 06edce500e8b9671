"""Weight-name tables of vision-language models' image towers and connectors (data, not code).

Each entry is (zoo parameter, Hugging Face tensor, transform); ``{i}`` in a tensor name stands for the tower's
layer index, and such a parameter stacks those tensors over the tower's layers (``vision.layers.*``), or, for
Qwen3-VL's DeepStack mergers (``projector.deepstack.*``), over its levels.
:func:`convert.tables.table_for` binds them beside the language model's rules (this module cannot import
convert.tables, which imports it). The language models themselves use convert.tables' decoder tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.vision_params import vision_specs

Entry = tuple[str, str, str]  # (zoo parameter, HF tensor, transform name)


def siglip_rules(V: str) -> list[Entry]:
    """A SigLIP tower under the prefix ``V`` (``model.vision_model.`` in SmolVLM/Idefics3, ``vision_tower.`` or
    ``vision_tower.vision_model.`` in Gemma 3)."""
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


def _idefics3(V: str) -> list[Entry]:
    """SmolVLM / Idefics3: the tower, then the pixel-shuffle connector's one Linear (no bias)."""
    return siglip_rules(V) + [("projector.proj", "model.connector.modality_projection.proj.weight", "transpose")]


def _gemma3(V: str) -> list[Entry]:
    """Gemma 3: the tower, then the average-pool connector's (1 + w) RMSNorm and its projection, stored [Dv, E]."""
    return siglip_rules(V) + [
        ("projector.norm", "multi_modal_projector.mm_soft_emb_norm.weight", "identity"),
        ("projector.proj", "multi_modal_projector.mm_input_projection_weight", "identity"),
    ]


def _gemma4(V: str) -> list[Entry]:
    """Gemma 4's tower (``model.vision_tower.``) and its embedder's projection; the clip bounds and the
    standardization buffers where the config has them (:func:`gemma4_optional`)."""
    L = V + "encoder.layers.{i}."
    A, M = L + "self_attn.", L + "mlp."
    rules = [("vision.patch_embed", V + "patch_embedder.input_proj.weight", "transpose"),
             ("vision.pos_embed", V + "patch_embedder.position_embedding_table", "identity"),
             ("vision.layers.attn_norm", L + "input_layernorm.weight", "identity"),
             ("vision.layers.post_attn_norm", L + "post_attention_layernorm.weight", "identity"),
             ("vision.layers.mlp_norm", L + "pre_feedforward_layernorm.weight", "identity"),
             ("vision.layers.post_mlp_norm", L + "post_feedforward_layernorm.weight", "identity"),
             ("vision.layers.q_norm", A + "q_norm.weight", "identity"),
             ("vision.layers.k_norm", A + "k_norm.weight", "identity"),
             ("vision.layers.q", A + "q_proj.linear.weight", "vq_in"),
             ("vision.layers.k", A + "k_proj.linear.weight", "vkv_in"),
             ("vision.layers.v", A + "v_proj.linear.weight", "vkv_in"),
             ("vision.layers.o", A + "o_proj.linear.weight", "vo_out"),
             ("vision.layers.gate", M + "gate_proj.linear.weight", "transpose"),
             ("vision.layers.up", M + "up_proj.linear.weight", "transpose"),
             ("vision.layers.down", M + "down_proj.linear.weight", "transpose"),
             ("vision.std_bias", V + "std_bias", "identity"),
             ("vision.std_scale", V + "std_scale", "identity"),
             ("projector.proj", "model.embed_vision.embedding_projection.weight", "transpose")]
    where = {"q": A + "q_proj.", "k": A + "k_proj.", "v": A + "v_proj.", "o": A + "o_proj.", "gate": M + "gate_proj.",
             "up": M + "up_proj.", "down": M + "down_proj."}
    bounds = {"in_min": "input_min", "in_max": "input_max", "out_min": "output_min", "out_max": "output_max"}
    return rules + [(f"vision.layers.{name}_{ours}", at + theirs, "scalar")
                    for name, at in where.items() for ours, theirs in bounds.items()]


def _qwen2_5(V: str) -> list[Entry]:
    """Qwen2.5-VL's tower under ``V`` (``visual.``) and its patch merger."""
    L = V + "blocks.{i}."
    return [
        ("vision.patch_embed", V + "patch_embed.proj.weight", "conv3d_patch"),
        ("vision.layers.attn_norm", L + "norm1.weight", "identity"),
        ("vision.layers.qkv", L + "attn.qkv.weight", "vqkv_in"),
        ("vision.layers.qkv_bias", L + "attn.qkv.bias", "vqkv_bias"),
        ("vision.layers.o", L + "attn.proj.weight", "vo_out"),
        ("vision.layers.o_bias", L + "attn.proj.bias", "identity"),
        ("vision.layers.mlp_norm", L + "norm2.weight", "identity"),
        ("vision.layers.gate", L + "mlp.gate_proj.weight", "transpose"),
        ("vision.layers.gate_bias", L + "mlp.gate_proj.bias", "identity"),
        ("vision.layers.up", L + "mlp.up_proj.weight", "transpose"),
        ("vision.layers.up_bias", L + "mlp.up_proj.bias", "identity"),
        ("vision.layers.down", L + "mlp.down_proj.weight", "transpose"),
        ("vision.layers.down_bias", L + "mlp.down_proj.bias", "identity"),
        ("projector.norm", V + "merger.ln_q.weight", "identity"),
        ("projector.fc1", V + "merger.mlp.0.weight", "transpose"),
        ("projector.fc1_bias", V + "merger.mlp.0.bias", "identity"),
        ("projector.fc2", V + "merger.mlp.2.weight", "transpose"),
        ("projector.fc2_bias", V + "merger.mlp.2.bias", "identity"),
    ]


def _qwen3_merger(zoo: str, hf: str) -> list[Entry]:
    """A Qwen3-VL patch merger (LayerNorm, fc1, fc2, each with a bias) at ``zoo`` from ``hf``."""
    return [(zoo + "norm", hf + "norm.weight", "identity"), (zoo + "norm_bias", hf + "norm.bias", "identity"),
            (zoo + "fc1", hf + "linear_fc1.weight", "transpose"),
            (zoo + "fc1_bias", hf + "linear_fc1.bias", "identity"),
            (zoo + "fc2", hf + "linear_fc2.weight", "transpose"),
            (zoo + "fc2_bias", hf + "linear_fc2.bias", "identity")]


def _qwen3(V: str) -> list[Entry]:
    """Qwen3-VL's tower under ``V`` (``model.visual.``), its patch merger and DeepStack mergers (stacked over the
    levels: :data:`LEVELS`)."""
    L = V + "blocks.{i}."
    return [
        ("vision.patch_embed", V + "patch_embed.proj.weight", "conv3d_patch"),
        ("vision.patch_bias", V + "patch_embed.proj.bias", "identity"),
        ("vision.pos_embed", V + "pos_embed.weight", "identity"),
        ("vision.layers.attn_norm", L + "norm1.weight", "identity"),
        ("vision.layers.attn_norm_bias", L + "norm1.bias", "identity"),
        ("vision.layers.qkv", L + "attn.qkv.weight", "vqkv_in"),
        ("vision.layers.qkv_bias", L + "attn.qkv.bias", "vqkv_bias"),
        ("vision.layers.o", L + "attn.proj.weight", "vo_out"),
        ("vision.layers.o_bias", L + "attn.proj.bias", "identity"),
        ("vision.layers.mlp_norm", L + "norm2.weight", "identity"),
        ("vision.layers.mlp_norm_bias", L + "norm2.bias", "identity"),
        ("vision.layers.up", L + "mlp.linear_fc1.weight", "transpose"),
        ("vision.layers.up_bias", L + "mlp.linear_fc1.bias", "identity"),
        ("vision.layers.down", L + "mlp.linear_fc2.weight", "transpose"),
        ("vision.layers.down_bias", L + "mlp.linear_fc2.bias", "identity"),
        *_qwen3_merger("projector.", V + "merger."),
        *_qwen3_merger("projector.deepstack.", V + "deepstack_merger_list.{i}."),
    ]


def _llama4(V: str) -> list[Entry]:
    """Llama 4's tower under ``V`` (``vision_model.``: its unfold patch Linear, class token, position table, pre-
    and post-layer LayerNorms, SigLIP-shaped layers with o_proj), the adapter MLP and the projector."""
    L = V + "model.layers.{i}."
    A = L + "self_attn."
    return [
        ("vision.patch_embed", V + "patch_embedding.linear.weight", "transpose"),
        ("vision.class_embed", V + "class_embedding", "identity"),
        ("vision.pos_embed", V + "positional_embedding_vlm", "identity"),
        ("vision.pre_norm", V + "layernorm_pre.weight", "identity"),
        ("vision.pre_norm_bias", V + "layernorm_pre.bias", "identity"),
        ("vision.layers.attn_norm", L + "input_layernorm.weight", "identity"),
        ("vision.layers.attn_norm_bias", L + "input_layernorm.bias", "identity"),
        *[(f"vision.layers.{x}", A + f"{x}_proj.weight", "vq_in") for x in "qkv"],
        *[(f"vision.layers.{x}_bias", A + f"{x}_proj.bias", "vq_bias") for x in "qkv"],
        ("vision.layers.o", A + "o_proj.weight", "vo_out"),
        ("vision.layers.o_bias", A + "o_proj.bias", "identity"),
        ("vision.layers.mlp_norm", L + "post_attention_layernorm.weight", "identity"),
        ("vision.layers.mlp_norm_bias", L + "post_attention_layernorm.bias", "identity"),
        ("vision.layers.up", L + "mlp.fc1.weight", "transpose"),
        ("vision.layers.up_bias", L + "mlp.fc1.bias", "identity"),
        ("vision.layers.down", L + "mlp.fc2.weight", "transpose"),
        ("vision.layers.down_bias", L + "mlp.fc2.bias", "identity"),
        ("vision.final_norm", V + "layernorm_post.weight", "identity"),
        ("vision.final_norm_bias", V + "layernorm_post.bias", "identity"),
        ("projector.fc1", V + "vision_adapter.mlp.fc1.weight", "transpose"),
        ("projector.fc2", V + "vision_adapter.mlp.fc2.weight", "transpose"),
        ("projector.proj", "multi_modal_projector.linear_1.weight", "transpose"),
    ]


# zoo parameters stacked over the DeepStack levels (their {i}), not the tower's layers
LEVELS = "projector.deepstack."

# source format -> (the tower's prefix as transformers 5 saves it, the vision side's entries under a prefix)
VISION_TABLES: dict[str, tuple[str, Callable[[str], list[Entry]]]] = {
    "hf-smolvlm": ("model.vision_model.", _idefics3),
    "hf-idefics3": ("model.vision_model.", _idefics3),
    "hf-gemma3-multimodal": ("vision_tower.", _gemma3),
    "hf-gemma4-multimodal": ("model.vision_tower.", _gemma4),
    "hf-qwen2_5-vl": ("visual.", _qwen2_5),
    "hf-qwen3-vl": ("model.visual.", _qwen3),
    "hf-qwen3-vl-moe": ("model.visual.", _qwen3),
    "hf-llama4-multimodal": ("vision_model.", _llama4),
    "hf-qwen3_5-multimodal": ("model.visual.", _qwen3),  # Qwen3.5: no DeepStack mergers (no levels in the config)
    "hf-qwen3_5_moe-multimodal": ("model.visual.", _qwen3),
}
# source format -> the other spelling of its tower a source may have (Gemma 3's files on the Hub)
OTHER_TOWER_PREFIX = {"hf-gemma3-multimodal": "vision_tower.vision_model."}


def with_tower_spelling(cfg: ModelConfig, fmt: str, names: Iterable[str], where: str) -> ModelConfig:
    """``cfg`` with the tower prefix of a source whose tensors are ``names`` recorded where the format has two
    spellings (so the export writes the source's back); ``cfg`` itself otherwise. A tower with SigLIP's pooling
    head (``vision_use_head: true``), which these models never run, is a UserError: the conversion would drop it."""
    if cfg.vision is None or fmt not in VISION_TABLES:
        return cfg
    names = set(names)
    other = OTHER_TOWER_PREFIX.get(fmt)
    prefix = other if other is not None and other + "post_layernorm.weight" in names else VISION_TABLES[fmt][0]
    if prefix + "head.probe" in names:
        raise UserError(f"{where}: its vision tower has SigLIP's pooling head ({prefix}head.*, vision_use_head: "
                        "true), which the model never runs and lmzoo does not carry; convert with --text-only")
    if prefix == VISION_TABLES[fmt][0]:
        return cfg
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, hf_tower_prefix=prefix))


def vision_entries(fmt: str, cfg: ModelConfig) -> list[tuple[str, str, str, tuple[int, ...] | None]]:
    """(zoo parameter, HF tensor, transform, the tower layers it stacks or None) of the vision side of a model of
    this config in source format ``fmt``; [] for a text model."""
    if cfg.vision is None:
        return []
    layers = tuple(range(cfg.vision.num_layers))
    levels = tuple(range(len(cfg.vision.deepstack_layers)))
    default, entries = VISION_TABLES[fmt]
    present = vision_specs(cfg)  # Gemma 4's clip bounds and standardization buffers are there where the config says
    return [(zoo, hf, t, (levels if zoo.startswith(LEVELS) else layers) if "{i}" in hf else None)
            for zoo, hf, t in entries(cfg.vision.hf_tower_prefix or default) if zoo in present]
