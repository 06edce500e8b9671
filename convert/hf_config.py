"""Hugging Face config.json <-> ModelConfig, one small field table per family."""

from __future__ import annotations

from typing import Any

from zoo.config import ModelConfig, RopeConfig
from zoo.errors import UserError

# architecture (or model_type, for configs that lack `architectures`) -> zoo family
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
}
MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
}

SUPPORTED_ROPE = ("default", "linear", "llama3")


def family_of(hf: dict[str, Any], where: str) -> str:
    """The zoo family of an HF config, or a UserError naming what is supported."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    got = ", ".join(archs) or f"model_type={hf.get('model_type')!r}"
    raise UserError(
        f"{where}: architecture {got} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def _rope(hf: dict[str, Any], where: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs (most of the Hub) use
    # `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE:
        raise UserError(f"{where}: rope type {kind!r} is not supported for this family; supported: {SUPPORTED_ROPE}")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Translate an HF config dict into a ModelConfig; unsupported settings are UserErrors."""
    family = family_of(hf, where)
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        cfg = ModelConfig(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope(hf, where),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=str(hf.get("hidden_act", "silu")),
        )
    except KeyError as e:
        raise UserError(f"{where}: required field {e.args[0]!r} is missing") from None
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise UserError(f"{where}: pretraining_tp={hf['pretraining_tp']} is not supported; set it to 1")
    from zoo.layers import ACTIVATIONS

    if cfg.hidden_act not in ACTIVATIONS:
        raise UserError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return cfg


# zoo family -> (model_type, architecture) written on export
EXPORT_NAMES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
}


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """A Hugging Face config dict for ``cfg`` (used when no source config was kept or it no longer fits)."""
    model_type, arch = EXPORT_NAMES[cfg.family]
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": cfg.hidden_act,
        # The pre-5.0 spelling: every version of transformers (and vLLM) reads it.
        "rope_theta": cfg.rope.theta,
        "rope_scaling": None,
    }
    r = cfg.rope
    if r.kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": r.factor}
    elif r.kind == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }
    return out


def export_hf_config(cfg: ModelConfig, source: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """The config.json to export: the source's own config when it still describes ``cfg``
    (so a round trip gives back the same file), else one generated from ``cfg``."""
    out: dict[str, Any]
    try:
        keep = source is not None and model_config_from_hf(source) == cfg
    except UserError:
        keep = False
    out = dict(source) if keep else hf_config_from_model(cfg)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if source and k in source and k not in out:
            out[k] = source[k]
    if not out.get("architectures"):
        out["architectures"] = [EXPORT_NAMES[cfg.family][1]]
    out.setdefault("model_type", EXPORT_NAMES[cfg.family][0])
    if "dtype" in out:
        out["dtype"] = dtype
    if "torch_dtype" in out or "dtype" not in out:
        out["torch_dtype"] = dtype
    return out
