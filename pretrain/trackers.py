"""The experiment trackers a run reports to (``report_to``, TRL's key): TensorBoard, Weights & Biases, MLflow, trackio.

``metrics.jsonl`` stays the run's record; a tracker is told what it holds. :class:`TrackerHook` runs right after
the metrics hook (pretrain/runlog.py), on the primary process only, and gives each tracker every record the log
wrote, at its step, with the same floats (named as TensorBoard names them: ``train/<name>``, ``eval/...``), the
tables a hook handed over for the step (:attr:`pretrain.hooks.StepInfo.tables`: GRPO's completions) and, once,
the resolved config as the run's hyperparameters (the config only: no environment variables, no credentials).

A resumed run continues the same tracker run: ``trackers.json`` in the run folder keeps each tracker's run id and
the last step it was given, and a rerun resumes that run and skips the steps it already holds (those a killed run
logged after its last checkpoint), so each step reaches a tracker once. Where each tracker writes is its own
settings' (``WANDB_MODE``, ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``,
``TRACKIO_PROJECT``, ``TRACKIO_SPACE_ID``), as with TRL. Each but TensorBoard is an extra (``lmzoo[wandb]``...);
a missing one is an error before anything is written (:func:`check_installed`), and so is one that cannot start
its run (:meth:`TrackerHook.open`: no server, no credentials).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from zoo.errors import UserError

if TYPE_CHECKING:  # the config reads this module's names: it imports nothing of the loop's (no JAX)
    from pretrain.hooks import RunModel, StepInfo

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
STATE_FILE = "trackers.json"


def chosen(report_to: Sequence[str] | str) -> list[str]:
    """The trackers ``report_to`` names (a list, or one string, comma-separated): TRL's ``"none"`` is none,
    ``"all"`` every installed one; an unknown name is a UserError."""
    items = [report_to] if isinstance(report_to, str) else list(report_to)
    names = [n.strip() for item in items for n in item.split(",") if n.strip()]
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [n for n in TRACKERS if _installed(n)]
    for n in names:
        if n not in TRACKERS:
            raise UserError(f"report_to: unknown tracker {n!r}; choose from {', '.join(TRACKERS)} (or none, all)")
    return list(dict.fromkeys(names))


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec("tensorboardX" if name == "tensorboard" else name) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules, or a broken install
        return False


def check_installed(report_to: Sequence[str] | str) -> None:
    """A UserError naming the extra to install for the first tracker ``report_to`` names that is not installed
    (checked without importing it: before anything of the run is written)."""
    for name in chosen(report_to):
        if not _installed(name):
            raise UserError(f"report_to: {name} is not installed; pip install 'lmzoo[{name}]' (or remove {name} "
                            f"from report_to)")


class NoBoard:
    """The TensorBoard writer of a run that does not report to TensorBoard: writes nothing."""

    def __init__(self, logdir: str) -> None:
        pass

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Nothing."""

    def close(self) -> None:
        """Nothing."""


class Tracker(Protocol):
    """One tracker's run: started (or resumed by id), given metrics and tables by step, finished."""

    def start(self, config: dict[str, Any], name: str, resume_id: str | None) -> str:
        """Start a run named ``name`` with ``config`` as its hyperparameters, or resume the run ``resume_id``;
        returns the run's id."""
        ...

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log ``metrics`` at ``step``."""
        ...

    def table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        """Log the table ``name`` (``rows``, each a mapping of column to value) at ``step``."""
        ...

    def finish(self) -> None:
        """End the run (it can be resumed)."""
        ...


class WandbTracker:
    """Weights & Biases: ``wandb.init(id=..., resume="allow")``; metrics by step, a table as a ``wandb.Table``."""

    def start(self, config: dict[str, Any], name: str, resume_id: str | None) -> str:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(name=name, config=config, id=resume_id or uuid.uuid4().hex[:12], resume="allow",
                              allow_val_change=True)  # a resumed run's config may change what runfolder allows
        run_id: str = self.run.id
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        columns: list[Any] = list(rows[0])
        self.run.log({name: self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])},
                     step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker:
    """MLflow: ``mlflow.start_run(run_id=...)``; the config flattened into params (``optimizer.learning_rate``),
    metrics by step, a table appended to the run's ``<name>.json`` artifact (``mlflow.log_table``)."""

    def start(self, config: dict[str, Any], name: str, resume_id: str | None) -> str:
        import mlflow

        self.mlflow = mlflow
        _answers(mlflow.get_tracking_uri())
        run = mlflow.start_run(run_id=resume_id, run_name=None if resume_id else name)
        # A param cannot change in MLflow: a resumed run adds the keys it did not have (a newer version's).
        have = run.data.params
        params = {k: str(v)[:6000] for k, v in _flat(config).items() if k not in have}
        if params:
            mlflow.log_params(params)
        run_id: str = run.info.run_id
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # MLflow's names take letters, digits, _ - . / and space: an eval task's other characters become _.
        self.mlflow.log_metrics({re.sub(r"[^\w\-. /]", "_", k): v for k, v in metrics.items()}, step=step)

    def table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        columns = list(rows[0])
        self.mlflow.log_table({c: [r.get(c) for r in rows] for c in columns}, artifact_file=f"{name}.json")

    def finish(self) -> None:
        self.mlflow.end_run()


def _answers(uri: str, timeout: float = 10) -> None:
    """Whether an http(s) tracking server answers at all (any status) within ``timeout`` seconds, else an error
    naming it: MLflow's own client retries a refused connection for about 4 minutes
    (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``), too long for a wrong ``MLFLOW_TRACKING_URI`` to stall a run's start.
    Proxies are honoured as MLflow's client honours them (``requests``)."""
    if not uri.startswith(("http://", "https://")):  # a local folder, a database, databricks: MLflow's to say
        return
    import requests

    try:
        requests.get(uri, timeout=timeout)
    except requests.RequestException as e:
        raise ConnectionError(f"no answer from {uri} ({type(e).__name__}); is MLFLOW_TRACKING_URI right and its "
                              f"server up?") from None


class TrackioTracker:
    """trackio (local, or a Space with ``TRACKIO_SPACE_ID``): ``trackio.init(name=..., resume="must")`` resumes a
    run by its name, so a fresh run's name is the run folder's with a unique suffix."""

    def start(self, config: dict[str, Any], name: str, resume_id: str | None) -> str:
        import trackio

        self.trackio = trackio
        self.run: Any = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "lmzoo"),
                                     name=resume_id or f"{name}-{uuid.uuid4().hex[:8]}", config=config,
                                     resume="must" if resume_id else "never",
                                     space_id=os.environ.get("TRACKIO_SPACE_ID"))
        run_name: str = self.run.name
        return run_name

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        columns = list(rows[0])
        self.run.log({name: self.trackio.Table(data=[[r.get(c) for c in columns] for r in rows], columns=columns)},
                     step=step)

    def finish(self) -> None:
        self.run.finish()


def _first_line(e: BaseException) -> str:
    """An exception's first line (its type's name when it says nothing)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


MAKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers as a tracker gets them: named as TensorBoard names them (``train/<name>``,
    ``eval/...`` as is), the same floats; a non-finite value left out, as ``metrics.jsonl`` writes it null."""
    return {k if k.startswith("eval/") else f"train/{k}": float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TrackerHook:
    """The trackers of the primary process (:data:`MAKERS`, those ``report_to`` names besides TensorBoard): every
    ``every`` steps and at the last, the step's metrics record; at any step, the tables a hook handed over. A
    :class:`pretrain.hooks.Hook` by its four methods; :meth:`open` starts the runs first, before the run folder
    is written."""

    def __init__(self, out: Path, names: Sequence[str], config: Any, every: int) -> None:
        self.out, self.every = out, every
        self.names = [n for n in names if n in MAKERS]
        self.config = dataclasses.asdict(config)
        self.runs: dict[str, Tracker] = {}
        self.state: dict[str, dict[str, Any]] = {}  # each tracker's run id and the last step it was given

    def setup(self, model: RunModel) -> None:
        """Nothing: the trackers' runs start before the run folder is written (:meth:`open`)."""

    def open(self) -> None:
        """Start each tracker's run, or resume the one ``trackers.json`` names (and the step it was given), writing
        nothing: a tracker that cannot start is a UserError in one line (the runs already started are finished),
        and the run folder stays as it was. MLflow's server is asked first, briefly (:func:`_answers`)."""
        path = self.out / STATE_FILE
        if not self.names:  # TensorBoard alone (RunLog draws it): no trackers.json
            return
        self.state = json.loads(path.read_text()) if path.is_file() else {}  # a tracker left out stays in it
        for name in self.names:
            was = self.state.get(name, {})
            tracker = MAKERS[name]()
            try:
                run_id = tracker.start(self.config, self.out.name, was.get("id"))
            except Exception as e:  # no credentials, no server: the tracker's own words, in one line
                self.close()
                raise UserError(f"report_to: {name} could not start its run ({_first_line(e)}); check its settings "
                                f"(see docs/training/index.md, Trackers)") from None
            self.runs[name] = tracker
            self.state[name] = {"id": run_id, "step": int(was.get("step", 0))}

    def start(self, step: int) -> None:
        """Write ``trackers.json`` (each run's id, for a rerun to resume it), now that the run folder exists."""
        if self.runs:
            self._save()

    def on_step(self, info: StepInfo) -> None:
        """Give each tracker the step's record and tables, unless it holds the step already."""
        metrics = scalars(info.record) if info.step % self.every == 0 or info.last else {}
        tables = {k: rows for k, rows in info.tables.items() if rows}
        if not self.runs or not (metrics or tables):
            return
        for name, tracker in self.runs.items():
            if info.step <= self.state[name]["step"]:  # logged before a kill, after the checkpoint resumed from
                continue
            if metrics:
                tracker.log(info.step, metrics)
            for table, rows in tables.items():
                tracker.table(info.step, table, rows)
            self.state[name]["step"] = info.step
        self._save()

    def _save(self) -> None:
        """Write ``trackers.json`` whole, then rename it over the old one (a kill leaves one or the other)."""
        path = self.out / STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        tmp.replace(path)

    def close(self) -> None:
        """Finish each tracker's run."""
        for tracker in self.runs.values():
            tracker.finish()
        self.runs = {}
