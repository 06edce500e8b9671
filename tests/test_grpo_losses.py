"""grpo/losses.py against a NumPy float64 reference written from TRL 1.16's GRPOTrainer formulas
(``_generate_and_score_completions``' advantages, ``_compute_loss``' loss, KL and clip metrics), its
micro-batch decomposition, and the REINFORCE gradient it reduces to at num_iterations 1."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.losses import advantages, loss_sum_count, masked_mean_sums, token_terms
from tests.grpo_loss_batch import EPS_HIGH, EPS_LOW, LOGP, MASK, OLD, REF, REWARDS, B, G, T

TOL = dict(rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# The reference: whole batch at once, float64, TRL's formulas transcribed.

def ref_advantages(rewards, group, scale):
    """TRL: mean per group; unbiased std per group ('group', 'none') or of the batch; (r - mean) / (std + 1e-4)
    unless 'none'; zero std by torch.isclose's defaults (|std| <= 1e-8)."""
    r = np.asarray(rewards, np.float64)
    mean = np.repeat(r.reshape(-1, group).mean(1), group)
    if scale == "batch":
        std = np.full_like(r, r.std(ddof=1))
    else:
        std = np.repeat(r.reshape(-1, group).std(1, ddof=1), group)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return adv, std, np.isclose(std, 0.0)  # numpy's defaults are torch's: rtol 1e-5, atol 1e-8


def ref_loss_and_metrics(logp, old, ref, adv, mask, beta, level, loss_type, max_len):
    """TRL's _compute_loss on one (local) batch, gradient accumulation 1: the loss and the logged
    kl / clip_ratio means (global_masked_mean: per token, or per sequence when the ratio is (B, 1))."""
    logp, old, ref, mask = (np.asarray(x, np.float64) for x in (logp, old, ref, mask))
    a = np.asarray(adv, np.float64)[:, None]
    log_ratio = logp - old
    if level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
    coef_1 = np.exp(liw)
    coef_2 = np.clip(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token_loss = -np.minimum(coef_1 * a, coef_2 * a)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_len)
    elif loss_type == "dapo":
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)  # num_items_in_batch: the batch's tokens

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / max(x.shape[0], 1)
        return (x * mask).sum() / max(mask.sum(), 1.0)

    low = ((coef_1 < 1 - EPS_LOW) & (a < 0)).astype(np.float64)
    high = ((coef_1 > 1 + EPS_HIGH) & (a > 0)).astype(np.float64)
    metrics = {"kl": global_masked_mean(kl), "low_clip": global_masked_mean(low),
               "high_clip": global_masked_mean(high), "region_clip": global_masked_mean(np.maximum(low, high))}
    per_token = {"loss": np.broadcast_to(per_token_loss, logp.shape), "low_clip": np.broadcast_to(low, logp.shape),
                 "high_clip": np.broadcast_to(high, logp.shape)}
    return loss, metrics, per_token


LOSS_TYPES, SCALES, LEVELS, BETAS = ("grpo", "dr_grpo", "dapo", "bnpo"), ("group", "batch", "none"), \
    ("token", "sequence"), (0.0, 0.04)
SPLITS = (2, 4)  # micro-batches of 6 and 3 rows


def combine(pairs):
    """What the trainer does with the micro-batches' (sum, count) pairs: sum / max(count, 1)."""
    return sum(p[0] for p in pairs) / jnp.maximum(sum(p[1] for p in pairs), 1.0)


@jax.jit
def all_advantages(rewards):
    """advantages() at every scale."""
    return {scale: dict(zip(("adv", "std", "zero_std"), advantages(rewards, G, scale))) for scale in SCALES}


@jax.jit
def everything(adv, logp, old, ref, mask):
    """Every (level, beta) in ONE compiled program, run once per scale's advantages (the suite compiles it
    once; each test reads its part): the token terms, the loss of each loss type, the kl and clip metrics."""
    out = {}
    for level, beta in itertools.product(LEVELS, BETAS):
        key = f"{level}/{beta}"
        terms = token_terms(logp, old, ref, adv, mask, EPS_LOW, EPS_HIGH, beta, level)
        out[f"terms/{key}"] = terms
        for loss_type in LOSS_TYPES:
            out[f"loss/{loss_type}/{key}"] = combine([loss_sum_count(terms["loss"], mask, loss_type, T)])
        out[f"kl/{key}"] = combine([masked_mean_sums(terms["kl"], mask)])
        for k in ("low_clip", "high_clip", "region_clip"):
            # TRL logs sequence-level clip ratios per sequence (the ratio is (B, 1)): the first column, all rows
            x, m = (terms[k][:, :1], jnp.ones((B, 1))) if level == "sequence" else (terms[k], mask)
            out[f"{k}/{key}"] = combine([masked_mean_sums(x, m)])
    return out


@jax.jit
def micro_batched(loss, kl, mask):
    """Each loss type's loss and the kl from the (sum, count) pairs of 2 and 4 equal micro-batches."""
    out = {}
    for pieces in SPLITS:
        parts = np.array_split(np.arange(B), pieces)
        for loss_type in LOSS_TYPES:
            out[f"loss/{loss_type}/{pieces}"] = combine([loss_sum_count(loss[r], mask[r], loss_type, T)
                                                          for r in parts])
        out[f"kl/{pieces}"] = combine([masked_mean_sums(kl[r], mask[r]) for r in parts])
    return out


@functools.cache
def results():
    """On the fixed batch, as NumPy arrays: {"adv": all_advantages(), scale: everything() of its advantages}."""
    adv = jax.tree.map(np.asarray, all_advantages(REWARDS))
    return {"adv": adv, **{scale: jax.tree.map(np.asarray, everything(adv[scale]["adv"], LOGP, OLD, REF, MASK))
                           for scale in SCALES}}


# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", SCALES)
def test_advantages_match_trl(scale):
    got = results()["adv"][scale]
    want_adv, want_std, want_zero = ref_advantages(REWARDS, G, scale)
    np.testing.assert_allclose(got["adv"], want_adv, **TOL)
    np.testing.assert_allclose(got["std"], want_std, **TOL)
    np.testing.assert_array_equal(got["zero_std"], want_zero)
    assert got["adv"].dtype == np.float32 and got["adv"].shape == (B,)
    if scale != "batch":  # the tied group is flagged and gets exactly 0 (not float32 rounding / 1e-4)
        assert got["zero_std"][:G].all() and not got["zero_std"][G:].any()
        assert (got["adv"][:G] == 0).all()


def test_unscorable_rewards_are_left_out_and_get_zero_advantage():
    """TRL marks a completion no reward function scored NaN: nanmean / nanstd skip it, its advantage is 0;
    an all-NaN group has a NaN std (not flagged as zero) and zero advantages."""
    r = REWARDS.copy()
    r[5] = np.nan
    r[8:12] = np.nan
    out = jax.tree.map(np.asarray, all_advantages(r))  # the same shapes: no new compilation
    adv, std, zero = (out["group"][k] for k in ("adv", "std", "zero_std"))
    g1 = r[4:8][~np.isnan(r[4:8])].astype(np.float64)
    want = (g1 - g1.mean()) / (g1.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(adv[[4, 6, 7]], want, **TOL)
    assert adv[5] == 0 and (adv[8:] == 0).all() and np.isnan(std[8:]).all() and not zero[8:].any()
    adv_b, std_b = out["batch"]["adv"], out["batch"]["std"]
    np.testing.assert_allclose(std_b, np.nanstd(r.astype(np.float64), ddof=1), **TOL)
    assert np.isfinite(adv_b).all() and adv_b[5] == 0


@pytest.mark.parametrize("loss_type,scale,level,beta", list(itertools.product(LOSS_TYPES, SCALES, LEVELS, BETAS)))
def test_loss_kl_and_clip_metrics_match_trl(loss_type, scale, level, beta):
    key = f"{level}/{beta}"
    got = results()[scale]
    terms = got[f"terms/{key}"]
    want_adv = ref_advantages(REWARDS, G, scale)[0]
    want, want_metrics, want_tok = ref_loss_and_metrics(LOGP, OLD, REF, want_adv, MASK, beta, level, loss_type, T)
    np.testing.assert_allclose(got[f"loss/{loss_type}/{key}"], want, **TOL)

    on = MASK.astype(bool)  # the per-token arrays on the completion tokens (padding is the caller's to mask)
    for k in ("loss", "low_clip", "high_clip"):
        np.testing.assert_allclose(terms[k][on], want_tok[k][on], **TOL, err_msg=k)
    assert all(terms[k].shape == (B, T) and terms[k].dtype == np.float32 for k in terms)
    # both bounds are exercised by this data, at both levels
    assert want_tok["low_clip"][on].any() and want_tok["high_clip"][on].any()

    for k in ("low_clip", "high_clip", "region_clip"):
        np.testing.assert_allclose(got[f"{k}/{key}"], want_metrics[k], **TOL, err_msg=k)
    if beta:
        np.testing.assert_allclose(got[f"kl/{key}"], want_metrics["kl"], **TOL)
        assert got[f"kl/{key}"] > 0
    else:
        assert not terms["kl"].any()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_micro_batches_combine_to_the_whole_batch_loss(loss_type, level):
    """2 and 4 micro-batches (advantages from the whole batch, as TRL scores the generation batch): the summed
    (sum, count) pairs give TRL's whole-batch loss for grpo, dr_grpo, dapo; for bnpo the mean of the
    micro-batches' token means (TRL normalizes bnpo per local batch); the metrics' pairs the global token mean."""
    terms = results()["group"][f"terms/{level}/0.04"]
    got = jax.tree.map(np.asarray, micro_batched(terms["loss"], terms["kl"], MASK))  # one compilation, 2 levels
    want_adv = ref_advantages(REWARDS, G, "group")[0]
    whole, metrics, _ = ref_loss_and_metrics(LOGP, OLD, REF, want_adv, MASK, 0.04, level, loss_type, T)
    for pieces in SPLITS:
        if loss_type == "bnpo":
            want = np.mean([ref_loss_and_metrics(LOGP[r], OLD[r], REF[r], want_adv[r], MASK[r], 0.04, level,
                                                 "bnpo", T)[0]
                            for r in np.array_split(np.arange(B), pieces)])
            assert abs(want - whole) > 1e-3  # it does depend on the split
        else:
            want = whole
        np.testing.assert_allclose(got[f"loss/{loss_type}/{pieces}"], want, **TOL)
        np.testing.assert_allclose(got[f"kl/{pieces}"], metrics["kl"], **TOL)


def test_padding_values_do_not_leak():
    """Padding positions may hold -inf / NaN log-probabilities: the losses, the metrics and the GSPO ratio
    read only the completion tokens."""
    pad = ~MASK.astype(bool)
    adv = results()["adv"]["group"]["adv"]
    dirty = everything(adv, np.where(pad, -np.inf, LOGP).astype(np.float32), np.where(pad, np.nan, OLD),
                       np.where(pad, np.nan, REF).astype(np.float32), MASK)
    for key, value in jax.tree.map(np.asarray, dirty).items():
        if not key.startswith("terms/"):
            np.testing.assert_array_equal(value, results()["group"][key], err_msg=key)


def _reinforce_gradients(theta, targets, mask, rewards):
    """jax.grad of GRPO's normalized loss at num_iterations 1 and of the REINFORCE surrogate, per
    (loss_type, level); see the test's docstring."""
    b, t = mask.shape
    adv = advantages(rewards, 4, "none")[0]

    def logps(th):
        return jnp.take_along_axis(jax.nn.log_softmax(th, -1), targets[..., None], -1)[..., 0]

    def loss(th, loss_type, level):
        lp = logps(th)
        terms = token_terms(lp, jax.lax.stop_gradient(lp), None, adv, mask, EPS_LOW, EPS_HIGH, 0.0, level)
        return combine([loss_sum_count(terms["loss"], mask, loss_type, t)])

    def surrogate(th, loss_type):
        per_row = (logps(th) * mask).sum(-1) * adv  # A_i sum_t logp_it
        if loss_type == "grpo":
            return -(per_row / jnp.maximum(mask.sum(-1), 1.0)).sum() / b
        if loss_type == "dr_grpo":
            return -per_row.sum() / (b * t)
        return -per_row.sum() / mask.sum()  # dapo, and bnpo on its one micro-batch

    want = {lt: jax.grad(surrogate)(theta, lt) for lt in ("grpo", "dr_grpo", "dapo")}
    return adv, {f"{lt}/{lv}": (jax.grad(loss)(theta, lt, lv), want["dapo" if lt == "bnpo" else lt])
                 for lt, lv in itertools.product(LOSS_TYPES, LEVELS)}


GRAD_REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 0.2, 0.7, 0.7, 0.1], np.float32)


@functools.cache
def reinforce():
    """_reinforce_gradients on a small theta [8, 5, 6] (two groups of 4, a zero-length row), compiled once."""
    rng = np.random.RandomState(1)
    b, t, v = 8, 5, 6
    theta = rng.randn(b, t, v).astype(np.float32)
    targets = rng.randint(0, v, (b, t))
    mask = (np.arange(t)[None] < np.array([5, 2, 0, 4, 1, 5, 3, 2])[:, None]).astype(np.float32)
    return jax.tree.map(np.asarray, jax.jit(_reinforce_gradients)(theta, targets, mask, GRAD_REWARDS))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_on_policy_gradient_is_reinforce_with_the_group_mean_baseline(loss_type, level):
    """num_iterations 1 (old = stop_gradient(logp), ratio 1), beta 0, scale_rewards "none", so
    A_i = r_i - mean of its group and nothing clips; with logp_it = log_softmax(theta)[target] the gradient of
    the normalized loss is that of the REINFORCE surrogate (|o_i| = row i's completion tokens, clamped at 1;
    T_max = max_completion_length; N = sum of the mask, all rows):

    * grpo:    -(1 / B) sum_i (A_i / |o_i|) sum_t logp_it
    * dr_grpo: -(1 / (B T_max)) sum_i A_i sum_t logp_it
    * dapo:    -(1 / N) sum_i A_i sum_t logp_it
    * bnpo:    as dapo (one micro-batch: its token mean is the batch's)

    The sequence level (GSPO) gives the same gradients: its ratio exp(mean_t log-ratio) has gradient
    (1 / |o_i|) sum_t d logp_it, and its per-token loss, the same on each of the row's |o_i| tokens, sums to
    |o_i| times it."""
    adv, grads = reinforce()
    r = np.asarray(GRAD_REWARDS)
    np.testing.assert_allclose(adv, r - np.repeat(r.reshape(2, 4).mean(1), 4), rtol=1e-6, atol=1e-7)
    got, want = grads[f"{loss_type}/{level}"]
    assert np.abs(want).max() > 1e-2  # a real gradient, not two zeros
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("beta", BETAS)
def test_what_the_loss_logs_at_one_update_per_batch(beta):
    """The logged `loss` at num_iterations 1 (the ratio is 1, nothing clips), as the README says: per token -A
    plus beta x its k3 KL, normalized as the loss type says. With beta 0, grpo's mean over completions of their
    token means is the mean advantage, 0 (a group's advantages sum to 0); dapo's token mean weighs each
    completion's advantage by its length L, -sum(A L) / sum(L), not 0 on unequal lengths (positive where the
    longer completions score below their group, as in a run where they ramble and miss); dr_grpo's is
    -sum(A L) / (B T_max); bnpo's (one micro-batch) dapo's."""
    rng = np.random.RandomState(1)
    lengths = np.array([7, 2, 5, 1, 3, 6, 4, 7])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    r = np.array([[0.1, 0.9, 0.3, 1.0], [0.7, 0.2, 0.5, 0.0]])  # the longer, the lower
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    logp = -rng.exponential(1.0, (8, T))
    ref = logp + 0.3 * rng.randn(8, T)
    kl = (np.exp(ref - logp) - (ref - logp) - 1) * mask
    want = {"grpo": (-adv + beta * kl.sum(1) / lengths).mean(),
            "dapo": (-(adv * lengths).sum() + beta * kl.sum()) / lengths.sum(),
            "dr_grpo": (-(adv * lengths).sum() + beta * kl.sum()) / (8 * T)}
    want["bnpo"] = want["dapo"]
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    terms = token_terms(f32(logp), f32(logp), f32(ref), f32(adv), mask, EPS_LOW, EPS_HIGH, beta, "token")
    for loss_type, value in want.items():
        got = float(combine([loss_sum_count(terms["loss"], mask, loss_type, T)]))
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6, err_msg=loss_type)
    if beta == 0:
        assert abs(want["grpo"]) < 1e-12 and want["dapo"] > 0.3, want  # positive: long completions scored low
