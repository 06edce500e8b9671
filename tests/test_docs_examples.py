"""The docs and the example configs start where a new user stands.

- Every examples/ config reads checkpoints (model.path, a DPO reference, a GKD teacher, a GRPO reward model) that
  docs/quickstart.md makes or that a command shown before it on its docs page makes: each page's shell blocks are
  walked in order, each command's config resolved as its command resolves it (no model is read or trained).
- Each task page (docs/training/) shows the whole sequence from a fresh install: the install, then every command
  that makes what a later one reads.
- A missing model.path says how to make it, in one line.
- The --help of each training command names the methods its config keys select.
- The Python snippet of docs/quickstart.md (and README.md's copy) runs, on a tiny checkpoint in place of the page's.
"""

from __future__ import annotations

import os
import re
import shlex
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dpo.cli
import grpo.cli
import rm.cli
import sft.cli
from demo.config_reference import COMMANDS
from dpo.config import LOSS_TYPES as DPO_LOSSES
from grpo.config import ADVANTAGES, IMPORTANCE_LEVELS
from grpo.config import LOSS_TYPES as GRPO_LOSSES
from pretrain.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
TASK_PAGES = sorted((ROOT / "docs" / "training").glob("*.md"))
SCHEMAS = {name.split()[0]: schema for name, schema in COMMANDS}  # "sft" -> SFTConfig, ...
SEPARATORS = {"&&", "||", ";", "&", "|", "do", "done", "then", "else", "fi"}
OVERRIDE = re.compile(r"^[A-Za-z_][\w.\[\]]*=")
SHELL_BLOCK = re.compile(r"^([ \t]*)```(?:bash|sh)\n(.*?)^\1```", re.S | re.M)
SNIPPET = re.compile(r"^## From Python\n.*?^```python\n(.*?)^```", re.S | re.M)
INSTALL = "pip install -e ."  # the README's set-up
MADE_BY_QUICKSTART = "runs/quickstart/smollm2"  # the checkpoint the page converts, which its snippet loads


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a Markdown text's ```bash/```sh blocks, in order, each as its words: continuations joined,
    comments dropped, `&&`/`;`/`&` chains and loop bodies split into their commands."""
    out: list[list[str]] = []
    for _indent, body in SHELL_BLOCK.findall(text):
        for line in textwrap.dedent(body).replace("\\\n", " ").splitlines():
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            words: list[str] = []
            for word in [*lex, ";"]:
                if word not in SEPARATORS:
                    words.append(word)
                elif words:
                    out.append(words)
                    words = []
    return out


def _after(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words and words.index(flag) + 1 < len(words) else None


def checkpoints_read(cfg: TrainConfig) -> list[str]:
    """The checkpoint paths a resolved config reads: the model, and a DPO reference, a GKD teacher, a GRPO
    reference or reward model where it names one."""
    paths = [] if cfg.model.init == "random" else [str(cfg.model.path)]
    pref = getattr(cfg, "dpo", None)
    if pref is not None:
        paths += [p for p in (pref.reference, pref.reference_model) if p not in (None, "base", "none", "precomputed")]
    distill = getattr(cfg, "distill", None)
    if distill is not None and distill.teacher:
        paths.append(distill.teacher)
    rl = getattr(cfg, "grpo", None)
    if rl is not None:
        paths += [rl.reference] if rl.beta > 0 and rl.reference != "base" else []
        names = [r.get("function", "") if isinstance(r, dict) else r for r in rl.rewards]
        paths += [n[len("rm:"):] for n in names if isinstance(n, str) and n.startswith("rm:")]
    return paths


def walk(page: Path, made: set[str], strict: bool) -> tuple[list[str], set[str], set[str]]:
    """Walk ``page``'s shell commands in order from ``made`` (the checkpoints there already). Returns (problems,
    what is made after it, the example configs it trains). An examples/ config's checkpoints must be made by then;
    ``strict`` (a page from a fresh install): so must every zoo command's checkpoint, and the install comes first."""
    text = page.read_text()
    first = SHELL_BLOCK.search(text)
    # The install may come before the first shell block (the quickstart shows it as text: its test runs the blocks).
    installed = not strict or INSTALL in text[:first.start() if first else len(text)]
    made, trained, problems = set(made), set(), []
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    for words in shell_commands(text):
        shown = f"{name}: `{shlex.join(words)}`"
        if shlex.join(words[:4]) == INSTALL:
            installed = True
        if words[0] not in SCHEMAS and words[0] != "zoo":
            continue
        if not installed:
            problems.append(f"{shown} comes before the install ({INSTALL})")
            installed = True
        reads: list[str] = []
        if words[0] == "zoo" and len(words) > 2:
            if words[1] in ("generate", "eval", "export", "info", "quantize") and strict and words[2][:1] != "-":
                reads.append(words[2])
            if words[1] in ("convert", "init", "quantize") and _after(words, "--out"):
                made.add(os.path.normpath(str(_after(words, "--out"))))
        elif words[0] in SCHEMAS and len(words) > 1 and words[1] in ("train", "inspect"):
            config = _after(words, "--config") or ""
            if not config.startswith("examples/"):
                continue  # a config of the reader's own (run.yaml)
            cfg = load_config(ROOT / config, [w for w in words[2:] if OVERRIDE.match(w)], SCHEMAS[words[0]])
            dry = "--print-config" in words or "--compile-only" in words
            reads += [] if dry else checkpoints_read(cfg)
            if words[1] == "train" and not dry:
                made.add(os.path.normpath(os.path.join(cfg.output_dir, "final")))
                trained.add(config)
        problems += [f"{shown} reads {p}, which nothing before it makes (on this page"
                     f"{'' if strict else ' or in docs/quickstart.md'})"
                     for p in reads if os.path.normpath(p) not in made]
    return problems, made, trained


def _quickstart_made() -> set[str]:
    problems, made, _ = walk(QUICKSTART, set(), strict=True)
    assert not problems, problems
    return made


def _pages_with_examples() -> list[Path]:
    """The docs pages whose shell blocks run an examples/ config (besides the quickstart)."""
    pages = sorted(set(TASK_PAGES) | set((ROOT / "docs").rglob("*.md")))
    return [p for p in pages if p != QUICKSTART and "--config examples/" in p.read_text()]


def test_the_quickstart_makes_what_it_reads_from_a_fresh_install():
    made = _quickstart_made()
    assert MADE_BY_QUICKSTART in made and any(p.startswith("runs/quickstart/") and p.endswith("final") for p in made)


@pytest.mark.parametrize("page", _pages_with_examples(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_example_on_a_page_starts_from_what_is_made_before_it(page, monkeypatch):
    """A task page shows the whole sequence from a fresh install (it starts from nothing); another page may start
    where docs/quickstart.md ends."""
    monkeypatch.chdir(ROOT)  # the configs' own paths (an environment's file) are the repository root's
    strict = page in TASK_PAGES
    problems, _, _ = walk(page, set() if strict else _quickstart_made(), strict)
    assert not problems, "\n".join(problems)


def test_every_example_config_is_trained_on_a_task_page(monkeypatch):
    monkeypatch.chdir(ROOT)
    trained = set().union(*(walk(p, set(), strict=True)[2] for p in TASK_PAGES))
    examples = {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").rglob("*.yaml")}
    assert examples - trained == set(), "examples no task page's shell block trains"


def test_the_walk_finds_a_checkpoint_nothing_makes(tmp_path, monkeypatch):
    """The check itself, on a page written here: a DPO run on an SFT run the page never makes, before the
    install, fails; with the install, the conversion and the SFT run before it, it passes."""
    monkeypatch.chdir(ROOT)
    page = tmp_path / "page.md"
    dpo_run = "dpo train --config examples/dpo/dpo_records.yaml model=runs/a/final\n"
    page.write_text(f"```bash\n{dpo_run}```\n")
    problems, _, _ = walk(page, set(), strict=True)
    assert len(problems) == 2 and "before the install" in problems[0] and "reads runs/a/final" in problems[1]
    page.write_text("```bash\npip install -e .\nzoo convert x.gguf --out ckpt/base   # a comment\n"
                    "sft train --config examples/finetune/lora_records.yaml model=ckpt/base \\\n"
                    f"    output_dir=runs/a && {dpo_run}```\n")
    problems, made, trained = walk(page, set(), strict=True)
    assert problems == [] and {"ckpt/base", "runs/a/final"} <= made
    assert trained == {"examples/finetune/lora_records.yaml", "examples/dpo/dpo_records.yaml"}


# ---- a missing model.path ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cli, config, hint", [
    (sft.cli, "examples/finetune/lora_records.yaml", "make it with `zoo convert SOURCE --out runs/quickstart/smollm2`"),
    (dpo.cli, "examples/dpo/dpo_records.yaml", "run the training whose output_dir is runs/quickstart/sft first"),
])
def test_a_missing_model_path_says_how_to_make_it(cli, config, hint, tmp_path, monkeypatch, capsys):
    """An example run before the quickstart: exit 2, one line naming the path, how to make it and the page whose
    commands make it; nothing written."""
    for name in ("examples", "demo"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", config]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.path runs/quickstart/"), err
    assert hint in lines[0] and "docs/quickstart.md" in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()


# ---- --help ------------------------------------------------------------------------------------------------------

def _help(cli, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words


# Each command: (its module, what its --help names, what `train --help` names besides).
HELP = {
    "dpo": (dpo.cli, ["DPO", "IPO", "SLiC", "SimPO", "RPO", "ORPO", "CPO", "KTO"],
            ["unpaired", "dpo.loss_type", "dpo.sft_weight", "dpo.reference", *DPO_LOSSES]),
    "grpo": (grpo.cli, ["GRPO", "Dr. GRPO", "DAPO", "BNPO", "CISPO", "SAPO", "LUSPO", "VESPO", "GSPO", "RLOO", "REINFORCE++", "tools", "environments"],
             ["grpo.loss_type", "grpo.advantage", "grpo.importance_sampling_level", "grpo.tools", "grpo.environment",
              "rm:", *GRPO_LOSSES, *ADVANTAGES, *IMPORTANCE_LEVELS]),
    "sft": (sft.cli, ["SFT", "LoRA", "QLoRA", "GKD"],
            ["distill.teacher", "distill.lmbda", "distill.seq_kd", "lora.rank", "lora.base_quant", "sft inspect"]),
    "reward": (rm.cli, ["Bradley-Terry", "LoRA"], ["rm.margin_field", "rm.center_rewards_coefficient", "rm:"]),
}


@pytest.mark.parametrize("command", sorted(HELP))
def test_help_names_the_methods_and_their_keys(command, capsys):
    """`<command> --help` names each method its command runs; `train --help` names them too, with the config key
    (and value) that selects each."""
    cli, methods, keys = HELP[command]
    top = _help(cli, ["--help"], capsys)
    assert [w for w in methods if w not in top] == [], top
    text = _help(cli, ["train", "--help"], capsys)
    assert [w for w in methods + keys if w not in text] == [], text


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_command_tables_name_the_methods(page):
    """The table of commands in README.md and docs/index.md: each training command's row names its methods."""
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+) train --config run.yaml` \| (.*) \|$", (ROOT / page).read_text(),
                                            re.M)}
    assert [w for w in HELP["sft"][1] if w not in rows["sft"]] == []
    assert [w for w in HELP["dpo"][1] if w not in rows["dpo"]] == [] and "unpaired" in rows["dpo"]
    assert [w for w in HELP["grpo"][1] if w not in rows["grpo"]] == []
    assert "Bradley-Terry" in rows["reward"]


def test_dpo_train_help_does_not_speak_of_pairs_only(capsys):
    text = _help(dpo.cli, ["train", "--help"], capsys)
    assert "pairs (prompt, chosen, rejected)" in text and "(prompt, completion, label)" in text


# ---- the Python snippet ------------------------------------------------------------------------------------------

def snippet(page: Path) -> str:
    """The ```python block under the page's `## From Python` heading."""
    m = SNIPPET.search(page.read_text())
    assert m, f"{page.name}: no ```python block under ## From Python"
    return m[1]


def test_the_readme_snippet_is_the_quickstarts():
    assert snippet(ROOT / "README.md") == snippet(QUICKSTART)


@pytest.mark.slow  # three small compilations: about 8 s on 2 busy cores
def test_the_quickstart_snippet_runs_on_its_own_checkpoint(tiny_lm, tmp_path, capsys):
    """The snippet loads the checkpoint the page converts, defines everything it uses, and runs (on the tiny
    model, its path put in place of the page's); its packed row's second document scores as it does alone."""
    import shutil

    import jax.numpy as jnp

    code = snippet(QUICKSTART)
    assert f'"{MADE_BY_QUICKSTART}"' in code and MADE_BY_QUICKSTART in _quickstart_made()
    ckpt = tmp_path / "zoo"
    shutil.copytree(tiny_lm / "zoo", ckpt)
    shutil.copytree(tiny_lm / "tok", ckpt / "tokenizer", dirs_exist_ok=True)  # its tokenizer, as a conversion keeps it
    scope: dict = {}
    exec(compile(code.replace(MADE_BY_QUICKSTART, str(ckpt)), "quickstart.md", "exec"), scope)
    assert capsys.readouterr().out.strip()
    model, a, b = scope["model"], scope["a"], scope["b"]
    assert scope["logits"].shape == (1, len(a), model.cfg.vocab_size)
    alone = np.asarray(model(jnp.array([b], jnp.int32))[0])  # computed here, not read from the snippet
    np.testing.assert_allclose(np.asarray(scope["packed"])[0, len(a):], alone, atol=1e-4)
