"""The `grpo` command: `grpo train --config run.yaml [key.sub=value ...]` (RL with verifiable rewards on the shared loop)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from grpo.config import GRPOConfig
from pretrain.cli import add_train_command, train_command
from zoo.console import run_cli

if TYPE_CHECKING:
    from pretrain.task import Task


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `grpo` (every flag documented)."""
    p = argparse.ArgumentParser(prog="grpo", description="lmzoo GRPO: online reinforcement learning with "
                                                         "verifiable rewards (GRPO, Dr. GRPO, DAPO, BNPO, GSPO) "
                                                         "on the shared training loop.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_command(sub, "grpo", "train a model on prompts with reward functions from a YAML config",
                      "grpo.num_generations=8 grpo.loss_type=dr_grpo grpo.beta=0.04",
                      "Each step samples grpo.num_generations completions per prompt with the current model, "
                      "scores them with grpo.rewards and trains on their group-relative advantages.")
    return p


def grpo_tasks() -> tuple[type[Task], ...]:
    """The tasks `grpo train` runs (pretrain.task.task_for)."""
    from grpo.task import GRPOTask  # jax and the model only once a command runs: --help stays fast

    return (GRPOTask,)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `grpo` console script."""
    args = build_parser().parse_args(argv)

    return run_cli(lambda: train_command(args, GRPOConfig, grpo_tasks))


if __name__ == "__main__":
    sys.exit(main())
