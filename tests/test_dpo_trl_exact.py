"""DPO metrics equal TRL 1.16's, on answers of unequal length, with ``dpo.sft_weight``, however the batch is split.

The expected numbers are TRL's formulas written out in NumPy (float64; tests/trl_oracles.py's trl_metrics, and
ORPO's and CPO's here), not our code: DPOTrainer._compute_loss for sigmoid, hinge, robust and ipo (and
its ``"sft"`` loss term, ``loss_type=[..., "sft"], loss_weights=[1, w]``) and
CPOTrainer (``loss_type="simpo"``, ``cpo_alpha``). The first tests run the real
train step (pretrain/jit_step.py, with the DPO task) on fixed per-token
log-probabilities, the model's forward pass replaced by a lookup, so every
loss type and batch split costs one tiny compilation; the last two run `dpo train`
on a tiny model, against transformers' log-probabilities and against one step of
TRL's own DPOTrainer (metrics and every weight's change).
"""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpo.task
from dpo.config import DPOConfig
from dpo.task import DPOTask
from prefs.pairs import CHOSEN, PROMPT, REJECTED
from pretrain.config import load_config
from pretrain.jit_step import make_step
from pretrain.loop import train
from tests.hf_models import hf_logps
from tests.preference_data import UNEVEN_PAIRS, LookupRows, dpo_cfg, lookup_batch_logps
from tests.run_files import read_metrics, write_jsonl
from tests.trl_oracles import logsigmoid, trl_metrics

BETA, EPS, GAMMA, SFT = 0.1, 0.1, 0.5, 0.7
PROMPT_LEN, SEQ = 2, 16
CHOSEN_LENS, REJECTED_LENS = (1, 3, 2, 5), (4, 1, 3, 2)  # unequal answers; 4 and 7 chosen tokens per half


# ---- TRL 1.16, written out: tests/trl_oracles.py's trl_metrics (shared with tests/test_vlm_dpo.py) ---------------

# ---- the train step on fixed log-probabilities -----------------------------------------------------------

def _answers(seed: int = 0) -> dict[str, list]:
    """Per-token log-probabilities of each answer: policy and reference, chosen and rejected, plus the
    direction the fake parameter ``b`` moves each policy token (to check gradients)."""
    rng = np.random.RandomState(seed)
    out = {}
    for side, lens in (("c", CHOSEN_LENS), ("r", REJECTED_LENS)):
        out[f"pol_{side}"] = [rng.uniform(-3.0, -0.1, n) for n in lens]
        out[f"ref_{side}"] = [rng.uniform(-3.0, -0.1, n) for n in lens]
        out[f"coef_{side}"] = [rng.uniform(-1.0, 1.0, n) for n in lens]
        out[f"logit_{side}"] = [rng.normal(0.0, 2.0, n) for n in lens]
    return out


def _prompt_logps(seed: int = 0) -> tuple[list, list]:
    """Per-token log-probabilities of each pair's PROMPT_LEN prompt targets (read by ORPO's NLL alone), and
    their directions in ``b``; a stream of their own, so _answers' numbers stay as they were."""
    rng = np.random.RandomState(seed + 100)
    pairs = len(CHOSEN_LENS)
    return [rng.uniform(-3.0, -0.1, PROMPT_LEN) for _ in range(pairs)], \
        [rng.uniform(-1.0, 1.0, PROMPT_LEN) for _ in range(pairs)]


def _rows(a: dict, read_prompt: bool = False) -> dict[str, np.ndarray]:
    """Model-batch rows [pairs, SEQ] the way prefs/pairs.py lays a pair out: the prompt's targets, then each
    answer's (its last token's position, which predicts the next segment, weighs nothing), then padding.
    ``read_prompt``: the prompt's targets hold _prompt_logps (ORPO's NLL reads them), else garbage."""
    pairs = len(CHOSEN_LENS)
    rows = {k: np.zeros((pairs, SEQ), np.float32) for k in ("weights", "fake_logps", "ref_logps", "fake_coef",
                                                              "fake_logits")}
    rows["segment_ids"] = np.zeros((pairs, SEQ), np.int32)
    prompt_logps, prompt_coef = _prompt_logps()
    for i in range(pairs):
        rows["segment_ids"][i, :PROMPT_LEN] = PROMPT
        at = PROMPT_LEN
        for side, seg in (("c", CHOSEN), ("r", REJECTED)):
            n = len(a[f"pol_{side}"][i])
            span = slice(at, at + n)
            rows["segment_ids"][i, at:at + n + 1], rows["weights"][i, span] = seg, 1.0
            rows["fake_logps"][i, span], rows["ref_logps"][i, span] = a[f"pol_{side}"][i], a[f"ref_{side}"][i]
            rows["fake_coef"][i, span], rows["fake_logits"][i, span] = a[f"coef_{side}"][i], a[f"logit_{side}"][i]
            # Garbage outside the answers: it must never be read.
            rows["fake_logps"][i, at + n:] = rows["ref_logps"][i, at + n:] = -50.0
            at += n + 1
        rows["fake_logps"][i, :PROMPT_LEN] = rows["ref_logps"][i, :PROMPT_LEN] = -50.0
        if read_prompt:
            rows["fake_logps"][i, :PROMPT_LEN], rows["fake_coef"][i, :PROMPT_LEN] = prompt_logps[i], prompt_coef[i]
    return rows


def _step_metrics(loss_type: str, sft_weight: float, micro_batches: int, monkeypatch, *overrides: str
                  ) -> dict[str, float]:
    """One train step's metrics (and |dL/db| as grad_norm) on the fixed pairs, split into ``micro_batches``."""
    monkeypatch.setattr(dpo.task, "batch_logps", lookup_batch_logps)
    free = loss_type in ("simpo", "orpo", "cpo")
    cfg = load_config(None, ["model.path=none", "data.path=none", "max_steps=1",
                             f"dpo.reference={'none' if free else 'precomputed'}",
                             f"dpo.loss_type={loss_type}", f"dpo.beta={BETA}", f"dpo.sft_weight={sft_weight}",
                             f"dpo.simpo_gamma={GAMMA}",
                             f"dpo.label_smoothing={EPS if loss_type == 'robust' else 0.0}", *overrides], DPOConfig)
    rows = _rows(_answers(), read_prompt=loss_type == "orpo")
    batch = LookupRows.of({k: jnp.asarray(v.reshape(micro_batches, -1, SEQ)) for k, v in rows.items()})
    step, _ = make_step(None, optax.sgd(0.0), jnp.float32, task=DPOTask(cfg))
    params = {"b": jnp.zeros((), jnp.float32)}
    state = {"params": params, "opt_state": optax.sgd(0.0).init(params), "step": jnp.zeros((), jnp.int32)}
    _, m = step(state, batch)
    return {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            **{k: float(v) for k, v in m["task"].items()}}


def _want(loss_type: str, sft_weight: float, b: float = 0.0) -> dict[str, float]:
    a = _answers()
    eps = EPS if loss_type == "robust" else 0.0
    move = {s: [p + b * c for p, c in zip(a[f"pol_{s}"], a[f"coef_{s}"])] for s in ("c", "r")}
    return trl_metrics(loss_type, move["c"], move["r"], a["ref_c"], a["ref_r"], BETA, eps, GAMMA, sft_weight)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust", "simpo"])
def test_step_metrics_and_gradient_equal_trl(loss_type, monkeypatch):
    """Every loss type with dpo.sft_weight: the step's loss, rewards/* and logps/* equal TRL's on pairs of
    unequal answer lengths, and so does the gradient (a central difference of TRL's loss), one micro-batch
    or two (4 and 7 chosen tokens: a mean of per-micro-batch token means would differ)."""
    want = _want(loss_type, SFT)
    h = 1e-4
    slope = (_want(loss_type, SFT, h)["loss"] - _want(loss_type, SFT, -h)["loss"]) / (2 * h)
    for micro_batches in (1, 2):
        got = _step_metrics(loss_type, SFT, micro_batches, monkeypatch)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k}, {micro_batches} micro")
        np.testing.assert_allclose(got["grad_norm"], abs(slope), rtol=1e-4, err_msg=f"{micro_batches} micro")
        # logits/*: as DPOTrainer._compute_loss logs them, the token-weighted mean logit over one micro-batch's
        # answer tokens, appended once per micro-batch and averaged by DPOTrainer.log (4 and 7 chosen tokens
        # per half: a token mean over the whole batch would differ).
        a = _answers()
        for side, s in (("chosen", "c"), ("rejected", "r")):
            halves = np.array_split(np.arange(len(a[f"logit_{s}"])), micro_batches)
            want_logit = np.mean([np.concatenate([a[f"logit_{s}"][i] for i in h]).mean() for h in halves])
            np.testing.assert_allclose(got[f"logits/{side}"], want_logit, rtol=1e-5,
                                       err_msg=f"logits/{side}, {micro_batches} micro")


def _log1mexp(x: np.ndarray) -> np.ndarray:
    return np.where(x < -math.log(2), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


def trl_orpo_cpo(loss_type: str, micro_batches: int, b: float = 0.0, eps: float = 0.0,
                 alpha: float = 1.0) -> dict[str, float]:
    """TRL 1.16's ORPOTrainer / CPOTrainer step metrics on the fixed pairs moved by ``b``, written out: each
    micro-batch's get_batch_loss_metrics (ORPO: nll over the chosen prompt and answer tokens minus mean(beta *
    logsigmoid(log_odds)) on mean logps; CPO: mean sigmoid loss on summed logps plus alpha * nll over the chosen
    answer tokens), then the Trainer's average over the micro-batches (its loss / gradient_accumulation_steps) and
    the stored metrics' mean (ORPOTrainer.log / CPOTrainer.log)."""
    a = _answers()
    pp, pc_ = _prompt_logps()
    move = {s: [x + b * c for x, c in zip(a[f"pol_{s}"], a[f"coef_{s}"])] for s in ("c", "r")}
    prompt = [x + b * c for x, c in zip(pp, pc_)]
    per_micro: list[dict[str, float]] = []
    for h in np.array_split(np.arange(len(CHOSEN_LENS)), micro_batches):
        sc = np.array([move["c"][i].sum() for i in h])
        sr = np.array([move["r"][i].sum() for i in h])
        if loss_type == "orpo":
            mc = sc / np.array([len(move["c"][i]) for i in h])
            mr = sr / np.array([len(move["r"][i]) for i in h])
            log_odds = (mc - mr) - (_log1mexp(mc) - _log1mexp(mr))
            ratio = logsigmoid(log_odds)
            # chosen_nll_loss: CrossEntropyLoss over every (shifted) token of prompt + chosen
            nll = -np.concatenate([np.concatenate([prompt[i], move["c"][i]]) for i in h]).mean()
            loss = nll - (BETA * ratio).mean()
            rc, rr, lc, lr = BETA * mc, BETA * mr, mc, mr
            extra = {"log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()}
        else:
            logits = sc - sr
            losses = -logsigmoid(BETA * logits) * (1 - eps) - logsigmoid(-BETA * logits) * eps
            nll = -np.concatenate([move["c"][i] for i in h]).mean() if alpha else 0.0
            loss = losses.mean() + alpha * nll
            rc, rr, lc, lr = BETA * sc, BETA * sr, sc, sr
            extra = {}
        per_micro.append({"loss": loss, "nll_loss": nll, "rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(),
                          "rewards/accuracies": (rc > rr).mean(), "rewards/margins": (rc - rr).mean(),
                          "logps/chosen": lc.mean(), "logps/rejected": lr.mean(), **extra})
    return {k: float(np.mean([m[k] for m in per_micro])) for k in per_micro[0]}


@pytest.mark.parametrize("loss_type,eps,alpha", [("orpo", 0.0, 1.0), ("cpo", EPS, 0.6), ("cpo", 0.0, 0.0)])
def test_orpo_and_cpo_step_metrics_and_gradient_equal_trl(loss_type, eps, alpha, monkeypatch):
    """ORPO and CPO without a reference: the step's loss, nll_loss, rewards/*, logps/* (and ORPO's log odds)
    equal TRL's trainers written out, on answers of unequal length in 1, 2 and 4 micro-batches (the NLL is a
    token mean per micro-batch, averaged over them: 4 and 7 chosen tokens per half), and so does the gradient."""
    h = 1e-4
    for micro in (1, 2, 4):
        want = trl_orpo_cpo(loss_type, micro, eps=eps, alpha=alpha)
        slope = (trl_orpo_cpo(loss_type, micro, h, eps, alpha)["loss"]
                 - trl_orpo_cpo(loss_type, micro, -h, eps, alpha)["loss"]) / (2 * h)
        got = _step_metrics(loss_type, 0.0, micro, monkeypatch, f"dpo.label_smoothing={eps}",
                            f"dpo.cpo_alpha={alpha}")
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k}, {micro} micro")
        np.testing.assert_allclose(got["grad_norm"], abs(slope), rtol=1e-4, err_msg=f"{micro} micro")
    one, two = trl_orpo_cpo(loss_type, 1, eps=eps, alpha=alpha), trl_orpo_cpo(loss_type, 2, eps=eps, alpha=alpha)
    assert alpha == 0 or abs(one["nll_loss"] - two["nll_loss"]) > 1e-4  # the split matters (rtol 1e-5 sees it)


def test_sft_weight_is_one_token_mean_over_the_global_batch(monkeypatch):
    """The sft_weight term is TRL's: sft_weight times the NLL summed over every chosen token of the global
    batch over their number, added once to the mean preference loss (TRL's sigmoid metrics without it, written
    out: trl_metrics); not a mean of per-pair means, nor of per-micro-batch means (one pair per micro-batch
    here). The other metrics are TRL's without the term."""
    a = _answers()
    nll = -np.concatenate(a["pol_c"]).mean()
    base = _want("sigmoid", 0.0)
    got = _step_metrics("sigmoid", SFT, 4, monkeypatch)
    np.testing.assert_allclose(got["loss"] - base["loss"], SFT * nll, rtol=1e-5)
    per_pair = np.mean([-x.mean() for x in a["pol_c"]])
    assert abs(per_pair - nll) > 0.05 * nll  # the lengths make the two means differ
    for k in ("rewards/chosen", "rewards/margins", "logps/chosen"):  # the metrics do not move
        np.testing.assert_allclose(got[k], base[k], rtol=1e-6, err_msg=k)


def test_ipo_rewards_and_logps_are_summed_and_only_the_loss_is_normalized(monkeypatch):
    """IPO as TRL's DPOTrainer logs it: rewards beta * (summed policy - summed reference log-probability),
    logps/* summed; the loss alone compares per-token means of the log-ratios (plus the sft term: the program
    is test_step_metrics_and_gradient_equal_trl's ipo one in two micro-batches)."""
    a = _answers()
    got = _step_metrics("ipo", SFT, 2, monkeypatch)
    ratio_c = np.array([p.sum() - r.sum() for p, r in zip(a["pol_c"], a["ref_c"])])
    ratio_r = np.array([p.sum() - r.sum() for p, r in zip(a["pol_r"], a["ref_r"])])
    np.testing.assert_allclose(got["rewards/chosen"], BETA * ratio_c.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["rewards/rejected"], BETA * ratio_r.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["logps/rejected"], np.mean([p.sum() for p in a["pol_r"]]), rtol=1e-5)
    normalized = ratio_c / np.array(CHOSEN_LENS) - ratio_r / np.array(REJECTED_LENS)
    nll = -np.concatenate(a["pol_c"]).mean()
    np.testing.assert_allclose(got["loss"], np.mean((normalized - 1 / (2 * BETA)) ** 2) + SFT * nll, rtol=1e-5)


# ---- end to end: a tiny model, transformers' log-probabilities -------------------------------------------

@pytest.mark.slow
def test_ipo_with_sft_weight_step_one_equals_trl_from_transformers(dpo_models, tmp_path):
    """`dpo train`, ipo with sft_weight, two micro-batches, answers of unequal length: step 1's loss and
    every reward and logps metric equal TRL's formulas on transformers' log-probabilities of the policy and
    the reference checkpoint."""
    root, tok, models = dpo_models
    rows = UNEVEN_PAIRS
    write_jsonl(root / "uneven_ipo.jsonl", rows)
    out = tmp_path / "run"
    cfg = dpo_cfg(root, out, "max_steps=1", "grad_accum=2", "dpo.loss_type=ipo", f"dpo.beta={BETA}",
               f"dpo.sft_weight={SFT}", f"dpo.reference={root / 'reference'}", data="uneven_ipo.jsonl")
    train(cfg, progress=False, task=DPOTask(cfg))
    got = read_metrics(out)[0]
    pc, pr, qc, qr, nc, nr = [], [], [], [], [], []
    for row in rows:
        prompt = tok(row["prompt"])["input_ids"]
        c = tok(row["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        r = tok(row["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pc.append(hf_logps(models["policy"], prompt, c))
        pr.append(hf_logps(models["policy"], prompt, r))
        qc.append(hf_logps(models["reference"], prompt, c))
        qr.append(hf_logps(models["reference"], prompt, r))
        nc.append(len(c))
        nr.append(len(r))
    pc, pr, qc, qr, nc, nr = map(np.asarray, (pc, pr, qc, qr, nc, nr))
    assert len(set(nc)) > 1 and len(set(nr)) > 1
    ipo = ((pc - qc) / nc - (pr - qr) / nr - 1 / (2 * BETA)) ** 2
    nll = -pc.sum() / nc.sum()  # every chosen token of the global batch, token-weighted
    rc, rr = BETA * (pc - qc), BETA * (pr - qr)
    want = {"loss": ipo.mean() + SFT * nll, "rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(),
            "rewards/accuracies": float(np.mean(rc > rr)), "rewards/margins": (rc - rr).mean(),
            "logps/chosen": pc.mean(), "logps/rejected": pr.mean()}
    # rewards are beta x (policy sum - reference sum): within 1e-5 of those sums' size (assert_same_metrics)
    scale = BETA * max(abs(pc).max(), abs(pr).max(), abs(qc).max(), abs(qr).max())
    for k, v in want.items():
        atol = 1e-5 * scale if k.startswith("rewards/") and k != "rewards/accuracies" else 1e-7
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=atol, err_msg=k)
    assert not math.isclose(nll, np.mean(-pc / nc), rel_tol=1e-3)  # the per-pair mean would be caught


# ---- end to end: TRL's own DPOTrainer ----------------------------------------------------------------------

@pytest.mark.slow
def test_sigmoid_step_one_equals_trl_dpo_trainer(dpo_models, tmp_path):
    """One SGD step of `dpo train` (sigmoid, a reference checkpoint, two micro-batches, answers of unequal length)
    against one step of trl.DPOTrainer on the same transformers models: loss, grad_norm, every reward, logps and
    logits metric, and every weight's change (minus the gradient) within 1e-5."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig as TRLDPOConfig
    from trl import DPOTrainer

    from tests.trl_oracles import (
        SGD_STEP_ONE,
        assert_same_change,
        assert_same_metrics,
        exported_change,
        reward_operands,
        trl_step_one,
    )

    root, tok, _ = dpo_models
    write_jsonl(root / "uneven_trl.jsonl", UNEVEN_PAIRS)

    def load(name):
        return AutoModelForCausalLM.from_pretrained(root / name, attn_implementation="eager", dtype=torch.float32)

    want, trl_change = trl_step_one(
        DPOTrainer, TRLDPOConfig, load("hf_policy"), tmp_path / "trl",
        dict(ref_model=load("hf_reference"), train_dataset=Dataset.from_list(UNEVEN_PAIRS), processing_class=tok),
        beta=BETA, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    cfg = dpo_cfg(root, tmp_path / "ours", *SGD_STEP_ONE, "grad_accum=2", f"dpo.beta={BETA}",
                  f"dpo.reference={root / 'reference'}", data="uneven_trl.jsonl")
    train(cfg, progress=False, task=DPOTask(cfg))
    assert_same_metrics(read_metrics(tmp_path / "ours")[0], want,
                        ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
                         "rewards/accuracies", "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"),
                        reward_operands(want, BETA))
    assert_same_change(exported_change(tmp_path / "ours" / "final", root / "hf_policy", tmp_path / "exp"), trl_change)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["orpo", "cpo"])
def test_orpo_and_cpo_step_one_equal_trl_trainers(dpo_models, tmp_path, loss_type):
    """One SGD step of `dpo train` (no reference, two micro-batches, answers of unequal length) against one step
    of trl.experimental's ORPOTrainer / CPOTrainer on the same transformers model: loss, grad_norm, nll_loss,
    every reward and logps metric (ORPO: its log odds too), and every weight's change within 1e-5."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from tests.trl_oracles import SGD_STEP_ONE, assert_same_change, assert_same_metrics, exported_change, trl_step_one

    if loss_type == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    root, tok, _ = dpo_models
    # ORPOTrainer and CPOTrainer put the tokenizer's BOS before every prompt (add_bos_token_if_needed), where
    # DPOTrainer and prefs/pairs.py add only the special tokens the tokenizer itself adds (none for this one): the
    # prompts start with the BOS text, which both sides then keep as it is
    pairs = [{**row, "prompt": tok.bos_token + row["prompt"]} for row in UNEVEN_PAIRS]
    write_jsonl(tmp_path / "uneven_bos.jsonl", pairs)
    model = AutoModelForCausalLM.from_pretrained(root / "hf_policy", attn_implementation="eager",
                                                 dtype=torch.float32)
    want, trl_change = trl_step_one(Trainer, Config, model, tmp_path / "trl",
                                    dict(train_dataset=Dataset.from_list(pairs), processing_class=tok),
                                    beta=BETA, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    cfg = dpo_cfg(root, tmp_path / "ours", *SGD_STEP_ONE, "grad_accum=2", f"dpo.beta={BETA}",
                  f"dpo.loss_type={loss_type}", f"data.path={tmp_path / 'uneven_bos.jsonl'}")
    train(cfg, progress=False, task=DPOTask(cfg))
    keys = ("loss", "grad_norm", "nll_loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "rewards/accuracies", "logps/chosen", "logps/rejected")
    assert_same_metrics(read_metrics(tmp_path / "ours")[0], want,
                        keys + (("log_odds_ratio", "log_odds_chosen") if loss_type == "orpo" else ()))
    assert_same_change(exported_change(tmp_path / "ours" / "final", root / "hf_policy", tmp_path / "exp"), trl_change)
