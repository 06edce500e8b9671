"""TRL as an oracle: one step of TRL's own trainer against one plain SGD step of ours (issue 44's
end-to-end checks), the weight change of our exported run, the comparisons of changes and metrics, and TRL 1.16's
DPO metrics written out (trl_metrics), and TRL 1.16's generalized JSD (GKD's loss) transcribed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Our side of a step-1 comparison: one plain SGD step at learning rate 1, no momentum, clipping or decay, so the
# step's weight change is minus the gradient.
SGD_STEP_ONE = ("max_steps=1", "optimizer.name=sgd", "optimizer.b1=0", "optimizer.grad_clip=0",
                "optimizer.learning_rate=1.0", "optimizer.weight_decay=0", "schedule.name=constant")


def trl_step_one(trainer_cls, args_cls, model, out: Path, trainer_kwargs: dict, **args_kwargs
                 ) -> tuple[dict, dict[str, np.ndarray]]:
    """One step of TRL's ``trainer_cls`` on the torch ``model`` (CPU, float32), as SGD_STEP_ONE does ours: returns
    the metrics TRL logs at step 1 and the step's weight change per tensor name (minus the gradient).

    ``trainer_kwargs`` go to the trainer (train_dataset, processing_class, ref_model, ...), ``args_kwargs`` to its
    config (beta, per_device_train_batch_size, gradient_accumulation_steps, ...)."""
    import torch

    before = {k: v.detach().to(torch.float64).clone() for k, v in model.state_dict().items()}
    settings = dict(output_dir=str(out), max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                    max_grad_norm=0.0, weight_decay=0.0, warmup_steps=0, logging_steps=1, report_to=[],
                    use_cpu=True, save_strategy="no", seed=0, bf16=False, disable_tqdm=True)
    trainer = trainer_cls(model=model, args=args_cls(**{**settings, **args_kwargs}), **trainer_kwargs)
    trainer.train()
    change = {k: (v.detach().to(torch.float64) - before[k]).numpy() for k, v in model.state_dict().items()}
    return trainer.state.log_history[0], change


def exported_change(final: Path, before: Path, out: Path, *export_args: str) -> dict[str, np.ndarray]:
    """The weight change of our run, per Hugging Face tensor name: the run's ``final`` checkpoint exported with
    `zoo export` (plus ``export_args``) into ``out``, minus the safetensors of the folder ``before``."""
    from zoo.cli import main

    assert main(["export", str(final), "--out", str(out), "--overwrite", *export_args]) == 0
    from safetensors.numpy import load_file

    def tensors(folder: Path) -> dict[str, np.ndarray]:
        return {k: v.astype(np.float64) for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    after, start = tensors(out), tensors(before)
    return {k: after[k] - start[k] for k in after}


def assert_same_change(ours: dict[str, np.ndarray], trl: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    """Every tensor's step-1 change (minus the gradient) equals TRL's within ``rtol`` of its largest entry."""
    assert ours and set(ours) <= set(trl), sorted(set(ours) - set(trl))
    moved = 0
    for k, d in ours.items():
        scale = float(np.abs(trl[k]).max())
        moved += scale > 0
        np.testing.assert_allclose(d, trl[k], rtol=0, atol=rtol * max(scale, 1e-12), err_msg=k)
    assert moved, "no tensor moved: the comparison would pass on a step that did nothing"


def assert_same_metrics(ours: dict, trl: dict, names, operands: dict | None = None) -> None:
    """Each named step metric of ours equals TRL's logged one within 1e-5: relative to the metric, or, for a metric
    that is a difference of larger numbers (``operands[name]``: their magnitude; DPO's rewards are beta times a
    log-probability sum minus another), relative to those, since float32 sums of them agree to about 1e-7 of
    their size and a small difference inherits that error (atol 1e-7 at least, for values near 0)."""
    for k in names:
        atol = max(1e-7, 1e-5 * abs(float((operands or {}).get(k, 0.0))))
        np.testing.assert_allclose(float(ours[k]), float(trl[k]), rtol=1e-5, atol=atol, err_msg=k)


def reward_operands(metrics: dict, beta: float) -> dict[str, float]:
    """The magnitudes DPO-style rewards are differences of: beta x each answer's summed log-probability
    (``logps/*``), for :func:`assert_same_metrics`."""
    scale = beta * max(abs(float(metrics["logps/chosen"])), abs(float(metrics["logps/rejected"])))
    return {k: scale for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")}


# ---- TRL 1.16's DPO metrics, written out ----------------------------------------------------------------

def logsigmoid(x: np.ndarray) -> np.ndarray:
    """log(sigmoid(x)), stable in float64."""
    return -np.logaddexp(0.0, -x)


def trl_metrics(loss_type: str, pol_c: list, pol_r: list, ref_c: list, ref_r: list, beta: float,
                label_smoothing: float, simpo_gamma: float, sft_weight: float) -> dict[str, float]:
    """TRL's step metrics from per-token log-probabilities (one float64 array per answer)."""
    eps = label_smoothing
    n_c = np.array([len(x) for x in pol_c], float)
    n_r = np.array([len(x) for x in pol_r], float)
    chosen_logps = np.array([x.sum() for x in pol_c])  # logps = per_token_logps.sum(dim=1)
    rejected_logps = np.array([x.sum() for x in pol_r])
    if loss_type == "simpo":
        # CPOTrainer: get_batch_logps(average_log_prob=loss_type in ["ipo", "simpo"]) feeds everything.
        chosen_logps, rejected_logps = chosen_logps / n_c, rejected_logps / n_r
        logits = chosen_logps - rejected_logps - simpo_gamma / beta
        losses = -logsigmoid(beta * logits) * (1 - eps) - logsigmoid(-beta * logits) * eps
        chosen_rewards, rejected_rewards = beta * chosen_logps, beta * rejected_logps
    else:
        chosen_logratios = chosen_logps - np.array([x.sum() for x in ref_c])
        rejected_logratios = rejected_logps - np.array([x.sum() for x in ref_r])
        delta = chosen_logratios - rejected_logratios
        if loss_type == "sigmoid":
            losses = -logsigmoid(beta * delta)
        elif loss_type == "hinge":
            losses = np.maximum(0.0, 1 - beta * delta)
        elif loss_type == "robust":
            clean = -(1 - eps) * logsigmoid(beta * delta)
            flipped = -eps * logsigmoid(-beta * delta)
            losses = (clean - flipped) / (1 - 2 * eps)
        elif loss_type == "ipo":
            # chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0), the loss alone
            ipo_delta = chosen_logratios / n_c - rejected_logratios / n_r
            losses = (ipo_delta - 1 / (2 * beta)) ** 2
        else:
            raise AssertionError(loss_type)
        chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    # "sft": -chosen_per_token_logps[chosen_mask.bool()].mean(), i.e. over every chosen token of the batch
    # (CPOTrainer's nll_loss: CrossEntropyLoss over the chosen labels, the same token mean).
    nll = -np.concatenate(pol_c).mean()
    return {"loss": losses.mean() + sft_weight * nll,  # loss += per_sequence_loss.mean() * loss_weight
            "rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(float).mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen_logps.mean(), "logps/rejected": rejected_logps.mean()}


# TRL 1.16's GKDTrainer.generalized_jsd_loss, in numpy (tests/test_distill.py, tests/test_vlm_rm_kto.py).
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_div(inp: np.ndarray, target: np.ndarray) -> np.ndarray:
    """torch.nn.functional.kl_div(inp, target, reduction='none', log_target=True): exp(t) * (t - inp)."""
    return np.exp(target) * (target - inp)


def trl_generalized_jsd(student: np.ndarray, teacher: np.ndarray, labels: np.ndarray, beta: float,
                        temperature: float) -> float:
    """TRL 1.16 generalized_jsd_loss, reduction 'batchmean' with labels (-100 ignored), transcribed."""
    s = _log_softmax(student / temperature)
    t = _log_softmax(teacher / temperature)
    if beta == 0:
        jsd = _kl_div(s, t)
    elif beta == 1:
        jsd = _kl_div(t, s)
    else:
        mix = np.logaddexp(s + np.log1p(-beta), t + np.log(beta))
        jsd = beta * _kl_div(mix, t) + (1 - beta) * _kl_div(mix, s)
    mask = labels != -100
    jsd = jsd[mask]  # [N, V] (TRL sums every element: over positions and vocabulary)
    return float(jsd.sum() / max(mask.sum(), 1))
