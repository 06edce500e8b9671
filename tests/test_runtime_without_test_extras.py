"""The commands users run need none of the test-only packages (torch, peft, trl, accelerate).

The suite itself has them installed, so each command runs here in a subprocess whose
`sitecustomize` makes them look uninstalled: `import torch` fails and
`importlib.util.find_spec("torch")` answers None, as on a machine without them.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.processes import REPO, TEST_ONLY
from zoo.registry.catalogue import bundled_gguf as smollm2_gguf


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    site = tmp_path_factory.mktemp("blocked")
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {TEST_ONLY!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError; find_spec answers None\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(env, *args, timeout=600):
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_the_block_works(env):
    for name in TEST_ONLY:
        r = _run(env, "-c", f"import importlib.util, sys; assert importlib.util.find_spec({name!r}) is None; "
                            f"import {name}")
        assert r.returncode != 0 and f"import of {name} halted" in r.stderr, (name, r.stderr[-500:])


# The commands in one process (each would pay the imports again in its own): `zoo.cli.main` per command, as
# `python -m zoo.cli` runs it, each command's output after a marker line.
_COMMANDS = """
import json, sys
from zoo.cli import main
for argv in json.loads(sys.argv[1]):
    print("### zoo " + argv[0], flush=True)
    code = main(argv)
    if code:
        sys.exit(code)
"""


def _by_command(text: str) -> dict[str, str]:
    parts = text.split("### zoo ")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] if "\n" in part else "" for part in parts}


@pytest.mark.slow
def test_convert_and_generate_without_torch(env, tmp_path, tiny_family):
    """Slow (slow lane): `zoo convert`, `zoo generate` and `zoo eval` of the real SmolLM2 GGUF file in a
    subprocess, and `zoo export` of a tiny Gemma 3 (the richest config: per-layer-type RoPE, layer types,
    soft-capping) without a stored config, built through transformers' config classes as save_pretrained
    writes it."""
    import shutil

    out = tmp_path / "smol"
    _, gemma3 = tiny_family("gemma3")  # conftest.py's: transformers' save_pretrained at hf/, converted at zoo/
    bare = tmp_path / "gemma3"
    shutil.copytree(gemma3 / "zoo", bare, ignore=shutil.ignore_patterns("hf_config.json"))
    commands = [
        ["convert", str(smollm2_gguf()), "--out", str(out)],
        ["generate", str(out), "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "8"],
        # one example of each kind of task (multiple choice, perplexity): each compiles its own scoring program
        ["eval", str(out), "--tasks", "easy_mc,prose", "--limit", "1", "--out", str(tmp_path / "results.json")],
        ["export", str(bare), "--out", str(tmp_path / "back")],
    ]
    # Not set from outside (an earlier command in the suite's own process sets it): the commands must set it.
    env = {k: v for k, v in env.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    r = _run(env, "-c", _COMMANDS, json.dumps(commands))
    assert r.returncode == 0, r.stderr[-3000:]
    stdout = _by_command(r.stdout)
    assert list(stdout) == ["convert", "generate", "eval", "export"], r.stdout[-3000:]
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "model.json").is_file()
    assert "Paris" in stdout["generate"]
    assert "PyTorch was not found" not in r.stderr  # transformers' import advice is not for lmzoo's users
    assert set(json.loads((tmp_path / "results.json").read_text())["tasks"]) == {"easy_mc", "prose"}
    # key for key and value for value save_pretrained's (tests/test_export_hf_config.py's other exports)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((gemma3 / "hf" / "config.json").read_text())
