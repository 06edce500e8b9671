"""The `dpo` command: `dpo train --config run.yaml [key.sub=value ...]` (preference optimization on the shared loop)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pretrain import distributed
from pretrain.cli import add_run_flags, train_command
from zoo.console import run_cli


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `dpo` (every flag documented)."""
    p = argparse.ArgumentParser(prog="dpo", description="lmzoo preference optimization (DPO, IPO, SimPO, ...) "
                                                        "on the shared training loop.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    what = "train a model on preference pairs (prompt, chosen, rejected) from a YAML config"
    s = sub.add_parser("train", help=what, description=what + "; `key.sub=value` arguments override config keys.")
    s.add_argument("--config", metavar="YAML", help="the run's config file (keys: see `dpo train --print-config`)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. dpo.beta=0.05 dpo.loss_type=ipo dpo.reference=precomputed")
    s.add_argument("--print-config", action="store_true",
                   help="print the fully resolved config (with defaults) and exit")
    add_run_flags(s)
    distributed.add_flags(s)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dpo` console script."""
    args = build_parser().parse_args(argv)

    def dpo_task() -> type:
        from dpo.task import DPOTask  # jax and the model only once a command runs: --help stays fast

        return DPOTask

    return run_cli(lambda: train_command(args, dpo_task))


if __name__ == "__main__":
    sys.exit(main())
