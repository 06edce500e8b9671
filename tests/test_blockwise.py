"""The hand-written backward passes (blockwise attention, dense) against autodiff of the plain formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.blockwise import blockwise_attention, key_ranges
from zoo.layers import ACTIVATIONS, attention_mask, dense, glu_down


def _plain_attention(q, k, v, mask, scale, cap):
    """softmax(mask(cap(q k^T scale))) v over all keys at once: the reference."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    s = jnp.where(mask[:, :, None], s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhgqk,bhkd->bhgqd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block", [16, 50, 64])
def test_blockwise_attention_matches_plain_softmax_and_its_gradients(cap, window, block):
    rng = np.random.RandomState(0)
    b, kv, g, t, d = 2, 2, 3, 50, 8  # 3 query heads per key/value head; blocks that do not divide t
    q, k, v, dout = (jnp.asarray(rng.randn(*s), jnp.float32)
                     for s in [(b, kv, g, t, d), (b, kv, t, d), (b, kv, t, d), (b, kv, g, t, d)])
    # Two packed documents and trailing padding.
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 25 + [0] * 5], b, axis=0), jnp.int32)
    mask = attention_mask(seg, window)

    def got(q, k, v):
        return blockwise_attention(q, k, v, mask, 0.3, cap, window, block)

    def want(q, k, v):
        return _plain_attention(q, k, v, mask, 0.3, cap)

    np.testing.assert_allclose(np.asarray(got(q, k, v)), np.asarray(want(q, k, v)), rtol=1e-5, atol=1e-6)
    g_got = jax.grad(lambda *a: jnp.sum(got(*a) * dout), (0, 1, 2))(q, k, v)
    g_want = jax.grad(lambda *a: jnp.sum(want(*a) * dout), (0, 1, 2))(q, k, v)
    for name, x, y in zip("qkv", g_got, g_want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_key_ranges_skip_the_blocks_a_causal_window_cannot_see():
    assert key_ranges(10, 4, None) == [(0, 4, 0, 4), (4, 8, 0, 8), (8, 10, 0, 10)]
    # Query 8 with window 3 sees keys 6..8: the first six keys are never scored.
    assert key_ranges(10, 4, 3) == [(0, 4, 0, 4), (4, 8, 2, 8), (8, 10, 6, 10)]


def test_blockwise_attention_skips_the_masked_blocks():
    """At 4 blocks the causal scores computed are 10/16 of the full square (counted from the jaxpr)."""
    q = jax.ShapeDtypeStruct((1, 1, 1, 64, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 1, 64, 8), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 1, 64, 64), jnp.bool_)
    jaxpr = jax.make_jaxpr(lambda q, k, v, m: blockwise_attention(q, k, v, m, 1.0, None, None, 16))(q, kv, kv, mask)
    scored = sum(int(np.prod(e.outvars[0].aval.shape)) for e in jaxpr.jaxpr.eqns[0].params["call_jaxpr"].eqns
                 if e.primitive.name == "exp")
    assert scored == 16 * (16 + 32 + 48 + 64)


@pytest.mark.parametrize("shape", [(7, 5), (5, 7)])
def test_dense_gradients_equal_autodiff_of_matmul(shape):
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.randn(2, 3, shape[0]), jnp.float32)
    w = jnp.asarray(rng.randn(*shape), jnp.float32)
    dy = jnp.asarray(rng.randn(2, 3, shape[1]), jnp.float32)
    got = jax.grad(lambda x, w: jnp.sum(dense(x, w) * dy), (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum((x @ w) * dy), (0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dense(x, w)), np.asarray(x @ w), rtol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_glu_down_gradients_equal_autodiff(act):
    rng = np.random.RandomState(2)
    gate, up = (jnp.asarray(rng.randn(2, 3, 6), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.randn(6, 4), jnp.float32)
    dy = jnp.asarray(rng.randn(2, 3, 4), jnp.float32)
    got = jax.grad(lambda *a: jnp.sum(glu_down(*a, act) * dy), (0, 1, 2))(gate, up, w)
    want = jax.grad(lambda g, u, w: jnp.sum((ACTIVATIONS[act](g) * u) @ w * dy), (0, 1, 2))(gate, up, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
