"""The `dpo` command: `dpo train --config run.yaml [key.sub=value ...]` (preference optimization on the shared loop)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dpo.config import DPOConfig
from pretrain.cli import add_train_command, train_command
from zoo.console import run_cli


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `dpo` (every flag documented)."""
    p = argparse.ArgumentParser(prog="dpo", description="lmzoo preference optimization (DPO, IPO, SimPO, ...) "
                                                        "on the shared training loop.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_command(sub, "dpo", "train a model on preference pairs (prompt, chosen, rejected) from a YAML config",
                      "dpo.beta=0.05 dpo.loss_type=ipo dpo.reference=precomputed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dpo` console script."""
    args = build_parser().parse_args(argv)

    def dpo_task() -> type:
        import dpo.kto  # noqa: F401  (KTOTask: DPOTask.for_config picks it for dpo.loss_type kto)
        from dpo.task import DPOTask  # jax and the model only once a command runs: --help stays fast

        return DPOTask

    return run_cli(lambda: train_command(args, DPOConfig, dpo_task))


if __name__ == "__main__":
    sys.exit(main())
