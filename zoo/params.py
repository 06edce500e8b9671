"""The parameter layout of the zoo decoder: shape and logical axes of every weight.

Paths are dotted (``layers.q``). Layer weights are stacked on a leading
``layers`` axis so that the forward pass can scan over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    """Shape, logical axis names and initializer kind of one parameter."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str  # "normal" | "ones" | "zeros"


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every parameter of a model with this config, by dotted path."""
    E, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    H, K, D, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    # A norm weight w scales by (norm_offset + w): Gemma's (1 + w) starts at zero.
    unit = "ones" if cfg.norm_offset == 0 else "zeros"
    s: dict[str, ParamSpec] = {
        "embed": ParamSpec((V, E), ("vocab", "embed"), "normal"),
        "layers.attn_norm": ParamSpec((L, E), ("layers", "embed"), unit),
        "layers.q": ParamSpec((L, E, H, D), ("layers", "embed", "heads", "head_dim"), "normal"),
        "layers.k": ParamSpec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "layers.v": ParamSpec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "layers.o": ParamSpec((L, H, D, E), ("layers", "heads", "head_dim", "embed"), "normal"),
        "layers.mlp_norm": ParamSpec((L, E), ("layers", "embed"), unit),
        "layers.gate": ParamSpec((L, E, F), ("layers", "embed", "mlp"), "normal"),
        "layers.up": ParamSpec((L, E, F), ("layers", "embed", "mlp"), "normal"),
        "layers.down": ParamSpec((L, F, E), ("layers", "mlp", "embed"), "normal"),
        "final_norm": ParamSpec((E,), ("embed",), unit),
    }
    if cfg.qkv_bias:
        s["layers.q_bias"] = ParamSpec((L, H, D), ("layers", "heads", "head_dim"), "zeros")
        s["layers.k_bias"] = ParamSpec((L, K, D), ("layers", "kv_heads", "head_dim"), "zeros")
        s["layers.v_bias"] = ParamSpec((L, K, D), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.o_bias:
        s["layers.o_bias"] = ParamSpec((L, E), ("layers", "embed"), "zeros")
    if cfg.qk_norm:
        s["layers.q_norm"] = ParamSpec((L, D), ("layers", "head_dim"), unit)
        s["layers.k_norm"] = ParamSpec((L, D), ("layers", "head_dim"), unit)
    if cfg.post_norms:
        s["layers.post_attn_norm"] = ParamSpec((L, E), ("layers", "embed"), unit)
        s["layers.post_mlp_norm"] = ParamSpec((L, E), ("layers", "embed"), unit)
    if cfg.mlp_bias:
        s["layers.gate_bias"] = ParamSpec((L, F), ("layers", "mlp"), "zeros")
        s["layers.up_bias"] = ParamSpec((L, F), ("layers", "mlp"), "zeros")
        s["layers.down_bias"] = ParamSpec((L, E), ("layers", "embed"), "zeros")
    if not cfg.tie_word_embeddings:
        s["lm_head"] = ParamSpec((E, V), ("embed", "vocab"), "normal")
    return s


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{'layers.q': x} -> {'layers': {'q': x}}."""
    out: dict[str, Any] = {}
    for path, v in flat.items():
        *parents, leaf = path.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`nest`."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def count_params(cfg: ModelConfig) -> int:
    """Total number of parameters of a model with this config."""
    total = 0
    for spec in param_specs(cfg).values():
        n = 1
        for d in spec.shape:
            n *= d
        total += n
    return total
