"""`dpo train` on the shared loop: losses against transformers, reference modes (step 1 exact where the policy is
the reference), learning, resume."""

import gc
import json
import math
import os
import signal
from typing import Any

import jax
import numpy as np
import pytest

import zoo
from dpo.cli import main as dpo_main
from dpo.task import DPOTask
from pretrain.loop import train
from tests.hf_models import hf_logits, hf_logps, log_softmax
from tests.preference_data import DPO_LORA, UNEVEN_PAIRS, dpo_cfg, dpo_pairs
from tests.processes import REPO, TRAIN_IMPORTS, ForkServer, devices_env, kill_after_checkpoint
from tests.run_files import read_metrics, write_jsonl
from tests.tiny_lm import TINY_LM
from zoo.cli import main as zoo_main

SMALL = TINY_LM  # the policy is the session's tiny Llama (seed 0, 512-id vocabulary)


@pytest.fixture(scope="module")
def setup(dpo_models):
    return dpo_models  # (folder, tokenizer, transformers models): conftest.py


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


# name -> (config overrides, per-pair loss from (beta h), sft_weight); TRL's DPOTrainer/CPOTrainer formulas, written
# out. ipo's step one against transformers is tests/test_dpo_trl_exact.py's
# test_ipo_with_sft_weight_step_one_equals_trl_from_transformers (with sft_weight and two micro-batches besides).
EPS = 0.1
LOSSES = {
    "sigmoid": ((), lambda bh: -_logsig(bh), 0.0),
    # cDPO (sigmoid with label smoothing) and RPO's sft term in one run: the loss is their sum
    "cdpo_rpo": (("dpo.label_smoothing=0.1", "dpo.sft_weight=0.5"),
                 lambda bh: -(1 - EPS) * _logsig(bh) - EPS * _logsig(-bh), 0.5),
    "robust": (("dpo.loss_type=robust", "dpo.label_smoothing=0.1"),
               lambda bh: (-(1 - EPS) * _logsig(bh) + EPS * _logsig(-bh)) / (1 - 2 * EPS), 0.0),
    "hinge": (("dpo.loss_type=hinge",), lambda bh: max(0.0, 1 - bh), 0.0),
    "simpo": (("dpo.loss_type=simpo", "dpo.simpo_gamma=0.5"), lambda bh: -_logsig(bh), 0.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOSSES))
def test_step_one_metrics_equal_transformers(setup, tmp_path, name):
    """A separate reference checkpoint: step 1's loss and rewards equal a computation from transformers'
    logits of the two models (all four pairs are in the first batch).
    Slow (about 5 s each): whole training runs through the loop, each compiling its step configuration."""
    root, tok, models = setup
    beta = 0.1
    overrides, per_pair, sft_weight = LOSSES[name]
    out = tmp_path / "run"
    reference = "none" if name == "simpo" else root / "reference"  # SimPO reads no reference (one line if given)
    cfg = dpo_cfg(root, out, "max_steps=1", f"dpo.beta={beta}", f"dpo.reference={reference}", *overrides,
                  data="four.jsonl")
    train(cfg, progress=False, task=DPOTask(cfg))
    got = read_metrics(out)[0]
    losses, rc, rr, nll_sum, chosen_tokens = [], [], [], 0.0, 0
    for row in dpo_pairs(4):
        prompt = tok(row["prompt"])["input_ids"]
        c = tok(row["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        r = tok(row["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pc, pr = hf_logps(models["policy"], prompt, c), hf_logps(models["policy"], prompt, r)
        qc, qr = hf_logps(models["reference"], prompt, c), hf_logps(models["reference"], prompt, r)
        nll_sum, chosen_tokens = nll_sum - pc, chosen_tokens + len(c)
        if name == "simpo":  # CPOTrainer: reference-free, on mean per-token log-probabilities, a target margin
            pc, pr = pc / len(c), pr / len(r)
            losses.append(per_pair(beta * (pc - pr - 0.5 / beta)))
            rc.append(beta * pc)
            rr.append(beta * pr)
            continue
        losses.append(per_pair(beta * ((pc - pr) - (qc - qr))))
        rc.append(beta * (pc - qc))  # summed log-ratios
        rr.append(beta * (pr - qr))
    # TRL's "sft" term (RPO): one token mean over every chosen token of the batch, added once.
    sft = sft_weight * nll_sum / chosen_tokens
    np.testing.assert_allclose(got["loss"], np.mean(losses) + sft, rtol=1e-5, err_msg="loss")
    np.testing.assert_allclose(got["rewards/chosen"], np.mean(rc), rtol=1e-5, err_msg="rewards/chosen")
    np.testing.assert_allclose(got["rewards/rejected"], np.mean(rr), rtol=1e-5, err_msg="rewards/rejected")
    np.testing.assert_allclose(got["rewards/margins"], np.mean(rc) - np.mean(rr), rtol=1e-4, err_msg="margins")
    assert got["rewards/accuracies"] == np.mean(np.asarray(rc) > np.asarray(rr)), "rewards/accuracies"


def test_step_one_logps_and_logits_are_trl_means(setup, tmp_path):
    """logps/* are means over pairs of summed answer log-probabilities; logits/* are TRL's mean logit over
    the vocabulary averaged over every answer token of the batch (token-weighted: answers of unequal
    length here, so a mean of per-pair means would differ), from transformers' logits. The step program is
    the sigmoid case's of test_step_one_metrics_equal_transformers (the same shapes and settings)."""
    root, tok, models = setup
    write_jsonl(root / "uneven.jsonl", UNEVEN_PAIRS)
    out = tmp_path / "run"
    cfg = dpo_cfg(root, out, "max_steps=1", f"dpo.reference={root / 'reference'}", data="uneven.jsonl")
    train(cfg, progress=False, task=DPOTask(cfg))
    got, policy = read_metrics(out)[0], models["policy"]
    logps = {"chosen": [], "rejected": []}
    logit_sums, lengths = {"chosen": 0.0, "rejected": 0.0}, {"chosen": [], "rejected": []}
    mean_of_means = []
    for row in UNEVEN_PAIRS:
        prompt = tok(row["prompt"])["input_ids"]
        for side in ("chosen", "rejected"):
            answer = tok(row[side], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            logits = hf_logits(policy, np.asarray([prompt + answer]))[0]
            at = slice(len(prompt) - 1, len(prompt) - 1 + len(answer))  # the positions predicting the answer
            logps[side].append(hf_logps(policy, prompt, answer))
            logit_sums[side] += float(logits[at].mean(-1).sum())
            lengths[side].append(len(answer))
            if side == "chosen":
                mean_of_means.append(float(logits[at].mean()))
    for side in ("chosen", "rejected"):
        assert len(set(lengths[side])) > 1  # answers of unequal length, where the two means differ
        np.testing.assert_allclose(got[f"logps/{side}"], np.mean(logps[side]), rtol=1e-5, err_msg=f"logps/{side}")
        np.testing.assert_allclose(got[f"logits/{side}"], logit_sums[side] / sum(lengths[side]), rtol=1e-5,
                                   err_msg=f"logits/{side}")
    # The mean of per-pair means is not what is logged.
    assert abs(np.mean(mean_of_means) - got["logits/chosen"]) > 1e-4 * abs(got["logits/chosen"])


def _assert_exact_at_start(rec: dict, mode: str) -> None:
    """Step 1 where the policy equals the reference (``mode``: how the reference is read): every reward is exactly 0
    (and so is TRL's accuracy, the share of pairs with chosen reward > rejected reward), the loss log 2."""
    rewards = {k: v for k, v in rec.items() if k.startswith("rewards/")}
    assert len(rewards) == 4 and set(rewards.values()) == {0.0}, (mode, rewards)
    assert abs(rec["loss"] - math.log(2)) < 1e-7, (mode, rec["loss"])


LORA_SGD = ("optimizer.name=sgd", "optimizer.learning_rate=0.5", *DPO_LORA)  # updates proportional to the gradients


@pytest.fixture(scope="module")
def lora_base_run(setup, tmp_path_factory):
    """2 LoRA steps (LORA_SGD) against the base as the reference (the default for LoRA), trained once, counting
    after each step the live arrays of the base's embed or lm_head shape. The live-reference trajectory that the
    precomputed reference must reproduce. Returns (run folder, counts)."""
    import pretrain.loop as trainer

    root, tok, _ = setup
    shapes = {(len(tok), SMALL["hidden_size"]), (SMALL["hidden_size"], len(tok))}  # embed, lm_head
    real, copies = trainer.make_step, []

    def spy(*args, **kwargs):
        step, evaluate = real(*args, **kwargs)

        def counted(*a, **kw):
            out = jax.block_until_ready(step(*a, **kw))
            gc.collect()
            copies.append(sum(tuple(x.shape) in shapes for x in jax.live_arrays()))
            return out

        return counted, evaluate

    out = tmp_path_factory.mktemp("dpo_lora") / "run"
    cfg = dpo_cfg(root, out, "max_steps=2", *LORA_SGD)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "make_step", spy)
        train(cfg, progress=False, task=DPOTask(cfg))
    return out, copies


@pytest.mark.slow
def test_lora_base_reference_starts_at_log2_with_one_copy_of_the_base(setup, lora_base_run, tmp_path, monkeypatch):
    """Step 1 is exact (:func:`_assert_exact_at_start`: the adapters add nothing yet, the policy is the base), yet
    the policy is still differentiated: the step equals one that reads the reference's own log-probabilities
    (which differ from the policy's in the last bits), up to that rounding. One copy of the base lives.
    Slow (about 10 s): two runs, each compiling its step."""
    root, _, _ = setup
    out, copies = lora_base_run
    recs = read_metrics(out)
    _assert_exact_at_start(recs[0], "lora base")
    assert recs[1]["loss"] != recs[0]["loss"]  # the adapters moved
    assert copies == [2, 2]  # the base's embed and lm_head, once each: no reference copy
    monkeypatch.setattr(DPOTask, "_at_reference", lambda self, lora, step: False)
    cfg = dpo_cfg(root, tmp_path / "plain", "max_steps=1", *LORA_SGD)
    train(cfg, progress=False, task=DPOTask(cfg))
    plain = read_metrics(tmp_path / "plain")[0]
    assert recs[0]["grad_norm"] > 0
    np.testing.assert_allclose(recs[0]["grad_norm"], plain["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(recs[0]["loss"], plain["loss"], rtol=1e-6)


def test_full_fine_tuning_needs_a_reference(setup, tmp_path, capsys):
    root, _, _ = setup
    args = ["train", f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}",
            f"data.path={root / 'four.jsonl'}", "batch_size=4", "max_steps=1", f"output_dir={tmp_path / 'o'}"]
    assert dpo_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a reference model" in err[0] and "dpo.reference" in err[0]


@pytest.mark.slow
def test_training_on_preferences_drives_accuracy_up(setup, tmp_path):
    """Full fine-tuning against a frozen copy of the start: the implicit reward learns the preference;
    eval logs the same metrics with an eval_ prefix, and `zoo plot` draws the rewards.
    Slow (about 70 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    root, _, _ = setup
    out = tmp_path / "run"
    cfg = dpo_cfg(root, out, "max_steps=30", "batch_size=8", "optimizer.learning_rate=3e-3",
               f"dpo.reference={root / 'policy'}", "data.eval_fraction=0.1", "eval_every=15")
    final = train(cfg, progress=False, task=DPOTask(cfg))
    recs = read_metrics(out)
    _assert_exact_at_start(recs[0], "full fine-tuning, a checkpoint of the start")
    assert np.mean([r["rewards/accuracies"] for r in recs[-5:]]) > 0.9
    assert recs[-1]["loss"] < 0.5 * math.log(2)
    evals = [r for r in recs if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1]["eval_rewards/accuracies"] > 0.9
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]
    assert zoo.checkpoints.format.read_meta(final)["training"]["method"] == "dpo"
    assert zoo_main(["plot", str(out)]) == 0 and (out / "curves.png").is_file()


@pytest.mark.slow
def test_full_fine_tuning_precomputed_step_one_is_exact(setup, tmp_path):
    """Step 1 of full fine-tuning against precomputed scores of the starting weights is exact (the other reference
    modes: on the runs of the tests above)."""
    root, _, _ = setup
    cfg = dpo_cfg(root, tmp_path / "run", "max_steps=1", "dpo.reference=precomputed", data="four.jsonl")
    train(cfg, progress=False, task=DPOTask(cfg))
    _assert_exact_at_start(read_metrics(tmp_path / "run")[0], "full fine-tuning precomputed")


def _sgd(root):
    """Full fine-tuning with plain SGD (updates proportional to the gradients) against the checkpoint reference."""
    return ["max_steps=3", "batch_size=8", "optimizer.name=sgd", "optimizer.learning_rate=0.5",
            f"dpo.reference={root / 'reference'}"]


@pytest.fixture(scope="module")
def sgd_run(setup, tmp_path_factory):
    """The reference trajectory, trained once (:func:`_sgd`, one device, no accumulation): grad_accum 2 and the
    8-device meshes must follow it. Returns (run folder, final checkpoint)."""
    root, _, _ = setup
    out = tmp_path_factory.mktemp("dpo_sgd") / "run"
    cfg = dpo_cfg(root, out, *_sgd(root))
    return out, train(cfg, progress=False, task=DPOTask(cfg))


@pytest.mark.slow
def test_grad_accum_2_equals_one_batch_twice_as_large(setup, sgd_run, tmp_path):
    """Slow (about 93 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    root, _, _ = setup
    a_out, fa = sgd_run  # grad_accum 1
    b = dpo_cfg(root, tmp_path / "b", *_sgd(root), "grad_accum=2")
    fb = train(b, progress=False, task=DPOTask(b))
    ma, mb = read_metrics(a_out), read_metrics(tmp_path / "b")
    # Not logits/*: TRL's DPOTrainer logs them per micro-batch and averages, so they depend on grad_accum
    # (tests/test_dpo_trl_exact.py checks that definition).
    for k in ("loss", "rewards/chosen", "rewards/accuracies"):
        np.testing.assert_allclose([r[k] for r in mb], [r[k] for r in ma], rtol=1e-5, atol=1e-7, err_msg=k)
    for x, y in zip(jax.tree.leaves(zoo.load_params(fa)), jax.tree.leaves(zoo.load_params(fb))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


@pytest.fixture(scope="module")
def forks():
    """A fork server (tests/processes.py) that imports `dpo train`'s modules once, for this module's two runs that
    need a process of their own (killed with SIGKILL; on 8 simulated devices)."""
    with ForkServer(imports=(*TRAIN_IMPORTS, "dpo.cli", "dpo.task"), cwd=REPO, env=os.environ.copy()) as server:
        yield server


@pytest.mark.slow
def test_precomputed_reference_equals_live_is_cached_and_survives_kill_9(setup, lora_base_run, forks, tmp_path,
                                                                         monkeypatch, capsys):
    """LoRA against precomputed reference log-probabilities (grad_accum 2, LORA_SGD), three runs of one config:
    - uninterrupted: the reference pass runs once (a cache miss, one .npz, keyed by the params dtype and the chat
      template too), step 1 is exact (:func:`_assert_exact_at_start`), and its first two steps follow the live base
      reference's (lora_base_run, grad_accum 1) within 1e-5;
    - `dpo train` SIGKILLed after its step-2 checkpoint (a process of its own);
    - rerun for step 3: it reads the killed run's cache, never running the reference pass, and ends where the
      uninterrupted run does, bit for bit (the reference log-probabilities ride in the checkpointed data lanes).
    Slow (slow lane): whole training runs through the loop, one in a forked process, each compiling."""
    import dpo.task

    root, _, _ = setup
    common = ["max_steps=3", "checkpoint.every=2", "grad_accum=2", "dpo.reference=precomputed", *LORA_SGD]
    real, calls = dpo.task.compute_reference_logps, []
    real_cached, keyed = dpo.task.cached_reference_logps, []

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    def spy_cached(*a, **k):  # the cache is keyed by the params dtype and the chat template too
        keyed.append(a[6:])
        return real_cached(*a, **k)

    monkeypatch.setattr(dpo.task, "compute_reference_logps", spy)
    monkeypatch.setattr(dpo.task, "cached_reference_logps", spy_cached)
    capsys.readouterr()
    cfg = dpo_cfg(root, tmp_path / "full", *common)
    full = train(cfg, progress=False, task=DPOTask(cfg))
    err = capsys.readouterr().err
    assert calls == [1] and "cache miss, computed " in err and " pairs with " in err
    assert len(list((tmp_path / "full" / "reference_logps").glob("*.npz"))) == 1
    assert keyed == [("float32", {"source": None, "kwargs": {}, "date": "2024-07-26"})]
    live, ma = read_metrics(lora_base_run[0]), read_metrics(tmp_path / "full")
    _assert_exact_at_start(ma[0], "lora precomputed")
    for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
        np.testing.assert_allclose([r[k] for r in ma[:2]], [r[k] for r in live], rtol=1e-5, atol=1e-7, err_msg=k)

    out = tmp_path / "killed"
    args = [f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}", f"data.path={root / 'prefs.jsonl'}",
            "data.seq_len=32", "batch_size=4", "schedule.name=constant", "log_every=1", f"output_dir={out}", *common]
    code = forks.run({"script": kill_after_checkpoint("dpo.cli"), "argv": ["2", "train", *args],
                      "err": str(tmp_path / "killed.err")})
    assert code == -signal.SIGKILL, (tmp_path / "killed.err").read_text()[-2000:]
    assert (out / "checkpoints" / "2").is_dir() and not (out / "checkpoints" / "3").exists()
    assert not (out / "final").exists()
    capsys.readouterr()
    resumed = train(dpo_cfg(root, out, *common), progress=False, task=DPOTask(dpo_cfg(root, out, *common)))
    assert calls == [1] and "cache hit" in capsys.readouterr().err
    from zoo.checkpoints.adapter import load_adapters

    a = load_adapters(full, zoo.checkpoints.format.read_meta(full))
    b = load_adapters(resumed, zoo.checkpoints.format.read_meta(resumed))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    mb = read_metrics(out)
    assert len(mb) == 3 and [r["loss"] for r in mb] == [r["loss"] for r in ma]


MESH_SCRIPT = r"""
import json, sys
import jax
from dpo.config import DPOConfig
from pretrain.config import load_config
from pretrain.loop import train
from dpo.task import DPOTask
assert len(jax.devices()) == 8
base = json.loads(sys.argv[1])
out = {}
for name, mesh in [("fsdp8", ["mesh.data=1", "mesh.fsdp=8"]), ("d2f2t2", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])]:
    d = sys.argv[2] + "/" + name
    cfg = load_config(None, base + mesh + [f"output_dir={d}"], DPOConfig)
    train(cfg, progress=False, task=DPOTask(cfg))
    out[name] = [json.loads(l)["loss"] for l in open(d + "/metrics.jsonl")]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_8_devices_match_one_device(setup, sgd_run, forks, tmp_path):
    """Full fine-tuning with a checkpoint reference (sharded like the policy) on 8 devices: fsdp, and
    data x fsdp x tensor, follow the one-device losses (their first two steps: the second after an update).
    Slow (slow lane): a process of its own (forked) on 8 simulated devices trains DPO with its own compilations."""
    root, _, _ = setup
    ref = [r["loss"] for r in read_metrics(sgd_run[0])]
    base = [f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}",
            f"data.path={root / 'prefs.jsonl'}", "data.seq_len=32", "schedule.name=constant", "log_every=1",
            "checkpoint.every=100", *_sgd(root), "max_steps=2"]
    env = {k: devices_env(8)[k] for k in ("XLA_FLAGS", "JAX_PLATFORMS")}
    said = {"out": str(tmp_path / "mesh.out"), "err": str(tmp_path / "mesh.err")}
    code = forks.run({"script": MESH_SCRIPT, "argv": [json.dumps(base), str(tmp_path)], "env": env, **said}, 900)
    assert code == 0, (tmp_path / "mesh.err").read_text()[-3000:]
    got = json.loads((tmp_path / "mesh.out").read_text().strip().splitlines()[-1])
    assert ref[1] != ref[0]  # the policy moves, so equal losses mean equal updates
    for name, losses in got.items():
        np.testing.assert_allclose(losses, ref[:2], rtol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_rows_score_each_answer_as_its_own_sequence(setup, lora):
    """A row holding the prompt once (its answers reading it as a shared prefix) gives every answer token the
    log-probability the plain two-copy layout gives it (1e-5), with and without LoRA adapters.
    Slow (about 51 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    import jax.numpy as jnp

    from prefs.pairs import CHOSEN, REJECTED, normalize_pair, pair_document, tokenize_pair
    from zoo.data.batching import padded, to_model_batch
    from zoo.lora.params import LoraConfig, init_lora, lora_scale
    from zoo.lora.weights import Weights
    from zoo.model.logps import batch_logps

    root, tok, _ = setup
    cfg = zoo.read_config(root / "policy")
    params = zoo.load_params(root / "policy")
    weights: Any = params
    if lora:
        lc = LoraConfig(rank=4)
        ad = jax.jit(lambda key: init_lora(cfg, lc, key))(jax.random.key(0))  # one program, not one per op
        rng = np.random.RandomState(1)  # adapters that add something (NumPy: no compilation per shape)
        weights = Weights(params, jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + 0.1 * rng.standard_normal(
            a.shape).astype(np.float32)), ad), lora_scale(lc))
    pairs = [tokenize_pair(normalize_pair(r), tok) for r in dpo_pairs(3) + [
        {"prompt": "a longer prompt with several words in it:", "chosen": " yes", "rejected": " no, not at all"}]]
    logps_of = jax.jit(lambda w, b: batch_logps(cfg, w, b)[0])  # one program per layout, not one per eager op
    sums = {}
    for shared in (True, False):
        docs = [padded(pair_document(t, shared), 64) for t in pairs]  # both layouts of every pair whole
        b = to_model_batch({k: np.stack([d[k] for d in docs]) for k in docs[0]})
        assert ("prefix_ids" in b) == shared
        logp = np.asarray(logps_of(weights, {k: jnp.asarray(v) for k, v in b.items()}))
        w, seg = b["weights"], b["segment_ids"]
        sums[shared] = [(logp * w * (seg == s)).sum(-1) for s in (CHOSEN, REJECTED)]
        counts = [(w * (seg == s)).sum(-1) for s in (CHOSEN, REJECTED)]
        np.testing.assert_array_equal(counts, [[len(t.chosen) for t in pairs], [len(t.rejected) for t in pairs]])
    np.testing.assert_allclose(sums[True], sums[False], rtol=1e-5)


@pytest.mark.slow
def test_sliding_window_models_keep_the_two_copy_layout(setup, tmp_path):
    """Sliding windows count row indices, which a shared prompt would stretch: such models get the plain
    layout (as `dpo.share_prompt: false` asks), and the model refuses prefix ids outright."""
    import dataclasses

    import jax.numpy as jnp

    from pretrain.setup import RUN, TokenIds
    from pretrain.task import RunContext
    from zoo.lora.params import LoraConfig
    from zoo.model.decoder import forward

    root, _, _ = setup
    cfg = dpo_cfg(root, tmp_path / "run", "lora.rank=4", "max_steps=1")
    mcfg = zoo.read_config(root / "policy")
    sliding = dataclasses.replace(mcfg, sliding_window=8, layer_types=("sliding", "full"))
    off = dpo_cfg(root, tmp_path / "run", "lora.rank=4", "max_steps=1", "dpo.share_prompt=false")
    for c, model, shared in ((cfg, mcfg, True), (cfg, sliding, False), (off, mcfg, False)):
        task = DPOTask(c)
        ctx = RunContext(c, model, None, LoraConfig(rank=4), {}, RUN, TokenIds.stand_in(model))
        assert task.prepare(ctx) is None  # reference: base needs nothing prepared
        assert task.shared_prompt is shared
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="sliding-window"):
        forward(sliding, zoo.load_params(root / "policy"), tokens, prefix_ids=jnp.zeros((1, 8), jnp.int32))


def test_demo_pair_scores_equal_transformers_log_probabilities(setup):
    """The main job's held-out pair scores (demo.job.pair_logps, the DPO row layout with a shared prompt)
    are each answer's summed token log-probabilities given its prompt, as transformers computes them."""
    from demo.job import pair_logps
    from prefs.pairs import normalize_pair, tokenize_pair

    root, tok, models = setup
    pairs = dpo_pairs(5, seed=3)
    chosen, rejected = pair_logps(root / "policy", tok, pairs, seq_len=32, rows=4)
    for i, row in enumerate(pairs):
        t = tokenize_pair(normalize_pair(row), tok)
        for answer, got in ((t.chosen, chosen[i]), (t.rejected, rejected[i])):
            ids = np.concatenate([t.prompt, answer])[None]
            logp = log_softmax(hf_logits(models["policy"], ids))[0]
            want = sum(logp[len(t.prompt) - 1 + j, a] for j, a in enumerate(answer))
            np.testing.assert_allclose(got, want, rtol=1e-5)
