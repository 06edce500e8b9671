"""The `pretrain` command: `pretrain train --config run.yaml [key.sub=value ...] [--print-config]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pretrain import distributed
from zoo.cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `pretrain` (every flag documented)."""
    p = argparse.ArgumentParser(prog="pretrain", description="lmzoo pretraining / continued pretraining.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train from a YAML config; `key.sub=value` arguments override its keys.")
    s.add_argument("--config", metavar="YAML", help="the run's config file (keys: see --print-config)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. optimizer.learning_rate=3e-4 data.seq_len=1024")
    s.add_argument("--print-config", action="store_true", help="print the fully resolved config (with defaults) and exit")
    distributed.add_flags(s)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pretrain` console script."""
    args = build_parser().parse_args(argv)

    def body() -> None:
        from pretrain.config import load_config, to_yaml

        cfg = load_config(args.config, list(args.overrides))
        if args.print_config:
            print(to_yaml(cfg), end="")
            return
        distributed.initialize(args)
        from pretrain.trainer import train

        final = train(cfg)
        if distributed.is_primary():
            print(f"final model: {final}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
