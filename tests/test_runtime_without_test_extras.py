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


@pytest.mark.slow
def test_convert_and_generate_without_torch(env, tmp_path):
    """Slow (slow lane): `zoo convert` and `zoo generate` of the real SmolLM2 GGUF file in subprocesses."""
    out = tmp_path / "smol"
    r = _run(env, "-m", "zoo.cli", "convert", str(smollm2_gguf()), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "model.json").is_file()
    r = _run(env, "-m", "zoo.cli", "generate", str(out), "--chat", "--prompt", "What is the capital of France?",
             "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout
    assert "PyTorch was not found" not in r.stderr  # transformers' import advice is not for lmzoo's users
    r = _run(env, "-m", "zoo.cli", "eval", str(out), "--tasks", "easy_mc,prose", "--limit", "4",
             "--out", str(tmp_path / "results.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(json.loads((tmp_path / "results.json").read_text())["tasks"]) == {"easy_mc", "prose"}
