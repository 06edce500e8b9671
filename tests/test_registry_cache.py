"""Registry names resolve through a local Hugging Face cache (offline); a missing one says how to get it."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_models import hf_logits, make_llama, mean_kl, random_tokens
from tests.hub_runs import lay_out_hf_cache, zoo_offline


@pytest.mark.slow
def test_registry_name_resolves_from_local_cache(tmp_path):
    import zoo

    hf = make_llama(tmp_path / "files", tie_word_embeddings=True)
    from huggingface_hub import snapshot_download

    cache = tmp_path / "cache"
    lay_out_hf_cache(cache, "HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "files")
    # huggingface_hub itself finds the snapshot in this cache.
    assert Path(snapshot_download("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=cache, local_files_only=True)).is_dir()
    out = tmp_path / "zoo"
    p = zoo_offline(["convert", "smollm2-135m-instruct", "--out", str(out)], cache)
    assert p.returncode == 0, p.stderr
    tokens = random_tokens(hf.config.vocab_size)
    got = np.asarray(zoo.load(out)(jnp.asarray(tokens)))
    ref = hf_logits(hf, tokens)
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6
    meta = zoo.checkpoints.format.read_meta(out)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in meta["source"]
    assert meta["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the repo the registry name resolved to


def test_uncached_name_offline_says_how_to_download(tmp_path):
    out = tmp_path / "zoo"
    p = zoo_offline(["convert", "llama3.2-1b", "--out", str(out)], tmp_path / "empty-cache")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr
    assert "meta-llama/Llama-3.2-1B" in lines[0] and "hf download" in lines[0] and "local folder" in lines[0]
    assert not out.exists()
