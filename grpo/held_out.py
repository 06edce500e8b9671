"""The reward on held-out prompts while GRPO trains, to catch reward hacking (TRL's eval loop, trl#2959).

Every ``eval_every`` steps (and at the last) the prompts of ``data.eval_path`` (or the ``data.eval_fraction``
held out of ``data.path``) are completed twice with the current policy and scored by the run's rewards:

- with the run's sampling, ``grpo.num_generations`` completions per prompt, logged under TRL's eval names:
  ``eval_reward``, ``eval_reward_std`` (the std of the batch's rewards, as ``reward_std``),
  ``eval_rewards/<function>/mean`` and ``/std``, ``eval_completions/mean_length`` (the model's tokens),
  ``eval_completions/clipped_ratio`` and, with tools, ``eval_num_turns``, ``eval_tool_calls``,
  ``eval_tool_failures``, ``eval_tools/call_frequency``, ``eval_tools/failure_frequency``;
- greedy, one completion per prompt: the same names under ``eval_greedy_``.

The samples use a key stream of their own, folded from the run's seed and the step, so evaluating changes nothing
that training draws, and a resumed run evaluates exactly as a run never stopped. The prompts are completed in
batches of the train step's shape (the sampler compiled for training is reused; greedy compiles once more); the
last batch is filled with copies of its last prompt, which are not counted. Every held-out prompt is used each
time: keep the held-out set as small as the signal allows.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from grpo.config import GRPOConfig
from grpo.rewards import RewardSet, reward_metrics
from pretrain.task import RowSource
from zoo.data.batching import Document, replicated_batch
from zoo.lora.weights import Weights


class Completes(Protocol):
    """What of :class:`grpo.rollouts.Rollouts` the held-out evaluation reads."""

    cfg: GRPOConfig
    batch_shape: tuple[int, int]
    group_size: int
    replicated: Any
    rewards: RewardSet

    def complete(self, weights: Weights, rows: dict[str, Any], step: int, source: RowSource,
                 mode: str = "train") -> Any: ...


def _std(x: np.ndarray) -> float:
    return float(x.std(ddof=1)) if len(x) > 1 else 0.0


def held_out_metrics(task: Completes, weights: Weights, docs: list[Document], rows_source: RowSource,
                     step: int) -> dict[str, float]:
    """The held-out prompts' metrics at ``step`` (module docstring) with the policy's ``weights``;
    ``rows_source``: the rows they come from, ``docs``: the held-out prompts' documents."""
    cfg = task.cfg
    shape = task.batch_shape
    b = shape[0] * shape[1]
    width = cfg.data.seq_len + 1
    out: dict[str, float] = {}
    for mode, group, prefix in (("held_out", task.group_size, "eval_"), ("greedy", 1, "eval_greedy_")):
        per = b // group
        totals, per_fns, lengths, ended, episodes = [], [], [], [], []
        for start in range(0, len(docs), per):
            chunk = docs[start:start + per]
            n = len(chunk)
            chunk = chunk + [chunk[-1]] * (per - n)
            tokens = np.zeros((b, width), np.int32)
            seg = np.zeros((b, width), np.int32)
            row = np.zeros((b, width), np.int32)
            for k, d in enumerate(chunk):
                ids = d["tokens"]
                for j in range(k * group, (k + 1) * group):
                    tokens[j, :len(ids)], seg[j, :len(ids)], row[j] = ids, 1, int(d["row"][0])
            placed = replicated_batch({"tokens": tokens.reshape(shape + (width,)),
                                       "tokens_segment_ids": seg.reshape(shape + (width,)),
                                       "row": row.reshape(shape + (width,))}, task.replicated)
            done = task.complete(weights, placed, step, rows_source, mode)
            keep = n * group
            totals.append(done.total[:keep])
            per_fns.append(done.per_fn[:keep])
            lengths.append(done.drawn.n_model[:keep])
            ended.append(done.drawn.ended[:keep])
            if done.drawn.episodes is not None:
                episodes += done.drawn.episodes.episodes[:keep]
        total, per_fn = np.concatenate(totals), np.concatenate(per_fns)
        m: dict[str, Any] = {
            "reward": float(total.mean()),
            "reward_std": _std(total),  # the batch's, as TRL 1.16's (in training and evaluation alike)
            "completions/mean_length": float(np.concatenate(lengths).mean()),
            "completions/clipped_ratio": float(1.0 - np.concatenate(ended).mean()),
            **reward_metrics(task.rewards.names, per_fn),
        }
        if episodes:
            from grpo.agentic import episode_metrics

            m.update(episode_metrics(episodes))
        out.update({prefix + k: v for k, v in m.items()})
    return out
