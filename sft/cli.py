"""The `sft` command: `sft train --config run.yaml [key.sub=value ...]` and `sft inspect --config run.yaml`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pretrain import distributed
from pretrain.cli import train_command
from zoo.cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `sft` (every flag documented)."""
    p = argparse.ArgumentParser(prog="sft", description="lmzoo supervised fine-tuning (SFT) on the shared loop.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, what in (("train", "fine-tune a model from a YAML config"),
                       ("inspect", "print the first examples tokenized, trained tokens highlighted")):
        s = sub.add_parser(name, help=what, description=what + "; `key.sub=value` arguments override config keys.")
        s.add_argument("--config", metavar="YAML", help="the run's config file (keys: see `sft train --print-config`)")
        s.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="config overrides, e.g. optimizer.learning_rate=1e-4 data.format=messages")
        if name == "train":
            s.add_argument("--print-config", action="store_true",
                           help="print the fully resolved config (with defaults) and exit")
            distributed.add_flags(s)
        else:
            s.add_argument("-n", type=int, default=3, help="how many examples to show (default 3)")
            s.add_argument("--no-color", action="store_true",
                           help="mark trained tokens with [[ ]] instead of a green background")
    return p


def _inspect(cfg, n: int, color: bool) -> None:
    from pretrain.setup import load_tokenizer, tokenizer_folder
    from sft.masks import render_mask
    from sft.task import SFTTask

    task = SFTTask(cfg)
    tokenizer = load_tokenizer(tokenizer_folder(cfg))
    rows = task.load(cfg.data.path, cfg)
    docs, bad = task.documents(rows, tokenizer, cfg.data.path, cfg.data.skip_bad_rows, list(range(min(n, len(rows)))))
    print(f"{cfg.data.path}: {len(rows)} rows, format {rows.field}")
    for i, d in docs.items():
        trained = int(d["loss_mask"][1:].sum())
        print(f"--- row {i}: {len(d['tokens'])} tokens, {trained} trained")
        print(render_mask(d["tokens"], d["loss_mask"], tokenizer, color))
    if bad:
        print(f"({bad} bad rows skipped)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sft` console script."""
    args = build_parser().parse_args(argv)

    def body() -> None:
        if args.command == "inspect":
            from pretrain.config import load_config

            _inspect(load_config(args.config, list(args.overrides)), args.n, not args.no_color)
            return

        def sft_task(cfg):
            from sft.task import SFTTask

            return SFTTask(cfg)

        train_command(args, sft_task)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
