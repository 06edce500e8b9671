"""`zoo eval` and `zoo plot`: the bodies of those `zoo` commands (zoo/cli.py parses their flags).

`zoo eval` scores a checkpoint on perplexity, multiple-choice and generation tasks (see eval/task_files.py); the heavy
modules (JAX, the model, transformers) load inside :func:`eval_command`. `zoo plot` draws a run's curves.
"""

from __future__ import annotations

import argparse
from typing import Any

from zoo.console import print_table

# Metrics shown in the console table, per task kind (the JSON has them all).
SHOWN = {"perplexity": ("word_perplexity", "bits_per_byte", "ppl"), "multiple_choice": ("acc", "acc_norm", "acc_bytes"),
         "generation": ("exact_match",)}


def eval_command(args: argparse.Namespace) -> None:
    """`zoo eval CKPT --tasks T1,T2`: evaluate a checkpoint on tasks; print a table, optionally write JSON."""
    from zoo.errors import UserError

    if args.list_tasks:
        return _list_tasks()
    if args.log_samples and not args.out:
        raise UserError("--log-samples writes beside --out: give --out results.json too")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be at least 1")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.chunk is not None and args.chunk < 1:
        raise UserError(f"--chunk {args.chunk}: must be at least 1")
    if args.max_length is not None and args.max_length < 2:
        raise UserError(f"--max-length {args.max_length}: must be at least 2")
    if args.max_length is not None and not getattr(args, "harness", None):
        raise UserError("--max-length is lm-eval's context length: use it with --harness (native perplexity "
                        "tasks set window: in their task file)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot {args.num_fewshot}: must be 0 or more")
    from eval.harness_run import check_out

    check_out(args.out)  # before anything loads: the results are never lost for want of a place to write them
    if getattr(args, "harness", None):
        if args.tasks:
            raise UserError("give either --tasks (lmzoo's task files) or --harness (lm-eval's task names), not both")
        from eval.harness_run import harness_command

        return harness_command(args)
    if args.include_path:
        raise UserError("--include-path adds lm-eval task YAMLs: use it with --harness")
    if not args.ckpt or not args.tasks:
        raise UserError("zoo eval needs CKPT and --tasks T1,T2 (see `zoo eval --list-tasks`) or --harness T1,T2")
    from zoo.checkpoints.paths import checkpoint_dir

    args.ckpt = str(checkpoint_dir(args.ckpt))  # a missing path or a run folder: said before anything loads

    import datetime
    import json
    import time
    from pathlib import Path

    from eval.task_files import resolve_tasks

    t0 = time.perf_counter()
    tasks = resolve_tasks(args.tasks)  # bad task files fail here, before JAX and the model load
    for t in tasks:
        t.rows(1)  # ... and so do missing or unreadable data files

    import jax
    import ml_dtypes
    import numpy as np

    import zoo
    from eval.scoring import evaluate
    from zoo.data.tokenizer import load_tokenizer

    out = Path(args.out) if args.out else None
    tokenizer = load_tokenizer(args.ckpt)
    model = zoo.load(args.ckpt, dtype=np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16,
                     attention=getattr(args, "attention", "auto"))
    cfg, params = model.cfg, model.param_dict()
    t_load = time.perf_counter() - t0
    res = evaluate(cfg, params, tokenizer, tasks, limit=args.limit, batch_size=args.batch_size,
                   num_fewshot=args.num_fewshot, chat_template=args.chat_template, log_samples=args.log_samples,
                   chunk=args.chunk)
    logs = {name: r.pop("log") for name, r in res["tasks"].items() if "log" in r}
    t_total = time.perf_counter() - t0
    report = {
        "checkpoint": str(Path(args.ckpt).absolute()),
        "lmzoo_version": zoo.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {"tasks": [t.name for t in tasks], "limit": args.limit, "batch_size": args.batch_size,
                     "num_fewshot": args.num_fewshot, "chat_template": args.chat_template, "dtype": args.dtype,
                     "devices": f"{jax.devices()[0].platform} x{jax.device_count()}"},
        "tasks": res["tasks"],
        "timings": {"load_s": round(t_load, 3), "eval_s": round(t_total - t_load, 3), "total_s": round(t_total, 3),
                    **{f"{name}_s": r["seconds"] for name, r in res["tasks"].items()}},
    }
    print_results(report)
    if out is not None:
        from eval.harness_run import samples_path, write_atomic

        write_atomic(out, json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
        if args.log_samples:
            lines = (json.dumps({"task": name, **item}) for name, items in logs.items() for item in items)
            write_atomic(samples_path(out), "".join(line + "\n" for line in lines))
            print(f"wrote {samples_path(out)}")


def print_results(report: dict[str, Any]) -> None:
    """The results as a table: one row per (task, metric)."""
    rows = [("task", "version", "kind", "n", "metric", "value", "seconds")]
    for name, r in report["tasks"].items():
        for m in SHOWN.get(r["kind"], tuple(r["metrics"])):
            v = r["metrics"][m]
            err = r["metrics"].get(f"{m}_stderr")
            text = f"{v:.4f}" + (f" ± {err:.4f}" if err is not None else "")
            rows.append((name, str(r["version"]), r["kind"], str(r["examples"]), m, text, f"{r['seconds']:.1f}"))
    print_table(rows)


def _list_tasks() -> None:
    """Print the shipped tasks."""
    from eval.task_files import load_task, shipped_tasks

    rows = [("task", "kind", "version", "description")]
    for name, path in shipped_tasks().items():
        t = load_task(path)
        rows.append((name, t.kind, str(t.version), t.description))
    print_table(rows)


def plot_command(args: argparse.Namespace) -> None:
    """`zoo plot RUN_DIR`: a PNG of a training run's curves."""
    from eval.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")
