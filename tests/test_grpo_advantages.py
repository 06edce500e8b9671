"""`grpo.advantage: rloo | reinforce_pp | reinforce_pp_baseline` (grpo/losses.py) against NumPy float64
transcriptions: TRL 1.16's RLOOTrainer (``_generate_and_score_completions``' leave-one-out advantages,
``_compute_loss``' per-sequence loss and clip metrics, averaged over micro-batches as the Trainer averages
them) and OpenRLHF's REINFORCE++ (``compute_reward``, ``get_cumulative_returns`` and the batch whitening of
openrlhf/trainer/ppo_utils/experience_maker.py), on completions of unequal length."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo.losses import reinforce_pp_advantages, rloo_advantages, rloo_sequence_terms

G, B, T = 4, 12, 6
EPS_LOW, EPS_HIGH = 0.2, 0.28
TOL = dict(rtol=1e-5, atol=1e-6)
rng = np.random.default_rng(7)
REWARDS = rng.normal(size=B)
REWARDS[4:8] = [1.0, 1.0, 1.0, 1.0]  # a tied group: zero std
REWARDS[1] = -2.0  # below its siblings, where its ratio falls under 1 - epsilon: the low clip
LENGTHS = np.array([6, 1, 3, 5, 2, 6, 4, 1, 3, 3, 5, 2])
MASK = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float64)
LOGP = rng.uniform(-3, -0.1, (B, T))
OLD = LOGP + rng.normal(0, 0.35, (B, T))  # the summed ratios cross both clip bounds
REF = LOGP + rng.normal(0, 0.3, (B, T))


def _nanstd(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.std(ddof=1)) if len(x) > 1 else float("nan")


def trl_rloo_advantages(rewards: np.ndarray, group: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """RLOOTrainer: nansum baseline over the other scorable completions, / (scorable - 1); normalize over
    the scorable rows (nanmean, nanstd + 1e-4); NaN -> 0; group std by nanstd (unbiased)."""
    grouped = rewards.reshape(-1, group)
    scorable = (~np.isnan(grouped)).sum(1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        baselines = (np.nansum(grouped, 1, keepdims=True) - grouped) / (scorable - 1)
    adv = rewards - baselines.reshape(-1)
    if normalize:
        adv = (adv - np.nanmean(adv)) / (_nanstd(adv) + 1e-4)
    return np.nan_to_num(adv, nan=0.0), np.array([_nanstd(g) for g in grouped])


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_match_trl(normalize):
    """Leave-one-out baselines, with an unscorable completion (out of its siblings' baselines, advantage 0), a
    group with one scorable completion (no baseline: 0) and a tied group (zero std, advantages 0)."""
    r = REWARDS.copy()
    r[1] = np.nan
    r[9:12] = np.nan  # group 3: one scorable completion
    adv, std = (np.asarray(x) for x in rloo_advantages(jnp.asarray(r, jnp.float32), G, normalize))
    want_adv, want_std = trl_rloo_advantages(r, G, normalize)
    np.testing.assert_allclose(adv, want_adv, **TOL)
    np.testing.assert_allclose(std[:2], want_std[:2], **TOL)
    assert adv[1] == 0 and (adv[9:] == 0).all() and np.isnan(std[2])
    assert np.isclose(std[1], 0.0) and (adv[4:8] == (0.0 if not normalize else adv[4])).all()
    if not normalize:  # not GRPO's: with n scorable, n / (n - 1) times the deviation from their mean
        g0 = r[[0, 2, 3]]
        np.testing.assert_allclose(adv[[0, 2, 3]], (g0 - g0.mean()) * 3 / 2, **TOL)


def trl_rloo_loss(logp, old, adv, mask, micro: int) -> dict[str, float]:
    """RLOOTrainer._compute_loss on each micro-batch (summed logps, one ratio per sequence, the mean over its
    sequences; clip flags per sequence), averaged over the micro-batches as the Trainer's loss / GA and the
    logged metric means."""
    out = []
    for rows in np.array_split(np.arange(len(adv)), micro):
        log_ratio = (logp[rows] * mask[rows]).sum(1) - (old[rows] * mask[rows]).sum(1)
        c1 = np.exp(log_ratio)
        c2 = np.clip(c1, 1 - EPS_LOW, 1 + EPS_HIGH)
        a = adv[rows]
        low, high = (c1 < 1 - EPS_LOW) & (a < 0), (c1 > 1 + EPS_HIGH) & (a > 0)
        out.append({"loss": -np.minimum(c1 * a, c2 * a).mean(), "low": low.mean(), "high": high.mean(),
                    "region": (low | high).mean()})
    return {k: float(np.mean([o[k] for o in out])) for k in out[0]}


def test_rloo_loss_and_clip_metrics_in_micro_batches():
    """The per-sequence loss and clip flags, summed per micro-batch over the sequence count as the step
    combines them, equal TRL's average of micro-batch means in 1, 2 and 4 micro-batches (both bounds clip)."""
    adv = trl_rloo_advantages(REWARDS, G, False)[0]
    for micro in (1, 2, 4):
        want = trl_rloo_loss(LOGP, OLD, adv, MASK, micro)
        tot = {"loss": 0.0, "low": 0.0, "high": 0.0, "region": 0.0}
        for rows in np.array_split(np.arange(B), micro):
            t = rloo_sequence_terms(jnp.asarray(LOGP[rows], jnp.float32), jnp.asarray(OLD[rows], jnp.float32),
                                    jnp.asarray(adv[rows], jnp.float32), jnp.asarray(MASK[rows]), EPS_LOW, EPS_HIGH)
            for k, name in (("loss", "loss"), ("low", "low_clip"), ("high", "high_clip"), ("region", "region_clip")):
                tot[k] += float(np.asarray(t[name]).sum())
        for k in tot:
            np.testing.assert_allclose(tot[k] / B, want[k], **TOL, err_msg=f"{k}, {micro}")
    whole = trl_rloo_loss(LOGP, OLD, adv, MASK, 1)
    assert whole["low"] > 0 and whole["high"] > 0


def openrlhf_reinforce_pp(rewards, mask, kl, beta, baseline_group, clip):
    """OpenRLHF, written out with its loops: process_experiences (reinforce_baseline: minus the group mean),
    compute_reward (clamp; -beta * kl per token; the reward on the last action token), get_cumulative_returns
    (gamma 1, a reverse loop) and the whitening over every action token of the batch."""
    r = np.nan_to_num(np.asarray(rewards, np.float64))
    if baseline_group:
        g = r.reshape(-1, baseline_group)
        r = (g - g.mean(1, keepdims=True)).reshape(-1)
    if clip is not None:
        r = np.clip(r, *clip)
    b, t = mask.shape
    reward = -beta * kl * mask
    for i in range(b):
        eos = t - 1 - int(np.argmax(mask[i, ::-1]))
        reward[i, eos] += r[i]
    returns = np.zeros_like(reward)
    running = np.zeros(b)
    for j in reversed(range(t)):
        running = reward[:, j] * mask[:, j] + running
        returns[:, j] = running
    n = mask.sum()
    mean = (returns * mask).sum() / n
    var = (((returns - mean) ** 2) * mask).sum() / n
    return (returns - mean) / np.sqrt(max(var, 1e-8))


@pytest.mark.parametrize("beta,baseline,clip", [(0.0, False, None), (0.05, False, (-1.0, 1.0)),
                                                (0.05, True, None)])
def test_reinforce_pp_advantages_match_openrlhf(beta, baseline, clip):
    """Per-token advantages on the completion tokens, with the KL penalty on every token, the reward on the
    last one, the group-mean baseline and reward clipping; 0 off the completion."""
    kl = OLD - REF
    got = np.asarray(reinforce_pp_advantages(jnp.asarray(REWARDS, jnp.float32), jnp.asarray(MASK, jnp.float32),
                                             jnp.asarray(kl, jnp.float32), beta, G if baseline else None, clip))
    want = openrlhf_reinforce_pp(REWARDS, MASK, kl, beta, G if baseline else None, clip)
    on = MASK > 0
    np.testing.assert_allclose(got[on], want[on], **TOL)
    assert (got[~on] == 0).all()
    if beta == 0:  # without the KL a completion's advantage is one value on all of its tokens
        assert all(np.ptp(got[i, on[i]]) < 1e-6 for i in range(B))
    else:
        assert np.ptp(got[0, on[0]]) > 1e-3


def test_every_advantage_setting_names_one_estimator_class():
    """``grpo.advantage`` picks its estimator from a table by name (grpo/advantages.py): every name the config
    accepts has its class, and only those; the group estimator's KL is a term of the loss, the others' in the
    reward (they read the sampling policy's log-probabilities)."""
    from grpo.advantages import ESTIMATORS, TokenSurrogate, estimator_of
    from grpo.config import ADVANTAGES, GrpoSection

    assert set(ESTIMATORS) == set(ADVANTAGES)
    for name in ADVANTAGES:
        est = estimator_of(GrpoSection(advantage=name))
        assert type(est).name == name
        assert est.needs_old == (name != "group")
        assert (isinstance(est, TokenSurrogate) and est.beta_in_loss) == (name == "group")
