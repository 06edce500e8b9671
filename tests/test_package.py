"""The distribution's shape: one package per stage, the agreed console scripts, layering."""

import ast
import importlib
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_console_scripts():
    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.dist and e.dist.name == "lmzoo"}
    assert set(scripts) == {"zoo", "sft", "dpo", "pretrain"}  # no `eval`, no `convert`
    for value in scripts.values():
        mod, fn = value.split(":")
        assert callable(getattr(importlib.import_module(mod), fn))


def test_zoo_imports_nothing_of_the_upper_floors():
    """zoo/ is the ground floor; only zoo/cli.py may reach up, lazily inside functions."""
    upper = {"convert", "sft", "dpo", "pretrain", "eval"}
    for f in (ROOT / "zoo").glob("*.py"):
        tree = ast.parse(f.read_text())
        nodes = tree.body if f.name == "cli.py" else list(ast.walk(tree))
        for node in nodes:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in upper, f"{f.name} imports {n}"
