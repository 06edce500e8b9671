"""The fixed GRPO loss batch the loss tests share (tests/test_grpo_losses.py, test_grpo_trl_losses.py): three
groups of four completions whose ratios clip on both sides at both importance levels, a tied group and a
zero-length completion."""

from __future__ import annotations

import numpy as np

G = 4  # num_generations
B, T = 12, 7  # three groups; max_completion_length == T
EPS_LOW, EPS_HIGH = 0.2, 0.28  # clip-higher: the two bounds differ, so a swapped bound shows


def make_batch():
    """(rewards [B], logp, old, ref, mask [B, T]) float32."""
    rng = np.random.RandomState(0)
    rewards = np.array([0.1, 0.1, 0.1, 0.1,  # a tie of non-dyadic values: std exactly 0
                        1.0, 0.0, 0.5, 1.0,
                        0.3, -0.2, 0.9, 0.0], np.float32)
    lengths = np.array([7, 3, 0, 5, 1, 7, 2, 6, 4, 7, 3, 5])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    old = -rng.exponential(1.5, (B, T)).astype(np.float32)
    # per-row shifts move whole sequences' ratios out of the clip range too (GSPO): up where A > 0 (rows 4, 8,
    # 10), down where A < 0 (rows 5, 9); per-token noise clips single tokens on both sides
    shift = np.array([0.1, -0.1, 0.0, 0.2, 0.4, -0.4, 0.05, -0.3, 0.3, -0.5, 0.35, 0.0])[:, None]
    logp = (old + shift + 0.3 * rng.randn(B, T)).astype(np.float32)
    ref = (old + 0.2 * rng.randn(B, T)).astype(np.float32)
    return rewards, logp, old, ref, mask


REWARDS, LOGP, OLD, REF, MASK = make_batch()
