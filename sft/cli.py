"""The `sft` command: `sft train --config run.yaml [key.sub=value ...]` and `sft inspect --config run.yaml`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pretrain import distributed
from pretrain.cli import EpilogAsWritten, add_compile_flags, add_run_flags, train_command
from pretrain.config import load_config
from sft.config import SFTConfig
from zoo.console import run_cli, use_color

if TYPE_CHECKING:
    from pretrain.task import Task


METHODS = """\
methods:
  SFT (the default)     rows as text, prompt/completion, messages, alpaca or sharegpt (data.format, or read from
                        the columns); the loss on the completion or the assistant turns (see `sft inspect`)
  LoRA, QLoRA           lora.rank > 0 trains adapters; lora.base_quant: nf4 or int8 keeps the frozen base quantized
  distillation (GKD)    distill.teacher: a checkpoint whose next-token distributions the model learns (TRL's
                        GKDTrainer): distill.lmbda (the share of the model's own samples), distill.beta (the
                        generalized JSD), distill.seq_kd (the teacher's samples)
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `sft` (every flag documented)."""
    p = argparse.ArgumentParser(prog="sft", description="lmzoo supervised fine-tuning on the shared loop: SFT, full "
                                                        "or LoRA/QLoRA, and distillation from a teacher (GKD).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, what in (("train", "fine-tune a model (or distill a teacher into it) from a YAML config"),
                       ("inspect", "print the first examples tokenized, trained tokens highlighted")):
        s = sub.add_parser(name, help=what, description=what + "; `key.sub=value` arguments override config keys.",
                           epilog=METHODS if name == "train" else None,
                           formatter_class=EpilogAsWritten)
        s.add_argument("--config", metavar="YAML", help="the run's config file (keys: see `sft train --print-config`)")
        s.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="config overrides, e.g. optimizer.learning_rate=1e-4 data.format=messages")
        if name == "train":
            s.add_argument("--print-config", action="store_true",
                           help="print the fully resolved config (with defaults) and exit")
            add_run_flags(s)
            add_compile_flags(s)
            distributed.add_flags(s)
        else:
            s.add_argument("-n", type=int, default=3, help="how many examples to show (default 3)")
            s.add_argument("--no-color", action="store_true",
                           help="mark trained tokens with [[ ]] instead of a green background (always so off a "
                                "terminal, or with the NO_COLOR environment variable set)")
    return p


def _inspect(cfg, n: int, color: bool) -> None:
    from pretrain.config import data_sources
    from pretrain.data.mixture import source_config
    from pretrain.setup import tokenizer_folder
    from sft.task import SFTTask
    from zoo.data.tokenizer import load_tokenizer

    task = SFTTask(cfg)
    tokenizer = load_tokenizer(tokenizer_folder(cfg))
    mixture = isinstance(cfg.data.path, list)
    for src in data_sources(cfg):  # a mixture: the first examples of each source, read in its own format
        _inspect_source(task, source_config(cfg, src) if mixture else cfg, tokenizer, n, color)


def _model_config(cfg):
    """The config of the run's model, read without its weights."""
    from pretrain.setup import model_config_of

    if cfg.model.init == "random":
        return model_config_of(cfg.model.config, "model.config")
    return model_config_of(cfg.model.path, "model.path")


def _inspect_source(task, cfg, tokenizer, n: int, color: bool) -> None:
    from chat.images import image_column
    from chat.loss_masks import render_mask
    from zoo.data.row_origin import row_where

    rows = task.load(cfg.data.path, cfg)
    if image_column(list(rows.ds.column_names)) and task.vision is None:  # rows with images need the model's tower
        task.vision = _model_config(cfg).vision  # what prepare reads in a run
    made = task.documents(rows, tokenizer, cfg.data.path, cfg.data.skip_bad_rows, list(range(min(n, len(rows)))))
    docs, bad = made.docs, made.bad
    print(f"{cfg.data.path}: {len(rows)} rows, format {rows.field}")
    limit = cfg.data.seq_len + 1
    for i, d in docs.items():
        # As the run will train it: cut to a row of seq_len + 1 tokens, or left out (data.long_examples).
        length, trained = len(d["tokens"]), int(d["loss_mask"][1:].sum())
        head = f"--- {row_where(cfg.data.path, i)}: {length} tokens"
        if length > limit and cfg.data.long_examples == "drop":
            print(f"{head}: left out, longer than data.seq_len + 1 = {limit} (data.long_examples: drop)")
            continue
        if length > limit:
            d = {k: v[:limit] for k, v in d.items()}
            kept = int(d["loss_mask"][1:].sum())
            head += f", cut to {limit} tokens (data.seq_len + 1): {kept} trained ({trained - kept} cut off)"
            if not kept:
                head += "; trains nothing: left out of training"
        else:
            head += f", {trained} trained"
        print(head)
        print(render_mask(d["tokens"], d["loss_mask"], tokenizer, color, images=task.image_spans(i)))
    if bad:
        print(f"({bad} bad rows skipped)")


def sft_tasks() -> tuple[type[Task], ...]:
    """The tasks `sft train` runs, each variant before the task it varies (pretrain.task.task_for)."""
    from sft.gkd import GKDTask, OnlineGKDTask  # jax and the model only once a command runs: --help stays fast
    from sft.task import SFTTask

    return (OnlineGKDTask, GKDTask, SFTTask)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sft` console script."""
    args = build_parser().parse_args(argv)

    def body() -> int | None:
        if args.command == "inspect":
            color = not args.no_color and use_color(sys.stdout)  # no escape codes in a file or a pipe
            _inspect(load_config(args.config, list(args.overrides), SFTConfig), args.n, color)
            return None

        return train_command(args, SFTConfig, sft_tasks)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
