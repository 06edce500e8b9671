"""The preference tests' data and configuration (tests/test_dpo*.py, test_kto.py, test_reward_model.py;
conftest.py's dpo_models): colour pairs, pairs of uneven lengths, the DPO config, and rows whose log-probabilities
come from a lookup in place of a forward pass (NumPy transcriptions through the real step)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from prefs.batch import KTOBatch
from zoo.lora.weights import Weights

DPO_COLORS = "red blue green yellow black white".split()


def dpo_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` preference rows: the prompt names a colour, the chosen answer repeats it, the rejected one another."""
    rng = np.random.RandomState(seed)
    rows = []
    for _ in range(n):
        c, o = rng.choice(DPO_COLORS, 2, replace=False)
        rows.append({"prompt": f"colour {c}:", "chosen": f" {c} {c}", "rejected": f" {o} {o}"})
    return rows


def dpo_cfg(root, out, *overrides, data="prefs.jsonl"):
    """The DPO tests' config: the policy and tokenizer of dpo_models' folder ``root``, its ``data``, out at ``out``."""
    from dpo.config import DPOConfig
    from pretrain.config import load_config

    return load_config(None, [f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}",
                              f"data.path={root / data}", "data.seq_len=32", "batch_size=4",
                              "schedule.name=constant", "log_every=1", "checkpoint.every=100",
                              f"output_dir={out}", *overrides], DPOConfig)


# Preference rows whose answers have unequal lengths (a mean of per-pair means differs from a token mean).
UNEVEN_PAIRS = [{"prompt": "colour red:", "chosen": " red", "rejected": " blue blue blue blue"},
                {"prompt": "colour green:", "chosen": " green green green", "rejected": " black"},
                {"prompt": "colour white:", "chosen": " white white", "rejected": " yellow yellow yellow"},
                {"prompt": "colour blue:", "chosen": " blue blue blue blue blue", "rejected": " red red"}]

DPO_LORA = ("lora.rank=8", "lora.alpha=16")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LookupRows(KTOBatch):
    """Pair-layout rows (DPO's, or KTO's with ``label``) carrying fixed per-token numbers that
    :func:`lookup_batch_logps` reads in place of a forward pass."""

    fake_logps: Any
    fake_coef: Any
    fake_logits: Any


def lookup_batch_logps(mcfg, params, mb, remat="none", **kw):
    """zoo.model.logps.batch_logps with the forward pass replaced by the batch's fixed per-token log-probabilities,
    moved by the one parameter ``b`` along ``fake_coef`` (its mean logits: ``fake_logits``)."""
    b = Weights.wrap(params).base["b"]
    return mb["fake_logps"] + b * mb["fake_coef"], mb["fake_logits"], None
