"""A training run's files: the JSON-lines data it reads and the metrics.jsonl it writes."""

from __future__ import annotations

import json


def write_jsonl(path, rows):
    """Write ``rows`` as JSON lines at ``path``; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_metrics(out) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
