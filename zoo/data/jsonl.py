"""JSON-lines logs as a run folder keeps them (metrics.jsonl, completions.jsonl): read back whole-line records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zoo.storage import RunPath


def read_records(path: Path | RunPath) -> tuple[list[dict[str, Any]], int]:
    """(the JSON objects of the JSON-lines file ``path``, its number of lines); a line that is not a JSON object,
    such as one torn by a kill -9 (never complete, so never part of the record), is left out. ([], 0) when there
    is no file."""
    if not path.is_file():
        return [], 0
    lines = path.read_bytes().decode(errors="replace").splitlines()
    records = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records, len(lines)
