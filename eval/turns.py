"""Multi-turn decoding on the inference engine: a conversation continues where it stopped instead of being read
again.

:class:`CachedTurns` runs each turn of a batch of conversations as requests of one engine
(:class:`eval.engine.engine.Engine`):

- :meth:`CachedTurns.start` takes every row's prompt (rows are independent: each rollout's prompt may differ,
  e.g. an environment's observation);
- :meth:`CachedTurns.turn` decodes one assistant turn for the active rows: a request whose prompt is the row's
  conversation so far, ending at its end-of-turn token or once its room (the episode's budget left) is spent.
  The engine's prefix cache holds the full pages of the conversation the row's previous request left (its
  prompt and its turn, :meth:`eval.engine.engine.Engine.step`), so only the tokens since then are computed;
- :meth:`CachedTurns.extend` appends to a row that goes on the tokens that follow its last drawn token (a tool's
  answer and the next generation prompt, as the chat template renders them): the next turn's request reads them.

Row r's turn ``index`` draws with the key data ``fold_in(fold_in(key, index), r)`` (and the token's index), so a
resumed run draws the same tokens. The requests of a turn are submitted each distinct conversation's first row
first (:func:`eval.rollout.leaders_first`): the G rollouts of a prompt share its pages from the first turn on.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eval.engine.engine import Engine
from eval.generate import Sampler
from eval.rollout import PAGE_SIZE, local_weights, row_keys, run_requests, sampling_params
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig


class CachedTurns:
    """The turns of a batch of conversations on one engine (module docstring). ``params`` are the policy's weights
    (a model's params, or :class:`zoo.lora.weights.Weights` with LoRA adapters), computed with in ``compute``
    (a dtype). ``engines``: where a run keeps its engines across steps (:class:`eval.rollout.RolloutEngine`, whose
    :meth:`eval.rollout.RolloutEngine.engine` gives one of a batch's rows; None: an engine of this batch's own)."""

    def __init__(self, cfg: ModelConfig, params: dict | Weights, sampler: Sampler, eos_ids: tuple[int, ...],
                 budget: int, key: jax.Array, compute: Any = jnp.float32, engines: Any = None):
        self.cfg, self.sampler, self.eos_ids = cfg, sampler, tuple(eos_ids)
        # Every process of a run decodes every row, each on its own devices from the weights gathered whole.
        self.params = local_weights(params).without_dropout().cast(jnp.dtype(compute))
        self.budget, self.key, self.engines = budget, key, engines
        self.engine: Engine | None = None
        self.conversations: list[list[int]] = []

    def start(self, prompts: list[list[int]], width: int) -> None:
        """Take each row's prompt (at most ``width`` tokens); a row's conversation has room for ``width + budget``."""
        max_len = width + self.budget
        if self.engines is not None:
            self.engine = self.engines.engine(len(prompts), max_len, self.params)
        else:
            self.engine = Engine(self.cfg, self.params.base, max_seqs=len(prompts), max_len=max_len,
                                 page_size=PAGE_SIZE)
        self.engine.set_weights(self.params)
        self.conversations = [list(p) for p in prompts]

    def turn(self, active: np.ndarray, room: np.ndarray, index: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each active row's tokens of turn ``index`` (ending with its end-of-turn token, or cut at its ``room``)
        and their log-probabilities; empty lists for the other rows."""
        assert self.engine is not None, "start() first"
        b = len(self.conversations)
        rows = [r for r in range(b) if active[r] and room[r] > 0]
        keys = row_keys(jax.random.fold_in(self.key, index), b)
        params = [sampling_params(self.sampler, min(int(room[r]), self.budget), self.eos_ids) for r in rows]
        drawn, logps = run_requests(self.engine, [self.conversations[r] for r in rows], params, keys[rows])
        out: list[list[int]] = [[] for _ in range(b)]
        out_logps: list[list[float]] = [[] for _ in range(b)]
        for r, d, lp in zip(rows, drawn, logps):
            out[r], out_logps[r] = d, lp
            self.conversations[r] += d
        return out, out_logps

    def extend(self, rows: dict[int, list[int]]) -> None:
        """Row r goes on: ``rows[r]`` is its last drawn token, then the tokens that follow it."""
        for r, ids in rows.items():
            assert self.conversations[r] and self.conversations[r][-1] == ids[0], "extend after the row's turn"
            self.conversations[r] += ids[1:]

    def close(self) -> None:
        """Let go of the weights (the engine stays, its pool with it)."""
        if self.engine is not None:
            self.engine.release_weights()
