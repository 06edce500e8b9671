"""The shared training loop on a tiny model: learning, gradient accumulation, resume."""

import json

import numpy as np
import pytest

import zoo
from pretrain.config import load_config
from pretrain.trainer import train
from tests.tiny import make_llama
from zoo.cli import main as zoo_main

WORDS = "the a cat dog sat ran on under mat log red blue big small quickly slowly and then".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    from transformers import AutoTokenizer

    from zoo.cli import smollm2_gguf

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(root / "tok"))
    make_llama(root / "hf", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1)
    assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    rng = np.random.RandomState(0)
    with open(root / "data.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS[:8], rng.randint(5, 30)))}) + "\n")
    return root


def _cfg(setup, out, *overrides):
    base = [f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={setup / 'data.jsonl'}",
            "data.seq_len=32", "batch_size=8", "optimizer.learning_rate=0.01", "schedule.name=constant",
            "log_every=1", "checkpoint.every=2", f"output_dir={out}"]
    return load_config(None, base + list(overrides))


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_loss_decreases_and_final_is_a_zoo_checkpoint(setup, tmp_path):
    final = train(_cfg(setup, tmp_path / "run", "max_steps=25"), progress=False)
    losses = _losses(tmp_path / "run")
    assert len(losses) == 25
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"step", "loss", "learning_rate", "grad_norm", "tokens_seen", "tokens_per_sec", "step_time", "mfu"} <= set(rec)
    model = zoo.load(final)  # zoo.load reads the trained model
    assert model.cfg.num_layers == 2
    meta = zoo.checkpoint.read_meta(final)
    assert meta["training"]["method"] == "pretrain" and meta["training"]["steps"] == 25
    assert zoo_main(["export", str(final), "--out", str(tmp_path / "hf")]) == 0  # and zoo export too


def test_grad_accum_equals_one_larger_step(setup, tmp_path):
    # SGD keeps the update proportional to the gradient (Adam would amplify fp32 summation-order
    # noise in near-zero gradients), so this compares the accumulated gradients themselves.
    sgd = ("optimizer.name=sgd", "optimizer.learning_rate=0.5")
    a = train(_cfg(setup, tmp_path / "a", "max_steps=3", "grad_accum=1", *sgd), progress=False)
    b = train(_cfg(setup, tmp_path / "b", "max_steps=3", "grad_accum=4", *sgd), progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "a"), _losses(tmp_path / "b"), rtol=1e-5)
    pa, pb = zoo.load_params(a), zoo.load_params(b)
    for x, y in zip(jax_leaves(pa), jax_leaves(pb)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_interrupted_run_resumes_to_the_same_result(setup, tmp_path, monkeypatch):
    full = train(_cfg(setup, tmp_path / "full", "max_steps=6"), progress=False)
    import pretrain.trainer as trainer

    real = trainer.to_model_batch
    calls = []

    def crash_at_5(b):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # killed after step 4 was checkpointed
        return real(b)

    monkeypatch.setattr(trainer, "to_model_batch", crash_at_5)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(setup, tmp_path / "resumed", "max_steps=6"), progress=False)
    monkeypatch.setattr(trainer, "to_model_batch", real)
    resumed = train(_cfg(setup, tmp_path / "resumed", "max_steps=6"), progress=False)
    assert _losses(tmp_path / "resumed")[-2:] == _losses(tmp_path / "full")[-2:]
    for x, y in zip(jax_leaves(zoo.load_params(full)), jax_leaves(zoo.load_params(resumed))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
