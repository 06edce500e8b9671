"""The calculator example's environment (examples/agents/calculator.py) with a latency on every call, as a remote
sandbox, grader or web request would have: ``grpo.environment: bench/slow_calculator.py:calculator``. The latency
is ``LMZOO_TOOL_LATENCY`` seconds (default 0.5), spent sleeping (no CPU), so that bench/grpo_async.py measures how
much of it asynchronous rollouts hide."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "calculator_example", Path(__file__).resolve().parents[1] / "examples" / "agents" / "calculator.py")
assert _spec is not None and _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

LATENCY = float(os.environ.get("LMZOO_TOOL_LATENCY", "0.5"))


class SlowCalculator(_example.Calculator):  # type: ignore[name-defined,misc]  # loaded from a file path
    """The example's calculator, each call answered after ``LATENCY`` seconds."""

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / and parentheses, e.g. "37 * 48".
        """
        time.sleep(LATENCY)
        return str(super().calculate(expression))


def calculator() -> SlowCalculator:
    """The environment factory."""
    return SlowCalculator()
