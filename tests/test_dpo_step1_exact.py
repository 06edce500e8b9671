"""DPO's step-1 metrics are exact: where the policy equals the reference, every reward is exactly 0 (and so
is TRL's accuracy, the share of pairs with chosen reward > rejected reward), in each reference mode; the
step's loss and gradient stay what the reference's own log-probabilities give (up to float rounding)."""

import math

import numpy as np
import pytest

from dpo.task import DPOTask
from pretrain.loop import train
from tests.preference_data import DPO_LORA, dpo_cfg
from tests.run_files import read_metrics

MODES = {
    "lora_base": DPO_LORA,  # dpo.reference: base, the adapters off (B = 0: the policy is the base)
    "full_path": ("dpo.reference={policy}",),  # full fine-tuning against a checkpoint of the start
    "lora_precomputed": ("dpo.reference=precomputed", *DPO_LORA),
    "full_precomputed": ("dpo.reference=precomputed",),
}
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def _step_one(root, out, mode) -> dict:
    cfg = dpo_cfg(root, out, "max_steps=1", *[o.format(policy=root / "policy") for o in MODES[mode]],
               data="four.jsonl")
    train(cfg, progress=False, task=DPOTask(cfg))
    return read_metrics(out)[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_step_one_rewards_are_exactly_zero(dpo_models, tmp_path, monkeypatch, mode):
    """Slow (about 38 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    root, _, _ = dpo_models
    got = _step_one(root, tmp_path / "exact", mode)
    rewards = {k: got[k] for k in REWARDS}
    assert rewards == dict.fromkeys(REWARDS, 0.0), rewards
    assert abs(got["loss"] - math.log(2)) < 1e-7  # sigmoid at a zero margin
    if mode == "lora_base":
        # The policy is still differentiated: the step equals one that reads the reference's own
        # log-probabilities (which differ from the policy's in the last bits), up to that rounding.
        monkeypatch.setattr(DPOTask, "_at_reference", lambda self, lora, step: False)
        plain = _step_one(root, tmp_path / "plain", mode)
        assert got["grad_norm"] > 0
        np.testing.assert_allclose(got["grad_norm"], plain["grad_norm"], rtol=1e-5)
        np.testing.assert_allclose(got["loss"], plain["loss"], rtol=1e-6)
