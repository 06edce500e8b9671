"""The `reward` command: `reward train --config run.yaml [key.sub=value ...]` (a Bradley-Terry reward model on the
shared loop). Not `rm`: that name would shadow the shell's `rm` for everyone who installs lmzoo."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pretrain.cli import add_train_command, train_command
from rm.config import RMConfig
from zoo.console import run_cli

if TYPE_CHECKING:
    from pretrain.task import Task


METHODS = """\
the model: the decoder with a scalar score head at each sequence's last token (TRL's RewardTrainer); full or LoRA
  (lora.rank > 0: the head trains whole beside the adapters)
the loss: Bradley-Terry, -logsigmoid(r_chosen - r_rejected - margin) (the margin column: rm.margin_field), plus
  rm.center_rewards_coefficient x (r_chosen + r_rejected)^2
after: `zoo export RUN/final` writes a *ForSequenceClassification folder; grpo.rewards: ["rm:RUN/final"] scores
  GRPO's completions with it
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `reward` (every flag documented)."""
    p = argparse.ArgumentParser(prog="reward", description="lmzoo reward models (Bradley-Terry on preference "
                                                           "pairs) on the shared training loop, full or LoRA.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_command(sub, "reward", "train a reward model on preference pairs (prompt, chosen, rejected) from a "
                      "YAML config", "rm.center_rewards_coefficient=0.01 optimizer.learning_rate=1e-5",
                      epilog=METHODS)
    return p


def reward_tasks() -> tuple[type[Task], ...]:
    """The tasks `reward train` runs (pretrain.task.task_for)."""
    from rm.task import RewardTask  # jax and the model only once a command runs: --help stays fast

    return (RewardTask,)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `reward` console script (and of `python -m rm`)."""
    args = build_parser().parse_args(argv)

    return run_cli(lambda: train_command(args, RMConfig, reward_tasks))


if __name__ == "__main__":
    sys.exit(main())
