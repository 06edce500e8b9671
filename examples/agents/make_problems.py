"""Writes examples/agents/data/: arithmetic word problems that need a calculator (two- and three-digit products
and sums of products), as GRPO prompts with an `answer` column (train and held-out), and SFT demonstrations of
the calculator's use for the warm start: tool-call rows (an assistant turn with `tool_calls`, the calculator's
answer as a `tool` message, the final number) with the calculator's JSON schema in their `tools` column, the
schema GRPO's episodes render (transformers' `get_json_schema` of `Calculator.calculate`).

    python examples/agents/make_problems.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from calculator import Calculator, evaluate  # noqa: E402 - the environment's own arithmetic, beside this script

SYSTEM = ("You are a careful assistant with a calculator. To compute, write exactly\n<tool_call>\n"
          '{"name": "calculate", "arguments": {"expression": "EXPRESSION"}}\n</tool_call>\n'
          "then read its answer in <tool_response>, and reply with just the final number.")
TEMPLATES = [
    ("A box holds {a} rows of {b} eggs. How many eggs are in the box?", "{a} * {b}"),
    ("A farmer plants {a} rows of {b} trees. How many trees does he plant?", "{a} * {b}"),
    ("A theatre has {a} rows of {b} seats. How many seats are there?", "{a} * {b}"),
    ("Each of {a} buses carries {b} people. How many people ride the buses?", "{a} * {b}"),
    ("A shop sells {a} packs of {b} pens and {c} loose pens. How many pens does it sell?", "{a} * {b} + {c}"),
    ("A library has {a} shelves of {b} books and gives away {c} books. How many books are left?",
     "{a} * {b} - {c}"),
]


def problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, expression, answer)."""
    text, expr = rng.choice(TEMPLATES)
    v = {"a": rng.randint(12, 99), "b": rng.randint(12, 99), "c": rng.randint(10, 999)}
    e = expr.format(**v)
    return text.format(**v), e, int(evaluate(e))


def prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(0)
    for name, n in (("train", 400), ("eval", 48)):
        with (out / f"{name}.jsonl").open("w") as f:
            for _ in range(n):
                q, _, answer = problem(rng)
                f.write(json.dumps({"prompt": prompt(q), "answer": str(answer)}) + "\n")
    from transformers.utils import get_json_schema

    tools = [get_json_schema(Calculator().calculate)]
    with (out / "demos.jsonl").open("w") as f:
        for _ in range(256):
            q, e, answer = problem(rng)
            call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": e}}}
            f.write(json.dumps({"messages": prompt(q) + [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculate", "content": str(answer)},
                {"role": "assistant", "content": str(answer)}], "tools": tools}) + "\n")


if __name__ == "__main__":
    main()
