"""Every command at its edges (issue 41): errors said before anything heavy loads or runs, and output that stays
plain off a terminal (no colour codes, no carriage-return redraws, no traceback when the reader of a pipe leaves)."""

import functools
import json
import os
import subprocess
import sys

import pytest

from zoo.console import run_cli

# ---- item 15: a config error before JAX, transformers or the model code is imported ----------------------------

# Runs one command's main in a fresh interpreter, then says its exit code and which heavy modules it imported.
IMPORTS_SCRIPT = """
import importlib, sys
code = importlib.import_module(sys.argv[1]).main(sys.argv[2:])
print(code, ",".join(m for m in ("jax", "flax", "optax", "transformers", "torch") if m in sys.modules))
"""


@pytest.fixture
def bad_config(tmp_path):
    """A config with a misspelt key (`optimizer.learning_rat`) and everything else a run needs."""
    f = tmp_path / "bad.yaml"
    f.write_text("model: ckpt\nmax_steps: 1\ndata:\n  path: rows.jsonl\noptimizer:\n  learning_rat: 1.0e-4\n")
    return f


@pytest.mark.parametrize("module, argv, words", [
    ("sft.cli", ["train", "--config", "{bad}"], ["optimizer.learning_rat", "optimizer.learning_rate"]),
    ("sft.cli", ["inspect", "--config", "{bad}"], ["optimizer.learning_rat"]),
    ("dpo.cli", ["train", "--config", "{bad}"], ["optimizer.learning_rat"]),
    ("rm.cli", ["train", "--config", "{bad}"], ["optimizer.learning_rat"]),
    ("grpo.cli", ["train", "model.path=ckpt", "data.path=rows.jsonl", "max_steps=1", "optimizer.learning_rate=oops"],
     ["optimizer.learning_rate", "oops"]),
    ("pretrain.cli", ["train", "--config", "{bad}"], ["optimizer.learning_rat"]),
    ("zoo.cli", ["eval", "ckpt", "--tasks", "prose", "--out", "{bad}/results.json"], ["--out", "is a file"]),
    ("zoo.cli", ["convert", "llama-nosuch", "--out", "out"], ["unknown model name 'llama-nosuch'"]),
])
def test_bad_arguments_fail_before_heavy_imports(module, argv, words, bad_config, tmp_path):
    """Each a subprocess of about 0.3 s (before: 2-3.5 s here, importing JAX)."""
    argv = [a.format(bad=bad_config) for a in argv]
    p = subprocess.run([sys.executable, "-c", IMPORTS_SCRIPT, module, *argv], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    code, heavy = p.stdout.strip().split(" ") if " " in p.stdout.strip() else (p.stdout.strip(), "")
    assert code == "2" and heavy == "", (p.stdout, p.stderr)
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


# ---- item 10: `zoo eval --out` that cannot be written fails before the model loads -----------------------------

@pytest.mark.parametrize("flags", [["--tasks", "prose"], ["--harness", "arc_easy"]])
def test_eval_out_that_cannot_be_written_fails_before_anything_loads(flags, tmp_path, monkeypatch, capsys):
    import zoo
    from zoo.cli import main

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(zoo, "load", loaded)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.json").write_text("{}")  # passes for a checkpoint until something reads it
    blocker = tmp_path / "file.txt"
    blocker.write_text("kept")
    out = blocker / "sub" / "x.json"
    assert main(["eval", str(ckpt), *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {out}" in err and f"{blocker} is a file" in err, err
    assert blocker.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file.txt"]


# ---- item 11: an unknown lm-eval task name is said before the model loads -------------------------------------

@pytest.fixture
def local_task_index(monkeypatch):
    """lm-eval's TaskManager over --include-path's tasks alone (its whole library takes 13 s to index)."""
    from lm_eval import tasks

    monkeypatch.setattr(tasks, "TaskManager", functools.partial(tasks.TaskManager, include_defaults=False))


def _harness_task(folder):
    """One lm-eval task YAML, `zoo_mc`, over a two-row JSONL in ``folder``."""
    rows = [{"question": "Two plus two equals", "choices": ["four", "five"], "gold": 0}] * 2
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "zoo_mc.yaml").write_text(
        f"task: zoo_mc\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\noutput_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\n"
        "doc_to_choice: choices\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n")
    return folder


def test_unknown_harness_task_of_a_training_run_is_named_before_the_model_loads(local_task_index, tmp_path,
                                                                                 monkeypatch, capsys):
    from pretrain import loop as trainer
    from pretrain.cli import training_hooks
    from pretrain.config import load_config

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer, "set_up_model", loaded)
    tasks = _harness_task(tmp_path)
    cfg = load_config(None, ["model.path=ckpt", "data.path=rows.jsonl", "max_steps=1", "eval_every=1",
                             "eval.tasks=[zoo_mcq]", f"eval.include_path={tasks}", f"output_dir={tmp_path / 'run'}"])
    assert run_cli(lambda: trainer.train(cfg, progress=False, hooks=training_hooks(cfg))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "eval.tasks zoo_mcq: not an lm-eval task" in err, err
    assert "did you mean zoo_mc" in err


def test_lm_evals_task_index_is_built_once_per_folder(local_task_index, tmp_path):
    """The names are checked before the model loads, and the run then reuses that index."""
    from eval.harness_run import task_manager

    tasks = _harness_task(tmp_path)
    first = task_manager(str(tasks))
    assert task_manager(str(tasks) + "/") is first and "zoo_mc" in first.all_tasks


# ---- item 13: plain output off a terminal -----------------------------------------------------------------------

@pytest.fixture
def chat_rows(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "colour red"},
                                          {"role": "assistant", "content": "red red"}]}) + "\n")
    return f


def test_sft_inspect_colours_only_a_terminal_without_no_color(smollm2_tokenizer, chat_rows, monkeypatch, capsys):
    from sft.cli import main

    args = ["inspect", "model.path=unused", f"model.tokenizer={smollm2_tokenizer}", f"data.path={chat_rows}",
            "max_steps=1", "-n", "1"]
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert main(args) == 0  # stdout captured: not a terminal
    shown = capsys.readouterr().out
    assert "\x1b[" not in shown and "[[" in shown, shown  # the trained tokens marked in plain text
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm")
    assert main(args) == 0
    assert "\x1b[42m" in capsys.readouterr().out  # a terminal: the green background
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(args) == 0
    assert "\x1b[" not in capsys.readouterr().out


def test_eval_progress_off_a_terminal_is_plain_lines(capsys):
    from eval.progress import progress_bar

    with progress_bar(10, "prose", "win", True) as bar:  # stderr captured: not a terminal
        bar.update(4)
        bar.update(6)
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b[" not in err and err.splitlines()[-1].startswith("prose: 10/10 win"), err


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`zoo list | head -0`: stdout is a pipe nobody reads (its read end closed before the command starts)."""
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-m", "zoo.cli", "list"], stdout=write, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    finally:
        os.close(write)
    assert p.stderr == "" and p.returncode == 141, p.stderr  # 141: a shell's code for SIGPIPE, as `cat` gives
