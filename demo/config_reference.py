"""The configuration reference page (docs/reference/configuration.md), generated from the config dataclasses.

    python -m demo.config_reference --out docs/reference/configuration.md    # write it
    python -m demo.config_reference --check                                 # exit 1 if the page is stale
    python -m demo.config_reference --undocumented                          # the keys without a doc line

On the top floor because it names every command's schema (the tasks' config modules); the rendering itself is
pretrain/config_doc.py's. The test suite runs the check (tests/test_docs_config.py), so CI fails on a stale page.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dpo.config import DPOConfig
from grpo.config import GRPOConfig
from pretrain.config import TrainConfig
from pretrain.config_doc import render_page, undocumented
from rm.config import RMConfig
from sft.config import SFTConfig

PAGE = "docs/reference/configuration.md"  # relative to the repository root
REGENERATE = f"python -m demo.config_reference --out {PAGE}"
# Each `train` command and the schema its CLI reads (pretrain/cli.py, sft/cli.py, ...: the schema each passes to
# train_command; a test holds this table to them). Distillation (GKD) is `sft train`'s `distill:` section; KTO,
# ORPO, CPO, SimPO and IPO are `dpo train`'s dpo.loss_type.
COMMANDS: tuple[tuple[str, type[TrainConfig]], ...] = (
    ("pretrain train", TrainConfig),
    ("sft train", SFTConfig),
    ("dpo train", DPOConfig),
    ("grpo train", GRPOConfig),
    ("reward train", RMConfig),
)


def page() -> str:
    """The reference page as the code describes it now."""
    return render_page(COMMANDS, REGENERATE)


def check(path: Path) -> str | None:
    """None if the page at ``path`` is what :func:`page` generates; else the one-line message saying how to
    regenerate it."""
    if not path.is_file():
        return f"{path} is missing; generate it: {REGENERATE}"
    if path.read_text() != page():
        return f"{path} differs from what the config dataclasses generate; regenerate it: {REGENERATE}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Write the page (``--out``), check it (``--check``: exit 1, with one line naming the fix, when stale) or
    list the keys whose source has no doc line (``--undocumented``)."""
    p = argparse.ArgumentParser(prog="python -m demo.config_reference",
                                description="Generate the configuration reference from the config dataclasses.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", metavar="MD", help=f"write the page here (the checked-in one: {PAGE})")
    what.add_argument("--check", nargs="?", const=PAGE, metavar="MD",
                      help=f"exit 1 if this page (default {PAGE}) differs from what the code generates")
    what.add_argument("--undocumented", action="store_true",
                      help="list the keys without a doc line (a comment on or above the field) in the source")
    args = p.parse_args(argv)
    if args.undocumented:
        print("\n".join(undocumented([schema for _, schema in COMMANDS])))
        return 0
    if args.check:
        problem = check(Path(args.check))
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(f"{args.check} is up to date")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
