"""TRL 1.16's newer GRPO losses (cispo, sapo, luspo, vespo) against TRL's own code: ``GRPOTrainer._compute_loss``
run on fixed log-probabilities (ratios clipped on both sides, at both importance levels, with and without a KL
term), its loss, its gradient with respect to the policy's log-probabilities and its logged metrics, against
grpo/losses.py's terms and (sum, count) normalization; and one SGD step of `grpo train` against one of TRL's
GRPOTrainer itself."""

from __future__ import annotations

import itertools
import json
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.losses import LossKnobs, loss_sum_count, masked_mean_sums, token_terms
from tests.grpo_loss_batch import EPS_LOW, LOGP, MASK, OLD, REF, T

NEW = ("cispo", "sapo", "luspo", "vespo")
CISPO_EPS_HIGH = 1.25  # cispo's upper clip of the ratio itself: some tokens above it, most below
KNOBS = dict(sapo_temperature_pos=1.3, sapo_temperature_neg=0.9, vespo_k_pos=2.5, vespo_lambda_pos=2.0,
             vespo_k_neg=1.5, vespo_lambda_neg=3.5)  # not the defaults: a swapped pair shows
ADV = np.array([0.0, 0.0, 0.0, 0.0, 1.2, -1.1, 0.3, 0.9, -0.4, -1.4, 1.1, 0.2], np.float32)


class _Accel:
    """The accelerator TRL's loss calls, one process: gather and reduce are the identity."""

    num_processes = 1

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def trl_loss(loss_type: str, level: str, beta: float, logp: np.ndarray, eps_high: float,
             is_ratio: np.ndarray | None = None):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on these tensors (one process, gradient accumulation 1, no entropy
    bonus; ``is_ratio``: vLLM's importance-sampling correction, the weights given): (loss, d loss / d logp,
    metrics)."""
    import torch
    from trl import GRPOTrainer

    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    args = types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1, **KNOBS)
    fake = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=args, loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=eps_high, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=True,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=_Accel(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None))
    b = logp.shape[0]
    inputs = {"prompt_ids": torch.zeros((b, 1), dtype=torch.long), "prompt_mask": torch.ones((b, 1)),
              "completion_ids": torch.zeros((b, T), dtype=torch.long), "completion_mask": mask,
              "advantages": torch.tensor(ADV, dtype=torch.float64),
              "old_per_token_logps": torch.tensor(OLD, dtype=torch.float64),
              "ref_per_token_logps": torch.tensor(REF, dtype=torch.float64), "num_items_in_batch": mask.sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = torch.tensor(is_ratio, dtype=torch.float64)
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
    return float(loss), lp.grad.numpy(), metrics


def ours(loss_type: str, level: str, beta: float, logp: np.ndarray, eps_high: float,
         is_ratio: np.ndarray | None = None):
    """grpo/losses.py's loss of the batch (one micro-batch), its gradient and the metrics TRL names."""
    knobs = LossKnobs(loss_type=loss_type, **KNOBS)

    def loss(lp):
        terms = token_terms(lp, jnp.asarray(OLD), jnp.asarray(REF), jnp.asarray(ADV), jnp.asarray(MASK), EPS_LOW,
                            eps_high, beta, level, knobs, None if is_ratio is None else jnp.asarray(is_ratio))
        s, n = loss_sum_count(terms["loss"], jnp.asarray(MASK), loss_type, T)
        return s / jnp.maximum(n, 1.0), terms

    (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    m = jnp.asarray(MASK)
    per_seq = lambda x: masked_mean_sums(x[:, :1], jnp.ones_like(x[:, :1]))  # noqa: E731
    clip_of = per_seq if level == "sequence" else (lambda x: masked_mean_sums(x, m))
    sums = {"kl": masked_mean_sums(terms["kl"], m)} if beta else {}
    names = {"low_clip": "clip_ratio/low_mean", "high_clip": "clip_ratio/high_mean",
             "region_clip": "clip_ratio/region_mean", "cispo_clip": "cispo_clip_ratio"}
    sums |= {names[k]: clip_of(v) for k, v in terms.items() if k in names}
    if "phi" in terms:
        sums["vespo/phi_seq_mean"] = per_seq(terms["phi"])
    return float(value), np.asarray(grad), {k: float(s / max(float(n), 1.0)) for k, (s, n) in sums.items()}


CASES = list(itertools.product(NEW, ("token", "sequence"), (0.0, 0.04)))


@pytest.mark.slow  # the fast lane's budget: torch and TRL's trainer module imported, 16 gradient programs
@pytest.mark.parametrize("loss_type,level,beta", CASES)
def test_new_losses_equal_trls_compute_loss(loss_type, level, beta):
    """Loss, gradient and metrics within 1e-5 of TRL's float64 code; the data exercises what each loss type
    branches on (a ratio above cispo's clip, both signs of advantage, a gamma weight neither 0 nor 1)."""
    # VESPO's ratio is the completion's summed one: the batch's shifts, over up to 7 tokens, would land in the
    # gamma weight's tail (every weight 0, nothing compared), so a quarter of them
    logp = LOGP if loss_type != "vespo" else (OLD + 0.25 * (LOGP - OLD)).astype(np.float32)
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else 0.28
    want, want_grad, want_m = trl_loss(loss_type, level, beta, logp, eps_high)
    got, grad, got_m = ours(loss_type, level, beta, logp, eps_high)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    on = MASK.astype(bool)
    np.testing.assert_allclose(grad[on], want_grad[on], rtol=1e-5, atol=1e-6)
    assert not grad[~on].any()  # padding trains nothing
    # TRL's names, less its entropy (the stub's zeros; ours is the trainer's, grpo/advantages.py) and the clip
    # ratios' per-sequence min and max (not logged here for any loss type)
    skip = {"entropy", "clip_ratio/low_min", "clip_ratio/high_max"}
    assert set(got_m) == set(want_m) - skip, (sorted(got_m), sorted(want_m))
    for k in got_m:
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
    if loss_type == "cispo":
        assert 0 < got_m["cispo_clip_ratio"] < 1
    if loss_type == "vespo":
        assert got_m["vespo/phi_seq_mean"] > 0.05 and abs(got_m["vespo/phi_seq_mean"] - 1) > 0.05


# ---- one SGD step against TRL's GRPOTrainer ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """tests/test_grpo.py's tiny word-level model, prompts and rewards."""
    from tests.grpo_fixtures import build_setup

    return build_setup(tmp_path_factory.mktemp("grpo"))


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", NEW)
def test_new_loss_step_one_equals_trl_grpo_trainer(setup, tmp_path, monkeypatch, loss_type):
    """One plain SGD step of `grpo train` against one step of TRL 1.16's own GRPOTrainer on the same transformers
    model, both sides given the same completions (tests/test_grpo.py's fixed ones, ending with EOS after 1 to 4
    tokens), two prompts of four completions in two micro-batches, the loss type's own knobs set off their
    defaults (cispo's clip below 1, so that it weighs every token at step 1, where the ratios are 1): loss,
    grad_norm, reward and every weight's change within 1e-5. The ratios away from 1:
    test_new_losses_equal_trls_compute_loss."""
    from trl import GRPOConfig, GRPOTrainer

    import eval.rollout
    from grpo.task import GRPOTask
    from pretrain.loop import train
    from tests.grpo_fixtures import fixed_completions, read_metrics, run_cfg, trl_fixed_step
    from tests.trl_oracles import SGD_STEP_ONE, assert_same_change, assert_same_metrics, exported_change

    g, vocab = 4, 18
    completions, fixed_sampler, score = fixed_completions(tmp_path, g, vocab)
    prompts = [{"prompt": "red blue green"}, {"prompt": "gold pink gray"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))

    class FixedCompletions(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kw):
            return completions(prompt_ids), None  # no sampler log-probabilities

    knobs = {"cispo": {"epsilon_high": 0.9}, "sapo": {k: v for k, v in KNOBS.items() if k.startswith("sapo")},
             "luspo": {"importance_sampling_level": "sequence"},
             "vespo": {k: v for k, v in KNOBS.items() if k.startswith("vespo")}}[loss_type]
    want, trl_change = trl_fixed_step(FixedCompletions, GRPOConfig, setup, tmp_path / "trl", score, prompts, g,
                                      loss_type=loss_type, **knobs)
    monkeypatch.setattr(eval.rollout, "sample_group_completions", fixed_sampler)
    cfg = run_cfg(setup, tmp_path / "ours", *SGD_STEP_ONE, "batch_size=8", "grad_accum=2",
               "grpo.max_completion_length=5", f"grpo.loss_type={loss_type}", f"data.path={tmp_path / 'p.jsonl'}",
               f"grpo.rewards=[{tmp_path / 'score.py'}:id_score]", "data.seq_len=3",
               *(f"grpo.{k}={v}" for k, v in knobs.items()))
    train(cfg, task=GRPOTask(cfg), progress=False)
    # The loss types' own metrics are token means: TRL's is the mean of its micro-batches' (which changes with the
    # micro-batching), ours the batch's; test_new_losses_equal_trls_compute_loss checks them on one batch.
    assert_same_metrics(read_metrics(tmp_path / "ours")[0], want, ("loss", "grad_norm", "reward"))
    assert_same_change(exported_change(tmp_path / "ours" / "final", setup / "hf", tmp_path / "exp"), trl_change)


# ---- the sampler correction (TRL's vllm_importance_sampling_correction) ------------------------------------------

SAMPLER = (OLD + np.random.RandomState(3).normal(0, 0.4, OLD.shape)).astype(np.float32)  # a sampler off by ~0.4
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
CLIPS = {"token_truncate": (0.5, 1.5), "token_mask": (0.6, 1.6), "sequence_truncate": (None, 2.0),
         "sequence_mask": (0.3, 3.0)}


def trl_sampler_ratio(mode: str, clip_min, clip_max) -> np.ndarray:
    """TRL 1.16 ``GRPOTrainer._generate_and_score_completions``' vllm_importance_sampling_ratio, transcribed
    (float64): exp of (old - sampler) * mask per token, or its row sum; truncated (clamp) or masked (0 outside)."""
    diff = np.nan_to_num((OLD.astype(np.float64) - SAMPLER) * MASK, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    r = np.exp(diff)
    if mode.endswith("truncate"):
        return np.clip(r, -np.inf if clip_min is None else clip_min, np.inf if clip_max is None else clip_max)
    lo, hi = -np.inf if clip_min is None else clip_min, np.inf if clip_max is None else clip_max
    return np.where((r < lo) | (r > hi), 0.0, r)


@pytest.mark.parametrize("mode", MODES)
def test_sampler_ratios_are_trls(mode):
    """grpo/losses.py's sampler_ratio against TRL's, each mode with bounds that bite (some weights clipped or 0)."""
    from grpo.losses import sampler_ratio

    lo, hi = CLIPS[mode]
    got = np.asarray(sampler_ratio(jnp.asarray(OLD), jnp.asarray(SAMPLER), jnp.asarray(MASK), mode, lo, hi))
    want = trl_sampler_ratio(mode, lo, hi)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    raw = trl_sampler_ratio(mode, None, None)
    on = MASK > 0 if raw.shape[1] > 1 else MASK.sum(1, keepdims=True) > 0
    moved = (want != raw)[on]
    assert moved.any() and not moved.all()  # the bounds clipped or masked some weights, not all


@pytest.mark.slow  # as test_new_losses_equal_trls_compute_loss
@pytest.mark.parametrize("loss_type,mode", [("dapo", "sequence_mask"), ("grpo", "token_truncate"),
                                            ("cispo", "token_mask"), ("sapo", "sequence_truncate"),
                                            ("luspo", "token_truncate"), ("vespo", "token_truncate")])
def test_sampler_correction_in_the_loss_is_trls(loss_type, mode):
    """The weights applied in the loss as TRL's ``_compute_loss`` applies them (a factor of each token's loss
    before the KL; vespo: inside its gamma weight), with a KL term: loss, gradient and metrics within 1e-5."""
    lo, hi = CLIPS[mode]
    ratio = trl_sampler_ratio(mode, lo, hi)
    logp = LOGP if loss_type != "vespo" else (OLD + 0.25 * (LOGP - OLD)).astype(np.float32)
    eps_high = CISPO_EPS_HIGH if loss_type == "cispo" else 0.28
    want, want_grad, want_m = trl_loss(loss_type, "token", 0.04, logp, eps_high, ratio)
    got, grad, got_m = ours(loss_type, "token", 0.04, logp, eps_high, ratio.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad[MASK > 0], want_grad[MASK > 0], rtol=1e-5, atol=1e-6)
    plain = ours(loss_type, "token", 0.04, logp, eps_high)[0]
    assert abs(plain - got) > 1e-3  # the correction changed the loss
    for k in got_m:
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_sampler_correction_weighs_the_update(setup, tmp_path, monkeypatch):
    """`grpo train` with grpo.importance_sampling_correction, the sampler's log-probabilities all 0 (the fixed
    completions' stand-in): in sequence_mask mode with clip_min 0.5 every completion's weight (exp of its summed
    log-probability, far below 0.5) is 0, so one SGD step moves nothing, and the logged ratios are 0; with
    token_truncate clipped to [1, 1] every weight is 1 and the step is the uncorrected one, bit for bit. TRL's
    metric names."""
    import eval.rollout
    import zoo
    from grpo.task import GRPOTask
    from pretrain.loop import train
    from tests.grpo_fixtures import fixed_completions, read_metrics, run_cfg
    from tests.trl_oracles import SGD_STEP_ONE

    _, fixed_sampler, _ = fixed_completions(tmp_path, 4, 18)
    monkeypatch.setattr(eval.rollout, "sample_group_completions", fixed_sampler)
    base = (*SGD_STEP_ONE, "batch_size=8", "grad_accum=2", "grpo.max_completion_length=5", "data.seq_len=3",
            f"grpo.rewards=[{tmp_path / 'score.py'}:id_score]")
    runs = {"plain": (), "masked": ("grpo.importance_sampling_correction=true", "grpo.importance_sampling_clip_min=0.5"),
            "ones": ("grpo.importance_sampling_correction=true", "grpo.importance_sampling_mode=token_truncate",
                     "grpo.importance_sampling_clip_min=1", "grpo.importance_sampling_clip_max=1")}
    for name, extra in runs.items():
        cfg = run_cfg(setup, tmp_path / name, *base, *extra)
        train(cfg, task=GRPOTask(cfg), progress=False)
    m = {name: read_metrics(tmp_path / name)[0] for name in runs}
    assert "sampling/importance_sampling_ratio/mean" not in m["plain"]
    assert m["masked"]["sampling/importance_sampling_ratio/max"] == 0.0 and m["masked"]["loss"] == 0.0
    gap = "sampling/sampling_logp_difference/"  # the sampler's 0s against log-probabilities below 0
    assert 0 < m["masked"][gap + "mean"] < m["masked"][gap + "max"]
    assert m["ones"]["sampling/importance_sampling_ratio/min"] == m["ones"]["sampling/importance_sampling_ratio/max"] == 1
    assert m["ones"]["loss"] == m["plain"]["loss"] and m["ones"]["grad_norm"] == m["plain"]["grad_norm"] > 0
    start = zoo.load(setup / "zoo", dtype=np.float32).param_dict()
    after = {name: zoo.load(tmp_path / name / "final", dtype=np.float32).param_dict() for name in runs}
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(after["masked"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for b, c in zip(*(jax.tree.leaves(after[x]) for x in ("plain", "ones"))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
