"""Checkpoint paths given by a user: what is there, and the way to the right one when it is not a checkpoint.

Every command that takes a zoo checkpoint (``zoo generate``, ``zoo eval``,
``zoo export``, ``zoo info``, training's ``model.path``) resolves it here, so a
missing path, a training run's folder (its checkpoint is ``RUN/final``) and a
folder that is some other thing each get one line that says what to give.
"""

from __future__ import annotations

import os
from pathlib import Path

from zoo.errors import UserError
from zoo.storage import fetched, is_remote, local_copy, run_path

MODEL_FILE = "model.json"  # zoo.checkpoints.format.MODEL_FILE (not imported: that module loads NumPy)
PARAMS_DIR = "params"  # zoo.checkpoints.format.PARAMS_DIR (likewise)
QUICKSTART_RUNS = ("runs", "quickstart")  # where docs/quickstart.md writes its checkpoints
RUN_MARKS = ("final", "checkpoints", "metrics.jsonl", "config.yaml")  # what a training run's output_dir holds
RUN_RECORDS = ("config.yaml", "metrics.jsonl")  # what a model card reads of a run beside its final/


def checkpoint_dir(path: str | Path, what: str = "") -> Path:
    """The zoo checkpoint folder at ``path``, or a UserError that says what ``path`` is and what to give instead.

    ``what`` names where the path came from (``"model.path"``); it starts the message.
    """
    if is_remote(path):  # a checkpoint on a bucket: a local copy of its small files; Orbax reads its arrays there
        return _fetched_with_run(str(path), what or "checkpoint")
    p = Path(path).expanduser()
    label = f"{what} {path}" if what else str(path)
    if (p / MODEL_FILE).is_file():
        return p
    if not p.exists():
        raise UserError(f"{label}: no such checkpoint (no such file or folder); {_how_to_make(str(path))}")
    if p.is_dir() and any((p / m).exists() for m in RUN_MARKS):
        final = p / "final"
        if (final / MODEL_FILE).is_file():
            raise UserError(f"{label} is a training run, not a checkpoint; use its final checkpoint: {final}")
        raise UserError(f"{label} is a training run that has not finished (no checkpoint in {final} yet); run it "
                        f"again to resume it, then use {final}")
    if (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").is_file()):
        raise UserError(f"{label} is not a zoo checkpoint but a model to convert: "
                        f"`zoo convert {path} --out DIR`, then use DIR")
    raise UserError(f"{label} is not a zoo checkpoint (no {MODEL_FILE}); create one with "
                    "`zoo convert SOURCE --out DIR` (or `zoo init`), or give a training run's final/ folder")


def _fetched_with_run(url: str, what: str) -> Path:
    """The local copy of the checkpoint at ``url``, less its arrays (``params/``: the readers read them at the URL,
    :func:`zoo.checkpoints.format.params_dir`); a run's ``final/`` comes with its run's records beside it
    (config.yaml, metrics.jsonl, as on a local disk), which an export's model card reads."""
    folder = fetched(url, MODEL_FILE, what, leave=(PARAMS_DIR,))
    run = url.rstrip("/")
    if run.endswith("/final"):
        run = run[: -len("/final")]
        for name in RUN_RECORDS:
            if (run_path(run, what) / name).exists():
                local_copy(f"{run}/{name}", what)
    return folder


def _how_to_make(path: str) -> str:
    """How to make the missing checkpoint ``path``: a registry name's conversion, a run's ``final`` by its run,
    anything else by ``zoo convert``; and, under ``runs/quickstart``, that the quickstart's commands make it."""
    from zoo.registry import catalogue as registry

    if registry.looks_like_name(path) and path in registry.REGISTRY:
        return f"{path} is a model of the zoo: convert it first with `zoo convert {path} --out ckpt/{path}`"
    p = Path(path)
    if p.name == "final":
        how = f"it is a training run's final checkpoint: run the training whose output_dir is {p.parent} first"
    else:
        how = f"make it with `zoo convert SOURCE --out {path}` (SOURCE: a Hub repo, a Hugging Face folder, a GGUF file)"
    if Path(os.path.normpath(path)).parts[:2] == QUICKSTART_RUNS:
        how += "; docs/quickstart.md's commands make it (the example configs start from its checkpoints)"
    return how
