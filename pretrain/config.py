"""Typed training configuration: YAML file + `key.sub=value` overrides -> dataclasses.

:class:`TrainConfig` holds the keys every task shares. A task composes its own
schema by subclassing it (its own config section, and a subclass of
:class:`DataSection` for its data keys) and naming it as its ``config_class``;
:func:`load_config` reads any schema alike. Unknown keys name the nearest valid
key of that schema; wrong types name the key and the expected type; a key whose
field metadata lists ``choices`` must be one of them, and a numeric key whose
metadata gives a ``range`` (an interval, :func:`pretrain.config_values.check_range`) must lie in it
(no float key may be NaN or infinite); ``--print-config`` shows the resolved
config with defaults. Each section may check itself (``check``). A key set to other than its default that the
run will not read is an error naming why: each schema lists such keys in its ``UNREAD`` table
(:mod:`pretrain.config_unread`).

An override indexes a list with ``[N]``: ``data.path[1].weight=0.5`` sets the
weight of a mixture's second source (:func:`load_config`, :mod:`pretrain.config_overrides`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import yaml

from pretrain import trackers
from pretrain.config_overrides import remove_override, set_override
from pretrain.config_unread import Unread, check_unread, keys_unread
from pretrain.config_values import check_field, coerce, field_type, schema_keys
from zoo.errors import UserError
from zoo.model.config import ATTENTION_KERNELS


@dataclass
class ModelSection:
    """What to train: a zoo checkpoint path or registry name, or a random init from a config."""

    path: str | None = None  # a zoo checkpoint folder (`zoo convert`'s, or a run's final/) or a registry name
    # "pretrained" (load `path`) | "random" (build from `config`)
    init: str = field(default="pretrained", metadata={"choices": ("pretrained", "random")})
    config: str | None = None  # for init: random — a registry entry with a built-in config, or a config.json
    tokenizer: str | None = None  # a tokenizer folder (or zoo checkpoint); default: the model checkpoint's
    # the training forward's attention kernel (zoo.kernels.choice): auto = cuDNN flash attention on NVIDIA GPUs where it
    # applies (16-bit compute), splash (Pallas) on TPUs where it applies, else the blockwise XLA path
    attention: str = field(default="auto", metadata={"choices": ATTENTION_KERNELS})
    # a vision-language model's parts kept as they are, among vision (the image tower) and projector (the
    # connector): no updates, no optimizer moments, no gradient into them; [] trains every weight (LoRA trains
    # its adapters alone in any case, and adapters on a frozen part are an error)
    freeze: list[str] = field(default_factory=list)


FREEZABLE = ("vision", "projector")  # model.freeze's names: the image tower, the connector to the language model


@dataclass
class DataSource:
    """One source of a data mixture (``data.path`` as a list); unset keys fall back to the ``data.*`` ones."""

    path: str  # a local file/folder or a Hugging Face Hub dataset name
    weight: float = field(default=1.0, metadata={"range": "(0, inf)"})  # relative: normalized over the sources
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
    text_field: str = "text"  # the column holding each row's text (pretraining)
    # tokens per row (each row holds seq_len + 1 tokens: inputs and shifted targets)
    seq_len: int = field(default=512, metadata={"range": "[1, inf)"})
    packing: bool = True  # false: one document per row, truncated/padded to seq_len
    # best-fit packing (sft): at most this many documents a row (None: as many as fit). NVIDIA GPUs' cuDNN attention
    # takes packed rows only with a bound (each document's start and length; its statistics grow with it), e.g. 16
    max_segments: int | None = field(default=None, metadata={"range": "[1, inf)"})
    # whole examples (best-fit packing, or rows a task lays out itself) longer than seq_len + 1: truncate | drop
    long_examples: str = field(default="truncate", metadata={"choices": ("truncate", "drop")})
    # stop before step 1 if more examples than this lose every trained token to truncation (a seq_len too short)
    max_untrainable_fraction: float = field(default=0.5, metadata={"range": "[0, 1]"})
    eval_path: str | None = None  # a held-out eval set (file/folder or Hub name), scored every eval_every steps
    # the share of the training rows held out for eval instead (a seeded split), when eval_path is not set
    eval_fraction: float = field(default=0.0, metadata={"range": "[0, 1)"})
    skip_bad_rows: bool = False  # malformed rows are counted and skipped (false: the first one stops the run)

    def check(self) -> None:
        """Cross-field checks of the data keys (a task's section adds its own; ``data.path`` is needed by a run that
        reads data: :meth:`TrainConfig.check_inputs`)."""


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


def _source_list(key: str, value: list[Any], source_class: type[DataSource]) -> list[dict[str, Any]]:
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
            src[k] = coerce(f"{at}.{k}", v, hints[k])
            check_field(f"{at}.{k}", src[k], fields[k])
        if not src.get("path"):
            raise UserError(f"config key '{at}.path' is missing; each source needs a path")
        if src.get("name") is not None:
            if src["name"] in names:
                raise UserError(f"config key '{at}.name': {src['name']!r} names two sources; give each its own")
            names.add(src["name"])
        out.append(dataclasses.asdict(source_class(**src)))
    return out


@dataclass
class OptimizerSection:
    """optax optimizer settings."""

    name: str = field(default="adamw", metadata={"choices": ("adamw", "adafactor", "sgd", "lion")})  # optax's
    # 0 is allowed: the weights stay as they are (a run that only measures); a negative rate climbs the loss
    learning_rate: float = field(default=3e-4, metadata={"range": "[0, inf)"})
    weight_decay: float = field(default=0.0, metadata={"range": "[0, inf)"})  # decoupled (AdamW's), every weight
    b1: float = field(default=0.9, metadata={"range": "[0, 1)"})  # sgd: the momentum
    b2: float = field(default=0.95, metadata={"range": "[0, 1)"})  # the second moment's decay (adamw, lion)
    eps: float = field(default=1e-8, metadata={"range": "(0, inf)"})  # added to the second moment's root (adamw)
    grad_clip: float = field(default=1.0, metadata={"range": "[0, inf)"})  # the global norm; 0: no clipping


@dataclass
class ScheduleSection:
    """Learning-rate schedule."""

    # the learning rate's shape after the warmup (wsd: warmup, stable, then a linear decay over the last 20%)
    name: str = field(default="cosine", metadata={"choices": ("constant", "cosine", "linear", "wsd")})
    warmup_steps: int = field(default=0, metadata={"range": "[0, inf)"})  # linear from 0 to the learning rate
    # the decaying schedules' final rate, as a share of optimizer.learning_rate
    min_lr_ratio: float = field(default=0.1, metadata={"range": "[0, 1]"})


@dataclass
class MeshSection:
    """Device mesh sizes; -1 means all remaining devices."""

    data: int = 1  # data parallelism: replicas of the weights, each given its share of the batch
    fsdp: int = -1  # fully sharded data parallelism: the batch and the weights, gradients and moments split
    tensor: int = 1  # tensor parallelism: the attention heads and MLP width split (Megatron's layout)
    expert: int = 1  # expert parallelism: a mixture of experts' experts split (MoE models)
    # context parallelism: each row's tokens split over this many devices (attention gathers the keys); for rows
    # too long for one device's activations. Must divide data.seq_len
    context: int = field(default=1, metadata={"range": "[1, inf)"})


@dataclass
class DtypeSection:
    """Master-weight and compute dtypes."""

    # the stored (master) weights and the optimizer's moments
    params: str = field(default="float32", metadata={"choices": ("float32", "bfloat16")})
    # the forward and backward passes' matmuls (the weights cast to it each step)
    compute: str = field(default="float32", metadata={"choices": ("float32", "bfloat16")})


@dataclass
class CheckpointSection:
    """How often checkpoints are saved and how many are kept."""

    every: int = field(default=500, metadata={"range": "[1, inf)"})  # steps between checkpoints (and the last)
    keep: int = field(default=3, metadata={"range": "[1, inf)"})  # the newest checkpoints kept (older are deleted)


@dataclass
class LoraSection:
    """LoRA adapters (zoo/lora/params.py); rank 0 trains the full model instead."""

    rank: int = field(default=0, metadata={"range": "[0, inf)"})  # r: the adapters' inner size (0: no LoRA)
    alpha: float = field(default=16.0, metadata={"range": "(0, inf)"})  # the update is scaled by alpha / rank
    dropout: float = field(default=0.0, metadata={"range": "[0, 1)"})  # on the adapters' input, in training only
    # HF module names (q_proj ... down_proj), a comma list, "all" (the language model's), or a regex; a VLM's tower
    # and connector apart: vision.q_proj ... vision.down_proj, projector.proj
    targets: list[str] | str = "all"
    rslora: bool = False  # scale by alpha/sqrt(rank) instead of alpha/rank
    base_quant: str | None = None  # QLoRA: store the frozen base quantized, "nf4" (bitsandbytes' NF4) or "int8"
    base_quant_double: bool = False  # NF4 double quantization (the absmax themselves 8-bit): 4.127 bits a weight


@dataclass
class EvalSection:
    """Scored `zoo eval` tasks run on the current weights every ``eval_every`` steps (besides the eval loss)."""

    # shipped task names (`zoo eval --list-tasks`), task YAML paths, or lm-evaluation-harness task names (the eval
    # extra; `zoo eval --harness`), e.g. [prose, arc_easy]
    tasks: list[str] | str = field(default_factory=list)
    limit: int | None = field(default=32, metadata={"range": "[1, inf)"})  # examples per task (None: all)
    batch_size: int = field(default=8, metadata={"range": "[1, inf)"})  # examples scored at once
    include_path: str | None = None  # a folder of your own lm-eval task YAMLs, for harness task names


# Keys every command reads only under a condition (pretrain/config_unread.py): LoRA's without LoRA, the scored
# tasks' without tasks, an optimizer's constants under another optimizer, a decay's floor without a decay.
COMMON_UNREAD: tuple[Unread, ...] = (
    *keys_unread(("lora.alpha", "lora.dropout", "lora.targets", "lora.rslora", "lora.base_quant",
                  "lora.base_quant_double"), lambda c: not c.lora.rank,
                 "is read by LoRA runs only, and lora.rank is 0 (full fine-tuning): set lora.rank, or remove it"),
    Unread("lora.base_quant_double", lambda c: c.lora.base_quant != "nf4",
           "applies to lora.base_quant: nf4 only (NF4's double quantization): remove it"),
    *keys_unread(("eval.limit", "eval.batch_size", "eval.include_path"), lambda c: not c.eval.tasks,
                 "configures the scored eval.tasks, and eval.tasks is empty: name tasks, or remove it"),
    Unread("optimizer.b1", lambda c: c.optimizer.name == "adafactor",
           "is read by optimizer.name adamw, lion (the first moment) and sgd (the momentum), not adafactor: "
           "remove it"),
    Unread("optimizer.b2", lambda c: c.optimizer.name not in ("adamw", "lion"),
           "is read by optimizer.name adamw and lion only, not {cfg.optimizer.name}: remove it"),
    Unread("optimizer.eps", lambda c: c.optimizer.name != "adamw",
           "is read by optimizer.name adamw only, not {cfg.optimizer.name}: remove it"),
    Unread("schedule.min_lr_ratio", lambda c: c.schedule.name == "constant",
           "is the floor a schedule decays to, and schedule.name constant never decays: remove it"),
    Unread("data.eval_fraction", lambda c: bool(c.data.eval_path),
           "holds rows of data.path out for eval when data.eval_path is not set; data.eval_path "
           "{cfg.data.eval_path} is the eval set: remove one of them"),
)
# Pretraining's text column, which the chat tasks do not read (their rows' columns are their format's).
TEXT_FIELD_UNREAD = Unread("data.text_field", lambda c: True,
                           "names the text column of pretraining's rows; this command reads the columns of its rows' "
                           "format: remove it")


def layout_unread(command: str) -> tuple[Unread, ...]:
    """The packing keys, unread by a task that lays out one example a row itself (``command`` names it)."""
    return keys_unread(("data.packing", "data.max_segments"), lambda c: True,
                       f"is not read by {command}: each example is a row of its own, laid out by the task; remove it")


@dataclass
class TrainConfig:
    """Everything a training run needs."""

    # Keys the run reads only under a condition (pretrain/config_unread.py); a task's schema extends the table.
    UNREAD: ClassVar[tuple[Unread, ...]] = COMMON_UNREAD

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    batch_size: int = field(default=8, metadata={"range": "[1, inf)"})  # rows per optimizer step (all devices)
    # micro-batches per step (batch_size / grad_accum rows each): the same update with less activation memory
    grad_accum: int = field(default=1, metadata={"range": "[1, inf)"})
    # the run's length (one of the two is needed): max_steps steps if set, else epochs passes over the data
    max_steps: int | None = field(default=None, metadata={"range": "[1, inf)"})
    epochs: int | None = field(default=None, metadata={"range": "[1, inf)"})  # passes over the data (no max_steps)
    seed: int = field(default=0, metadata={"range": "[0, 4294967295]"})  # numpy's and grain's seeds are 32-bit
    output_dir: str = "runs/run"  # the run folder: checkpoints, final/, metrics.jsonl, logs (a rerun resumes)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    dtype: DtypeSection = field(default_factory=DtypeSection)
    # none | full (recompute each layer in backward) | save_dots (keep weight matmuls) | offload (keep the layers'
    # inputs and attention projections in host memory, recompute the MLP: zoo.model.layer_scan.REMAT_POLICIES)
    remat: str = field(default="none", metadata={"choices": ("none", "full", "save_dots", "offload")})
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    log_every: int = field(default=10, metadata={"range": "[1, inf)"})  # steps between log lines and metrics
    # the trackers metrics.jsonl's records also go to (TRL's key): tensorboard, wandb, mlflow, trackio (each but
    # tensorboard an extra: lmzoo[wandb], ...), none or all; where each writes is its own settings' (WANDB_MODE, ...)
    report_to: list[str] | str = field(default_factory=lambda: ["tensorboard"])
    eval_every: int = field(default=0, metadata={"range": "[0, inf)"})  # 0: no eval during training
    eval: EvalSection = field(default_factory=EvalSection)
    # per device, for MFU; None: detected for known accelerators, else no MFU
    peak_tflops: float | None = field(default=None, metadata={"range": "(0, inf)"})

    def check(self) -> None:
        """Cross-field checks that types alone cannot express (a task's schema extends them)."""
        if self.model.init == "pretrained" and not self.model.path:
            raise UserError("config needs `model` (a zoo checkpoint path or registry name), or `model.init: random`")
        if self.model.init == "random" and not (self.model.config and self.model.tokenizer):
            raise UserError("`model.init: random` needs `model.config` (a tiny registry entry or a config.json) "
                            "and `model.tokenizer` (a tokenizer folder or a zoo checkpoint)")
        self.data.check()
        for name in self.model.freeze:
            if name not in FREEZABLE:
                raise UserError(f"model.freeze names {name!r}; choose among {', '.join(FREEZABLE)}")
        if self.mesh.context > 1 and self.data.seq_len % self.mesh.context:
            raise UserError(f"data.seq_len {self.data.seq_len} must be a multiple of mesh.context "
                            f"{self.mesh.context} (each device attends an equal block of every row)")
        if self.batch_size % self.grad_accum:
            raise UserError(f"batch_size={self.batch_size} must be a multiple of grad_accum={self.grad_accum}")
        trackers.chosen(self.report_to)  # an unknown tracker's name
        if self.eval.tasks and not self.eval_every:
            raise UserError("eval.tasks are scored every eval_every steps; set eval_every (e.g. eval_every=100)")


    def check_inputs(self) -> None:
        """What a run that trains needs and ``--compile-only`` does not (it reads no data and compiles one step
        whatever the run's length): the data and the run's length."""
        if not self.data.path:
            raise UserError("config needs `data.path` (a jsonl/json/parquet/txt file or folder)")
        if self.max_steps is None and self.epochs is None:
            raise UserError("config needs `max_steps` or `epochs`")


def _build(cls: type, data: dict[str, Any], prefix: str = "", root: type | None = None) -> Any:
    root = root or cls
    kwargs = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in fields:
            valid = schema_keys(root)
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(valid)}"
            raise UserError(f"unknown config key '{key}'{hint}")
        t = field_type(cls, k)
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
            kwargs[k] = coerce(key, v, t)
            check_field(key, kwargs[k], fields[k])
    return cls(**kwargs)


def load_config(path: str | Path | None, overrides: Sequence[str] = (),
                schema: type[TrainConfig] | None = None, compile_only: bool = False) -> TrainConfig:
    """Read a YAML config (safely) and apply `key.sub=value` (and `~key.sub` removal) overrides, as ``schema`` (a task's ``config_class``;
    default :class:`TrainConfig`, pretraining's) says. ``compile_only``: for ``--compile-only``, which needs no
    ``data.path`` and no ``max_steps`` (:meth:`TrainConfig.check_inputs` is skipped)."""
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
        if item.startswith("~") and "=" not in item:  # Hydra's removal: `~lora` trains the file's run in full
            remove_override(tree, item[1:].strip())
            continue
        if "=" not in item:
            raise UserError(f"override {item!r}: write it as key.sub=value, or ~key.sub to remove a key")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except (yaml.YAMLError, ValueError):  # ValueError: YAML reads 2025-13-40 as a date, and fails
            value = raw
        set_override(tree, key.strip(), value)
    cfg: TrainConfig = _build(schema or TrainConfig, tree)
    cfg.check()
    if not compile_only:
        cfg.check_inputs()
    check_unread(cfg, cfg.UNREAD)
    return cfg


def config_keys(schema: type[TrainConfig] | None = None) -> list[str]:
    """Every dotted config key of ``schema`` (default :class:`TrainConfig`; ``data.seq_len``, ...), in declaration
    order."""
    return schema_keys(schema or TrainConfig)


def to_yaml(cfg: TrainConfig) -> str:
    """The fully resolved config as YAML (what --print-config shows and checkpoints record)."""
    text: str = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    return text
