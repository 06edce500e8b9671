"""Each row's own draw: per-request temperature, top-k, top-p and seed in one batch.

`zoo generate`'s :func:`eval.generate.sample_next` shapes its program by one batch-wide setting; the engine's rows
are different requests, so the settings are arrays and the cut is computed per row: greedy rows take the argmax,
the others the logits over their temperature cut to their top-k, then to their top-p, drawn by
:func:`eval.generate.categorical`'s two-stage draw with a key of the request's seed and the token's index (so a
request's draws do not depend on which rows run beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowSampling:
    """Per-row settings [b]: ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off), ``key`` [b, 2]
    (a request's raw threefry key: ``PRNGKey(seed)``'s data) and ``index`` (the new token's index in its request:
    it is drawn with ``fold_in(key, index)``). ``banned`` (static): ids never drawn (a vision-language model's
    image token)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array
    index: jax.Array
    banned: tuple[int, ...] = field(default=(), metadata={"static": True})

    @classmethod
    def of(cls, rows: list[tuple[float, int, float, np.ndarray, int]], banned: tuple[int, ...] = ()) -> RowSampling:
        """From (temperature, top_k, top_p, key data [2] uint32, index) per row."""
        t, k, p, key, i = zip(*rows)
        return cls(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32),
                   jnp.asarray(np.stack(key), jnp.uint32), jnp.asarray(i, jnp.int32), banned)


def key_data(seed: int) -> np.ndarray:
    """``jax.random.PRNGKey(seed)``'s data (threefry: the seed's high and low 32 bits), made on the host."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


CATEGORICAL_BLOCK = 128  # vocabulary entries per block of :func:`categorical`'s first draw


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw [b] int32 from softmax(``logits`` [b, vocab]) per row (-inf entries never drawn), in two exact
    stages: a block of CATEGORICAL_BLOCK entries with probability its share of the mass (its logsumexp), then an
    entry of that block in proportion to its probability within it.

    The distribution is ``jax.random.categorical``'s, but its Gumbel draw over the whole vocabulary, one random
    number and two logarithms per entry, costs about 57 ms a decoding step for 64 rows of a 49,152-entry
    vocabulary on a 2-CPU machine, a quarter of a 135M model's step; this draws vocab / 128 + 128 numbers a row
    instead (about 5 ms)."""
    b, v = logits.shape
    block = min(CATEGORICAL_BLOCK, v)
    pad = (-v) % block
    blocks = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, block)
    k_block, k_entry = jax.random.split(key)
    which = jax.random.categorical(k_block, jax.nn.logsumexp(blocks, axis=-1), axis=-1)
    inside = jnp.take_along_axis(blocks, which[:, None, None], axis=1)[:, 0]
    return (which * block + jax.random.categorical(k_entry, inside, axis=-1)).astype(jnp.int32)


def _cut(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits [b, V] with each row's tokens outside its top-k, then outside its top-p of what is left, at -inf.

    Ties at a row's k-th or p-th value are kept together (the cut is a threshold on the value)."""
    v = logits.shape[-1]
    srt = -jnp.sort(-logits, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    srt = jnp.where(jnp.arange(v)[None] < k[:, None], srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    # Keep a token while the mass strictly before it is under top_p (the most likely always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) | (jnp.arange(v)[None] == 0)
    smallest = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < smallest, -jnp.inf, logits)


def first_argmax(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32 (the first of equal maxima) as two plain reductions, a max and a
    min over the indices holding it: XLA's CPU argmax (one reduction over value and index pairs) took 7 ms for 64
    rows of a 49,152-entry vocabulary on the 2-CPU machine, these 2 ms. A row holding NaN gives its last index."""
    v = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(first, v - 1)


def draw_rows(logits: jax.Array, s: RowSampling) -> tuple[jax.Array, jax.Array]:
    """(next token [b] int32, its log-probability [b]) of each row from its last-position logits [b, V] under its
    own settings. The log-probability is under softmax(logits / temperature) before any cut (greedy rows: the
    plain softmax's), the distribution a trainer computes (GRPO's update, :mod:`eval.rollout`)."""
    raw = logits.astype(jnp.float32)
    logits = raw.at[:, jnp.asarray(s.banned, jnp.int32)].set(-jnp.inf) if s.banned else raw
    greedy = first_argmax(logits)
    sampled = s.temperature > 0
    scale = jnp.where(sampled, s.temperature, 1.0)[:, None]
    x = logits / scale
    needs_cut = jnp.any(sampled & ((s.top_k > 0) | (s.top_p < 1.0)))
    x = jax.lax.cond(needs_cut, lambda x: _cut(x, s.top_k, s.top_p), lambda x: x, x)
    keys = jax.vmap(jax.random.fold_in)(s.key, s.index)
    # An all-greedy batch (a server's greedy clients, `zoo generate` without --temperature) draws nothing.
    drawn = jax.lax.cond(jnp.any(sampled), lambda x: jax.vmap(lambda key, row: categorical(key, row[None])[0])(keys, x),
                         lambda x: greedy, x)
    tok = jnp.where(sampled, drawn, greedy)
    logp = jax.nn.log_softmax(raw / scale, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
