"""`zoo eval` and `zoo plot`: the bodies of those `zoo` commands and their flags (zoo/cli.py builds the parser).

`zoo eval` scores a checkpoint on perplexity, multiple-choice and generation tasks (see eval/task_files.py); the heavy
modules (JAX, the model, transformers) load inside :func:`eval_command`, so building the parser stays light. `zoo plot` draws a run's curves.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.console import add_dtype_flag, print_table
from zoo.model.config import ATTENTION_KERNELS

if TYPE_CHECKING:
    from zoo.storage import RunPath

# (tokenizer folder, tokenizer) -> the image expander of the model's processor files (chat/images.py's
# ImageExpander.from_folder, which the dispatcher passes in: chat/ is a floor above this one).
ExpanderOf = Callable[[Path, Any], Any]

# Metrics shown in the console table, per task kind (the JSON has them all).
SHOWN = {"perplexity": ("word_perplexity", "bits_per_byte", "ppl"), "multiple_choice": ("acc", "acc_norm", "acc_bytes"),
         "generation": ("exact_match",)}


def add_eval_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo eval`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser(
        "eval", help="score a checkpoint on perplexity, multiple-choice and generation tasks",
        description="Score CKPT on each task of --tasks (shipped task names, see --list-tasks, or paths of task "
                    "YAML files; format in eval/tasks/README.md). Prints a table; --out also writes JSON with the "
                    "checkpoint, each task's name, version, metrics and settings, and timings.")
    p.add_argument("ckpt", metavar="CKPT", nargs="?", help="a zoo checkpoint folder (with tokenizer/)")
    p.add_argument("--tasks", metavar="T1,T2", help="comma-separated shipped task names and/or task YAML paths")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="score only the first N examples of each task")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="rows per forward pass (default 8)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                   help="solved examples before each question (default: each task's num_fewshot)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template to generation prompts (default: each task's setting)")
    add_dtype_flag(p)
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="auto",
                   help="the attention kernel of the full forward that scores perplexity and rolling tasks: auto "
                        "(the default: cuDNN flash attention on an NVIDIA GPU, splash on a TPU, blockwise on the "
                        "CPU), blockwise, cudnn, or splash (interpreted off a TPU: slow, for checks); the KV-cache "
                        "paths (multiple choice, generation) attend over cache slots")
    p.add_argument("--out", metavar="JSON", help="write the results here as JSON")
    p.add_argument("--list-tasks", action="store_true", help="list the shipped tasks and exit")
    p.add_argument("--harness", metavar="T1,T2",
                   help="lm-evaluation-harness task (or group) names, e.g. mmlu,hellaswag,arc_easy, scored by "
                        "lm-eval's own definitions on this model (needs the eval extra: pip install 'lmzoo[eval]')")
    p.add_argument("--include-path", metavar="DIR",
                   help="with --harness: a folder of your own lm-eval task YAMLs, found besides lm-eval's library")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="with --harness: tokens of context per request, and the length of a rolling-perplexity "
                        "window, as lm-eval's hf backend's max_length (default: the model's context)")
    p.add_argument("--chunk", type=int, default=None, metavar="N",
                   help="tokens per forward pass of a longer row (a long rolling window or a native perplexity "
                        "window), which is read N tokens at a time through the KV cache: the same scores, a "
                        "chunk's activation memory (default 2048, or a native task's own chunk: setting)")
    p.add_argument("--log-samples", action="store_true",
                   help="with --out: also write every scored item (inputs, per-choice log-likelihoods, predictions, "
                        "targets) as JSONL beside it (OUT.samples.jsonl), one line per item with its task")
    return p


def eval_command(args: argparse.Namespace, expander_of: ExpanderOf | None = None) -> None:
    """`zoo eval CKPT --tasks T1,T2`: evaluate a checkpoint on tasks; print a table, optionally write JSON.
    ``expander_of`` makes the model's image expander, which tasks whose rows have images need."""
    from zoo.errors import UserError

    if args.list_tasks:
        return _list_tasks()
    _check_flags(args)
    from eval.harness_run import check_out, out_path

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
    from zoo.storage import is_remote

    # the report names the checkpoint as given when on a bucket (read from its local copy in lmzoo's cache)
    named = args.ckpt if is_remote(args.ckpt) else None
    args.ckpt = str(checkpoint_dir(args.ckpt))  # a missing path or a run folder: said before anything loads

    import datetime
    import time

    from eval.task_files import resolve_tasks

    t0 = time.perf_counter()
    tasks = resolve_tasks(args.tasks)  # bad task files fail here, before JAX and the model load
    for t in tasks:
        t.rows(1)  # ... and so do missing or unreadable data files

    import jax
    import jax.numpy as jnp

    import zoo
    from eval.scoring import evaluate
    from zoo.data.tokenizer import load_tokenizer

    out = out_path(args.out)
    tokenizer = load_tokenizer(args.ckpt)
    expander = _image_rows_checked(args, tasks, tokenizer, expander_of)  # before the weights load
    model = zoo.load(args.ckpt, dtype=jnp.dtype(args.dtype),
                     attention=getattr(args, "attention", "auto"))
    cfg, params = model.cfg, model.param_dict()
    t_load = time.perf_counter() - t0
    res = evaluate(cfg, params, tokenizer, tasks, limit=args.limit, batch_size=args.batch_size,
                   num_fewshot=args.num_fewshot, chat_template=args.chat_template, log_samples=args.log_samples,
                   chunk=args.chunk, expander=expander)
    logs = {name: r.pop("log") for name, r in res["tasks"].items() if "log" in r}
    t_total = time.perf_counter() - t0
    report = {
        "checkpoint": named or str(Path(args.ckpt).absolute()),
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
        _write_report(out, report, logs if args.log_samples else None)


def _image_rows_checked(args: argparse.Namespace, tasks: list[Any], tokenizer: Any,
                        expander_of: ExpanderOf | None) -> Any:
    """The model's image expander when a task's rows have images (else None), after every such row was read and
    expanded once: a bad row (a missing or unreadable image, images that do not match their placeholders, a
    prompt longer than the model's context with its images, images on a text model) is its one-line error
    before the weights load."""
    from eval.scoring import check_image_rows, image_tasks

    with_images = image_tasks(tasks, args.limit)
    if not with_images:
        return None
    import zoo
    from zoo.data.tokenizer import tokenizer_dir

    cfg = zoo.read_config(args.ckpt)
    expander = None
    if cfg.vision is not None:
        assert expander_of is not None, "the dispatcher passes the image expander"
        expander = expander_of(tokenizer_dir(args.ckpt), tokenizer)
    check_image_rows(cfg, tokenizer, with_images, args.limit, args.num_fewshot, args.chat_template, expander)
    return expander


def _check_flags(args: argparse.Namespace) -> None:
    """`zoo eval`'s flags that are out of range or given without the flag they need: a UserError, before anything loads."""
    from zoo.errors import UserError

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


def _write_report(out: Path | RunPath, report: dict[str, Any], logs: dict[str, list[dict[str, Any]]] | None) -> None:
    """Write the results JSON to ``out`` and, with ``logs`` (--log-samples), every scored item beside it."""
    import json

    from eval.harness_run import samples_path, write_atomic

    write_atomic(out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if logs is not None:
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


def add_plot_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo plot`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser("plot", help="draw a training run's loss, eval-loss and learning-rate curves to a PNG")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run's output_dir (with metrics.jsonl)")
    p.add_argument("--out", metavar="PNG", help="where to write the picture (default RUN_DIR/curves.png)")
    return p


def plot_command(args: argparse.Namespace) -> None:
    """`zoo plot RUN_DIR`: a PNG of a training run's curves."""
    from eval.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")
