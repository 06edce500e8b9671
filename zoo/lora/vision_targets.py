"""The LoRA target names of a vision-language model's image tower and connector, and the module paths peft sees
them at in each family (data; read without JAX, by the configs).

The tower is named apart from the language model (``vision.*``), so the bare names stay the language model's. A
name stands for the same kind of projection in every tower, under the text names where the tower has them:
``vision.q_proj`` ... ``vision.o_proj`` (attention), ``vision.gate_proj``, ``vision.up_proj``,
``vision.down_proj`` (the MLP: SigLIP's and Qwen3-VL's fc1/fc2 are ``up``/``down``), and ``vision.qkv``, the
Qwen towers' fused q/k/v Linear, adapted whole as peft adapts it (one A on its input, one B over its 3 x heads x
head_dim outputs). The connectors: ``projector.proj`` (SmolVLM's, Gemma 3's and Gemma 4's one projection),
``projector.fc1`` and ``projector.fc2`` (the Qwen patch merger's MLP, Llama 4's adapter MLP; Llama 4's
projector Linear is its ``projector.proj``) and ``projector.deepstack.fc1`` /
``projector.deepstack.fc2`` (Qwen3-VL's DeepStack mergers, one adapter a level).
"""

from __future__ import annotations

# Target name -> the zoo weights (whole paths) it names; a model adapts those it has.
VISION_TARGETS: dict[str, tuple[str, ...]] = {
    "vision.q_proj": ("vision.layers.q",),
    "vision.k_proj": ("vision.layers.k",),
    "vision.v_proj": ("vision.layers.v",),
    "vision.qkv": ("vision.layers.qkv",),
    "vision.o_proj": ("vision.layers.o",),
    "vision.gate_proj": ("vision.layers.gate",),
    "vision.up_proj": ("vision.layers.up",),
    "vision.down_proj": ("vision.layers.down",),
    "projector.proj": ("projector.proj",),
    "projector.fc1": ("projector.fc1",),
    "projector.fc2": ("projector.fc2",),
    "projector.deepstack.fc1": ("projector.deepstack.fc1",),
    "projector.deepstack.fc2": ("projector.deepstack.fc2",),
}
# transformers' spellings of the towers' modules -> the target name above: SigLIP's out_proj, fc1, fc2; the Qwen
# towers' attn.proj; Qwen3-VL's mlp.linear_fc1, mlp.linear_fc2
VISION_ALIASES = {"vision.out_proj": "vision.o_proj", "vision.fc1": "vision.up_proj", "vision.fc2": "vision.down_proj",
                  "vision.proj": "vision.o_proj", "vision.linear_fc1": "vision.up_proj",
                  "vision.linear_fc2": "vision.down_proj"}


def _layer(prefix: str, names: dict[str, str]) -> dict[str, str]:
    """Target name -> its module path in layer 0 of a tower whose layers are at ``prefix``."""
    return {f"vision.{k}": prefix + v for k, v in names.items()}


_SIGLIP = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
           "o_proj": "self_attn.out_proj", "up_proj": "mlp.fc1", "down_proj": "mlp.fc2"}
_QWEN_ATTENTION = {"qkv": "attn.qkv", "o_proj": "attn.proj"}
_QWEN3_MERGERS = {"projector.fc1": "model.visual.merger.linear_fc1", "projector.fc2": "model.visual.merger.linear_fc2",
                  "projector.deepstack.fc1": "model.visual.deepstack_merger_list.0.linear_fc1",
                  "projector.deepstack.fc2": "model.visual.deepstack_merger_list.0.linear_fc2"}
# Tower kind (:func:`tower_kind`) -> each target's module path as peft sees it in transformers 5's model (layer 0),
# which a regex target is matched against in full. Gemma 3's connector projection is a bare parameter
# (``mm_input_projection_weight``), no module: no regex reaches it, ``projector.proj`` names it.
VISION_PATHS: dict[str, dict[str, str]] = {
    "smolvlm": {**_layer("model.vision_model.encoder.layers.0.", _SIGLIP),
                "projector.proj": "model.connector.modality_projection.proj"},
    "gemma3": _layer("model.vision_tower.encoder.layers.0.", _SIGLIP),
    # Gemma 4's projections are clippable wrappers around a Linear (``.linear``), which peft wraps
    "gemma4": {**_layer("model.vision_tower.encoder.layers.0.", {
        k: f"{where}.{k}.linear" for k, where in (("q_proj", "self_attn"), ("k_proj", "self_attn"),
                                                  ("v_proj", "self_attn"), ("o_proj", "self_attn"),
                                                  ("gate_proj", "mlp"), ("up_proj", "mlp"), ("down_proj", "mlp"))}),
               "projector.proj": "model.embed_vision.embedding_projection"},
    "qwen2_5": {**_layer("model.visual.blocks.0.", {**_QWEN_ATTENTION, "gate_proj": "mlp.gate_proj",
                                                    "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}),
                "projector.fc1": "model.visual.merger.mlp.0", "projector.fc2": "model.visual.merger.mlp.2"},
    "qwen3": {**_layer("model.visual.blocks.0.", {**_QWEN_ATTENTION, "up_proj": "mlp.linear_fc1",
                                                  "down_proj": "mlp.linear_fc2"}), **_QWEN3_MERGERS},
    # Llama 4: SigLIP's layer with o_proj; the adapter's MLP and the projector (the tower sits at the model's top)
    "llama4": {**_layer("vision_model.model.layers.0.", {**_SIGLIP, "o_proj": "self_attn.o_proj"}),
               "projector.fc1": "vision_model.vision_adapter.mlp.fc1",
               "projector.fc2": "vision_model.vision_adapter.mlp.fc2", "projector.proj": "multi_modal_projector.linear_1"},
}


def tower_kind(tower: str, connector: str) -> str:
    """The key of :data:`VISION_PATHS` of a model's ``VisionConfig.tower`` and ``connector`` (SigLIP's tower is
    SmolVLM's or Gemma 3's, told apart by the connector)."""
    if tower == "siglip":
        return "gemma3" if connector == "avg_pool" else "smolvlm"
    return tower


def vision_paths(kind: str | None) -> dict[str, tuple[str, ...]]:
    """Target name -> the module paths a regex is matched against: those of tower ``kind``, or with None (no model
    at hand: a config checked on its own) every tower's."""
    kinds = VISION_PATHS if kind is None else {kind: VISION_PATHS[kind]}
    out: dict[str, tuple[str, ...]] = {}
    for paths in kinds.values():
        for name, path in paths.items():
            out[name] = (*out.get(name, ()), path)
    return out
