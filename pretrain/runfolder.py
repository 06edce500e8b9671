"""A run folder's protection: what a rerun may change, starting over (``--fresh``), and what a folder holds.

A rerun in an ``output_dir`` that holds a run continues it. Its config is
compared with the one the run saved: keys that shape what is trained (model,
data, seq_len, batch, optimizer, schedule, LoRA, the task's settings, seed,
dtypes) cannot change mid-run unless ``--resume-with-changes`` names them;
``MAY_CHANGE`` lists the keys that can (how long, how often to log, evaluate and
checkpoint, the mesh). ``--fresh`` moves an old run aside, never deleting it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import yaml

from pretrain.config import TrainConfig, config_keys
from zoo.errors import UserError
from zoo.storage import RunPath, check_writable, is_remote, move_tree

CONFIG_FILE = "config.yaml"
# Keys a resumed run may change freely (a key or a whole section). Anything else is a change of the run itself.
MAY_CHANGE = ("max_steps", "epochs", "log_every", "eval_every", "eval", "checkpoint", "output_dir", "peak_tflops",
              "mesh", "remat", "report_to")


# What Orbax writes into a checkpoint on object storage once the whole step is there (it cannot rename a folder
# there atomically, so a step folder exists before it is complete).
COMMIT_FILE = "commit_success.txt"


def checkpoint_steps(out: RunPath) -> list[int]:
    """The steps of the training checkpoints in ``out/checkpoints`` (committed ones only: on local disk a step's
    folder is renamed into place whole; on object storage it holds Orbax's commit file)."""
    d = out / "checkpoints"
    if not d.is_dir():
        return []
    remote = is_remote(out)
    return sorted(int(p.name) for p in d.iterdir()
                  if p.name.isdigit() and p.is_dir() and (not remote or (p / COMMIT_FILE).exists()))


def holds_run(out: RunPath) -> bool:
    """Whether ``out`` holds a run that a rerun would continue (a checkpoint or a final model)."""
    return bool(checkpoint_steps(out)) or (out / "final" / "model.json").is_file()


def finished_run(out: RunPath, cfg: TrainConfig) -> RunPath | None:
    """``out/final`` when the run in ``out`` is complete for ``cfg`` (its final model is of the last checkpoint's
    step, and max_steps/epochs are those the run was saved with), else None. Cheap: reads two small files."""
    import json

    meta, saved = out / "final" / "model.json", out / CONFIG_FILE
    if not meta.is_file() or not saved.is_file():
        return None
    try:
        steps = json.loads(meta.read_text()).get("training", {}).get("steps")
        old = yaml.safe_load(saved.read_text()) or {}
    except (ValueError, yaml.YAMLError, AttributeError):
        return None
    ckpts = checkpoint_steps(out)
    if not ckpts or ckpts[-1] != steps or (old.get("max_steps"), old.get("epochs")) != (cfg.max_steps, cfg.epochs):
        return None
    return out / "final"


def changed_keys(old: Any, new: Any, key: str = "", in_list: bool = False) -> list[tuple[str, Any, Any]]:
    """What differs between two config trees, each change named as precisely as it can be ((key, old, new)
    each): a mapping key by key, a list item by item when both lists are as long (``data.path[1].weight: 0.3
    -> 0.5``), else the whole value (a source added, a path that became a mixture). Config keys are compared
    when both sides have them (one an older version did not have yet had its default then); a mapping inside a
    list (a source, a reward function's settings) only key by key when both have the same keys."""
    if isinstance(old, dict) and isinstance(new, dict) and (not in_list or old.keys() == new.keys()):
        return [c for k, v in new.items() if k in old
                for c in changed_keys(old[k], v, f"{key}.{k}" if key else str(k), in_list)]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new)) for c in changed_keys(a, b, f"{key}[{i}]", True)]
    return [(key, old, new)] if old != new else []


def _covered(key: str, names: Sequence[str]) -> bool:
    """Whether ``key`` (``data.path[1].weight``) is one of ``names`` or lies in one (``data.path``, ``data``)."""
    return any(key == n or key.startswith((n + ".", n + "[")) for n in names)


def parse_changes(spec: Sequence[str] | str | None, schema: type[TrainConfig] | None = None) -> list[str]:
    """The keys (or sections) ``--resume-with-changes`` names: comma- or space-separated; each must be a key or
    section of the config ``schema`` (default: :class:`TrainConfig`)."""
    if not spec:
        return []
    items = [spec] if isinstance(spec, str) else list(spec)
    names = [n.strip() for item in items for n in item.split(",") if n.strip()]
    valid = config_keys(schema)
    for n in names:
        if not any(k == n.split("[")[0] or k.startswith(n + ".") for k in valid):  # `data.path[1].weight` too
            import difflib

            near = difflib.get_close_matches(n, valid, n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise UserError(f"--resume-with-changes {n}: not a config key or section{hint}")
    return names


def config_changes(out: RunPath, cfg: TrainConfig, allowed: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """The changes of ``cfg`` from the config the run in ``out`` saved that matter ((key, old, new) each;
    ``MAY_CHANGE`` keys left out). A change ``allowed`` does not name is a UserError listing every one."""
    saved = out / CONFIG_FILE
    if not saved.is_file() or not holds_run(out):
        return []
    try:
        old = yaml.safe_load(saved.read_text()) or {}
    except yaml.YAMLError:
        raise UserError(f"{saved} is not valid YAML; restore it, or start over with --fresh") from None
    changes = [c for c in changed_keys(old, dataclasses.asdict(cfg)) if not _covered(c[0], MAY_CHANGE)]
    unlisted = [c for c in changes if not _covered(c[0], allowed)]
    if unlisted:
        listed = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in unlisted)
        # a list item's change is allowed by naming the list (data.path): no [N] for the shell to glob
        keys = ",".join(dict.fromkeys(k.split("[")[0] for k, _, _ in unlisted))
        raise UserError(f"{out} holds a run with another config ({listed}); rerun with its values, pass "
                        f"--resume-with-changes {keys} to continue it with the new ones, --fresh to start over (the "
                        f"old run is moved aside), or use another output_dir")
    return changes


def _show(v: Any) -> str:
    text: str = yaml.safe_dump(v, default_flow_style=True, width=1_000_000)
    return text.strip().removesuffix("...").strip()


def move_aside(out: RunPath) -> RunPath | None:
    """Move a non-empty ``out`` to a sibling ``<name>.old-<UTC time>`` (never deleting it); returns where, or None
    when there was nothing to move."""
    if not out.is_dir() or not any(out.iterdir()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = out.with_name(f"{out.name}.old-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = out.with_name(f"{out.name}.old-{stamp}-{n}")
    move_tree(out, dest)
    return dest


def open_run(out: RunPath, cfg: TrainConfig, fresh: bool, allowed: Sequence[str]) -> RunPath | None:
    """Get ``out`` ready for a run: checked to be writable (:func:`zoo.storage.check_writable`); ``fresh`` moves an old run
    aside; else a finished run's ``final`` is returned (nothing to train), and a resumed run's config changes
    (only what ``allowed`` and :data:`MAY_CHANGE` permit) are reported. None: train."""
    import sys

    from pretrain import distributed

    check_writable(out)  # on every process: each host writes its own shards, with its own credentials
    primary = distributed.is_primary()
    if fresh:
        moved = move_aside(out) if primary else None
        distributed.sync("lmzoo-fresh")
        if moved:
            print(f"--fresh: moved the old run in {out} to {moved}", file=sys.stderr)
        return None
    changes = config_changes(out, cfg, allowed)
    done = finished_run(out, cfg)
    if done is not None:
        if primary:
            steps = checkpoint_steps(out)[-1]
            print(f"{out}: the run is complete (step {steps} of {steps}; final model {done}); nothing to train "
                  f"(raise max_steps to train on, or pass --fresh to start over)")
        return done
    if changes and primary:
        print("continuing with changes: " + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes),
              file=sys.stderr)
    return None
