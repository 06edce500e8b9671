"""The parameter layout of a vision-language model's image tower (``vision.*``) and connector (``projector.*``).

The tower's layers are stacked on a leading ``layers`` axis, as the decoder's are, so the tower scans them
(:mod:`zoo.model.vision`). Appended to :func:`zoo.model.params.param_specs` (as its ParamSpecs) when ``cfg.vision`` is set.
"""

from __future__ import annotations

from zoo.model.config import ModelConfig
from zoo.model.vision_config import VisionConfig

# (shape, logical axes, initializer kind): the fields of zoo.model.params.ParamSpec, which wraps them (that module
# imports this one, so this one cannot import it)
Spec = tuple[tuple[int, ...], tuple[str | None, ...], str]


def _tower_layer_specs(v: VisionConfig) -> dict[str, Spec]:
    """The SigLIP encoder layers' weights (suffixes after ``vision.layers.``): LayerNorms with biases, q/k/v/o
    with biases, fc1 (``up``) and fc2 (``down``) with biases."""
    L, D, F, H, Dh = v.num_layers, v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim
    lay = ("layers",)
    s: dict[str, Spec] = {}
    for norm in ("attn_norm", "mlp_norm"):
        s[norm] = ((L, D), lay + ("embed",), "ones")
        s[f"{norm}_bias"] = ((L, D), lay + ("embed",), "zeros")
    for name in ("q", "k", "v"):
        s[name] = ((L, D, H, Dh), lay + ("embed", "heads", "head_dim"), "normal")
        s[f"{name}_bias"] = ((L, H, Dh), lay + ("heads", "head_dim"), "zeros")
    s["o"] = ((L, H, Dh, D), lay + ("heads", "head_dim", "embed"), "normal")
    s["o_bias"] = ((L, D), lay + ("embed",), "zeros")
    s["up"] = ((L, D, F), lay + ("embed", "mlp"), "normal")
    s["up_bias"] = ((L, F), lay + ("mlp",), "zeros")
    s["down"] = ((L, F, D), lay + ("mlp", "embed"), "normal")
    s["down_bias"] = ((L, D), lay + ("embed",), "zeros")
    return s


def _gemma4_specs(cfg: ModelConfig, v: VisionConfig) -> dict[str, Spec]:
    """Gemma 4's tower (zoo.model.vision_gemma4): a bias-free patch projection, a (2, pos_table, D) position
    table, layers of four RMSNorms, GQA projections with q/k norms, a gated MLP (and each linear's clip bounds
    when clipped), the standardization buffers, and the connector's projection."""
    L, D, F, H, KV, Dh = v.num_layers, v.hidden_size, v.intermediate_size, v.num_heads, v.kv_heads, v.head_dim
    lay = ("layers",)
    s: dict[str, Spec] = {"vision.patch_embed": ((v.patch_dim, D), (None, "embed"), "normal"),
                          "vision.pos_embed": ((2, v.pos_table, D), (None, None, "embed"), "normal")}
    layer: dict[str, Spec] = {norm: ((L, D), lay + ("embed",), "ones")
                              for norm in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")}
    layer.update({"q_norm": ((L, Dh), lay + ("head_dim",), "ones"), "k_norm": ((L, Dh), lay + ("head_dim",), "ones"),
                  "q": ((L, D, H, Dh), lay + ("embed", "heads", "head_dim"), "normal"),
                  "k": ((L, D, KV, Dh), lay + ("embed", "kv_heads", "head_dim"), "normal"),
                  "v": ((L, D, KV, Dh), lay + ("embed", "kv_heads", "head_dim"), "normal"),
                  "o": ((L, H, Dh, D), lay + ("heads", "head_dim", "embed"), "normal"),
                  "gate": ((L, D, F), lay + ("embed", "mlp"), "normal"), "up": ((L, D, F), lay + ("embed", "mlp"), "normal"),
                  "down": ((L, F, D), lay + ("mlp", "embed"), "normal")})
    if v.clipped:  # (input min, input max, output min, output max) of each projection: buffers, never trained
        layer.update({f"{name}_{bound}": ((L, 1), lay + (None,), "zeros") for name in PROJECTIONS for bound in CLIP_BOUNDS})
    s.update({f"vision.layers.{name}": spec for name, spec in layer.items()})
    if v.standardize:
        s["vision.std_bias"] = ((D,), ("embed",), "zeros")
        s["vision.std_scale"] = ((D,), ("embed",), "ones")
    s["projector.proj"] = ((D, cfg.hidden_size), (None, "embed"), "normal")
    return s


# Gemma 4's tower layer's linears, each of which may carry clip bounds (zoo.model.vision_gemma4.PROJECTIONS)
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
CLIP_BOUNDS = ("in_min", "in_max", "out_min", "out_max")  # transformers' input_min, input_max, ... of each


def _qwen_specs(cfg: ModelConfig, v: VisionConfig) -> dict[str, Spec]:
    """Qwen2.5-VL's tower (a conv3d patch embedding without bias; RMSNorms; fused qkv and o with biases; a SwiGLU
    MLP with biases) and its patch merger (``ln_q``, then fc1 -> gelu -> fc2 with biases)."""
    L, D, F, H, Dh = v.num_layers, v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim
    lay, W = ("layers",), v.group * D
    s: dict[str, Spec] = {"vision.patch_embed": ((v.patch_dim, D), (None, "embed"), "normal")}
    layers: dict[str, Spec] = {
        "attn_norm": ((L, D), lay + ("embed",), "ones"),
        "mlp_norm": ((L, D), lay + ("embed",), "ones"),
        "qkv": ((L, D, 3, H, Dh), lay + ("embed", None, "heads", "head_dim"), "normal"),
        "qkv_bias": ((L, 3, H, Dh), lay + (None, "heads", "head_dim"), "zeros"),
        "o": ((L, H, Dh, D), lay + ("heads", "head_dim", "embed"), "normal"),
        "o_bias": ((L, D), lay + ("embed",), "zeros"),
        "down": ((L, F, D), lay + ("mlp", "embed"), "normal"),
        "down_bias": ((L, D), lay + ("embed",), "zeros"),
    }
    for name in ("gate", "up"):
        layers[name] = ((L, D, F), lay + ("embed", "mlp"), "normal")
        layers[f"{name}_bias"] = ((L, F), lay + ("mlp",), "zeros")
    s.update({f"vision.layers.{name}": spec for name, spec in layers.items()})
    s["projector.norm"] = ((D,), ("embed",), "ones")
    s["projector.fc1"] = ((W, W), (None, "mlp"), "normal")
    s["projector.fc1_bias"] = ((W,), ("mlp",), "zeros")
    s["projector.fc2"] = ((W, cfg.hidden_size), ("mlp", "embed"), "normal")
    s["projector.fc2_bias"] = ((cfg.hidden_size,), ("embed",), "zeros")
    return s


def _qwen3_specs(cfg: ModelConfig, v: VisionConfig) -> dict[str, Spec]:
    """Qwen3-VL's tower (a conv3d patch embedding with a bias, a square position table, LayerNorms with biases,
    fused qkv and o with biases, fc1 (``up``) and fc2 (``down``) with biases), its patch merger (a LayerNorm per
    patch, fc1 -> gelu -> fc2 with biases) and one merger a DeepStack level (``projector.deepstack.*``, stacked
    over the levels; their LayerNorm over a token's concatenated group)."""
    L, D, F, H, Dh = v.num_layers, v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim
    lay, W, E, K = ("layers",), v.group * D, cfg.hidden_size, len(v.deepstack_layers)
    s: dict[str, Spec] = {"vision.patch_embed": ((v.patch_dim, D), (None, "embed"), "normal"),
                          "vision.patch_bias": ((D,), ("embed",), "zeros"),
                          "vision.pos_embed": ((v.pos_table, D), (None, "embed"), "normal")}
    layers: dict[str, Spec] = {
        "qkv": ((L, D, 3, H, Dh), lay + ("embed", None, "heads", "head_dim"), "normal"),
        "qkv_bias": ((L, 3, H, Dh), lay + (None, "heads", "head_dim"), "zeros"),
        "o": ((L, H, Dh, D), lay + ("heads", "head_dim", "embed"), "normal"),
        "o_bias": ((L, D), lay + ("embed",), "zeros"),
        "up": ((L, D, F), lay + ("embed", "mlp"), "normal"),
        "up_bias": ((L, F), lay + ("mlp",), "zeros"),
        "down": ((L, F, D), lay + ("mlp", "embed"), "normal"),
        "down_bias": ((L, D), lay + ("embed",), "zeros"),
    }
    for norm in ("attn_norm", "mlp_norm"):
        layers[norm] = ((L, D), lay + ("embed",), "ones")
        layers[f"{norm}_bias"] = ((L, D), lay + ("embed",), "zeros")
    s.update({f"vision.layers.{name}": spec for name, spec in layers.items()})
    merger: dict[str, Spec] = {"fc1": ((W, W), (None, "mlp"), "normal"), "fc1_bias": ((W,), ("mlp",), "zeros"),
                               "fc2": ((W, E), ("mlp", "embed"), "normal"), "fc2_bias": ((E,), ("embed",), "zeros")}
    s.update({f"projector.{name}": spec for name, spec in merger.items()})
    s.update({"projector.norm": ((D,), ("embed",), "ones"), "projector.norm_bias": ((D,), ("embed",), "zeros")})
    if K:
        deep = {**merger, "norm": ((W,), (None,), "ones"), "norm_bias": ((W,), (None,), "zeros")}
        s.update({f"projector.deepstack.{name}": ((K, *shape), lay + axes, init)
                  for name, (shape, axes, init) in deep.items()})
    return s


def _llama4_specs(cfg: ModelConfig, v: VisionConfig) -> dict[str, Spec]:
    """Llama 4's tower (zoo.model.vision_llama4): a bias-free patch projection, the class token, a position table
    of a tile's patches and the class token, LayerNorms before and after the SigLIP-shaped layers; its connector:
    the adapter MLP (fc1, fc2, no biases) and the projection to the language model."""
    D, A = v.hidden_size, v.adapter_dim
    s: dict[str, Spec] = {"vision.patch_embed": ((v.patch_dim, D), (None, "embed"), "normal"),
                          "vision.class_embed": ((D,), ("embed",), "normal"),
                          "vision.pos_embed": ((v.patches_per_image + 1, D), (None, "embed"), "normal")}
    for norm in ("pre_norm", "final_norm"):
        s[f"vision.{norm}"] = ((D,), ("embed",), "ones")
        s[f"vision.{norm}_bias"] = ((D,), ("embed",), "zeros")
    s.update({f"vision.layers.{name}": spec for name, spec in _tower_layer_specs(v).items()})
    s.update({"projector.fc1": ((v.group * D, A), (None, "mlp"), "normal"),
              "projector.fc2": ((A, A), ("mlp", None), "normal"),
              "projector.proj": ((A, cfg.hidden_size), (None, "embed"), "normal")})
    return s


def vision_specs(cfg: ModelConfig) -> dict[str, Spec]:
    """Every weight of the image tower and its connector, by dotted path ({} for a text model)."""
    v = cfg.vision
    if v is None:
        return {}
    if v.tower == "gemma4":
        return _gemma4_specs(cfg, v)
    if v.tower == "qwen2_5":
        return _qwen_specs(cfg, v)
    if v.tower == "qwen3":
        return _qwen3_specs(cfg, v)
    if v.tower == "llama4":
        return _llama4_specs(cfg, v)
    D = v.hidden_size
    s: dict[str, Spec] = {
        "vision.patch_embed": ((v.patch_dim, D), (None, "embed"), "normal"),
        "vision.patch_bias": ((D,), ("embed",), "zeros"),
        "vision.pos_embed": ((v.patches_per_image, D), (None, "embed"), "normal"),
    }
    s.update({f"vision.layers.{name}": spec for name, spec in _tower_layer_specs(v).items()})
    s["vision.final_norm"] = ((D,), ("embed",), "ones")
    s["vision.final_norm_bias"] = ((D,), ("embed",), "zeros")
    if v.connector == "avg_pool":  # a group of patches averaged, Gemma's (1 + w) RMSNorm, then projected
        s["projector.norm"] = ((D,), ("embed",), "zeros")
        s["projector.proj"] = ((D, cfg.hidden_size), (None, "embed"), "normal")
    else:  # shuffle_linear: a group of patches concatenated, projected to the language model's width (no bias)
        s["projector.proj"] = ((v.group * D, cfg.hidden_size), (None, "embed"), "normal")
    return s
