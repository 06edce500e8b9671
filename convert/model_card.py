"""What the cards `zoo export` writes say of a checkpoint: where its model comes from (the Hub repo, the license:
convert/card_origin.py), how it was trained (method, hyperparameters, data, final metrics: convert/card_training.py)
and how it scored (`zoo eval --out` results), rendered as Markdown.

Shared by the model's card (convert/export.py) and the PEFT adapter's (convert/peft_card.py). The metadata (front
matter) is huggingface_hub's ``ModelCardData``, so the Hub reads ``base_model``, ``license``, ``datasets``, ...
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard, ModelCardData

from convert.card_origin import Origin
from convert.card_training import Training, config_value, hyperparameters, method_text, metrics_of
from zoo.data.files import looks_like_hub_name
from zoo.errors import UserError


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


# --- local paths ---------------------------------------------------------------------------------------------

# An absolute path in free text (a method's line, a hyperparameter's value: ``rm:/models/judge``): a "/" that
# starts the text or follows a space, a quote, a bracket, ":" or "=", up to the next such character.
_ABSOLUTE = re.compile(r"(?:(?<=^)|(?<=[\s`'\"(\[{:=,]))(?:/|~/)[^\s`'\"()\[\]{},;]*")


def public_path(path: str | os.PathLike) -> str:
    """A local path as an exported file shows it (cards, adapter_config.json): an absolute one relative to the
    working directory when it lies under it, else its last name alone, since ``--push-to-hub`` publishes these
    files and a path of this machine says nothing to their readers; a relative path, a Hub id or a registry name
    as given."""
    text = str(path)
    p = Path(text).expanduser()
    if not p.is_absolute():
        return text
    try:
        rel = p.relative_to(Path.cwd())
    except ValueError:
        return p.name or text
    return str(rel) if rel.parts else p.name


def public_text(text: str) -> str:
    """``text`` with every absolute path in it written as :func:`public_path` writes it."""
    return _ABSOLUTE.sub(lambda m: public_path(m.group(0)), text)


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
        row = [name, f"`{public_path(s.path)}`", "?" if s.rows is None else f"{s.rows:,}"]
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
    lines = [f"**Method:** {public_text(method_text(t))}.", ""]
    settings = hyperparameters(t)
    if settings:  # a path among them (a teacher, a reference, a reward model) as public_path writes it
        lines += ["### Hyperparameters", "",
                  *table(("key", "value"), ((f"`{k}`", public_text(_setting(v))) for k, v in settings)), ""]
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
    all_tags = ["lmzoo", *tags, *(training.card.tags if training is not None and training.card is not None else ())]
    datasets = [s.path for s in (training.data + training.eval_data if training else [])
                if not Path(s.path).expanduser().exists() and looks_like_hub_name(s.path)]
    return ModelCardData(library_name=library_name, base_model=base_model, license=origin.license,
                         tags=list(dict.fromkeys(all_tags)), pipeline_tag=pipeline_tag,
                         datasets=list(dict.fromkeys(datasets)) or None)


def render(data: ModelCardData, body: Sequence[str]) -> str:
    """README.md: the metadata as front matter, then ``body``'s Markdown lines."""
    return str(ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(body)))
