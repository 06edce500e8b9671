"""Multi-turn decoding on one KV cache: a conversation continues where it stopped instead of being read again.

:class:`CachedTurns` holds each row's cache on the devices between turns:

- :meth:`CachedTurns.start` prefills every row's prompt (rows are independent: each rollout's prompt may differ,
  e.g. an environment's observation);
- :meth:`CachedTurns.turn` decodes one assistant turn for the active rows, each until its end-of-turn token or
  until its room (the episode's budget left) is spent. A row that has stopped is fed no more tokens, so its
  cache holds exactly its conversation so far, less the last token drawn;
- :meth:`CachedTurns.extend` feeds a row that goes on its last drawn token and the tokens that follow it (a tool's
  answer and the next generation prompt, as the chat template renders them) at the row's own length, and keeps
  the logits of its last position for the next turn.

Each piece is one jitted program of fixed shapes: rows x ``slots`` cache slots (prompt + budget), a turn's
``budget`` steps at most (a ``lax.while_loop`` that stops once every row has stopped), and an extension's width
rounded up to a multiple of :data:`EXTEND_BUCKET` (few compilations). Sampling keys fold in the step and the
turn, so a resumed run draws the same tokens.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eval.generate import Sampler
from eval.rollout import draw
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decode import Cache, forward_step, init_cache

EXTEND_BUCKET = 16


# The weights are cast to the compute dtype inside each program (``compute``, static), as the train step casts
# them: no cast copy of the weights outlives a call.


@partial(jax.jit, static_argnums=(0, 1, 5))
def _prefill(cfg: ModelConfig, compute: Any, weights: Weights, tokens: jax.Array, valid: jax.Array,
             slots: int) -> tuple[jax.Array, Cache]:
    weights = weights.cast(compute)
    cache = init_cache(cfg, tokens.shape[0], slots, weights.base["embed"].dtype)
    last = jnp.maximum(valid.sum(1) - 1, 0)
    return forward_step(cfg, weights, tokens, cache, valid, fresh=True, last=last)


@partial(jax.jit, static_argnums=(0, 1, 6, 7, 8))
def _turn(cfg: ModelConfig, compute: Any, weights: Weights, cache: Cache, logits: jax.Array, active: jax.Array,
          budget: int, sampler: Sampler, eos_ids: tuple[int, ...], room: jax.Array,
          key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Cache]:
    """(tokens [b, budget], their log-probabilities, counts [b], cache) of one turn of the ``active`` rows."""
    weights = weights.cast(compute)
    b = logits.shape[0]
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    stopped = ~active | (room <= 0)
    tok, logp = draw(logits, jax.random.fold_in(key, 0), sampler)
    out = jnp.zeros((b, budget), jnp.int32).at[:, 0].set(jnp.where(stopped, 0, tok))
    out_logp = jnp.zeros((b, budget), jnp.float32).at[:, 0].set(jnp.where(stopped, 0.0, logp))
    n = jnp.where(stopped, 0, 1)
    done = stopped | jnp.isin(tok, eos) | (n >= room)

    def more(carry: tuple) -> jax.Array:
        i, _, _, _, _, _, done = carry
        return (i < budget) & ~jnp.all(done)

    def step(carry: tuple) -> tuple:
        i, tok, cache, out, out_logp, n, done = carry
        # A row that has stopped is fed nothing: its cache keeps its conversation exactly.
        logits, cache = forward_step(cfg, weights, tok[:, None], cache, (~done)[:, None])
        nxt, lp = draw(logits[:, 0], jax.random.fold_in(key, i), sampler)
        out = jax.lax.dynamic_update_slice(out, jnp.where(done, 0, nxt)[:, None], (0, i))
        out_logp = jax.lax.dynamic_update_slice(out_logp, jnp.where(done, 0.0, lp)[:, None], (0, i))
        n = jnp.where(done, n, i + 1)
        return i + 1, nxt, cache, out, out_logp, n, done | jnp.isin(nxt, eos) | (n >= room)

    _, _, cache, out, out_logp, n, _ = jax.lax.while_loop(more, step, (jnp.int32(1), tok, cache, out, out_logp, n,
                                                                       done))
    return out, out_logp, n, cache


@partial(jax.jit, static_argnums=(0, 1))
def _extend(cfg: ModelConfig, compute: Any, weights: Weights, cache: Cache, logits: jax.Array, tokens: jax.Array,
            valid: jax.Array) -> tuple[jax.Array, Cache]:
    weights = weights.cast(compute)
    fed = valid.any(1)
    last = jnp.maximum(valid.sum(1) - 1, 0)
    new, cache = forward_step(cfg, weights, tokens, cache, valid, last=last)
    return jnp.where(fed[:, None], new, logits), cache


class CachedTurns:
    """The turns of a batch of conversations on one cache (module docstring). ``params`` are the policy's weights
    (a model's params, or :class:`zoo.lora.weights.Weights` with LoRA adapters), computed with in ``compute``
    (a dtype)."""

    def __init__(self, cfg: ModelConfig, params: dict | Weights, sampler: Sampler, eos_ids: tuple[int, ...],
                 budget: int, key: jax.Array, compute: Any = jnp.float32):
        self.cfg, self.params, self.sampler, self.eos_ids = cfg, Weights.wrap(params), sampler, tuple(eos_ids)
        self.compute = jnp.dtype(compute)
        self.budget, self.key = budget, key
        self.cache: Cache | None = None
        self.logits: jax.Array | None = None

    def start(self, prompts: list[list[int]], width: int) -> None:
        """Prefill each row's prompt (right-padded to ``width``); the cache has room for ``width + budget``."""
        tokens = np.zeros((len(prompts), width), np.int32)
        valid = np.zeros((len(prompts), width), bool)
        for r, ids in enumerate(prompts):
            tokens[r, :len(ids)], valid[r, :len(ids)] = ids, True
        self.logits, self.cache = _prefill(self.cfg, self.compute, self.params, jnp.asarray(tokens), jnp.asarray(valid),
                                           width + self.budget)

    def turn(self, active: np.ndarray, room: np.ndarray, index: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each active row's tokens of turn ``index`` (ending with its end-of-turn token, or cut at its ``room``)
        and their log-probabilities; empty lists for the other rows."""
        assert self.cache is not None and self.logits is not None, "start() first"
        out, logp, n, self.cache = _turn(self.cfg, self.compute, self.params, self.cache, self.logits, jnp.asarray(active),
                                         self.budget, self.sampler, self.eos_ids, jnp.asarray(room, jnp.int32),
                                         jax.random.fold_in(self.key, index))
        out_h, logp_h, n_h = np.asarray(out), np.asarray(logp), np.asarray(n)
        return ([out_h[r, :n_h[r]].tolist() for r in range(len(n_h))],
                [logp_h[r, :n_h[r]].tolist() for r in range(len(n_h))])

    def extend(self, rows: dict[int, list[int]]) -> None:
        """Feed row r the tokens ``rows[r]`` (its last drawn token, then what follows it) after its cache."""
        assert self.cache is not None and self.logits is not None, "start() first"
        b = self.logits.shape[0]
        k = -(-max(len(v) for v in rows.values()) // EXTEND_BUCKET) * EXTEND_BUCKET
        tokens = np.zeros((b, k), np.int32)
        valid = np.zeros((b, k), bool)
        for r, ids in rows.items():
            tokens[r, :len(ids)], valid[r, :len(ids)] = ids, True
        self.logits, self.cache = _extend(self.cfg, self.compute, self.params, self.cache, self.logits, jnp.asarray(tokens),
                                          jnp.asarray(valid))
