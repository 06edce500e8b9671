"""The `dpo` command: `dpo train --config run.yaml [key.sub=value ...]` (preference optimization on the shared loop)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dpo.config import DPOConfig
from pretrain.cli import add_train_command, train_command
from zoo.console import run_cli

if TYPE_CHECKING:
    from pretrain.task import Task


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `dpo` (every flag documented)."""
    p = argparse.ArgumentParser(prog="dpo", description="lmzoo preference optimization (DPO, IPO, SimPO, ...) "
                                                        "on the shared training loop.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_command(sub, "dpo", "train a model on preference pairs (prompt, chosen, rejected) from a YAML config",
                      "dpo.beta=0.05 dpo.loss_type=ipo dpo.reference=precomputed")
    return p


def dpo_tasks() -> tuple[type[Task], ...]:
    """The tasks `dpo train` runs, each variant before the task it varies (pretrain.task.task_for): KTO for
    ``dpo.loss_type: kto``, else DPO."""
    from dpo.kto import KTOTask  # jax and the model only once a command runs: --help stays fast
    from dpo.task import DPOTask

    return (KTOTask, DPOTask)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dpo` console script."""
    args = build_parser().parse_args(argv)

    return run_cli(lambda: train_command(args, DPOConfig, dpo_tasks))


if __name__ == "__main__":
    sys.exit(main())
