"""Routed experts' LoRA adapters in PEFT's ``target_parameters`` layout (peft's ``lora.ParamWrapper``).

transformers 5 keeps a MoE layer's experts fused, as parameters of one module, not as a Linear per expert:
Mixtral's, DeepSeek-V2/V3's, Qwen3-MoE's, GLM-4.5's and MiniMax-M2's ``mlp.experts.gate_up_proj`` [experts, 2 * mlp,
embed] (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` [experts, embed, mlp]; gpt-oss's
``gate_up_proj`` [experts, embed, 2 * mlp] (gate and up alternating column by column) and ``down_proj``
[experts, mlp, embed], stored [in, out] (its experts module says ``is_transposed``). peft 0.21 adapts
such a parameter with ``target_parameters``: ``lora_A.weight`` [rank * experts, in] holds expert e's A in
rows ``e * rank ...`` (expert-major) and ``lora_B.weight`` [out, rank * experts] its B in columns
``j * experts + e`` (rank-major), so that expert e's delta is ``scaling * B_e @ A_e`` ([out, in], the
parameter's own layout, or its transpose for experts stored [in, out] as gpt-oss's): the factors are the same
for both orientations. Biases (gpt-oss's ``gate_up_proj_bias``, ``down_proj_bias``) are not adapted.

The zoo adapts gate and up apart (``expert_gate``, ``expert_up``: A [experts, embed, r], B [experts, r, mlp]);
their one fused parameter gets an adapter of rank ``r`` times the parts adapted: the parts' A stacked on the
rank axis and their B block-diagonal (zero where a part has none), with ``rank_pattern`` and
``alpha_pattern`` keeping the scale ``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``). That is what peft's own
conversion of per-expert adapters does (``PeftConcatenate``), so the delta of each part is unchanged.
Gemma 4's zoo stack is fused as transformers' is (``expert_gate_up`` [experts, embed, 2 * mlp], of
``layers.{i}.experts.gate_up_proj``), with one adapter of its own: its parameter has one part, of rank ``r``.

peft wraps a module once per targeted parameter, nesting the wrappers in the module's parameter order: the
first targeted parameter's adapter sits under ``base_layer.`` once per later one.

Families missing from :data:`EXPERTS_LAYOUTS` have no layout here, and their expert adapters are refused.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from zoo.model.config import ModelConfig

EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down", "expert_gate_up")  # the zoo's routed experts' weights
CONTRACT = 1  # input axes of an expert weight [experts, *in, *out] after the expert axis
TRANSFORM = "peft_experts"  # PlannedTensor.transform of these tensors (no weight transform of the export tables)


@dataclass(frozen=True)
class FusedParam:
    """One parameter of transformers' experts module and the zoo expert weights fused in it.

    ``parts`` are in the order they fill the parameter's output features; ``interleaved``: they alternate
    feature by feature (gpt-oss's gate/up) instead of following one another in blocks.
    """

    name: str
    parts: tuple[str, ...]
    interleaved: bool = False


@dataclass(frozen=True)
class ExpertsLayout:
    """Where a family's experts live in transformers 5 and how peft 0.21 sees them.

    ``module``: the experts module (``{i}``: the layer); ``params``: its adaptable parameters, in the module's
    parameter order. ``rewritten``: Linear names that peft rewrites, for this model type, into the fused
    experts' ``target_parameters`` (its conversion of transformers-4 adapters), so an adapter on a Linear of
    that name (a dense MLP, the shared experts) cannot be loaded as one.
    """

    module: str
    params: tuple[FusedParam, ...]
    rewritten: tuple[str, ...] = ()
    swapped: bool = False  # stored [in, out] with no is_transposed for peft: its lora_A is our B, its lora_B our A


_GATE_UP_DOWN = (FusedParam("gate_up_proj", ("expert_gate", "expert_up")), FusedParam("down_proj", ("expert_down",)))

# family -> its experts' layout (a line per family; a family without one has no PEFT layout for expert adapters).
EXPERTS_LAYOUTS: dict[str, ExpertsLayout] = {
    "mixtral": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("w1", "w2", "w3")),
    "deepseek_v2": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v32": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("gate_proj", "up_proj", "down_proj")),
    "qwen3_next": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("gate_proj", "up_proj", "down_proj")),
    # transformers 5 fuses MiniMax-M2's Mixtral-named experts (w1, w3 -> gate_up_proj; w2 -> down_proj) under mlp.
    "minimax_m2": ExpertsLayout("model.layers.{i}.mlp.experts", _GATE_UP_DOWN, ("w1", "w2", "w3")),
    # peft has no v4 conversion for gpt-oss (whose experts were always fused): no Linear name is rewritten.
    "gpt_oss": ExpertsLayout("model.layers.{i}.mlp.experts", (
        FusedParam("gate_up_proj", ("expert_gate", "expert_up"), interleaved=True),
        FusedParam("down_proj", ("expert_down",)))),
    # Llama 4's experts (Llama4TextExperts): gate_up_proj [experts, embed, 2 * mlp] (gate then up) and down_proj
    # [experts, mlp, embed], stored [in, out]; always fused, so no Linear name is rewritten.
    # peft 0.21 reads them [out, in] (Llama4TextExperts says no is_transposed): the factors swap (swapped_factor).
    "llama4": ExpertsLayout("model.layers.{i}.feed_forward.experts", _GATE_UP_DOWN, swapped=True),
    "gemma4": ExpertsLayout("model.layers.{i}.experts", (FusedParam("gate_up_proj", ("expert_gate_up",)),
                                                         FusedParam("down_proj", ("expert_down",)))),
}


def is_expert_weight(zoo_path: str) -> bool:
    """Whether the zoo weight ``zoo_path`` (``layers.expert_gate``) is a routed expert stack of :data:`EXPERT_WEIGHTS`
    (whether its export rule stacks a tensor per expert, as Mixtral's, or reads one fused tensor, as gpt-oss's)."""
    return zoo_path.rpartition(".")[2] in EXPERT_WEIGHTS


def target_parameter(layout: ExpertsLayout, fused: FusedParam) -> str:
    """peft's ``target_parameters`` entry (matched as a suffix of ``<module path>.<parameter>``)."""
    return f"{layout.module.rsplit('{i}.', 1)[-1]}.{fused.name}"


def adapted_params(layout: ExpertsLayout, adapted: set[str]) -> list[tuple[FusedParam, tuple[str, ...]]]:
    """(fused parameter, its parts that have adapters) for every parameter with at least one, in module order."""
    out = []
    for fused in layout.params:
        parts = tuple(p for p in fused.parts if p in adapted)
        if parts:
            out.append((fused, parts))
    return out


def module_key(layout: ExpertsLayout, layer: int, position: int, count: int) -> str:
    """The module path of the ``position``-th of ``count`` wrapped parameters of layer ``layer``'s experts."""
    return layout.module.format(i=layer) + ".base_layer" * (count - 1 - position)


def fused_rank(rank: int, parts: tuple[str, ...]) -> int:
    """The rank of a fused parameter's adapter: ``rank`` for each adapted part."""
    return rank * len(parts)


def fused_alpha(alpha: float, rslora: bool, parts: tuple[str, ...]) -> float:
    """The alpha that gives the fused adapter (rank ``rank * len(parts)``) the parts' own scale."""
    n = len(parts)
    return alpha * (math.sqrt(n) if rslora else n)


def lora_a(fused: FusedParam, parts: tuple[str, ...], a: dict[str, np.ndarray]) -> np.ndarray:
    """peft's ``lora_A.weight`` [rank * parts * experts, in] from one layer's zoo A of each adapted part
    (``a[part]`` [experts, *in, r]): expert-major rows, the parts' ranks one after another in each expert."""
    stacked = np.concatenate([a[p].reshape(a[p].shape[0], -1, a[p].shape[-1]) for p in parts], axis=-1)
    experts, fan_in, r = stacked.shape
    return np.ascontiguousarray(stacked.transpose(0, 2, 1).reshape(experts * r, fan_in))


def lora_b(fused: FusedParam, parts: tuple[str, ...], b: dict[str, np.ndarray]) -> np.ndarray:
    """peft's ``lora_B.weight`` [out, rank * parts * experts] from one layer's zoo B of each adapted part
    (``b[part]`` [experts, r, *out]): per expert block-diagonal over the fused parts (zeros for parts without
    an adapter), its columns rank-major (column ``j * experts + e``)."""
    first = b[parts[0]]
    experts, r = first.shape[:2]
    width = math.prod(first.shape[2:])
    n = len(fused.parts)
    full = np.zeros((experts, n * width, r * len(parts)), first.dtype)  # [experts, out, fused rank]
    for q, part in enumerate(parts):
        f = fused.parts.index(part)
        rows = slice(f, None, n) if fused.interleaved else slice(f * width, (f + 1) * width)
        full[:, rows, q * r:(q + 1) * r] = b[part].reshape(experts, r, width).transpose(0, 2, 1)
    return np.ascontiguousarray(full.transpose(1, 2, 0).reshape(n * width, -1))


def fused_factor(layout: ExpertsLayout, key: str, arrays: dict[str, np.ndarray], index: int) -> np.ndarray:
    """The lora_A or lora_B tensor ``key`` (``<stack>.<fused parameter>.<a|b>``) of stack layer ``index``, built
    from the adapters in ``arrays`` (zoo adapter path -> stacked array)."""
    stack, name, part = key.rsplit(".", 2)
    fused = next(p for p in layout.params if p.name == name)
    source = {"a": "b", "b": "a"}[part] if layout.swapped else part
    parts = tuple(p for p in fused.parts if f"{stack}.{p}.{source}" in arrays)
    pieces = {p: arrays[f"{stack}.{p}.{source}"][index] for p in parts}
    if layout.swapped:
        return swapped_factor(fused, parts, pieces, part)
    return lora_a(fused, parts, pieces) if part == "a" else lora_b(fused, parts, pieces)


def swapped_factor(fused: FusedParam, parts: tuple[str, ...], pieces: dict[str, np.ndarray], part: str) -> np.ndarray:
    """peft's lora_A (``part`` "a", from the zoo's B of each part) or lora_B ("b", from the zoo's A) of an expert
    parameter that peft reads [out, in] while the model multiplies x by it [in, out] (Llama 4's): expert e's delta
    ``B_e @ A_e`` is then our ``A_e @ B_e``, so lora_A [rank * experts, our out] holds our B's (expert-major rows)
    and lora_B [our in, rank * experts] our A's (rank-major columns)."""
    if part == "a":
        m = lora_b(fused, parts, pieces)  # [out, R * E], column j * E + e
        out, cols = m.shape
        experts = pieces[parts[0]].shape[0]
        return np.ascontiguousarray(m.reshape(out, cols // experts, experts).transpose(2, 1, 0).reshape(cols, out))
    m = lora_a(fused, parts, pieces)  # [E * R, in], row e * R + j
    experts = pieces[parts[0]].shape[0]
    rows, fan_in = m.shape
    return np.ascontiguousarray(m.reshape(experts, rows // experts, fan_in).transpose(2, 1, 0).reshape(fan_in, rows))


# A vision-language model's class -> where its language model's layers sit in transformers 5's module tree, in place
# of the text model's ``model.layers.`` that EXPERTS_LAYOUTS names (Qwen3.5-MoE's composite model holds them under
# ``model.language_model.``, as Gemma 4's does; Llama 4's under ``language_model.model.``), as their files and the
# export name them.
COMPOSITE_LAYERS = {"Qwen3_5MoeForConditionalGeneration": "model.language_model.layers.",
                    "Gemma4ForConditionalGeneration": "model.language_model.layers.",
                    "Llama4ForConditionalGeneration": "language_model.model.layers."}


def layout_of(cfg: ModelConfig) -> ExpertsLayout | None:
    """The family's experts layout (its module under a vision-language model's language model where
    :data:`COMPOSITE_LAYERS` places it), or None when peft has none here."""
    layout = EXPERTS_LAYOUTS.get(cfg.family)
    where = None if cfg.vision is None else COMPOSITE_LAYERS.get(cfg.vision.arch)
    if layout is None or where is None:
        return layout
    return dataclasses.replace(layout, module=layout.module.replace("model.layers.", where, 1))
