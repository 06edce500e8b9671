"""The configuration reference (docs/reference/configuration.md) is current and complete, and every YAML config
that examples/ ships or the docs show loads with its command's ``--print-config``.

A ```yaml block in docs/ names its command on its first line: ``# <cmd> train`` (a whole config) or
``# <cmd> train --config <path>`` (a fragment, merged over that file's keys; the path from the repository root).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from types import ModuleType

import pytest
import yaml

import dpo.cli
import grpo.cli
import pretrain.cli
import rm.cli
import sft.cli
from demo import config_reference
from pretrain.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CLIS: dict[str, ModuleType] = {"pretrain": pretrain.cli, "sft": sft.cli, "dpo": dpo.cli, "grpo": grpo.cli,
                               "reward": rm.cli}
# Each example config and the command that runs it (as its header comment says). A new example fails
# test_example_config_loads until it is named here.
EXAMPLES = {
    "examples/pretrain_cpu.yaml": "pretrain",
    "examples/finetune/lora_records.yaml": "sft",
    "examples/distill/gkd_records.yaml": "sft",
    "examples/agents/calculator_sft.yaml": "sft",
    "examples/vision/shapes_sft.yaml": "sft",
    "examples/dpo/dpo_records.yaml": "dpo",
    "examples/dpo/kto_records.yaml": "dpo",
    "examples/dpo/orpo_records.yaml": "dpo",
    "examples/grpo/grpo_arith.yaml": "grpo",
    "examples/grpo/rloo_arith.yaml": "grpo",
    "examples/agents/calculator_grpo.yaml": "grpo",
    "examples/reward/rm_records.yaml": "reward",
}
HEADER = re.compile(r"#\s*(pretrain|sft|dpo|grpo|reward) train(?:\s+--config\s+(\S+))?\s*")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*\{?\.?(ya?ml)\b")


# --- the reference page ------------------------------------------------------------------------------------------

def test_checked_in_reference_is_what_the_code_generates():
    """The CI check: a config key added, removed or changed without regenerating the page fails here."""
    assert config_reference.check(ROOT / config_reference.PAGE) is None, \
        f"{config_reference.PAGE} is stale; regenerate it: {config_reference.REGENERATE}"


def test_check_mode_names_the_page_and_the_fix(tmp_path, capsys):
    """``--check`` exits 1 with one line naming the page and the regenerate command; ``--out`` writes a page
    that then passes it."""
    page = tmp_path / "configuration.md"
    page.write_text("# Configuration reference\n\nby hand\n")
    assert config_reference.main(["--check", str(page)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(page) in err and config_reference.REGENERATE in err
    assert config_reference.main(["--check", str(tmp_path / "absent.md")]) == 1
    assert "absent.md is missing" in capsys.readouterr().err
    assert config_reference.main(["--out", str(page)]) == 0
    assert config_reference.main(["--check", str(page)]) == 0


@pytest.mark.parametrize("command", sorted(CLIS))
def test_reference_documents_the_schema_each_cli_reads(command, monkeypatch):
    """The reference's table of commands is what each CLI passes to train_command (read by a spy, not assumed)."""
    seen: list[type] = []

    def spy(args, schema=TrainConfig, tasks=None):
        seen.append(schema)

    monkeypatch.setattr(CLIS[command], "train_command", spy)
    assert CLIS[command].main(["train"]) == 0
    assert dict(config_reference.COMMANDS)[f"{command} train"] is seen[0]


def _keys(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every dotted key of dataclass ``cls`` and its field, walked here (not by the generator), mixture sources
    (``data.path[N].x``, the data section's ``source_class``) included."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = f
    source = getattr(cls, "source_class", None)
    if source is not None:
        out |= _keys(source, f"{prefix}path[N].")
    return out


def _sections(page: str) -> dict[str, str]:
    """The page's ``## `` sections by heading."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _rows(text: str) -> dict[str, list[str]]:
    """The table rows of ``text`` by key: the cells after the key, as written."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            out[m[1]] = re.split(r"(?<!\\) \| ", m[2])
    return out


def _default_of(f: dataclasses.Field) -> typing.Any:
    """The field's default value; MISSING for a field without one."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _default_matches(cell: str, f: dataclasses.Field) -> bool:
    """The default cell (inline code, YAML) says the field's default value."""
    default = _default_of(f)
    if default is dataclasses.MISSING:
        return cell == "required"
    text = cell.strip("`")
    if isinstance(default, str):
        return text == default
    if isinstance(default, float):
        return float(text) == default  # YAML 1.1 reads 1e-08 as a string
    return yaml.safe_load(text) == default


def test_every_key_of_every_schema_is_in_the_reference_with_its_default():
    """Every key of every command's schema has a row, in the common section when it is declared as in
    TrainConfig, else in its command's section; each row's default is the field's."""
    sections = _sections(config_reference.page())
    common = _rows(sections["Common keys"])
    base = _keys(TrainConfig)
    assert set(common) == set(base)
    for name, schema in config_reference.COMMANDS:
        own = _rows(sections[name])
        for key, f in _keys(schema).items():
            row = own.get(key) or common.get(key)
            assert row is not None, f"{name}: key {key} is not in the reference"
            assert _default_matches(row[1], f), f"{name}: {key}'s default {row[1]} is not {_default_of(f)!r}"
            assert key in own or base[key] is f or base[key] == f, f"{name}: {key} is declared anew but not listed"


def test_known_rows_as_written_by_hand():
    """A few rows written out by hand: type, default, choices, range (and its reason) and doc line."""
    sections = _sections(config_reference.page())
    common, grpo, sft, pre = (_rows(sections[s]) for s in ("Common keys", "grpo train", "sft train",
                                                            "pretrain train"))
    assert common["remat"][:3] == ["`str`", "`none`", "`none`, `full`, `save_dots`, `offload`"]
    assert common["remat"][4].startswith(r"none \| full (recompute each layer in backward) \| save_dots")
    assert common["data.seq_len"] == ["`int`", "`512`", "—", "`[1, inf)`",
                                     "tokens per row (each row holds seq_len + 1 tokens: inputs and shifted targets)"]
    assert common["max_steps"][:4] == ["`int` or `null`", "`null`", "—", "`[1, inf)`"]
    assert common["data.path[N].weight"] == ["`float`", "`1.0`", "—", "`(0, inf)`",
                                             "relative: normalized over the sources"]
    assert grpo["grpo.loss_type"][:4] == ["`str`", "`dapo`", "`grpo`, `dr_grpo`, `dapo`, `bnpo`, `cispo`, `sapo`, `luspo`, `vespo`", "—"]
    assert grpo["grpo.num_generations"][3] == "`[2, inf)` (a group compares its completions)"
    assert grpo["data.seq_len"][4].startswith("the longest prompt, in tokens")  # redeclared: listed again
    assert "data.text_field" not in grpo  # as declared in common: not repeated
    assert sft["distill.teacher"][:2] == ["`str` or `null`", "`null`"]
    assert "data.path[N].format" in sft
    assert pre == {} and "Only the [common keys](#common-keys)." in sections["pretrain train"]


# --- YAML configs in examples/ and docs/ -------------------------------------------------------------------------

def _print_config(command: str, config: Path, capsys) -> dict:
    """The config as ``<command> train --config CONFIG --print-config`` resolves it (in process)."""
    code = CLIS[command].main(["train", "--config", str(config), "--print-config"])
    out, err = capsys.readouterr()
    assert code == 0, f"{command} train --config {config} --print-config: {err.strip()}"
    printed = yaml.safe_load(out)
    assert isinstance(printed, dict)
    return printed


def _same(given: typing.Any, printed: typing.Any) -> bool:
    """A value as the file writes it and as --print-config prints it (coerced to the key's type)."""
    if isinstance(given, list) and isinstance(printed, list):
        return len(given) == len(printed) and all(_same(g, p) for g, p in zip(given, printed))
    if isinstance(printed, dict) and not isinstance(given, dict):  # a mixture source given as its path
        return _same(given, printed.get("path"))
    if isinstance(given, dict) and isinstance(printed, dict):
        return all(k in printed and _same(v, printed[k]) for k, v in given.items())
    if isinstance(printed, float) and not isinstance(given, bool):
        return float(given) == printed
    return given == printed or str(given) == printed


def _assert_keys_kept(tree: dict, printed: dict, where: str) -> None:
    """Every key the file sets is in the printed config, with its value."""
    tree = {**tree, "model": {"path": tree["model"]}} if isinstance(tree.get("model"), str) else tree
    for key, value in tree.items():
        assert key in printed, f"{where}: key {key} is not in the printed config"
        if isinstance(value, dict):
            _assert_keys_kept(value, printed[key], f"{where}: {key}")
        else:
            assert _same(value, printed[key]), f"{where}: {key} is {value!r}, printed {printed[key]!r}"


def _example_files() -> list[str]:
    found = {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").rglob("*.y*ml")}
    return sorted(found | set(EXAMPLES))


@pytest.mark.parametrize("path", _example_files())
def test_example_config_loads(path, monkeypatch, capsys):
    """Each examples/ config loads with its command's --print-config and keeps every key it sets."""
    assert path in EXAMPLES, f"{path}: a new example config; name its command in EXAMPLES (tests/test_docs_config.py)"
    assert (ROOT / path).is_file(), f"{path} is gone; remove it from EXAMPLES (tests/test_docs_config.py)"
    monkeypatch.chdir(ROOT)  # the configs' paths are the repository root's
    printed = _print_config(EXAMPLES[path], Path(path), capsys)
    _assert_keys_kept(yaml.safe_load((ROOT / path).read_text()), printed, path)


@dataclasses.dataclass(frozen=True)
class Block:
    """A ```yaml block of a Markdown page: where it starts (the fence's line, 1-based) and its text."""

    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def yaml_blocks(page: str, text: str) -> list[Block]:
    """The fenced ```yaml (or ```yml, ~~~yaml) blocks of Markdown ``text``, indented ones (in a list or an
    admonition) too, their lines dedented by the fence's indent."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, start, body = m[1], m[2], i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        out.append(Block(page, start, "\n".join(body) + "\n"))
        i += 1
    return out


def _merged(base: dict, over: dict) -> dict:
    """``over`` deep-merged over ``base`` (mappings merged key by key; any other value replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_block(block: Block, tmp_path: Path, capsys) -> None:
    """The block names its command (and for a fragment, its base config) on its first line, and loads with the
    command's --print-config, every key it sets kept (run from the repository root)."""
    first = block.text.splitlines()[0] if block.text.strip() else ""
    m = HEADER.fullmatch(first.strip())
    assert m, (f"{block}: a ```yaml block's first line must name its command: `# <cmd> train` (a whole config) or "
               f"`# <cmd> train --config <path>` (a fragment over that file), cmd one of {', '.join(CLIS)}; "
               f"got {first!r}")
    tree = yaml.safe_load(block.text) or {}
    assert isinstance(tree, dict), f"{block}: the block must be a mapping of config keys"
    if m[2]:
        base = ROOT / m[2]
        assert base.is_file(), f"{block}: --config {m[2]} is not a file (paths are from the repository root)"
        tree = _merged(yaml.safe_load(base.read_text()) or {}, tree)
    config = tmp_path / "block.yaml"
    config.write_text(yaml.safe_dump(tree, sort_keys=False))
    printed = _print_config(m[1], config, capsys)
    _assert_keys_kept(tree, printed, str(block))


def _docs_blocks() -> list[Block]:
    return [b for p in sorted((ROOT / "docs").rglob("*.md"))
            for b in yaml_blocks(p.relative_to(ROOT).as_posix(), p.read_text())]


@pytest.mark.parametrize("block", _docs_blocks(), ids=str)
def test_docs_yaml_block_loads(block, monkeypatch, tmp_path, capsys):
    """Each ```yaml block of the docs loads with its command's --print-config (a fragment over its base)."""
    monkeypatch.chdir(ROOT)
    check_block(block, tmp_path, capsys)


PAGE = """\
Intro.

```yaml
# grpo train --config examples/grpo/grpo_arith.yaml
grpo:
  loss_type: dr_grpo
```

1. A step:

    ```yaml
    # dpo train
    model: m
    data: {path: d.jsonl}
    max_steps: 3
    dpo: {beta: 0.2}
    ```

```yaml
lora:
  rank: 8
```

```yaml
# sft train --config examples/finetune/lora_records.yaml
grpo: {beta: 0.1}
```

```yaml
# dpo train --config examples/dpo/dpo_records.yaml
dpo: {loss_type: dpo}
```
"""


def test_block_checker_on_a_page_of_its_own(monkeypatch, tmp_path, capsys):
    """The docs check itself, on a page written here: a fragment merges over its base, an indented block is
    read, and a block without its command, with a key its command lacks, or with a bad value fails."""
    monkeypatch.chdir(ROOT)
    blocks = yaml_blocks("page.md", PAGE)
    assert [b.line for b in blocks] == [3, 11, 19, 24, 29]
    check_block(blocks[0], tmp_path, capsys)  # grpo_arith.yaml with grpo.loss_type: dr_grpo
    check_block(blocks[1], tmp_path, capsys)  # indented in a list item
    with pytest.raises(AssertionError, match=r"page.md:19: a ```yaml block's first line must name its command"):
        check_block(blocks[2], tmp_path, capsys)
    with pytest.raises(AssertionError, match=r"sft train .*: error: unknown config key 'grpo'"):
        check_block(blocks[3], tmp_path, capsys)
    with pytest.raises(AssertionError, match=r"config key 'dpo.loss_type' is 'dpo'; choose one of sigmoid"):
        check_block(blocks[4], tmp_path, capsys)
