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


METHODS = """\
methods (dpo.loss_type):
  sigmoid               DPO (the default); dpo.label_smoothing > 0: conservative DPO
  ipo, hinge, robust    IPO, SLiC's hinge loss, robust DPO (rDPO)
  simpo, orpo, cpo      SimPO, ORPO, CPO: no reference model (orpo and cpo add an NLL term on the chosen answers)
  kto                   KTO on unpaired rows (prompt, completion, label: true for a desirable completion);
                        preference pairs are unpacked into a chosen (true) and a rejected (false) row
  dpo.sft_weight > 0 adds RPO's NLL term to a pair loss.
reference (dpo.reference): base (LoRA: the adapters off; the default), precomputed, a zoo checkpoint path, or
  none (simpo, orpo, cpo).
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `dpo` (every flag documented)."""
    p = argparse.ArgumentParser(prog="dpo", description="lmzoo preference optimization on the shared training loop: "
                                                        "DPO, IPO, SLiC (hinge), robust DPO, SimPO, RPO, ORPO, CPO "
                                                        "and KTO, full or LoRA.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_command(sub, "dpo", "train a model on preference pairs (prompt, chosen, rejected) or, for KTO, "
                      "unpaired rows (prompt, completion, label) from a YAML config",
                      "dpo.beta=0.05 dpo.loss_type=ipo dpo.reference=precomputed", epilog=METHODS)
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
