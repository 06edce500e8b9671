"""Typed training configuration: YAML file + `key.sub=value` overrides -> dataclasses.

:class:`TrainConfig` holds the keys every task shares. A task composes its own
schema by subclassing it (its own config section, and a subclass of
:class:`DataSection` for its data keys) and naming it as its ``config_class``;
:func:`load_config` reads any schema alike. Unknown keys name the nearest valid
key of that schema; wrong types name the key and the expected type; a key whose
field metadata lists ``choices`` must be one of them; ``--print-config`` shows
the resolved config with defaults. Each section may check itself (``check``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import yaml

from zoo.errors import UserError


@dataclass
class ModelSection:
    """What to train: a zoo checkpoint path or registry name, or a random init from a config."""

    path: str | None = None
    # "pretrained" (load `path`) | "random" (build from `config`)
    init: str = field(default="pretrained", metadata={"choices": ("pretrained", "random")})
    config: str | None = None  # for init: random — a registry entry with a built-in config, or a config.json
    tokenizer: str | None = None  # a tokenizer folder (or zoo checkpoint); default: the model checkpoint's


@dataclass
class DataSource:
    """One source of a data mixture (``data.path`` as a list); unset keys fall back to the ``data.*`` ones."""

    path: str
    weight: float = 1.0  # relative: the weights are normalized over the sources
    name: str | None = None  # in the mixture report and eval metrics; None: the file name without its suffix
    text_field: str | None = None  # None: data.text_field
    split: str | None = None  # None: data.split
    eval_path: str | None = None  # this source's own eval set (then nothing is held out of it)


@dataclass
class DataSection:
    """Training text and how it is cut into sequences (a task's subclass adds its own data keys)."""

    source_class: ClassVar[type[DataSource]] = DataSource  # what each source of a mixture may set

    # local file/folder, or a Hugging Face Hub dataset name (online or cached); or a mixture: a list of sources
    # (DataSource keys, e.g. [{path: a.jsonl, weight: 0.7}, b.jsonl]), stored as plain mappings (JSON/YAML as is)
    path: str | list[dict[str, Any]] | None = None
    split: str = "train"  # the split of a Hub dataset
    text_field: str = "text"
    seq_len: int = 512
    packing: bool = True  # false: one document per row, truncated/padded to seq_len
    # whole examples (best-fit packing, or rows a task lays out itself) longer than seq_len + 1: truncate | drop
    long_examples: str = field(default="truncate", metadata={"choices": ("truncate", "drop")})
    max_untrainable_fraction: float = 0.5  # stop before step 1 if more examples than this lose every trained
    # token to truncation (a seq_len too short for the data)
    eval_path: str | None = None
    eval_fraction: float = 0.0
    skip_bad_rows: bool = False

    def check(self) -> None:
        """Cross-field checks of the data keys."""
        if not self.path:
            raise UserError("config needs `data.path` (a jsonl/json/parquet/txt file or folder)")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise UserError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.max_untrainable_fraction <= 1.0:
            raise UserError(f"data.max_untrainable_fraction must be in [0, 1], got {self.max_untrainable_fraction}")


def data_sources(cfg: TrainConfig) -> list[DataSource]:
    """The run's data sources: a plain ``data.path`` is one source of weight 1 (names made unique)."""
    p = cfg.data.path
    items = [p] if isinstance(p, str) else list(p or [])
    cls = cfg.data.source_class
    out = [dataclasses.replace(s) if isinstance(s, DataSource) else cls(path=s) if isinstance(s, str)
           else cls(**s) for s in items]
    taken = {s.name for s in out if s.name is not None}
    for s in out:
        if s.name is None:
            base = Path(s.path.rstrip("/")).name.split(".")[0] or s.path
            s.name, k = base, 2
            while s.name in taken:
                s.name, k = f"{base}-{k}", k + 1
            taken.add(s.name)
    return out


def _source_list(key: str, value: list, source_class: type[DataSource]) -> list[dict[str, Any]]:
    """``data.path`` as a list: each source a full mapping of ``source_class``'s keys, validated (errors name
    data.path[i].key)."""
    if not value:
        raise UserError(f"config key '{key}' is an empty list; give at least one source (a path, or a mapping "
                        "with path and weight)")
    fields = {f.name: f for f in dataclasses.fields(source_class)}
    hints = typing.get_type_hints(source_class)
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
        out.append(dataclasses.asdict(source_class(**src)))
    return out


@dataclass
class OptimizerSection:
    """optax optimizer settings."""

    name: str = field(default="adamw", metadata={"choices": ("adamw", "adafactor", "sgd", "lion")})
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class ScheduleSection:
    """Learning-rate schedule."""

    name: str = field(default="cosine", metadata={"choices": ("constant", "cosine", "linear", "wsd")})
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

    params: str = field(default="float32", metadata={"choices": ("float32", "bfloat16")})
    compute: str = field(default="float32", metadata={"choices": ("float32", "bfloat16")})


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
    base_quant: str | None = None  # QLoRA: store the frozen base quantized, "nf4" (bitsandbytes' NF4) or "int8"
    base_quant_double: bool = False  # NF4 double quantization (the absmax themselves 8-bit): 4.127 bits a weight


@dataclass
class EvalSection:
    """Scored `zoo eval` tasks run on the current weights every ``eval_every`` steps (besides the eval loss)."""

    # shipped task names (`zoo eval --list-tasks`), task YAML paths, or lm-evaluation-harness task names (the eval
    # extra; `zoo eval --harness`), e.g. [prose, arc_easy]
    tasks: list[str] | str = field(default_factory=list)
    limit: int | None = 32  # examples per task (None: all)
    batch_size: int = 8
    include_path: str | None = None  # a folder of your own lm-eval task YAMLs, for harness task names


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
    # none | full (recompute each layer in backward) | save_dots (keep weight matmuls)
    remat: str = field(default="none", metadata={"choices": ("none", "full", "save_dots")})
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    log_every: int = 10
    eval_every: int = 0
    eval: EvalSection = field(default_factory=EvalSection)
    peak_tflops: float | None = None  # per device, for MFU; None: detected for known accelerators, else no MFU

    def check(self) -> None:
        """Cross-field checks that types alone cannot express (a task's schema extends them)."""
        if self.model.init == "pretrained" and not self.model.path:
            raise UserError("config needs `model` (a zoo checkpoint path or registry name), or `model.init: random`")
        if self.model.init == "random" and not (self.model.config and self.model.tokenizer):
            raise UserError("`model.init: random` needs `model.config` (a tiny registry entry or a config.json) "
                            "and `model.tokenizer` (a tokenizer folder)")
        self.data.check()
        if self.max_steps is None and self.epochs is None:
            raise UserError("config needs `max_steps` or `epochs`")
        for key in ("batch_size", "grad_accum", "data.seq_len", "log_every"):
            obj: Any = self
            for part in key.split("."):
                obj = getattr(obj, part)
            if obj < 1:
                raise UserError(f"config key '{key}' must be at least 1, got {obj}")
        if self.batch_size % self.grad_accum:
            raise UserError(f"batch_size={self.batch_size} must be a multiple of grad_accum={self.grad_accum}")
        if self.eval.tasks and not self.eval_every:
            raise UserError("eval.tasks are scored every eval_every steps; set eval_every (e.g. eval_every=100)")


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        t = _resolve(cls, f.name)
        if dataclasses.is_dataclass(t):
            out += _keys(cast(type, t), f"{prefix}{f.name}.")
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


def _build(cls: type, data: dict[str, Any], prefix: str = "", root: type | None = None) -> Any:
    root = root or cls
    kwargs = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in fields:
            valid = _keys(root)
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(valid)}"
            raise UserError(f"unknown config key '{key}'{hint}")
        t = _resolve(cls, k)
        if key == "data.path" and isinstance(v, list):  # a mixture of sources
            kwargs[k] = _source_list(key, v, cast(Any, cls).source_class)
            continue
        if dataclasses.is_dataclass(t):
            if isinstance(v, str) and t is ModelSection:
                v = {"path": v}  # `model: ckpt/llama` is short for `model.path`
            if not isinstance(v, dict):
                raise UserError(f"config key '{key}' must be a mapping of its sub-keys, got {v!r}")
            kwargs[k] = _build(cast(type, t), v, key + ".", root)
        else:
            kwargs[k] = _coerce(key, v, t)
            choices = fields[k].metadata.get("choices")
            if choices and kwargs[k] not in choices:
                raise UserError(f"config key '{key}' is {kwargs[k]!r}; choose one of {', '.join(choices)}")
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


def load_config(path: str | Path | None, overrides: Sequence[str] = (),
                schema: type[TrainConfig] | None = None) -> TrainConfig:
    """Read a YAML config (safely) and apply `key.sub=value` overrides, as ``schema`` (a task's ``config_class``;
    default :class:`TrainConfig`, pretraining's) says."""
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
    cfg = _build(schema or TrainConfig, tree)
    cfg.check()
    return cfg


def config_keys(schema: type[TrainConfig] | None = None) -> list[str]:
    """Every dotted config key of ``schema`` (default :class:`TrainConfig`; ``data.seq_len``, ...), in declaration
    order."""
    return _keys(schema or TrainConfig)


def to_yaml(cfg: TrainConfig) -> str:
    """The fully resolved config as YAML (what --print-config shows and checkpoints record)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
