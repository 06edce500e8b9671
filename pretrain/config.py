"""Typed training configuration: YAML file + `key.sub=value` overrides -> dataclasses.

The key names are the contract every trainer (pretrain, sft, dpo) shares.
Unknown keys name the nearest valid key; wrong types name the key and the
expected type; ``--print-config`` shows the resolved config with defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zoo.errors import UserError


@dataclass
class ModelSection:
    """What to train: a zoo checkpoint path or registry name, or a random init from a config."""

    path: str | None = None
    init: str = "pretrained"  # "pretrained" (load `path`) | "random" (build from `config`)
    config: str | None = None  # for init: random — a registry entry with a built-in config, or a config.json
    tokenizer: str | None = None  # a tokenizer folder (or zoo checkpoint); default: the model checkpoint's


@dataclass
class DataSection:
    """Training text and how it is cut into sequences."""

    # local file/folder, or a Hugging Face Hub dataset name (online or cached); or a mixture: a list of sources
    # (DataSource keys, e.g. [{path: a.jsonl, weight: 0.7}, b.jsonl]), stored as plain mappings (JSON/YAML as is)
    path: str | list[dict[str, Any]] | None = None
    split: str = "train"  # the split of a Hub dataset
    text_field: str = "text"
    seq_len: int = 512
    packing: bool = True  # false: one document per row, truncated/padded to seq_len
    long_examples: str = "truncate"  # sft (best-fit packing) and dpo pairs: truncate | drop those over seq_len + 1
    max_untrainable_fraction: float = 0.5  # sft, dpo: stop before step 1 if more examples than this lose every
    # trained token to truncation (a seq_len too short for the data)
    eval_path: str | None = None
    format: str | None = None  # sft: text | prompt_completion | messages | alpaca | sharegpt; None: from the columns
    chat_template: str | None = None  # sft, dpo: a Jinja chat-template file; None: the tokenizer's own template
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # sft, dpo: template variables (enable_thinking...)
    template_date: str = "2024-07-26"  # sft, dpo: the day a template's strftime_now reads (renders never vary)
    eval_fraction: float = 0.0
    skip_bad_rows: bool = False


@dataclass
class DataSource:
    """One source of a data mixture (``data.path`` as a list); unset keys fall back to the ``data.*`` ones."""

    path: str
    weight: float = 1.0  # relative: the weights are normalized over the sources
    name: str | None = None  # in the mixture report and eval metrics; None: the file name without its suffix
    format: str | None = None  # sft: this source's format (None: data.format, or detected from the columns)
    text_field: str | None = None  # None: data.text_field
    split: str | None = None  # None: data.split
    eval_path: str | None = None  # this source's own eval set (then nothing is held out of it)


def data_sources(cfg: TrainConfig) -> list[DataSource]:
    """The run's data sources: a plain ``data.path`` is one source of weight 1 (names made unique)."""
    p = cfg.data.path
    items = [p] if isinstance(p, str) else list(p or [])
    out = [dataclasses.replace(s) if isinstance(s, DataSource) else DataSource(path=s) if isinstance(s, str)
           else DataSource(**s) for s in items]
    taken = {s.name for s in out if s.name is not None}
    for s in out:
        if s.name is None:
            base = Path(s.path.rstrip("/")).name.split(".")[0] or s.path
            s.name, k = base, 2
            while s.name in taken:
                s.name, k = f"{base}-{k}", k + 1
            taken.add(s.name)
    return out


def _source_list(key: str, value: list) -> list[dict[str, Any]]:
    """``data.path`` as a list: each source a full DataSource mapping, validated (errors name data.path[i].key)."""
    if not value:
        raise UserError(f"config key '{key}' is an empty list; give at least one source (a path, or a mapping "
                        "with path and weight)")
    fields = {f.name: f for f in dataclasses.fields(DataSource)}
    hints = typing.get_type_hints(DataSource)
    out, names = [], set()
    for i, item in enumerate(value):
        at = f"{key}[{i}]"
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, dict):
            raise UserError(f"config key '{at}' must be a path or a mapping of {', '.join(fields)}, got {item!r}")
        src = {}
        for k, v in item.items():
            if k not in fields:
                near = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
                hint = f"; did you mean '{at}.{near[0]}'?" if near else f"; valid keys: {', '.join(fields)}"
                raise UserError(f"unknown config key '{at}.{k}'{hint}")
            src[k] = _coerce(f"{at}.{k}", v, hints[k])
        if not src.get("path"):
            raise UserError(f"config key '{at}.path' is missing; each source needs a path")
        weight = src.get("weight", 1.0)
        if not weight > 0 or weight == float("inf"):
            raise UserError(f"config key '{at}.weight' must be a positive number, got {weight}")
        if src.get("name") is not None:
            if src["name"] in names:
                raise UserError(f"config key '{at}.name': {src['name']!r} names two sources; give each its own")
            names.add(src["name"])
        out.append(dataclasses.asdict(DataSource(**src)))
    return out


@dataclass
class OptimizerSection:
    """optax optimizer settings."""

    name: str = "adamw"
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class ScheduleSection:
    """Learning-rate schedule."""

    name: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class MeshSection:
    """Device mesh sizes; -1 means all remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1


@dataclass
class DtypeSection:
    """Master-weight and compute dtypes."""

    params: str = "float32"
    compute: str = "float32"


@dataclass
class CheckpointSection:
    """How often checkpoints are saved and how many are kept."""

    every: int = 500
    keep: int = 3


@dataclass
class LoraSection:
    """LoRA adapters (zoo/lora.py); rank 0 trains the full model instead."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] | str = "all"  # HF module names (q_proj ... down_proj), a comma list, "all", or a regex
    rslora: bool = False  # scale by alpha/sqrt(rank) instead of alpha/rank


@dataclass
class EvalSection:
    """Scored `zoo eval` tasks run on the current weights every ``eval_every`` steps (besides the eval loss)."""

    tasks: list[str] | str = field(default_factory=list)  # shipped task names (`zoo eval --list-tasks`) or YAML paths
    limit: int | None = 32  # examples per task (None: all)
    batch_size: int = 8


@dataclass
class DpoSection:
    """Preference optimization (`dpo train`, dpo/): the loss, its constants and the reference model."""

    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge | robust | simpo (dpo/losses.py)
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid (conservative DPO), robust and simpo: the assumed label-noise rate
    simpo_gamma: float = 0.5  # simpo's target reward margin
    sft_weight: float = 0.0  # RPO (TRL's "sft" term): adds this times one mean NLL over the batch's chosen tokens
    reference: str = "base"  # base (LoRA: the adapters switched off) | precomputed | a zoo checkpoint path
    reference_model: str | None = None  # precomputed: the checkpoint scored once; None: the starting weights
    share_prompt: bool = True  # one copy of a pair's prompt, read by both answers (off: prompt+chosen | prompt+rejected)


@dataclass
class TrainConfig:
    """Everything a training run needs."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int | None = None
    epochs: int | None = None
    seed: int = 0
    output_dir: str = "runs/run"
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    dtype: DtypeSection = field(default_factory=DtypeSection)
    remat: str = "none"  # none | full (recompute each layer in backward) | save_dots (keep weight matmuls)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    log_every: int = 10
    eval_every: int = 0
    eval: EvalSection = field(default_factory=EvalSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    peak_tflops: float | None = None  # per device, for MFU; None: detected for known accelerators, else no MFU


CHOICES: dict[str, tuple[str, ...]] = {
    "model.init": ("pretrained", "random"),
    "data.long_examples": ("truncate", "drop"),
    "optimizer.name": ("adamw", "adafactor", "sgd", "lion"),
    "schedule.name": ("constant", "cosine", "linear", "wsd"),
    "remat": ("none", "full", "save_dots"),
    "dtype.params": ("float32", "bfloat16"),
    "dtype.compute": ("float32", "bfloat16"),
    "dpo.loss_type": ("sigmoid", "ipo", "hinge", "robust", "simpo"),
}


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        t = _resolve(cls, f.name)
        if dataclasses.is_dataclass(t):
            out += _keys(t, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _resolve(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _type_name(t: Any) -> str:
    args = [a for a in typing.get_args(t) if a is not type(None)]
    base = args[0] if args else t
    name = getattr(base, "__name__", str(base))
    return f"{name} or null" if type(None) in typing.get_args(t) else name


def _coerce(key: str, value: Any, t: Any) -> Any:
    optional = type(None) in typing.get_args(t)
    if value is None:
        if optional:
            return None
        raise UserError(f"config key '{key}' must be {_type_name(t)}, not null")
    base = next((a for a in typing.get_args(t) if a is not type(None)), t) if isinstance(t, types.UnionType) else t
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
                return value.lower() in ("true", "yes", "1")
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)  # also "3e-4", which YAML 1.1 reads as a string
        if base is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise UserError(f"config key '{key}' must be {_type_name(t)}, got {value!r}") from None
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    kwargs = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in fields:
            valid = _keys(TrainConfig)
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(valid)}"
            raise UserError(f"unknown config key '{key}'{hint}")
        t = _resolve(cls, k)
        if key == "data.path" and isinstance(v, list):  # a mixture of sources
            kwargs[k] = _source_list(key, v)
            continue
        if dataclasses.is_dataclass(t):
            if isinstance(v, str) and t is ModelSection:
                v = {"path": v}  # `model: ckpt/llama` is short for `model.path`
            if not isinstance(v, dict):
                raise UserError(f"config key '{key}' must be a mapping of its sub-keys, got {v!r}")
            kwargs[k] = _build(t, v, key + ".")
        else:
            kwargs[k] = _coerce(key, v, t)
            if key in CHOICES and kwargs[k] not in CHOICES[key]:
                raise UserError(f"config key '{key}' is {kwargs[k]!r}; choose one of {', '.join(CHOICES[key])}")
    return cls(**kwargs)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    d = tree
    for p in parts[:-1]:
        nxt = d.get(p)
        if isinstance(nxt, str) and p == "model":
            nxt = {"path": nxt}
        if not isinstance(nxt, dict):
            nxt = {}
        d[p] = nxt
        d = nxt
    d[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (safely) and apply `key.sub=value` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"--config {path}: no such file")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except (yaml.YAMLError, ValueError) as e:  # ValueError: an impossible date (2025-13-40) in a timestamp
            raise UserError(f"--config {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(tree, dict):
            raise UserError(f"--config {path} must hold a mapping of config keys")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r}: write it as key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except (yaml.YAMLError, ValueError):  # ValueError: YAML reads 2025-13-40 as a date, and fails
            value = raw
        _set(tree, key.strip(), value)
    cfg = _build(TrainConfig, tree)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that types alone cannot express."""
    if cfg.model.init == "pretrained" and not cfg.model.path:
        raise UserError("config needs `model` (a zoo checkpoint path or registry name), or `model.init: random`")
    if cfg.model.init == "random" and not (cfg.model.config and cfg.model.tokenizer):
        raise UserError("`model.init: random` needs `model.config` (a tiny registry entry or a config.json) "
                        "and `model.tokenizer` (a tokenizer folder)")
    if not cfg.data.path:
        raise UserError("config needs `data.path` (a jsonl/json/parquet/txt file or folder)")
    if cfg.max_steps is None and cfg.epochs is None:
        raise UserError("config needs `max_steps` or `epochs`")
    for key in ("batch_size", "grad_accum", "data.seq_len", "log_every"):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        if obj < 1:
            raise UserError(f"config key '{key}' must be at least 1, got {obj}")
    if cfg.batch_size % cfg.grad_accum:
        raise UserError(f"batch_size={cfg.batch_size} must be a multiple of grad_accum={cfg.grad_accum}")
    if not isinstance(cfg.data.template_kwargs, dict):
        raise UserError(f"data.template_kwargs must be a mapping of template variables (e.g. "
                        f"{{enable_thinking: false}}), got {cfg.data.template_kwargs!r}")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise UserError(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    if not 0.0 <= cfg.data.max_untrainable_fraction <= 1.0:
        raise UserError(f"data.max_untrainable_fraction must be in [0, 1], got {cfg.data.max_untrainable_fraction}")
    dpo = cfg.dpo
    if dpo.beta <= 0:
        raise UserError(f"dpo.beta must be positive, got {dpo.beta}")
    if not 0.0 <= dpo.label_smoothing < 0.5:
        raise UserError(f"dpo.label_smoothing must be in [0, 0.5), got {dpo.label_smoothing}")
    if dpo.sft_weight < 0:
        raise UserError(f"dpo.sft_weight must be at least 0, got {dpo.sft_weight}")
    if not dpo.reference.strip():
        raise UserError("dpo.reference must be base, precomputed or a zoo checkpoint path, got ''")
    if dpo.reference_model is not None and dpo.reference != "precomputed":
        raise UserError("dpo.reference_model is read only with dpo.reference: precomputed; for a live reference "
                        "checkpoint set dpo.reference to its path")
    if cfg.eval.tasks and not cfg.eval_every:
        raise UserError("eval.tasks are scored every eval_every steps; set eval_every (e.g. eval_every=100)")


def config_keys() -> list[str]:
    """Every dotted config key (``data.seq_len``, ...), in declaration order."""
    return _keys(TrainConfig)


def to_yaml(cfg: TrainConfig) -> str:
    """The fully resolved config as YAML (what --print-config shows and checkpoints record)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
