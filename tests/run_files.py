"""A training run's files: the JSON-lines data it reads and the metrics.jsonl it writes."""

from __future__ import annotations

import json

# The word list of most runs' pretraining texts (tests/tiny_lm.py's tiny model knows them all).
TEN_WORDS = tuple("the a cat dog sat ran on under mat log".split())


def write_jsonl(path, rows):
    """Write ``rows`` as JSON lines at ``path``; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_word_texts(path, words, rows: int):
    """``rows`` pretraining rows ``{"text": ...}`` of 5 to 29 of ``words`` drawn with seed 0, at ``path``."""
    import numpy as np

    rng = np.random.RandomState(0)
    return write_jsonl(path, [{"text": " ".join(rng.choice(words, rng.randint(5, 30)))} for _ in range(rows)])


def read_metrics(out) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def one_line_error(capsys, main, args: list[str]) -> str:
    """Run a command's ``main(args)``: it must exit 2 with exactly one ``error: ...`` line on stderr, which is
    returned without its prefix."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ")
    return err[0].removeprefix("error: ")
