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


METHODS = """\
methods:
  grpo.loss_type                   grpo (GRPO), dr_grpo (Dr. GRPO), dapo (DAPO, the default), bnpo (BNPO),
                                   cispo (CISPO), sapo (SAPO), luspo (LUSPO), vespo (VESPO)
  grpo.importance_sampling_level   token (the default), sequence (GSPO)
  grpo.advantage                   group (GRPO's, the default), rloo (RLOO: TRL's RLOOTrainer, its own loss),
                                   reinforce_pp, reinforce_pp_baseline (REINFORCE++)
rewards (grpo.rewards): a shipped verifier (exact_match, final_number, format, length_penalty), module:function,
  path/to/file.py:function, or rm:PATH (a reward model trained with `reward train`)
multi-turn episodes with tools and environments: grpo.tools (functions the model calls) or grpo.environment
  (TRL's environment_factory: one instance per rollout, its methods the tools), with grpo.max_turns and
  grpo.tool_parser
asynchronous rollouts: grpo.rollout=async samples the next batches while the trainer updates, at most
  grpo.max_staleness steps behind (0: the synchronous run), on grpo.rollout_devices of their own or interleaved
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `grpo` (every flag documented)."""
    p = argparse.ArgumentParser(prog="grpo", description="lmzoo online reinforcement learning with verifiable "
                                                         "rewards on the shared training loop: GRPO, Dr. GRPO, DAPO, "
                                                         "BNPO, CISPO, SAPO, LUSPO, VESPO, GSPO, RLOO and "
                                                         "REINFORCE++, full or LoRA; reward "
                                                         "functions or reward models; multi-turn episodes with tools "
                                                         "and environments.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_command(sub, "grpo", "train a model on prompts with reward functions from a YAML config",
                      "grpo.num_generations=8 grpo.loss_type=dr_grpo grpo.beta=0.04",
                      "Each step samples grpo.num_generations completions per prompt with the current model (an "
                      "episode each, with tools or an environment), scores them with grpo.rewards and trains on "
                      "their advantages.", epilog=METHODS)
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
