"""What a trained checkpoint's records say of its training, for its model card.

Each record is read when present, so a checkpoint written before a record existed, or moved out of its run
folder, gets the sections its records allow:

- model.json's ``training`` record (pretrain/final.py): method, data path, steps, the final loss, packing, a
  mixture's realized counts per source, and the method as its task declared it for the card (``card``: name,
  tags, key hyperparameters; zoo/checkpoints/method_card.py);
- the run folder a run's ``final/`` sits in: ``config.yaml`` (the resolved config: data) and ``metrics.jsonl``
  (every logged step, the eval metrics on theirs);
- local data files, whose rows are counted at export (a Hub dataset's are not: no download here).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zoo.checkpoints.method_card import MethodCard, adapter_settings
from zoo.data.files import SUFFIX_FORMATS
from zoo.data.jsonl import read_records
from zoo.data.row_origin import JSON_SPACE, file_lines, is_json_array

# A run folder's records beside its final/ (pretrain/runfolder.py CONFIG_FILE, pretrain/runlog.py METRICS_FILE;
# named here, not imported: convert/ stands below pretrain/).
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
# Fields of a metrics record that are not results: the step, the schedule's rate, and the machine's timings
# (pretrain/runlog.py TIMING_FIELDS, an online task's rollout/train throughput and generation share).
NOT_RESULTS = ("step", "learning_rate", "tokens_per_sec", "step_time", "mfu", "generation_share")
# Text data (JSON lines, text) counted at export only up to this size: a corpus' rows would take minutes to count.
COUNT_ROWS_MAX_BYTES = 4 * 2**30


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

    method: str  # the training record's method ("sft", "dpo", ...)
    card: MethodCard | None  # the method as its task declared it (None: a checkpoint from before the record)
    record: dict[str, Any]  # model.json's training record
    config: dict[str, Any] | None  # the run's resolved config (config.yaml), when beside final/
    lora: dict[str, Any] | None  # model.json's lora entry (an adapter checkpoint)
    data: list[DataSource] = field(default_factory=list)
    eval_data: list[DataSource] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)  # the last training metrics record
    last_eval: dict[str, Any] = field(default_factory=dict)  # the last record with eval metrics


def _step_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log that name their step (a line cut short by a kill is skipped)."""
    return [rec for rec in read_records(path)[0] if isinstance(rec.get("step"), int)]


def is_eval_key(key: str) -> bool:
    """Whether a metric is a held-out evaluation's (``eval_loss``, ...)."""
    return key.startswith("eval")


def run_folder(ckpt: Path) -> Path | None:
    """The run folder a run's ``final/`` checkpoint sits in (it holds config.yaml or metrics.jsonl), or None."""
    run = ckpt.absolute().parent
    if ckpt.absolute().name == "final" and ((run / CONFIG_FILE).is_file() or (run / METRICS_FILE).is_file()):
        return run
    return None


def config_value(config: dict[str, Any] | None, key: str) -> Any:
    """The value of dotted ``key`` (``data.split``) in a resolved config tree; None when absent."""
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
    data, evals = training_data(record, config)
    steps = record.get("steps")
    records = [r for r in _step_records(run / METRICS_FILE) if steps is None or r["step"] <= steps] if run else []
    last = records[-1] if records else {}
    evaluated = [r for r in records if any(is_eval_key(k) for k in r)]
    return Training(str(record.get("method") or "training"), MethodCard.of_record(record), record, config,
                    meta.get("lora"), data, evals, last, evaluated[-1] if evaluated else {})


def trained_with(record: dict[str, Any]) -> str:
    """"Trained with lmzoo (METHOD, N steps)": how a card opens its account of model.json's training record."""
    steps = f", {record['steps']} steps" if record.get("steps") is not None else ""
    return f"Trained with lmzoo ({record.get('method', 'training')}{steps})"


def method_text(t: Training) -> str:
    """One line: what the method is, as its task named it (a checkpoint from before: the method's own name)."""
    return t.card.name if t.card is not None else f"`{t.method}`"


def hyperparameters(t: Training) -> list[tuple[str, Any]]:
    """(config key, value) of the run's key hyperparameters: steps from the training record; the settings its
    task recorded for the card (the optimizer, schedule, batch, sequence length, LoRA's and the method's own;
    a checkpoint from before that record: LoRA's, from model.json's lora entry); the packing the run used."""
    settings = t.card.hyperparameters if t.card is not None else adapter_settings(t.lora) if t.lora else ()
    rows = [("steps", t.record.get("steps")), *settings, ("packing", t.record.get("packing"))]
    return [(k, v) for k, v in rows if v is not None]


def metrics_of(record: dict[str, Any], evals: bool) -> dict[str, Any]:
    """The results of one metrics record: its eval metrics (``evals``) or its training ones."""
    return {k: v for k, v in record.items()
            if k not in NOT_RESULTS and not k.endswith("_per_sec") and is_eval_key(k) == evals and v is not None}

