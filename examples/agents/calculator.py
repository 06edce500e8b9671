"""A calculator environment for GRPO with tools (`grpo.environment: examples/agents/calculator.py:calculator`).

The model may call ``calculate(expression)`` on arithmetic word problems (examples/agents/make_problems.py).
The expression is read by a small parser of numbers, + - * / and parentheses: nothing the model writes is
executed as code (no ``eval``), and anything else is an error the model reads back.
"""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node: ast.AST) -> float:
    """The value of a parsed arithmetic expression: numbers, + - * /, unary minus; anything else is refused."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only numbers, + - * / and parentheses")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text (an integer when it is one)."""
    if len(expression) > 200:
        raise ValueError("expression too long")
    value = _value(ast.parse(expression.replace("×", "*").replace("x", "*"), mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class Calculator:
    """One episode's calculator: its tool is calculate; it keeps the calls it answered (for the log)."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, **row: object) -> None:
        """A new problem: nothing to add to the prompt."""
        self.calls = 0

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / and parentheses, e.g. "37 * 48".
        """
        self.calls += 1
        return evaluate(expression)


def calculator() -> Calculator:
    """The environment factory."""
    return Calculator()
