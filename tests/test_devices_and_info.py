"""zoo.load on 8 simulated devices, and `zoo info`."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.hf_models import hf_logits, make_llama, mean_kl, random_tokens
from tests.processes import devices_env
from zoo.cli import main

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import zoo
assert len(jax.devices()) == 8, jax.devices()
model = zoo.load(sys.argv[1])
params = model.param_dict()
gate = params["layers"]["gate"]
tokens = np.load(sys.argv[2])
np.save(sys.argv[3], np.asarray(model(jnp.asarray(tokens))))
print(json.dumps({"gate_devices": len(gate.sharding.device_set),
                  "gate_shard": list(gate.addressable_shards[0].data.shape),
                  "gate_shape": list(gate.shape)}))
"""


@pytest.mark.slow
def test_loads_sharded_on_8_devices_with_same_logits(tmp_path):
    """Slow (slow lane): a subprocess on 8 simulated devices loads the model and compiles its forward."""
    hf = make_llama(tmp_path / "hf", hidden_size=64, intermediate_size=128)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    tokens = random_tokens(hf.config.vocab_size)
    np.save(tmp_path / "tokens.npy", tokens)
    env = devices_env(8)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "zoo"), str(tmp_path / "tokens.npy"),
                        str(tmp_path / "logits.npy")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    # FSDP by default: the embed axis of every weight is split over all 8 devices.
    assert info["gate_devices"] == 8
    assert info["gate_shard"] == [3, 64 // 8, 128]
    got = np.load(tmp_path / "logits.npy")
    ref = hf_logits(hf, tokens)
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6


def test_info_describes_checkpoint(tmp_path, capsys):
    make_llama(tmp_path / "hf", tie_word_embeddings=True)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "zoo")]) == 0
    out = capsys.readouterr().out
    from zoo.checkpoints.format import read_config
    from zoo.model.params import count_params

    n = count_params(read_config(tmp_path / "zoo"))
    assert "llama" in out and f"{n:,}" in out and "float32" in out
    assert "layers.gate" in out and "lm_head" not in out  # tied embeddings: no separate head
    assert "embed,mlp" in out  # logical axes shown


def test_info_on_non_checkpoint_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["info", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a zoo checkpoint" in err[0]


def test_list_shows_required_models(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ["llama2-7b", "llama3-8b", "llama3-8b-instruct", "llama3.1-8b", "llama3.1-70b", "llama3.2-1b",
                 "llama3.2-3b", "smollm2-135m-instruct", "smollm2-1.7b-instruct"]:
        assert f"\n{name} " in out
    assert "meta-llama/Llama-3.1-70B" in out
    for name, repo in [("mistral-7b-v0.3", "mistralai/Mistral-7B-v0.3"), ("gemma-2b", "google/gemma-2b"),
                       ("gemma-7b", "google/gemma-7b"), ("gemma2-2b", "google/gemma-2-2b"),
                       ("gemma2-9b", "google/gemma-2-9b"), ("gemma2-27b", "google/gemma-2-27b"),
                       ("gemma3-270m", "google/gemma-3-270m"), ("gemma3-1b", "google/gemma-3-1b-pt"),
                       ("gemma3-4b", "google/gemma-3-4b-pt"), ("gemma3-12b", "google/gemma-3-12b-pt"),
                       ("gemma3-27b", "google/gemma-3-27b-pt"), ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B"),
                       ("qwen2.5-7b", "Qwen/Qwen2.5-7B"), ("qwen3-0.6b", "Qwen/Qwen3-0.6B-Base"),
                       ("qwen3-8b", "Qwen/Qwen3-8B-Base"), ("mistral-7b-instruct-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
                       ("gemma2-2b-it", "google/gemma-2-2b-it"), ("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct"),
                       ("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1"),
                       ("mixtral-8x7b-instruct", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
                       ("mixtral-8x22b", "mistralai/Mixtral-8x22B-v0.1"),
                       ("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite"),
                       ("deepseek-v2-lite-chat", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
                       ("deepseek-v2", "deepseek-ai/DeepSeek-V2"), ("deepseek-v3", "deepseek-ai/DeepSeek-V3"),
                       ("deepseek-v3-tiny", "(built-in config: zoo init)")]:
        line = next(l for l in out.splitlines() if l.startswith(name + " "))
        assert line.rstrip().endswith(repo), line


def test_info_names_the_dense_layers_of_a_moe_model():
    """`zoo info`'s experts line names the dense layers wherever they sit: first layers (DeepSeek's
    first_k_dense_replace), Qwen3-MoE's mlp_only_layers and decoder_sparse_step, or none."""
    from dataclasses import replace

    from zoo.info import dense_layer_text
    from zoo.model.config import ModelConfig

    cfg = ModelConfig("qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
                      head_dim=8, num_layers=4, num_experts=8, experts_per_token=2, mlp_only_layers=(1, 3))
    assert dense_layer_text(cfg) == "layers 1, 3 dense (of 4)"
    assert dense_layer_text(replace(cfg, mlp_only_layers=())) == "every layer MoE"
    assert dense_layer_text(replace(cfg, mlp_only_layers=(), dense_layers=1)) == "first 1 layer dense"
    assert dense_layer_text(replace(cfg, mlp_only_layers=(), dense_layers=3)) == "first 3 layers dense"
    assert dense_layer_text(replace(cfg, mlp_only_layers=(), decoder_sparse_step=2)) == "layers 0, 2 dense (of 4)"
