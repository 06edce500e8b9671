"""`zoo eval CKPT --harness T1,T2`: lm-evaluation-harness's tasks on a zoo checkpoint (eval/harness.py's model).

lm-eval is the optional ``eval`` extra: without it ``--harness`` is a one-line
error naming the extra. Task names are checked against lm-eval's library (plus
``--include-path``) before the model loads. The results table is lm-eval's own;
``--out`` writes its results (configs, versions, n-samples, metrics) as JSON and,
with ``--log-samples``, every scored item as JSONL beside it.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from zoo.errors import UserError
from zoo.storage import RunPath, check_writable, is_remote, run_path

EXTRA_HINT = "pip install 'lmzoo[eval]' (from a checkout: pip install -e '.[eval]')"


def require_lm_eval() -> None:
    """lm-eval is importable, else a one-line error naming the extra."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"--harness needs lm-evaluation-harness, the eval extra: {EXTRA_HINT}") from None


def task_manager(include_path: str | None, names: list[str] | None = None) -> Any:
    """lm-eval's TaskManager over its library plus ``include_path`` (a folder that must exist), built once per
    process for each folder: indexing lm-eval's whole library takes 13-37 s, so the names are checked before
    the model loads and the run that follows reuses the index. Where every one of ``names`` is the folder's own
    task, group or tag, the manager indexes the folder alone (a second or less), not the library."""
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path}: no such folder (give a folder of lm-eval task YAMLs)")
    folder = None if include_path is None else str(Path(include_path).resolve())
    if folder is not None and names:
        own = _task_manager(folder, False)
        if all(n in own.all_tasks or own.match_tasks([n]) for n in names):
            return own
    return _task_manager(folder, True)


@functools.cache
def _task_manager(include_path: str | None, library: bool) -> Any:
    from lm_eval.tasks import TaskManager

    if library:
        return TaskManager(include_path=include_path)
    return TaskManager(include_path=include_path, include_defaults=False)


def check_task_names(names: list[str], manager: Any, flag: str = "--harness") -> None:
    """Every name is an lm-eval task, group or tag, else one line naming it and the closest known names."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known and not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(f"{flag} {name}: not an lm-eval task, group or tag{hint}; "
                            "list them with `lm-eval ls tasks`, or add your own with --include-path DIR")


def harness_command(args: argparse.Namespace) -> None:
    """Run ``args.harness`` through lm-eval on ``args.ckpt``; print lm-eval's table; write --out (and samples).
    (eval/cli.py has checked the flags both paths share.)"""
    require_lm_eval()
    if not args.ckpt:
        raise UserError("zoo eval --harness needs CKPT")
    from zoo.checkpoints.paths import checkpoint_dir

    ckpt = str(checkpoint_dir(args.ckpt))
    out = out_path(args.out)
    names = [n.strip() for n in args.harness.split(",") if n.strip()]
    manager = task_manager(args.include_path, names)
    check_task_names(names, manager)  # before the model loads

    import lm_eval
    from lm_eval.utils import make_table

    from eval.harness import LmzooLM
    from eval.rolling import DEFAULT_CHUNK

    t0 = time.perf_counter()
    model = LmzooLM(ckpt, batch_size=args.batch_size, dtype=args.dtype, max_length=args.max_length,
                    chunk=args.chunk or DEFAULT_CHUNK)
    t_load = time.perf_counter() - t0
    results = lm_eval.simple_evaluate(model=model, tasks=names, num_fewshot=args.num_fewshot, limit=args.limit,
                                      log_samples=args.log_samples, task_manager=manager,
                                      apply_chat_template=bool(args.chat_template))
    t_total = time.perf_counter() - t0
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if out is None:
        return
    samples = results.pop("samples", None)
    report = {"checkpoint": args.ckpt if is_remote(args.ckpt) else str(Path(ckpt).absolute()), "backend": "lmzoo",
              "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "timings": {"load_s": round(t_load, 3), "eval_s": round(t_total - t_load, 3)}, **results}
    write_atomic(out, json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    if samples is not None:
        path = samples_path(out)
        lines = (json.dumps({"task": task, **item}, default=str) for task, items in samples.items() for item in items)
        write_atomic(path, "".join(line + "\n" for line in lines))
        print(f"wrote {path}")


def out_path(out: str | None) -> Path | RunPath | None:
    """``--out`` as the path its results are written to: a bucket URL's object, or a local file."""
    if out is None:
        return None
    return run_path(out, "--out") if is_remote(out) else Path(out)


def check_out(out: str | None) -> None:
    """``--out`` can be written, checked before anything loads or is scored (results are not lost at the end):
    not a folder, and its folder exists or can be made. Nothing is created here: a run that fails writes nothing."""
    if out is None:
        return
    if is_remote(out):  # on a bucket: not a "folder" (a prefix with objects), and writable (a probe object)
        remote = run_path(out, "--out")
        if remote.is_dir():
            raise UserError(f"--out {out} is a folder; give a file path such as {remote / 'results.json'}")
        check_writable(remote.parent, f"--out {out}: its prefix")
        return
    path = Path(out)
    if path.is_dir():
        raise UserError(f"--out {out} is a folder; give a file path such as {path / 'results.json'}")
    folder = path.absolute().parent
    while not folder.exists():  # the nearest folder that is there: write_atomic makes the rest
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"--out {out}: its folder cannot be made, {folder} is a file; give a path in a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: cannot write in {folder} (permission denied); give a path in a folder "
                        "you can write")


def samples_path(out: Path | RunPath) -> Path | RunPath:
    """Where ``--log-samples`` writes beside ``--out``: OUT's name with ``.samples.jsonl`` for its suffix."""
    return out.with_name(out.stem + ".samples.jsonl")


def write_atomic(path: Path | RunPath, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it (its folder made if missing); on a bucket,
    as one object (an object is written whole)."""
    if is_remote(path):
        path.write_text(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # never a half-written file
