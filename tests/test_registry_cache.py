"""Registry names resolve through a local Hugging Face cache (offline); a missing one says how to get it."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tests.tiny import hf_logits, make_llama, mean_kl, random_tokens


def lay_out_hf_cache(cache: Path, repo_id: str, files_dir: Path, revision: str = "0" * 40) -> None:
    """Write the layout huggingface_hub's cache uses: blobs by hash, snapshot symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in files_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def _zoo(args, cache: Path):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("HF_HOME", None)
    return subprocess.run([sys.executable, "-m", "zoo.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def test_registry_name_resolves_from_local_cache(tmp_path):
    import zoo

    hf = make_llama(tmp_path / "files", tie_word_embeddings=True)
    from huggingface_hub import snapshot_download

    cache = tmp_path / "cache"
    lay_out_hf_cache(cache, "HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "files")
    # huggingface_hub itself finds the snapshot in this cache.
    assert Path(snapshot_download("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=cache, local_files_only=True)).is_dir()
    out = tmp_path / "zoo"
    p = _zoo(["convert", "smollm2-135m-instruct", "--out", str(out)], cache)
    assert p.returncode == 0, p.stderr
    tokens = random_tokens(hf.config.vocab_size)
    got = np.asarray(zoo.load(out)(jnp.asarray(tokens)))
    ref = hf_logits(hf, tokens)
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in zoo.checkpoint.read_meta(out)["source"]


def test_uncached_name_offline_says_how_to_download(tmp_path):
    out = tmp_path / "zoo"
    p = _zoo(["convert", "llama3.2-1b", "--out", str(out)], tmp_path / "empty-cache")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr
    assert "meta-llama/Llama-3.2-1B" in lines[0] and "hf download" in lines[0] and "local folder" in lines[0]
    assert not out.exists()
