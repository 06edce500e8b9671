"""The distribution's shape: one package per stage, the agreed console scripts, layering."""

import ast
import importlib
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_console_scripts():
    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.dist and e.dist.name == "lmzoo"}
    # no `eval`, no `convert`, no `rm` (it would shadow the shell's rm): reward models are `reward`
    assert set(scripts) == {"zoo", "sft", "dpo", "grpo", "pretrain", "reward"}
    for value in scripts.values():
        mod, fn = value.split(":")
        assert callable(getattr(importlib.import_module(mod), fn))


# The floors: a module imports only from its own floor's package or lower ones. zoo/ is the ground floor;
# convert/ and eval/ stand on it, pretrain/ on them (its commands compose eval/'s hooks), then the shared floors of the
# post-training half: chat/ (templates, renders, row formats, loss masks) and prefs/ on it (preference rows and
# their batches); the tasks above, siblings, and the main job on top.
FLOORS = {"zoo": 0, "convert": 1, "eval": 1, "pretrain": 2, "chat": 3, "prefs": 4,
          "serve": 4,  # `zoo serve`: the engine (eval/) behind HTTP, chat templates and tool-call parsers (chat/)
          "sft": 5, "dpo": 5, "rm": 5, "grpo": 5, "distill": 5, "demo": 6}
TASKS = {"sft", "dpo", "rm", "grpo", "distill"}
# The one arrow between tasks: GKD is SFT with a teacher (sft/ reads distill/'s teacher, losses and sampler).
TASK_ARROWS = {("sft", "distill")}
DISPATCHER = "zoo.cli"  # the `zoo` command: it reaches up, lazily inside its functions, to run a command's body


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in FLOORS:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def _imports(f: Path, modules: dict[str, Path], top_level_only: bool = False) -> set[str]:
    """The repository modules ``f`` imports (anywhere in it, lazily inside functions too, unless told)."""
    tree = ast.parse(f.read_text())
    out = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            out |= subs or ({node.module} & modules.keys())
    return out


def test_every_import_points_down_and_none_goes_round():
    """No two modules import each other, directly or in a loop (lazy imports count), and every import stays on
    its floor or goes down; only the dispatcher's functions reach up."""
    modules = _modules()
    graph = {m: _imports(f, modules, top_level_only=m == DISPATCHER) - {m} for m, f in modules.items()}
    for m, targets in graph.items():
        for t in targets:
            assert FLOORS[t.split(".")[0]] <= FLOORS[m.split(".")[0]] or t.split(".")[0] == m.split(".")[0], \
                f"{m} imports {t}, a floor above it"
        assert not (FLOORS[m.split(".")[0]] == 1 and any(t.split(".")[0] not in ("zoo", m.split(".")[0])
                                                         for t in targets)), f"{m} imports a neighbour: {targets}"
    # A loop: some module reaches itself again.
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            assert m != start, f"{start} imports itself round a loop of imports"
            if m not in seen:
                seen.add(m)
                todo += graph[m]


def test_zoo_imports_nothing_of_the_upper_floors():
    """zoo/ is the ground floor; only zoo/cli.py may reach up, lazily inside functions."""
    upper = set(FLOORS) - {"zoo"}
    for f in (ROOT / "zoo").rglob("*.py"):
        tree = ast.parse(f.read_text())
        nodes = tree.body if f == ROOT / "zoo" / "cli.py" else list(ast.walk(tree))
        for node in nodes:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in upper, f"{f.name} imports {n}"


def test_pretrain_names_no_task_converter_or_evaluator():
    """pretrain/ is the loop every task shares: its modules import only zoo/ and pretrain/. A command module
    (``*/cli.py``) composes a run, so it may reach up, lazily inside its functions (the scored ``eval.tasks`` hook of
    eval/during_training.py)."""
    allowed = {"zoo", "pretrain"}
    for f in (ROOT / "pretrain").rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in tree.body if f.name == "cli.py" else ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for n in names:
                assert n.split(".")[0] not in set(FLOORS) - allowed, f"{f.relative_to(ROOT)} imports {n}"


def test_no_task_imports_another():
    """The tasks are siblings on the shared floors: none imports another (lazily inside functions neither), but
    for sft -> distill."""
    modules = _modules()
    for m, f in modules.items():
        own = m.split(".")[0]
        if own not in TASKS:
            continue
        for t in _imports(f, modules):
            other = t.split(".")[0]
            assert other == own or other not in TASKS or (own, other) in TASK_ARROWS, f"{m} imports the task {t}"


def test_no_test_module_imports_another():
    """Shared test code lives in the helper modules of tests/ (named by what they help), never in a test module
    that another imports: a test module's import would run its tests' module-level set-up twice and tie two
    files' fixtures together."""
    for f in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert not n.split(".")[-1].startswith("test_"), f"{f.name} imports the test module {n}"
