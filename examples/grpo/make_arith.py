"""Writes demo/data/grpo_train.jsonl and grpo_eval.jsonl: small additions for the GRPO stage of `zoo demo`.

"What is a + b? Answer with just the number." with a, b in 2..22; the answer is the sum
(checked with the ``final_number`` verifier). Each unordered pair {a, b} lies in one split
only: 64 pairs (one random order each) are held out, the rest train in both orders.
Deterministic (seeded): run `python examples/grpo/make_arith.py` to regenerate.
"""

import json
import random
from pathlib import Path

LO, HI, N_EVAL, SEED = 2, 22, 64, 0
OUT = Path(__file__).resolve().parents[2] / "demo" / "data"


def row(a: int, b: int) -> dict:
    """One prompt row: the question as a user message, the sum as the answer."""
    text = f"What is {a} + {b}? Answer with just the number."
    return {"prompt": [{"role": "user", "content": text}], "answer": str(a + b)}


def main() -> None:
    """Split the operand pairs, write both files."""
    rng = random.Random(SEED)
    pairs = [(a, b) for a in range(LO, HI + 1) for b in range(a, HI + 1)]
    rng.shuffle(pairs)
    held, rest = pairs[:N_EVAL], pairs[N_EVAL:]
    evals = [row(*(p if rng.random() < 0.5 else p[::-1])) for p in held]
    train = [row(a, b) for a, b in rest] + [row(b, a) for a, b in rest if a != b]
    rng.shuffle(train)
    for name, rows in (("grpo_train.jsonl", train), ("grpo_eval.jsonl", evals)):
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
