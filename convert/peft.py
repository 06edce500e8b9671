"""LoRA adapter checkpoint -> PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

peft names each adapter after the module it wraps: ``base_model.model.<module
path>.lora_A.weight`` [r, in_features] and ``.lora_B.weight`` [out_features, r],
with ``delta W = scale * B @ A`` on a torch Linear weight W [out, in]. Module
paths come from the conversion tables (the HF weight name minus ``.weight``),
so they are the names of the merged model that ``zoo export`` writes.

Written with numpy and JSON only: peft and torch stay test-only dependencies.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convert import peft_experts
from convert.convert import DTYPES, shape_only
from convert.export import DTYPES_ALL, ST_NAMES, PlannedTensor, assign_shards, export, planned_files, safetensors_header
from convert.fused import fused_named, fusion_of, join
from convert.model_card import (
    EvalResults,
    card_data,
    eval_lines,
    origin_of,
    read_eval_results,
    render,
    trained_with,
    training_lines,
    training_of,
)
from convert.tables import BoundRule, table_for
from convert.transforms import TRANSFORMS
from zoo.checkpoints import quantized as quant_checkpoint
from zoo.checkpoints.adapter import base_checkpoint, base_location
from zoo.checkpoints.format import MODEL_FILE, read_meta
from zoo.checkpoints.provenance import hub_id, hub_weights
from zoo.checkpoints.readers import load_param_numpy
from zoo.checkpoints.writer import atomic_output, prepare_output
from zoo.errors import UserError
from zoo.lora.adapters import HF_TO_ZOO, WHOLE_WEIGHTS, whole_weights
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
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
# permutation too, and no adapter targets them (MLA attention has no adapters; GGUF is not an export format).
_FLAT = LoraLayout(_flat_a, _flat_b)
LORA_LAYOUTS: dict[str, LoraLayout] = {"transpose": _FLAT, "q_in": _FLAT, "kv_in": _FLAT, "o_out": _FLAT}
# PlannedTensor.transform of a fused Linear's adapter (Phi-3's qkv_proj, gate_up_proj: convert.fused): its parts'
# adapters as one of rank ``rank`` times the parts adapted, as convert.peft_experts lays out fused experts.
FUSED = "fused_linear"
# Gemma 4's full layers' attention: the same layouts at that kind's head_dim (convert.transforms._global).
LORA_LAYOUTS.update({"global_q_in": _FLAT, "global_kv_in": _FLAT, "global_o_out": _FLAT})
# PlannedTensor.transform prefix of a weight trained whole (a reward model's score head, zoo.lora.adapters.whole_weights):
# written as the merged model's tensor, under peft's name for a module to save (``base_model.model.score.weight``),
# followed by the table's own export transform.
WHOLE = "whole:"


def _adapter_paths(meta: dict[str, Any]) -> set[str]:
    """The base weights an adapter checkpoint's LoRA pairs adapt (not the weights it trained whole)."""
    return {p.rpartition(".")[0] for p in meta["lora"]["params"]
            if p not in whole_weights(ModelConfig.from_dict(meta["config"]))}

def adapter_meta_of(ckpt: str | os.PathLike) -> dict[str, Any]:
    """model.json of an adapter checkpoint; a UserError naming ``ckpt`` for any other checkpoint."""
    meta = read_meta(ckpt)
    if "lora" not in meta:
        raise UserError(f"{ckpt} is not a LoRA adapter checkpoint (its {MODEL_FILE} has no lora entry); "
                        "export it without --adapter")
    return meta


def _base_meta(base: Path) -> dict[str, Any] | None:
    """The base's model.json, or None when it is gone or unreadable (a PEFT export only names the base)."""
    try:
        return json.loads((base / MODEL_FILE).read_text())
    except (OSError, ValueError):
        return None


def base_model_ref(ckpt: str | os.PathLike, meta: dict[str, Any], base_out: str | os.PathLike | None = None) -> str:
    """peft's ``base_model_name_or_path``: the folder ``base_out`` when the base is exported there beside the
    adapter, else the Hub repo id whose model the base is, else the base checkpoint's path.

    The repo comes from the adapter checkpoint's own record (``base_hub_id``), so a run exported without its
    base still names it; for checkpoints written before that record, from the base's model.json (found as
    zoo.checkpoints.adapter finds it: beside a moved run too). A base converted from a multimodal Gemma 3 repo gets its
    path: the adapter's module names are those of the text-only model that `zoo export` writes, not of the
    repo's multimodal one.
    """
    if base_out is not None:
        return str(Path(base_out).absolute())
    if meta["lora"].get("base_hub_id"):
        return str(meta["lora"]["base_hub_id"])
    base = base_location(ckpt, meta)  # a base moved together with the run: its model.json there
    base_meta = _base_meta(base)
    return (hub_weights(base_meta) if base_meta else None) or str(base)


def quantized_base(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Path | None:
    """The base checkpoint when it is stored quantized (`zoo quantize`: a QLoRA base), which transformers cannot
    read: the adapter needs its dequantized export beside it. None for any other base."""
    base = base_location(ckpt, meta)
    base_meta = _base_meta(base)
    return base if base_meta is not None and quant_checkpoint.is_quantized(base_meta) else None


def default_base_out(ckpt: str | os.PathLike, out: str | os.PathLike) -> Path | None:
    """Where ``zoo export --adapter --out OUT`` writes the adapter's base when it has to: ``OUT-base`` beside
    ``OUT`` for a base stored quantized (:func:`quantized_base`); None (no base export) otherwise."""
    if quantized_base(ckpt, adapter_meta_of(ckpt)) is None:
        return None
    out = Path(out).absolute()
    return out.with_name(out.name + "-base")


def _adapted_rules(cfg: ModelConfig, meta: dict[str, Any], ckpt: str | os.PathLike) -> list[BoundRule]:
    """The export rules of the adapted weights, in the table's (Hub) order; refuses what peft cannot load.

    Routed experts' rules are among them only where :mod:`convert.peft_experts` has the family's layout."""
    adapted = _adapter_paths(meta)
    rules = [r for r in table_for(cfg.family, "hf", cfg) if r.zoo in adapted]
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


def _fused_groups(cfg: ModelConfig, rules: list[BoundRule]) -> dict[str, list[BoundRule | None]]:
    """Fused HF Linear (its name, ``{i}`` for the layer) -> the rule of each of its parts, in the fused tensor's
    order (None for a part without adapters): the adapted rules that :mod:`convert.fused` fuses."""
    groups: dict[str, list[BoundRule | None]] = {}
    for rule in rules:
        found = fusion_of(cfg, rule.hf)
        if found is not None and not peft_experts.is_expert_weight(rule.zoo):
            name, fusion, k = found
            groups.setdefault(name, [None] * len(fusion.parts))[k] = rule
    return groups


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
    for name, parts in _fused_groups(cfg, rules).items():
        adapted = [rule for rule in parts if rule is not None]
        first = adapted[0]
        assert first.layers is not None  # fused tensors are per layer
        fan_in = TRANSFORMS[first.transform].inverse(shape_only(specs[first.zoo].shape[1:]), cfg).shape[1]
        rows = sum(fused_named(cfg, name).part_sizes(cfg))
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
                module = PEFT_PREFIX + name.format(i=first.layers[ix[0]]).removesuffix(".weight")
                keyed.append(((first.layers[ix[0]], pos, part),
                              PlannedTensor(f"{module}.lora_{part.upper()}.weight", f"{key}.{part}", ix, FUSED,
                                            shape, dt)))
    return keyed


def _fused_factor(cfg: ModelConfig, t: PlannedTensor, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """lora_A or lora_B of fused-Linear adapter tensor ``t`` (:func:`_fused_tensors`) from the zoo adapters
    (path -> stacked array): A by :func:`convert.peft_experts.lora_a` (one expert), B's blocks placed in the
    fused tensor's rows by :func:`convert.fused.join`."""
    key, _, part = t.zoo.rpartition(".")
    paths = key.split("+")
    adapted = tuple(p for p in paths if p != "-")
    assert t.index is not None
    if part == "a":  # every export transform of a fused part flattens [*in, r] in order (LORA_LAYOUTS)
        one = {p: arrays[f"{p}.a"][t.index][None] for p in adapted}
        return peft_experts.lora_a(peft_experts.FusedParam(key, adapted), adapted, one)
    fusion = fused_named(cfg, t.name.removesuffix(".lora_B.weight") + ".weight")
    transforms = {rule.zoo: rule.transform for rule in table_for(cfg.family, "hf", cfg)}
    r = arrays[f"{adapted[0]}.b"].shape[1]
    dt = arrays[f"{adapted[0]}.b"].dtype
    blocks = []
    for p, size in zip(paths, fusion.part_sizes(cfg), strict=True):
        block = np.zeros((size, r * len(adapted)), dt)
        if p != "-":
            q = adapted.index(p)
            block[:, q * r:(q + 1) * r] = LORA_LAYOUTS[transforms[p]].b(arrays[f"{p}.b"][t.index])
        blocks.append(block)
    return join(fusion, blocks, dt)


def fused_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``rank_pattern`` / ``alpha_pattern`` entries of the fused Linears whose adapter joins several parts' (rank
    ``rank`` times the parts adapted, scale the parts' own: :func:`convert.peft_experts.fused_alpha`)."""
    cfg = ModelConfig.from_dict(meta["config"])
    info = meta["lora"]
    adapted = _adapter_paths(meta)
    rules = [r for r in table_for(cfg.family, "hf", cfg) if r.zoo in adapted]
    ranks, alphas = {}, {}
    for name, parts in _fused_groups(cfg, rules).items():
        zoo = tuple(rule.zoo for rule in parts if rule is not None)
        if len(zoo) > 1:
            leaf = name.removesuffix(".weight").rpartition(".")[2]
            ranks[leaf] = peft_experts.fused_rank(info["rank"], zoo)
            alpha = peft_experts.fused_alpha(info["alpha"], bool(info["rslora"]), zoo)
            alphas[leaf] = int(alpha) if float(alpha).is_integer() else alpha
    return {"rank_pattern": ranks, "alpha_pattern": alphas}


def experts_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The adapter_config.json fields of the routed experts' adapters: ``target_parameters`` and the fused
    parameters' ``rank_pattern`` / ``alpha_pattern`` (their rank is the rank times the parts adapted, their
    scale the parts' own); empty without expert adapters."""
    cfg = ModelConfig.from_dict(meta["config"])
    layout = peft_experts.layout_of(cfg)
    if layout is None:
        return {}
    info = meta["lora"]
    adapted = {p.rpartition(".")[2] for p in _adapter_paths(meta)}
    fused = peft_experts.adapted_params(layout, adapted)
    if not fused:
        return {}
    targets = [peft_experts.target_parameter(layout, param) for param, _ in fused]
    ranks, alphas = {}, {}
    for (_, parts), key in zip(fused, targets, strict=True):
        if len(parts) > 1:
            ranks[key] = peft_experts.fused_rank(info["rank"], parts)
            alpha = peft_experts.fused_alpha(info["alpha"], bool(info["rslora"]), parts)
            alphas[key] = int(alpha) if float(alpha).is_integer() else alpha
    return {"target_parameters": targets, "rank_pattern": ranks, "alpha_pattern": alphas}


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
        piece = specs[rule.zoo].shape[rule.slice_axes:]
        out_f, in_f = TRANSFORMS[rule.transform].inverse(shape_only(piece), cfg).shape
        for part, shape in (("a", (r, in_f)), ("b", (out_f, r))):
            dt = dtype or stored[f"{rule.zoo}.{part}"]["dtype"]
            if dt not in ST_NAMES:
                raise UserError(f"adapter {rule.zoo}.{part} has dtype {dt}, which safetensors export does not support")
            for ix in rule.indices():
                module = PEFT_PREFIX + rule.hf_name(ix).removesuffix(".weight")
                name = f"{module}.lora_{part.upper()}.weight"
                layer = rule.layers[ix[0]] if rule.layers is not None else -1
                keyed.append(((layer, pos, part), PlannedTensor(name, f"{rule.zoo}.{part}", ix or None,
                                                                rule.transform, shape, dt)))
    keyed.sort(key=lambda kt: kt[0])
    tensors = [t for _, t in keyed] + _whole_tensors(cfg, meta, dtype)
    assign_shards(tensors, max_bytes=2**63)  # one file: adapters are small
    return tensors


def _whole_tensors(cfg: ModelConfig, meta: dict[str, Any], dtype: str | None) -> list[PlannedTensor]:
    """The weights trained whole (:func:`zoo.lora.adapters.whole_weights`) as the merged model's tensors under peft's
    names, after the adapters (peft's own order: modules to save last)."""
    specs, stored = param_specs(cfg), meta["lora"]["params"]
    rules = {r.zoo: r for r in table_for(cfg.family, "hf", cfg)}
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
             if t.transform != peft_experts.TRANSFORM and not t.transform.startswith(WHOLE)}
    return [n for n in HF_TO_ZOO if n in names] + sorted(names - set(HF_TO_ZOO))


def peft_config(meta: dict[str, Any], base_ref: str, target_modules: list[str],
                saved: list[str] | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` content (peft's LoraConfig fields; peft fills the rest with defaults), the
    fused Linears' rank and alpha patterns (:func:`fused_config`) included. ``saved``: the modules trained whole
    (:func:`modules_to_save`), which make it a sequence classifier's adapter (peft's SEQ_CLS)."""
    info = meta["lora"]
    alpha = info["alpha"]
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if saved else "CAUSAL_LM",
        "base_model_name_or_path": base_ref,
        "revision": None,
        "inference_mode": True,
        "r": info["rank"],
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "use_rslora": bool(info["rslora"]),
        "target_modules": target_modules,
        "lora_dropout": 0.0,  # dropout only acts in training; the export is for inference
        "bias": "none",
        "fan_in_fan_out": False,  # the weights are torch Linear [out, in], not GPT-2 Conv1D
        "modules_to_save": saved or None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        **fused_config(meta),
        "use_dora": False,
        "lora_bias": False,
    }


def _base_story(ckpt: str | os.PathLike, meta: dict[str, Any], base_ref: str, base_out: str | os.PathLike | None
                ) -> tuple[str, bool]:
    """(what the card says the base is, whether transformers loads ``base_ref`` as it is)."""
    base = base_location(ckpt, meta)
    base_meta = _base_meta(base) or {}
    origin = hub_id(base_meta) or meta["lora"].get("base_hub_id")
    came = f" It comes from the Hub's `{origin}`." if origin else ""
    stored = quant_checkpoint.settings(base_meta)
    if base_out is not None:
        if stored:
            how = (f", dequantized: `{base}` stores its projections quantized ({quant_checkpoint.describe(*stored)}, "
                   "`zoo quantize`), and the adapters were trained beside those weights (QLoRA)")
        else:
            how = ", merged with its own adapters" if "lora" in base_meta else ""
        text = (f"The base model is `{base_ref}`, which `zoo export --adapter` wrote beside this adapter from the "
                f"lmzoo checkpoint `{base}`{how}.{came}")
        loads = True
    elif base_ref == str(base):
        text = (f"The base model is the lmzoo checkpoint `{base}`, which transformers does not read: export it with "
                f"`zoo export {base} --out BASE` and load the adapter onto BASE.{came}")
        loads = False
    else:
        text = (f"The base model is the Hub's `{base_ref}`: the adapters were trained on lmzoo's conversion of it "
                "(`zoo convert`).")
        loads = True
    asked = meta["lora"].get("base_quant")
    if asked and not stored:  # QLoRA on a float base: quantized at load, as the run quantized it
        text += (f" The adapters were trained beside its projections quantized "
                 f"({quant_checkpoint.describe(asked['kind'], bool(asked.get('double')))}, QLoRA): on the float "
                 f"base they give nearly the model they were trained in, and `zoo export {ckpt}` writes that "
                 "model exactly, merged.")
    return text, loads


def adapter_card(ckpt: str | os.PathLike, meta: dict[str, Any], base_ref: str, targets: list[str], repo_hint: str,
                 base_out: str | os.PathLike | None = None, eval_results: EvalResults | None = None) -> str:
    """README.md of the adapter folder: its metadata (base model where it is a Hub repo, the base's license,
    tags, datasets), the base model (what it is, and where), LoRA settings, how it was trained (method,
    hyperparameters, data, final metrics: convert/model_card.py), the `zoo eval` results when given, and how
    to load it."""
    info, training = meta["lora"], meta.get("training") or {}
    story, loads = _base_story(ckpt, meta, base_ref, base_out)
    trained = training_of(ckpt, meta)
    data = card_data("peft", origin_of(ckpt, meta), trained, tags=["lora"], pipeline_tag="text-generation",
                     # a Hub repo: the Hub links the adapter to it
                     base_model=base_ref if loads and base_out is None else None)
    how = f"{trained_with(training)}."
    # A reward model's adapter (its score head saved whole) loads onto the base read as a sequence classifier.
    kind = "SequenceClassification" if set(WHOLE_WEIGHTS) & set(info.get("params", {})) else "CausalLM"
    if kind == "SequenceClassification":
        data.pipeline_tag = "text-classification"
    if loads:  # peft loads the base itself, from the Hub or the exported folder
        load = [f"from peft import AutoPeftModelFor{kind}",
                f'model = AutoPeftModelFor{kind}.from_pretrained("{repo_hint}")']
    else:  # the base is a zoo checkpoint: transformers reads its export
        load = ["from peft import PeftModel", f"from transformers import AutoModelFor{kind}",
                f'base = AutoModelFor{kind}.from_pretrained("BASE")  # zoo export {base_ref} --out BASE',
                f'model = PeftModel.from_pretrained(base, "{repo_hint}")']
    return render(data, [
        f"# {repo_hint}", "",
        f"A LoRA adapter for `{base_ref}`: rank {info['rank']}, alpha {info['alpha']}"
        f"{' (rsLoRA)' if info['rslora'] else ''}, on {', '.join(targets)}. {how}", "",
        "## Base model", "", story, "",
        *(["## Training", "", *training_lines(trained)] if trained is not None else []),
        *eval_lines(eval_results),
        "## How to load", "", "```python", *load, "```", "",
    ])


def _check_base_out(out: Path, base_out: Path, overwrite: bool) -> None:
    """Both destinations free (or ``overwrite``) and apart, before anything is written."""
    if base_out == out or out in base_out.parents or base_out in out.parents:
        raise UserError(f"--base-out {base_out} and --out {out} overlap; give the base a folder of its own")
    prepare_output(out, overwrite)
    prepare_output(base_out, overwrite)


def export_adapter(ckpt: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
                   dtype: str | None = None, repo_hint: str | None = None,
                   base_out: str | os.PathLike | None = None, eval_results: str | os.PathLike | None = None) -> Path:
    """Write adapter checkpoint ``ckpt`` as a PEFT adapter folder at ``out`` (atomically); returns ``out``.

    ``dtype`` casts the adapters (default: as stored). With ``base_out`` the base checkpoint is exported there
    first (as ``zoo export`` writes it: dequantized when stored quantized, merged when an adapter checkpoint)
    and the adapter names that folder as its base. ``eval_results``: a `zoo eval --out` results file, whose
    scores the card lists. A non-adapter checkpoint, a non-empty ``out`` (or ``base_out``) without
    ``overwrite``, adapters peft has no layout for, or an unreadable results file are UserErrors.
    """
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    results = read_eval_results(eval_results) if eval_results is not None else None
    meta = adapter_meta_of(ckpt)
    tensors = plan_adapter(ckpt, meta, dtype)
    out = Path(out).absolute()
    if base_out is not None:
        base_out = Path(base_out).absolute()
        _check_base_out(out, base_out, overwrite)
        export(base_checkpoint(ckpt, meta), base_out, dtype, overwrite=overwrite, repo_hint=base_out.name)
    base_ref, targets = base_model_ref(ckpt, meta, base_out), target_modules_of(tensors)
    with atomic_output(out, overwrite) as tmp:
        _write_weights(Path(ckpt), meta, tensors, tmp / ADAPTER_WEIGHTS)
        experts = experts_config(meta)
        config = peft_config(meta, base_ref, targets, modules_to_save(tensors))
        for key, value in experts.items():  # the fused experts' patterns join the fused Linears'
            config[key] = {**config[key], **value} if isinstance(value, dict) else value
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        card = adapter_card(ckpt, meta, base_ref, targets + experts.get("target_parameters", []),
                            repo_hint or out.name, base_out, results)
        (tmp / "README.md").write_text(card)
    return out


def _write_weights(ckpt: Path, meta: dict[str, Any], tensors: list[PlannedTensor], path: Path) -> None:
    stored = meta["lora"]["params"]
    # Adapters are rank-r slivers of the model: read each whole, once.
    arrays = {p: load_param_numpy(ckpt, p, stored[p]) for p in stored}
    experts = peft_experts.layout_of(ModelConfig.from_dict(meta["config"]))
    with open(path, "wb") as f:
        f.write(safetensors_header(tensors))
        for t in tensors:
            if t.transform == peft_experts.TRANSFORM:
                assert experts is not None and t.index is not None  # planned only with the family's layout
                x = peft_experts.fused_factor(experts, t.zoo, arrays, t.index[0])
            elif t.transform == FUSED:
                x = _fused_factor(ModelConfig.from_dict(meta["config"]), t, arrays)
            elif t.transform.startswith(WHOLE):
                x = TRANSFORMS[t.transform.removeprefix(WHOLE)].inverse(arrays[t.zoo], ModelConfig.from_dict(meta["config"]))
            else:
                layout = LORA_LAYOUTS[t.transform]
                fn = layout.a if t.zoo.endswith(".a") else layout.b
                x = fn(arrays[t.zoo] if t.index is None else arrays[t.zoo][t.index])
            x = np.ascontiguousarray(x, dtype=DTYPES_ALL[t.dtype])
            if tuple(x.shape) != t.shape:
                raise UserError(f"{ckpt}: adapter {t.zoo} does not match its base weight (got {x.shape} for "
                                f"{t.name}, want {t.shape}); the checkpoint is damaged")
            f.write(x.reshape(-1).view(np.uint8).data)


def planned_adapter_files(ckpt: str | os.PathLike, dtype: str | None = None,
                          base_out: str | os.PathLike | None = None) -> list[tuple[str, int]]:
    """(file name, size in bytes; 0 = small, generated) of everything :func:`export_adapter` would write; the
    base's files (with ``base_out``) named by their path in ``base_out``."""
    meta = adapter_meta_of(ckpt)
    tensors = plan_adapter(ckpt, meta, dtype)
    weights = len(safetensors_header(tensors)) + sum(t.nbytes for t in tensors)
    files = [(ADAPTER_CONFIG, 0), (ADAPTER_WEIGHTS, weights), ("README.md", 0)]
    if base_out is not None:
        where = Path(base_out).absolute()
        files += [(str(where / name), size) for name, size in planned_files(base_checkpoint(ckpt, meta), dtype)]
    return files
