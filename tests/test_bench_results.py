"""The benchmark records in bench/results/ and the tables that quote them (docs/benchmarks.md, BENCHMARKS.md):
every record is well formed, every record a page names exists, and every number a current table quotes is its
record's, so a table edited without its record fails here."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
SUMMARY = ROOT / "BENCHMARKS.md"
RECORDS = sorted(RESULTS.glob("*/*.json"))
# A number as the tables write it: not part of a word, a version or a topology (v5p:2x2x2, r16, 3.11.7).
NUMBER = re.compile(r"(?<![\w.:/-])\d[\d,]*(?:\.\d+)?(?![\w:]|\.\d)")
RECORD_LINE = re.compile(r"^Records?: (.+)$", re.MULTILINE)
PATH = re.compile(r"`(bench/results/[^`]+\.json)`")


def numbers(text: str) -> list[float]:
    """The numbers in a table cell or a record value, commas dropped."""
    return [float(n.replace(",", "")) for n in NUMBER.findall(text)]


def load(path: str) -> dict:
    """The record at `path`, relative to the repository root."""
    return json.loads((ROOT / path).read_text())


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of `text`: rows of stripped cells, header first, the separator row dropped."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def blocks(text: str) -> list[tuple[str, str]]:
    """(heading, body) for each `##` or `###` part of a page."""
    parts = re.split(r"^(#{2,3} .+)$", text, flags=re.MULTILINE)
    return list(zip(parts[1::2], parts[2::2]))


def test_there_are_records():
    assert len(RECORDS) >= 20


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_record_is_well_formed(path: Path):
    record = json.loads(path.read_text())
    for key, kind in [("benchmark", str), ("date", str), ("commit", str), ("machine", str), ("command", str),
                      ("conditions", dict), ("figures", dict), ("checks", list), ("notes", list)]:
        assert isinstance(record.get(key), kind), f"{path}: {key} missing or not {kind.__name__}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|unknown", record["date"]), record["date"]
    if record["date"] != "unknown":
        assert path.name.startswith(record["date"]), "a dated record's file name starts with its date"
    if record["benchmark"].startswith("bench/"):
        assert (ROOT / record["benchmark"]).is_file(), record["benchmark"]
    assert isinstance(record["conditions"].get("load"), str)
    assert record["conditions"].get("rounds") is None or isinstance(record["conditions"]["rounds"], int)
    assert record["figures"], "a record has figures"
    for side, metrics in record["figures"].items():
        assert isinstance(metrics, dict) and metrics, side
        for value in metrics.values():
            assert isinstance(value, (int, float, str, list)) and not isinstance(value, bool) or value is True, value
            if isinstance(value, list):
                assert all(isinstance(v, (int, float)) for v in value), value
    for check in record["checks"]:
        assert isinstance(check["check"], str) and isinstance(check["measured"], str)
        assert check["target"] is None or isinstance(check["target"], str)
        assert check["value"] is None or isinstance(check["value"], (int, float))
        assert check["met"] in (True, False, None)
    assert all(isinstance(n, str) and n for n in record["notes"])
    if record.get("headline") is not None:
        assert record["headline"] in [c["check"] for c in record["checks"]]


def named_records(text: str) -> list[str]:
    """Every record path a "Record:"/"Records:" line of `text` names."""
    return [p for line in RECORD_LINE.findall(text) for p in PATH.findall(line)]


@pytest.mark.parametrize("page", [DOCS_PAGE, SUMMARY], ids=lambda p: p.name)
def test_every_named_record_exists(page: Path):
    text = page.read_text()
    names = named_records(text) + PATH.findall(text)
    assert names, f"{page.name} names no record"
    for name in names:
        assert (ROOT / name).is_file(), f"{page.name} names {name}, which does not exist"


def test_every_benchmark_section_names_a_record_of_a_bench_script():
    for section in re.split(r"^## ", DOCS_PAGE.read_text(), flags=re.MULTILINE)[1:]:
        heading = section.splitlines()[0]
        scripts = [load(p)["benchmark"] for p in named_records(section)]
        assert any(s.startswith("bench/") and (ROOT / s).is_file() for s in scripts), heading


def check_rows_agree(table: list[list[str]], default: str | None, where: str) -> int:
    """Each row of a checks table (check | target | measured | result [| record]) quotes its record's value and
    verdict. Returns how many rows were compared."""
    header = [h.lower() for h in table[0]]
    for row in table[1:]:
        path = PATH.findall(row[header.index("record")])[0] if "record" in header else default
        assert path, f"{where}: no record for {row[0]}"
        checks = {c["check"]: c for c in load(path)["checks"]}
        assert row[0] in checks, f"{where}: check {row[0]!r} is not in {path}"
        record = checks[row[0]]
        quoted = numbers(re.sub(r"[^*]*\*\*(.+?)\*\*.*", r"\1", row[header.index("measured")]))
        expected = [] if record["value"] is None else [float(record["value"])]
        assert quoted == expected, f"{where}: {row[0]!r} quotes {quoted}, {path} has {expected}"
        verdict = {True: "met", False: "not met", None: "—"}[record["met"]]
        assert row[header.index("result")] == verdict, f"{where}: {row[0]!r}"
    return len(table) - 1


def figure_rows_agree(table: list[list[str]], path: str, where: str) -> int:
    """Each row of a figures table is a side of the record, and every number in it is one of that side's values."""
    figures = load(path)["figures"]
    for row in table[1:]:
        assert row[0] in figures, f"{where}: row {row[0]!r} is not a side of {path}"
        allowed = set(numbers(json.dumps(list(figures[row[0]].values()))))
        for cell in row[1:]:
            for n in numbers(cell):
                assert n in allowed, f"{where}: {row[0]!r} quotes {n}, which {path} does not hold for that side"
    return len(table) - 1


def test_current_tables_quote_their_records():
    compared = 0
    for heading, body in blocks(DOCS_PAGE.read_text()):
        paths = named_records(body)
        if not paths:
            continue
        default = paths[0] if len(paths) == 1 else None
        for table in tables(body):
            if table[0][0].lower() == "check":
                compared += check_rows_agree(table, default, heading)
            else:
                assert default, f"{heading}: a figures table needs one record"
                compared += figure_rows_agree(table, default, heading)
    assert compared >= 40


def test_summary_headlines_are_their_records():
    (table,) = [t for t in tables(SUMMARY.read_text()) if t[0][0].lower() == "benchmark"]
    header = [h.lower() for h in table[0]]
    assert len(table) > 10
    for row in table[1:]:
        (path,) = PATH.findall(row[header.index("record")])
        record = load(path)
        headline = {c["check"]: c for c in record["checks"]}[record["headline"]]
        quoted = numbers(re.sub(r"[^*]*\*\*(.+?)\*\*.*", r"\1", row[1]))
        assert quoted == [float(headline["value"])], f"{row[0]}: quotes {quoted}, {path} has {headline['value']}"
