"""The `pretrain` command: `pretrain train --config run.yaml [key.sub=value ...] [--print-config]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pretrain import distributed
from pretrain.config import TrainConfig, load_config, to_yaml
from zoo.console import add_topology_flags, run_cli
from zoo.errors import UserError

if TYPE_CHECKING:
    from pretrain.hooks import Hooks
    from pretrain.task import Task


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `pretrain` (every flag documented)."""
    p = argparse.ArgumentParser(prog="pretrain", description="lmzoo pretraining / continued pretraining.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_command(sub, "pretrain", "train a model from a YAML config",
                      "optimizer.learning_rate=3e-4 data.seq_len=1024")
    return p


class EpilogAsWritten(argparse.HelpFormatter):
    """Help that wraps the description to the terminal but prints a multi-line epilog (a table of a command's
    methods and the keys that select them) as it is written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return text if "\n" in text.strip() else super()._fill_text(text, width, indent)


def add_train_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], command: str, what: str,
                      example: str, more: str = "", epilog: str | None = None) -> argparse.ArgumentParser:
    """A task's `train` subcommand of ``command`` (its parser's subparsers ``sub``): --config, KEY=VALUE overrides
    (``example`` shows some), --print-config, and the run-folder and multi-process flags; ``more`` adds to its
    description, and ``epilog`` (printed as written) ends its help."""
    s = sub.add_parser("train", help=what, epilog=epilog, formatter_class=EpilogAsWritten,
                       description=f"{what[0].upper()}{what[1:]}; `key.sub=value` arguments override config keys."
                                   + (f" {more}" if more else ""))
    s.add_argument("--config", metavar="YAML", help=f"the run's config file (keys: see `{command} train --print-config`)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=f"config overrides, e.g. {example}")
    s.add_argument("--print-config", action="store_true",
                   help="print the fully resolved config (with defaults) and exit")
    add_run_flags(s)
    add_compile_flags(s)
    distributed.add_flags(s)
    return s


def add_compile_flags(parser: argparse.ArgumentParser) -> None:
    """``--compile-only`` and its flags (pretrain.compile_only): the run's step compiled for a TPU slice."""
    g = parser.add_argument_group("compile for a TPU slice from this machine, without TPUs, weights or data")
    g.add_argument("--compile-only", action="store_true",
                   help="compile the run's train step for --topology and report its bytes per chip; nothing is "
                        "trained or written (exit 0: fits, 3: does not fit, 2: an error). `model` may also be a "
                        "registry name (llama3.1-8b) or a config.json. Needs the tpu extra (libtpu)")
    add_topology_flags(g)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every `train` command has for a run folder that already holds a run."""
    g = parser.add_argument_group("an output_dir that holds a run (a rerun continues it)")
    g.add_argument("--fresh", action="store_true",
                   help="start over: move the old run aside to OUTPUT_DIR.old-<time> (never deleted) first")
    g.add_argument("--resume-with-changes", metavar="KEYS", default="",
                   help="continue the run with these config keys changed knowingly (comma-separated keys or sections, "
                        "e.g. optimizer.learning_rate,data.seq_len); without it a change of what is trained (model, "
                        "data, batch, optimizer, schedule, LoRA, task settings, seed, dtypes) is an error. max_steps, "
                        "epochs, logging, eval and checkpoint cadence and the mesh may always change")


def train_command(args: argparse.Namespace, schema: type[TrainConfig] = TrainConfig,
                  tasks: Callable[[], Sequence[type[Task[Any]]]] | None = None) -> int | None:
    """The body of every `train` command: resolve the config with ``schema``, the task's config class (default
    pretraining's; ``--print-config`` prints it and stops), join the other processes, train and name the final
    model. The task is the first of the command's ``tasks()`` (classes imported on demand, each variant before the
    task it varies; default pretraining) that handles the config (:func:`pretrain.task.task_for`); the run's
    hooks are the command's (:func:`training_hooks`).

    The config is read and checked before JAX, the model code or transformers is imported: a config error comes
    at once, so ``schema`` comes from the task's light config module, not from its task class."""
    compiling = getattr(args, "compile_only", False)
    if not compiling and (getattr(args, "topology", None) or getattr(args, "report", None)):
        raise UserError("--topology and --report go with --compile-only")
    if compiling and not args.topology:
        raise UserError("--compile-only needs --topology, e.g. --topology v5e:2x4")
    if compiling and args.num_slices < 1:
        raise UserError(f"--num-slices must be at least 1, got {args.num_slices}")
    cfg = load_config(args.config, list(args.overrides), schema, compile_only=compiling)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return None
    from pretrain.task import PretrainTask, task_for

    classes = tasks() if tasks else (PretrainTask,)
    if compiling:
        from pretrain.compile_only import compile_only

        return compile_only(cfg, task_for(cfg, classes), args.topology, args.report, args.num_slices)
    distributed.initialize(args)
    from pretrain.loop import train

    for cls in classes:
        if cls.config_class is not schema:  # a command wired to the wrong schema: a bug, not a user error
            raise TypeError(f"{cls.__name__} reads {cls.config_class.__name__}, not {schema.__name__}")
    final = train(cfg, task=task_for(cfg, classes), fresh=args.fresh, resume_with_changes=args.resume_with_changes,
                  hooks=training_hooks(cfg))
    if distributed.is_primary():
        print(f"final model: {final}")
    return None


def training_hooks(cfg: TrainConfig) -> Hooks:
    """The hooks every training command adds to the loop's own: the scored ``eval.tasks`` every ``eval_every``
    steps (eval/during_training.py; read and checked now, before the model loads)."""
    from pretrain.hooks import Hooks

    hooks = Hooks()
    if cfg.eval.tasks:
        from eval.during_training import ScoredTasks  # the command composes the run: the loop names no evaluator

        hooks.add(ScoredTasks(cfg.eval.tasks, cfg.eval.include_path, cfg.eval.limit, cfg.eval.batch_size),
                  every=cfg.eval_every)
    return hooks



def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pretrain` console script."""
    args = build_parser().parse_args(argv)
    return run_cli(lambda: train_command(args))


if __name__ == "__main__":
    sys.exit(main())
