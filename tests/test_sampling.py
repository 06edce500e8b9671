"""The sampler's draws follow softmax(logits / temperature), cut to the top-k and top-p tokens, counted over many
draws against the probabilities computed here in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval.generate import Sampler, sample_next

V = 300  # three blocks of the two-stage draw, the last one padded
DRAWS = 60_000


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def _frequencies(logits: np.ndarray, sampler: Sampler) -> np.ndarray:
    """Each token's share of DRAWS draws for one row of logits: one batch of DRAWS equal rows, drawn at once."""
    batch = jnp.asarray(np.broadcast_to(logits, (DRAWS, V)), jnp.float32)
    tokens = np.asarray(jax.jit(lambda b, k: sample_next(b, k, sampler))(batch, jax.random.key(0)))
    assert tokens.min() >= 0 and tokens.max() < V
    return np.bincount(tokens, minlength=V) / tokens.size


def _expected(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(the sampler's probabilities, which tokens it keeps), computed in NumPy."""
    z = logits / temperature
    keep = np.ones(V, bool)
    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    if top_p < 1.0:
        order = np.argsort(-z)
        p_sorted = _softmax(np.where(keep, z, -np.inf)[order])
        before = np.cumsum(p_sorted) - p_sorted
        keep[order[before >= top_p]] = False
    return _softmax(np.where(keep, z, -np.inf)), keep


def _assert_follows(got: np.ndarray, want: np.ndarray, keep: np.ndarray) -> None:
    assert (got[~keep] == 0).all()  # a cut token is never drawn
    # Tokens expected at least 10 times, each within 5 sigma; the rarer ones (where counts are Poisson, not normal)
    # pooled into one bin, within 5 sigma too.
    common = want * DRAWS >= 10
    sigma = np.sqrt(want * (1 - want) / DRAWS)
    assert np.all(np.abs(got - want)[common] <= 5 * sigma[common]), np.max((np.abs(got - want) / sigma)[common])
    rare_p = want[~common].sum()
    assert abs(got[~common].sum() - rare_p) <= 5 * np.sqrt(rare_p * (1 - rare_p) / DRAWS) + 1 / DRAWS
    assert 0.5 * np.abs(got - want).sum() < 0.03  # total variation


def _logits() -> np.ndarray:
    rng = np.random.RandomState(1)
    logits = rng.randn(V) * 2.0
    logits[250:] -= 3.0  # the last block (and its padding) holds little mass: a wrong block weight shows there
    return logits


SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 7, 1.0), (1.0, 0, 0.5)]


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_draws_follow_the_samplers_distribution(temperature, top_k, top_p):
    logits = _logits()
    want, keep = _expected(logits, temperature, top_k, top_p)
    _assert_follows(_frequencies(logits, Sampler(temperature, top_k, top_p)), want, keep)


@pytest.mark.slow
def test_engine_rows_follow_their_own_settings():
    """The engine's per-row draw (eval.engine.sampling.draw_rows): one batch whose rows carry three different
    settings (a temperature alone, top-p alone, top-k and top-p together), each row drawn with its own key and
    token index, follows each setting's distribution.
    Slow (slow lane): about 7.6 s on a quiet 2-core machine (180,000 rows' draws over 300 entries, 5 s of it the
    draw itself)."""
    from eval.engine.sampling import RowSampling, draw_rows

    logits = _logits()
    settings = [(0.7, 0, 1.0), (1.0, 0, 0.5), (0.8, 20, 0.7)]
    n = DRAWS
    rows = [(t, k, p, np.array([0, s], np.uint32), i) for s, (t, k, p) in enumerate(settings) for i in range(n)]
    batch = jnp.asarray(np.broadcast_to(logits, (len(rows), V)), jnp.float32)
    tokens, _ = jax.jit(draw_rows)(batch, RowSampling.of(rows))
    tokens = np.asarray(tokens).reshape(len(settings), n)
    for s, setting in enumerate(settings):
        _assert_follows(np.bincount(tokens[s], minlength=V) / n, *_expected(logits, *setting))


def test_rows_draw_independently_and_minus_infinity_is_never_drawn():
    logits = np.zeros((4, V), np.float32)
    logits[:, ::2] = -np.inf  # only odd tokens
    tok = np.asarray(sample_next(jnp.asarray(logits), jax.random.key(3), Sampler(1.0, 0, 1.0)))
    assert (tok % 2 == 1).all() and len(set(tok.tolist())) > 1
