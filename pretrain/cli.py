"""The `pretrain` command (placeholder until its issue lands)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pretrain` console script; training is not implemented yet."""
    p = argparse.ArgumentParser(prog="pretrain", description="lmzoo pretrain training (not implemented yet).")
    p.parse_args(argv)
    print("error: `pretrain` is not implemented yet in this version of lmzoo", file=sys.stderr)
    return 2
