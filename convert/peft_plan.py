"""Where each tensor of a PEFT adapter export comes from: peft's lora_A / lora_B layout of each export
transform, and the plan of ``adapter_model.safetensors`` (names, shapes, dtypes, offsets) from an adapter
checkpoint's model.json, fused Linears' and routed experts' adapters included (convert/peft_experts.py).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from convert import peft_experts
from convert.convert import shape_only
from convert.export import ST_NAMES, PlannedTensor, assign_shards
from convert.fused import fused_named, fusion_of
from convert.rules import BoundRule
from convert.tables import export_format, table_for
from convert.transforms import TRANSFORMS
from zoo.errors import UserError
from zoo.lora.params import HF_TO_ZOO, whole_weights
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs

PEFT_PREFIX = "base_model.model."  # what PeftModel puts in front of the wrapped model's module paths


@dataclass(frozen=True)
class LoraLayout:
    """How one export transform lays out a LoRA pair for peft.

    ``a``: one layer's zoo A [*in, r] -> lora_A [r, in_features];
    ``b``: one layer's zoo B [r, *out] -> lora_B [out_features, r].
    """

    a: Callable[[np.ndarray], np.ndarray]
    b: Callable[[np.ndarray], np.ndarray]


def _flat_a(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1]).T


def _flat_b(b: np.ndarray) -> np.ndarray:
    return b.reshape(b.shape[0], -1).T


# These transforms write a zoo weight [*in, *out] as the torch weight [out, in] with the in and out axes each
# flattened in order (no permutation), so the inverse of scale * A @ B is scale * flat(B).T @ flat(A).T.
# Transforms that permute rows (GGUF's and MLA's RoPE orders) are absent: their adapters would need the
# permutation too, and no adapter targets them (MLA attention has no adapters; GGUF is not an export format);
# Llama 4's (rope_pairs_*) permute B's rows below.
_FLAT = LoraLayout(_flat_a, _flat_b)


LORA_LAYOUTS: dict[str, LoraLayout] = {"transpose": _FLAT, "q_in": _FLAT, "kv_in": _FLAT, "o_out": _FLAT}


def _rope_pairs_b(b: np.ndarray) -> np.ndarray:
    """Llama 4's q/k B [r, heads, head_dim] (each head rotate-half ordered) -> lora_B [heads * head_dim, r] in the
    checkpoint's interleaved pairs (convert.transforms' rope_pairs_*): dimension j of the first half is row 2j,
    of the second half row 2j + 1."""
    r, h, d = b.shape
    return b.reshape(r, h, 2, d // 2).swapaxes(2, 3).reshape(r, -1).T


LORA_LAYOUTS.update({"rope_pairs_q_in": LoraLayout(_flat_a, _rope_pairs_b),
                     "rope_pairs_k_in": LoraLayout(_flat_a, _rope_pairs_b)})
# A vision tower's attention (convert.transforms._tower): q_in / o_out at the tower's heads, Gemma 4's kv_in at
# its key/value heads, the Qwen towers' fused qkv [D, 3, heads, head_dim] <-> [3 * heads * head_dim, D]: flat as well.
LORA_LAYOUTS.update({"vq_in": _FLAT, "vo_out": _FLAT, "vkv_in": _FLAT, "vqkv_in": _FLAT})

# PlannedTensor.transform of a bare parameter's adapter (peft's ``target_parameters``, its ``ParamWrapper``): Gemma 3's
# connector projection, an [in, out] parameter read as ``x @ W``, which peft sees as [out_features, in_features] =
# [in, out] swapped: its lora_B [in, r] is the zoo's A and its lora_A [r, out] the zoo's B, as they are, so that
# ``scale * lora_B @ lora_A`` is the zoo's ``scale * A @ B`` in the parameter's own layout.
PARAMETER = "parameter"
# The HF names of the bare parameters peft adapts so (each read as x @ W, stored [in, out]).
PARAMETER_TARGETS = ("multi_modal_projector.mm_input_projection_weight",)

# Export format -> (the name's prefix as the export writes it, the module path transformers 5 gives it), first
# match wins: where transformers 5 saves a vision-language model under its older names (its checkpoint conversion
# undone on save), peft still sees the modules where the model holds them, and matches and loads by those paths.
MODULE_PATHS: dict[str, tuple[tuple[str, str], ...]] = {
    "hf-gemma3-multimodal": (("language_model.model.", "model.language_model."), ("language_model.lm_head", "lm_head"),
                             ("vision_tower.vision_model.", "model.vision_tower."),
                             ("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector.")),
    "hf-qwen2_5-vl": (("model.", "model.language_model."), ("visual.", "model.visual.")),
}


def module_path(cfg: ModelConfig, name: str) -> str:
    """The path peft sees the module (or parameter) of the exported tensor ``name`` at (:data:`MODULE_PATHS`)."""
    for prefix, path in MODULE_PATHS.get(export_format(cfg), ()):
        if name.startswith(prefix):
            return path + name.removeprefix(prefix)
    return name


# PlannedTensor.transform of a fused Linear's adapter (Phi-3's qkv_proj, gate_up_proj: convert.fused): its parts'
# adapters as one of rank ``rank`` times the parts adapted, as convert.peft_experts lays out fused experts.
FUSED = "fused_linear"


# Gemma 4's full layers' attention: the same layouts at that kind's head_dim (convert.transforms._global).
LORA_LAYOUTS.update({"global_q_in": _FLAT, "global_kv_in": _FLAT, "global_o_out": _FLAT})
# Qwen3-Next's linear layers' projections (convert.transforms._linear_heads, lin_out): flat as well.
LORA_LAYOUTS.update({"lin_k_in": _FLAT, "lin_v_in": _FLAT, "lin_out": _FLAT})


# PlannedTensor.transform prefix of a weight trained whole (a reward model's score head, zoo.lora.params.whole_weights):
# written as the merged model's tensor, under peft's name for a module to save (``base_model.model.score.weight``),
# followed by the table's own export transform.
WHOLE = "whole:"


def adapter_paths(meta: dict[str, Any]) -> set[str]:
    """The base weights an adapter checkpoint's LoRA pairs adapt (not the weights it trained whole)."""
    return {p.rpartition(".")[0] for p in meta["lora"]["params"]
            if p not in whole_weights(ModelConfig.from_dict(meta["config"]))}


def _adapted_rules(cfg: ModelConfig, meta: dict[str, Any], ckpt: str | os.PathLike) -> list[BoundRule]:
    """The export rules of the adapted weights, in the table's (Hub) order; refuses what peft cannot load.

    Routed experts' rules are among them only where :mod:`convert.peft_experts` has the family's layout."""
    adapted = adapter_paths(meta)
    rules = [r for r in table_for(cfg.family, export_format(cfg), cfg) if r.zoo in adapted]
    missing = adapted - {r.zoo for r in rules}
    if missing:
        raise UserError(f"{ckpt}: adapters on {sorted(missing)}, which the {cfg.family} export table does not name; "
                        "the checkpoint is damaged")
    layout = peft_experts.layout_of(cfg)
    for rule in rules:
        if peft_experts.is_expert_weight(rule.zoo):
            if layout is None:
                # transformers fuses routed experts into one parameter per projection: no Linear for peft to wrap,
                # and no target_parameters layout known here for this family.
                raise UserError(f"{ckpt}: adapters on routed experts ({rule.zoo}) have no PEFT layout for "
                                f"{cfg.family}; export the merged model instead (zoo export without --adapter)")
            continue
        fused = fusion_of(cfg, rule.hf)
        if fused is not None and (fused[1].interleaved or fused[1].axis != 0):
            # Its parts' rows are not blocks of a Linear's output features: no block-diagonal lora_B holds them.
            raise UserError(f"{ckpt}: adapters on {rule.zoo} have no PEFT layout: {cfg.family}'s "
                            f"{fused[0].rsplit('.', 2)[-2]} is one module in transformers, which peft adapts as a "
                            "whole; export the merged model instead (zoo export without --adapter)")
        if rule.hf in PARAMETER_TARGETS:
            continue
        if rule.transform not in LORA_LAYOUTS or not rule.hf.endswith(".weight"):
            raise UserError(f"{ckpt}: adapters on {rule.zoo} ({rule.transform} layout) have no PEFT layout; "
                            "export the merged model instead (zoo export without --adapter)")
        leaf = rule.hf.removesuffix(".weight").rpartition(".")[2]
        if layout is not None and leaf in layout.rewritten:
            raise UserError(f"{ckpt}: adapters on {rule.zoo} ({leaf}) cannot load in peft: for a {cfg.family} model "
                            f"peft rewrites {leaf} targets to the fused routed experts; export the merged model "
                            "instead, or train with targets experts.gate_proj, experts.up_proj, experts.down_proj")
    return rules


def _expert_tensors(cfg: ModelConfig, meta: dict[str, Any], rules: list[BoundRule], dtype: str | None
                    ) -> list[tuple[tuple[int, int, str], PlannedTensor]]:
    """The routed experts' adapter tensors in peft's target_parameters layout (:mod:`convert.peft_experts`),
    keyed for :func:`plan_adapter`'s order. ``PlannedTensor.zoo`` is ``<stack>.<fused parameter>.<a|b>``."""
    layout = peft_experts.layout_of(cfg)
    experts_rules = [r for r in rules if peft_experts.is_expert_weight(r.zoo)]
    stacks = dict.fromkeys(r.zoo.rpartition(".")[0] for r in experts_rules)
    if layout is None or not stacks:
        return []
    stored, r = meta["lora"]["params"], meta["lora"]["rank"]
    specs = param_specs(cfg)
    keyed = []
    for stack in stacks:
        layers = next(rule.layers for rule in experts_rules if rule.zoo.startswith(stack + "."))
        assert layers is not None  # expert rules are stacked over their layers
        adapted = {name for name in peft_experts.EXPERT_WEIGHTS if f"{stack}.{name}" in {x.zoo for x in rules}}
        fused = peft_experts.adapted_params(layout, adapted)
        for pos, (param, parts) in enumerate(fused):
            spec_a, spec_b = specs[f"{stack}.{parts[0]}"], specs[f"{stack}.{parts[-1]}"]
            experts = spec_a.shape[1]
            rank = peft_experts.fused_rank(r, parts)
            fan_in = math.prod(spec_a.shape[2:2 + peft_experts.CONTRACT])
            fan_out = len(param.parts) * math.prod(spec_b.shape[2 + peft_experts.CONTRACT:])
            if layout.swapped:  # peft reads the parameter [out, in] (convert.peft_experts.swapped_factor)
                fan_in, fan_out = fan_out, fan_in
            for part, shape in (("a", (rank * experts, fan_in)), ("b", (fan_out, rank * experts))):
                dt = dtype or stored[f"{stack}.{parts[0]}.{part}"]["dtype"]
                if dt not in ST_NAMES:
                    raise UserError(f"adapter {stack}.{parts[0]}.{part} has dtype {dt}, which safetensors export "
                                    "does not support")
                for i, layer in enumerate(layers):
                    module = PEFT_PREFIX + peft_experts.module_key(layout, layer, pos, len(fused))
                    keyed.append(((layer, 10**6 + pos, part),
                                  PlannedTensor(f"{module}.lora_{part.upper()}.weight", f"{stack}.{param.name}.{part}",
                                                (i,), peft_experts.TRANSFORM, shape, dt)))
    return keyed


def fused_groups(cfg: ModelConfig, rules: list[BoundRule]) -> list[tuple[str, list[BoundRule | None]]]:
    """(fused HF Linear (its name, ``{i}`` for the layer), the rule of each of its parts in the fused tensor's
    order: None for a part without adapters) of the adapted rules that :mod:`convert.fused` fuses, one per layer
    stack that holds it (Qwen3-Next's in_proj_qkvz in its MoE and its dense layers: two groups of one name)."""
    groups: dict[tuple[str, str], list[BoundRule | None]] = {}
    for rule in rules:
        found = fusion_of(cfg, rule.hf)
        if found is not None and not peft_experts.is_expert_weight(rule.zoo):
            name, fusion, k = found
            groups.setdefault((name, rule.zoo.partition(".")[0]), [None] * len(fusion.parts))[k] = rule
    return [(name, parts) for (name, _), parts in groups.items()]


def _fused_key(parts: list[BoundRule | None]) -> str:
    """``PlannedTensor.zoo`` of a fused Linear's adapter (before ``.a``/``.b``): its parts' zoo parameters in
    order, ``-`` for a part without adapters, joined by ``+``."""
    return "+".join("-" if r is None else r.zoo for r in parts)


def _fused_tensors(cfg: ModelConfig, meta: dict[str, Any], rules: list[BoundRule], dtype: str | None
                   ) -> list[tuple[tuple[int, int, str], PlannedTensor]]:
    """The adapter tensors of fused Linears (transform :data:`FUSED`), keyed for :func:`plan_adapter`'s order:
    lora_A [rank * adapted parts, in] (the parts' A stacked on the rank axis) and lora_B [out, rank * adapted
    parts] (their B block-diagonal, zero rows for a part without adapters)."""
    specs, stored, r = param_specs(cfg), meta["lora"]["params"], meta["lora"]["rank"]
    keyed = []
    for name, parts in fused_groups(cfg, rules):
        adapted = [rule for rule in parts if rule is not None]
        first = adapted[0]
        assert first.layers is not None  # fused tensors are per layer
        fan_in = TRANSFORMS[first.transform].inverse(shape_only(specs[first.zoo].shape[1:]), cfg).shape[1]
        fusion = fused_named(cfg, name)
        rows = fusion.group_count(cfg) * sum(fusion.part_sizes(cfg))
        pos = min(rules.index(rule) for rule in adapted)
        key = _fused_key(parts)
        for part, shape in (("a", (r * len(adapted), fan_in)), ("b", (rows, r * len(adapted)))):
            dts = {stored[f"{rule.zoo}.{part}"]["dtype"] for rule in adapted}
            if dtype is None and len(dts) != 1:
                raise UserError(f"adapters on {', '.join(rule.zoo for rule in adapted)} have dtypes {sorted(dts)} "
                                f"but peft adapts {name.rsplit('.', 2)[-2]} as one module; export with --dtype")
            dt = dtype or dts.pop()
            if dt not in ST_NAMES:
                raise UserError(f"adapter {first.zoo}.{part} has dtype {dt}, which safetensors export does not support")
            for ix in first.indices():
                module = PEFT_PREFIX + module_path(cfg, name.format(i=first.layers[ix[0]])).removesuffix(".weight")
                keyed.append(((first.layers[ix[0]], pos, part),
                              PlannedTensor(f"{module}.lora_{part.upper()}.weight", f"{key}.{part}", ix, FUSED,
                                            shape, dt)))
    return keyed


def plan_adapter(ckpt: str | os.PathLike, meta: dict[str, Any], dtype: str | None = None) -> list[PlannedTensor]:
    """Every tensor of ``adapter_model.safetensors``, layer by layer in module order, with its offset.

    ``PlannedTensor.zoo`` is the adapter parameter (``layers.q.a``), ``index`` its layer and
    ``transform`` the base weight's export transform (the key into :data:`LORA_LAYOUTS`); routed experts'
    tensors (transform ``peft_experts.TRANSFORM``) follow their layer's other adapters.
    """
    cfg = ModelConfig.from_dict(meta["config"])
    specs, stored, r = param_specs(cfg), meta["lora"]["params"], meta["lora"]["rank"]
    rules = _adapted_rules(cfg, meta, ckpt)
    keyed = _expert_tensors(cfg, meta, rules, dtype) + _fused_tensors(cfg, meta, rules, dtype)
    for pos, rule in enumerate(rules):
        if peft_experts.is_expert_weight(rule.zoo) or fusion_of(cfg, rule.hf) is not None:
            continue
        if rule.hf in PARAMETER_TARGETS:
            keyed += _parameter_tensors(cfg, meta, rule, dtype)
            continue
        piece = specs[rule.zoo].shape[rule.slice_axes:]
        out_f, in_f = TRANSFORMS[rule.transform].inverse(shape_only(piece), cfg).shape
        for part, shape in (("a", (r, in_f)), ("b", (out_f, r))):
            dt = dtype or stored[f"{rule.zoo}.{part}"]["dtype"]
            if dt not in ST_NAMES:
                raise UserError(f"adapter {rule.zoo}.{part} has dtype {dt}, which safetensors export does not support")
            for ix in rule.indices():
                module = PEFT_PREFIX + module_path(cfg, rule.hf_name(ix)).removesuffix(".weight")
                name = f"{module}.lora_{part.upper()}.weight"
                layer = rule.layers[ix[0]] if rule.layers is not None else -1
                keyed.append(((layer, pos, part), PlannedTensor(name, f"{rule.zoo}.{part}", ix or None,
                                                                rule.transform, shape, dt)))
    keyed.sort(key=lambda kt: kt[0])
    tensors = [t for _, t in keyed] + _whole_tensors(cfg, meta, dtype)
    assign_shards(tensors, max_bytes=2**63)  # one file: adapters are small
    return tensors


def _parameter_tensors(cfg: ModelConfig, meta: dict[str, Any], rule: BoundRule, dtype: str | None
                       ) -> list[tuple[tuple[int, int, str], PlannedTensor]]:
    """The adapter of a bare parameter (:data:`PARAMETER`), keyed after the layers' adapters: lora_A [r, out] (the
    zoo's B) and lora_B [in, r] (the zoo's A), on the module that holds the parameter."""
    stored, r = meta["lora"]["params"], meta["lora"]["rank"]
    fan_in, fan_out = param_specs(cfg)[rule.zoo].shape
    module = PEFT_PREFIX + module_path(cfg, rule.hf).rpartition(".")[0]
    out = []
    for peft_part, zoo_part, shape in (("A", "b", (r, fan_out)), ("B", "a", (fan_in, r))):
        dt = dtype or stored[f"{rule.zoo}.{zoo_part}"]["dtype"]
        if dt not in ST_NAMES:
            raise UserError(f"adapter {rule.zoo}.{zoo_part} has dtype {dt}, which safetensors export does not support")
        out.append(((10**9, 0, peft_part), PlannedTensor(f"{module}.lora_{peft_part}.weight", f"{rule.zoo}.{zoo_part}",
                                                          None, PARAMETER, shape, dt)))
    return out


def parameter_targets(cfg: ModelConfig, tensors: list[PlannedTensor]) -> list[str]:
    """peft's ``target_parameters`` of the bare parameters adapted (:data:`PARAMETER`): their paths in the model."""
    rules = {r.zoo: r for r in table_for(cfg.family, export_format(cfg), cfg)}
    zoo = dict.fromkeys(t.zoo.rpartition(".")[0] for t in tensors if t.transform == PARAMETER)
    return [module_path(cfg, rules[z].hf) for z in zoo]


def _whole_tensors(cfg: ModelConfig, meta: dict[str, Any], dtype: str | None) -> list[PlannedTensor]:
    """The weights trained whole (:func:`zoo.lora.params.whole_weights`) as the merged model's tensors under peft's
    names, after the adapters (peft's own order: modules to save last)."""
    specs, stored = param_specs(cfg), meta["lora"]["params"]
    rules = {r.zoo: r for r in table_for(cfg.family, export_format(cfg), cfg)}
    out = []
    for p in whole_weights(cfg):
        rule = rules[p]
        shape = TRANSFORMS[rule.transform].inverse(shape_only(specs[p].shape), cfg).shape
        dt = dtype or stored[p]["dtype"]
        out.append(PlannedTensor(PEFT_PREFIX + rule.hf, p, None, WHOLE + rule.transform, tuple(shape), dt))
    return out


def modules_to_save(tensors: list[PlannedTensor]) -> list[str]:
    """peft's ``modules_to_save``: the modules of the weights trained whole (a reward model's ``score``)."""
    return [t.name.removeprefix(PEFT_PREFIX).removesuffix(".weight") for t in tensors if t.transform.startswith(WHOLE)]


def target_modules_of(tensors: list[PlannedTensor]) -> list[str]:
    """peft's ``target_modules``: the exported modules' own names, in :data:`HF_TO_ZOO` order first."""
    names = {t.name.removesuffix(".weight").rsplit(".", 2)[-2] for t in tensors
             if t.transform not in (peft_experts.TRANSFORM, PARAMETER) and not t.transform.startswith(WHOLE)}
    return [n for n in HF_TO_ZOO if n in names] + sorted(names - set(HF_TO_ZOO))


def target_regex(tensors: list[PlannedTensor]) -> str:
    """peft's ``target_modules`` as one regex (peft matches a string in full against each module's path) of the
    adapted modules' paths, every layer index as ``\\d+`` (the index of a tensor stacked over layers or levels;
    a module's own number, Qwen2.5-VL's merger's ``mlp.0``, stays): a vision-language model's tower has modules of
    the language model's names (``q_proj``, ``k_proj``, ``v_proj``), so a list of names would adapt both where the
    adapters are one's alone."""
    modules = {t.name.removeprefix(PEFT_PREFIX).removesuffix(".weight").rsplit(".", 1)[0]: t.index is not None
               for t in tensors
               if t.transform not in (peft_experts.TRANSFORM, PARAMETER) and not t.transform.startswith(WHOLE)}
    patterns = dict.fromkeys(r"\.".join(r"\d+" if stacked and part.isdigit() else re.escape(part)
                                        for part in m.split(".")) for m, stacked in modules.items())
    return "|".join(patterns)
