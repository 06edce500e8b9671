"""Registry names resolve through a local Hugging Face cache (offline); a missing one says how to get it."""

import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_models import hf_logits, make_llama, mean_kl, random_tokens
from tests.hub_runs import lay_out_hf_cache


def _zoo_offline_here(args, cache: Path, monkeypatch, capfd) -> subprocess.CompletedProcess:
    """`zoo ARGS` in this process, offline, with ``cache`` as its Hugging Face Hub cache: as tests/hub_runs.py's
    zoo_offline runs it in a fresh interpreter (HF_HUB_CACHE, HF_HUB_OFFLINE), without the interpreter's start-up
    and imports. huggingface_hub reads those variables when imported: its settings are set on it too, and
    ``monkeypatch`` undoes it all after the test. Returns the exit code and what the command wrote."""
    from huggingface_hub import constants

    from zoo.cli import main

    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["zoo", *args], code, out, err)


@pytest.mark.slow
def test_registry_name_resolves_from_local_cache(tmp_path, monkeypatch, capfd):
    import zoo

    hf = make_llama(tmp_path / "files", tie_word_embeddings=True)
    from huggingface_hub import snapshot_download

    cache = tmp_path / "cache"
    lay_out_hf_cache(cache, "HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "files")
    # huggingface_hub itself finds the snapshot in this cache.
    assert Path(snapshot_download("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=cache, local_files_only=True)).is_dir()
    out = tmp_path / "zoo"
    p = _zoo_offline_here(["convert", "smollm2-135m-instruct", "--out", str(out)], cache, monkeypatch, capfd)
    assert p.returncode == 0, p.stderr
    # 64 tokens: tests/test_llama_parity.py's program for its tied-embeddings variant (this model), compiled once.
    tokens = random_tokens(hf.config.vocab_size, seq=64)
    got = np.asarray(zoo.load(out)(jnp.asarray(tokens)))
    ref = hf_logits(hf, tokens)
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6
    meta = zoo.checkpoints.format.read_meta(out)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in meta["source"]
    assert meta["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the repo the registry name resolved to


def test_uncached_name_offline_says_how_to_download(tmp_path, monkeypatch, capfd):
    out = tmp_path / "zoo"
    p = _zoo_offline_here(["convert", "llama3.2-1b", "--out", str(out)], tmp_path / "empty-cache", monkeypatch, capfd)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr
    assert "meta-llama/Llama-3.2-1B" in lines[0] and "hf download" in lines[0] and "local folder" in lines[0]
    assert not out.exists()
