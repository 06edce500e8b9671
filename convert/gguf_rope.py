"""llama3 RoPE scaling read back from a GGUF file's ``rope_freqs`` tensor.

llama.cpp's convert_hf_to_gguf.py writes a model's llama3 RoPE scaling (Llama 3.1 to 3.3, Llama 4 Scout) as no
metadata key but a tensor, ``rope_freqs.weight``: the factor each rotary frequency is divided by
(``LlamaModel.generate_extra_tensors``, which ``Llama4Model`` inherits). Its llama and llama4 graphs divide by them;
transformers (and lmzoo) compute the same frequencies from ``rope_scaling``'s parameters. So the parameters are
recovered here, checked to give the file's factors, and the tensor is dropped.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zoo.errors import UserError

ROPE_FREQS = "rope_freqs.weight"
# The architectures whose files carry it (llama.cpp's LlamaModel and its Llama4Model).
ROPE_FREQS_ARCHS = ("llama", "llama4")
# llama.cpp's original context when the config has no top-level original_max_position_embeddings (the released
# configs keep it inside rope_scaling, which llama.cpp does not read: 8192 for Llama 3.1 to 3.3 and Llama 4 Scout).
DEFAULT_ORIGINAL_CONTEXT = 8192
# (low_freq_factor, high_freq_factor) of the released llama3-scaled models: Llama 3.1 to 3.3, Llama 4 Scout. Tried
# when the factors cannot fix them (fewer than two frequencies between the two bands: any band edges in the same
# gaps give the same factors).
RELEASED_BANDS = ((1.0, 4.0), (1.0, 1.0))


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """Each rotary frequency's divisor under llama3 scaling, as llama.cpp's converter computes them: 1 above the
    high-frequency band, ``factor`` below the low one, a smooth blend between."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out)


def _fitted_bands(factors: np.ndarray, theta: float, dim: int, factor: float,
                  original: float) -> tuple[float, float] | None:
    """(low, high) from the blended frequencies' factors, when two or more lie between the bands: each blend is
    linear in original / wavelength."""
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if between.sum() < 2 or factor <= 1:
        return None
    x = original * (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))[between] / (2 * math.pi)
    s = (1 / factors[between].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
    slope = (s[-1] - s[0]) / (x[-1] - x[0])
    if slope == 0:
        return None
    low = x[0] - s[0] / slope
    return round(float(low), 4), round(float(low + 1 / slope), 4)


def llama3_scaling(factors: np.ndarray, raw: dict[str, Any], meta: dict[str, Any], arch: str,
                   where: str) -> dict[str, Any]:
    """The ``rope_scaling`` whose llama3 factors are ``factors`` (the file's rope_freqs), for the config ``raw``
    read so far (its rope_theta and head_dim): the factor and original context from the file's
    ``rope.scaling.*`` keys where present, else the factors' largest and llama.cpp's 8192; the bands fitted, or
    the released models'. Factors no such scaling gives: UserError naming the tensor."""
    theta = float(raw.get("rope_theta", 10000.0))
    dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    factors = np.asarray(factors, np.float64).reshape(-1)
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or factors.max(initial=1.0))
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or DEFAULT_ORIGINAL_CONTEXT)
    fitted = _fitted_bands(factors, theta, dim, factor, original)
    for low, high in ([fitted] if fitted else []) + list(RELEASED_BANDS):
        want = llama3_factors(theta, dim, factor, low, high, original)
        if want.shape == factors.shape and np.allclose(factors, want, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise UserError(f"{where}: {ROPE_FREQS} ({factors.size} factors, largest {factor:g}) is no llama3 RoPE scaling "
                    f"of rope_theta {theta:g} and head_dim {dim}; convert the model's safetensors checkpoint instead")
