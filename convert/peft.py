"""LoRA adapter checkpoint -> PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, and
the run's tokenizer files beside them, as a trainer's ``save_model`` leaves them).

peft names each adapter after the module it wraps: ``base_model.model.<module
path>.lora_A.weight`` [r, in_features] and ``.lora_B.weight`` [out_features, r],
with ``delta W = scale * B @ A`` on a torch Linear weight W [out, in]. Module
paths come from the conversion tables (the HF weight name minus ``.weight``),
so they are the names of the merged model that ``zoo export`` writes.

The tensors' plan (names, layouts, offsets) is convert/peft_plan.py's, the adapter's card and the base it names
convert/peft_card.py's; this module writes the folder. Written with numpy and JSON only: peft and torch stay
test-only dependencies.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from convert import peft_experts
from convert.card_origin import meta_at
from convert.convert import DTYPES
from convert.export import DTYPES_ALL, PlannedTensor, export, planned_files, safetensors_header
from convert.fused import fused_named, join
from convert.model_card import read_eval_results
from convert.peft_card import adapter_card, base_model_ref
from convert.peft_plan import (
    FUSED,
    LORA_LAYOUTS,
    PARAMETER,
    WHOLE,
    adapter_paths,
    fused_groups,
    modules_to_save,
    parameter_targets,
    plan_adapter,
    target_modules_of,
    target_regex,
)
from convert.tables import export_format, table_for
from convert.transforms import TRANSFORMS
from zoo.checkpoints import quantized as quant_checkpoint
from zoo.checkpoints.adapter import base_checkpoint, base_location
from zoo.checkpoints.format import MODEL_FILE, TOKENIZER_DIR, WEIGHT_FILES, read_meta
from zoo.checkpoints.readers import load_param_numpy
from zoo.checkpoints.writer import atomic_output, prepare_output
from zoo.data.tokenizer import holds_tokenizer
from zoo.errors import UserError
from zoo.model.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"


ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A model folder's files that a checkpoint's tokenizer/ may hold (model.tokenizer may name a whole model's folder;
# `zoo convert` keeps generation_config.json there) but that are no tokenizer's, nor an adapter's.
NOT_TOKENIZER = ("config.json", "generation_config.json", "README.md", ADAPTER_CONFIG)


def adapter_meta_of(ckpt: str | os.PathLike) -> dict[str, Any]:
    """model.json of an adapter checkpoint; a UserError naming ``ckpt`` for any other checkpoint."""
    meta = read_meta(ckpt)
    if "lora" not in meta:
        raise UserError(f"{ckpt} is not a LoRA adapter checkpoint (its {MODEL_FILE} has no lora entry); "
                        "export it without --adapter")
    return meta


def quantized_base(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Path | None:
    """The base checkpoint when it is stored quantized (`zoo quantize`: a QLoRA base), which transformers cannot
    read: the adapter needs its dequantized export beside it. None for any other base."""
    base = base_location(ckpt, meta)
    base_meta = meta_at(base)
    return base if base_meta is not None and quant_checkpoint.is_quantized(base_meta) else None


def default_base_out(ckpt: str | os.PathLike, out: str | os.PathLike) -> Path | None:
    """Where ``zoo export --adapter --out OUT`` writes the adapter's base when it has to: ``OUT-base`` beside
    ``OUT`` for a base stored quantized (:func:`quantized_base`); None (no base export) otherwise."""
    if quantized_base(ckpt, adapter_meta_of(ckpt)) is None:
        return None
    out = Path(out).absolute()
    return out.with_name(out.name + "-base")


def fused_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``rank_pattern`` / ``alpha_pattern`` entries of the fused Linears whose adapter joins several parts' (rank
    ``rank`` times the parts adapted, scale the parts' own: :func:`convert.peft_experts.fused_alpha`)."""
    cfg = ModelConfig.from_dict(meta["config"])
    info = meta["lora"]
    adapted = adapter_paths(meta)
    rules = [r for r in table_for(cfg.family, export_format(cfg), cfg) if r.zoo in adapted]
    ranks, alphas = {}, {}
    for name, parts in fused_groups(cfg, rules):
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
    adapted = {p.rpartition(".")[2] for p in adapter_paths(meta)}
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


def peft_config(meta: dict[str, Any], base_ref: str, target_modules: list[str] | str,
                saved: list[str] | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` content (peft's LoraConfig fields; peft fills the rest with defaults), the
    fused Linears' rank and alpha patterns (:func:`fused_config`) included. ``target_modules``: module names, or
    one regex of their paths (a vision-language model's: :func:`convert.peft_plan.target_regex`). ``saved``: the
    modules trained whole (:func:`modules_to_save`), which make it a sequence classifier's adapter (peft's
    SEQ_CLS)."""
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


def _fused_factor(cfg: ModelConfig, t: PlannedTensor, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """lora_A or lora_B of fused-Linear adapter tensor ``t`` (planned by convert.peft_plan) from the zoo adapters
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
    transforms = {rule.zoo: rule.transform for rule in table_for(cfg.family, export_format(cfg), cfg)}
    r = arrays[f"{adapted[0]}.b"].shape[1]
    dt = arrays[f"{adapted[0]}.b"].dtype
    blocks = []
    groups = fusion.group_count(cfg)
    for p, size in zip(paths, fusion.part_sizes(cfg), strict=True):
        block = np.zeros((groups * size, r * len(adapted)), dt)
        if p != "-":
            q = adapted.index(p)
            block[:, q * r:(q + 1) * r] = LORA_LAYOUTS[transforms[p]].b(arrays[f"{p}.b"][t.index])
        blocks.append(block)
    return join(fusion, blocks, dt, groups)


def _check_base_out(out: Path, base_out: Path, overwrite: bool) -> None:
    """Both destinations free (or ``overwrite``) and apart, before anything is written."""
    if base_out == out or out in base_out.parents or base_out in out.parents:
        raise UserError(f"--base-out {base_out} and --out {out} overlap; give the base a folder of its own")
    prepare_output(out, overwrite)
    prepare_output(base_out, overwrite, "--base-out")


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
        # A vision-language model's tower shares module names with its language model: the paths tell them apart.
        cfg = ModelConfig.from_dict(meta["config"])
        config = peft_config(meta, base_ref, target_regex(tensors) if cfg.vision else targets, modules_to_save(tensors))
        for key, value in experts.items():  # the fused experts' patterns join the fused Linears'
            config[key] = {**config[key], **value} if isinstance(value, dict) else value
        parameters = parameter_targets(cfg, tensors)  # bare parameters (Gemma 3's connector) join the experts'
        if parameters:
            config["target_parameters"] = [*config.get("target_parameters", []), *parameters]
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        tokenizer = tokenizer_files(ckpt)
        for f in tokenizer:
            shutil.copyfile(f, tmp / f.name)
        card = adapter_card(ckpt, meta, base_ref, targets + config.get("target_parameters", []),
                            repo_hint or out.name, base_out, results, tokenizer=bool(tokenizer))
        (tmp / "README.md").write_text(card)
    return out


def tokenizer_files(ckpt: str | os.PathLike) -> list[Path]:
    """The files of the adapter checkpoint's ``tokenizer/`` (the run's tokenizer, pretrain/final.py) that go
    beside the adapter, as a trainer's ``save_model`` saves its processing class there, so that
    ``AutoTokenizer.from_pretrained(adapter)`` loads it: none of a model's own (weights, config.json,
    generation_config.json), which would make the folder look like a model's. [] without tokenizer files."""
    folder = Path(ckpt) / TOKENIZER_DIR
    if not holds_tokenizer(folder):
        return []
    return sorted(f for f in folder.iterdir() if f.is_file() and f.name not in NOT_TOKENIZER
                  and not any(f.match(w) for w in WEIGHT_FILES))


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
            elif t.transform == PARAMETER:  # the zoo's A or B as it is (convert.peft_plan.PARAMETER)
                x = arrays[t.zoo]
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
    files = [(ADAPTER_CONFIG, 0), (ADAPTER_WEIGHTS, weights), ("README.md", 0),
             *((f.name, f.stat().st_size) for f in tokenizer_files(ckpt))]
    if base_out is not None:
        where = Path(base_out).absolute()
        files += [(str(where / name), size) for name, size in planned_files(base_checkpoint(ckpt, meta), dtype)]
    return files
