"""DPO's per-token log-probabilities: the fused frozen-head path against the rematerialized one and log_softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpo.logps import token_logps


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_frozen_head_logps_and_gradients_match_the_plain_computation(monkeypatch, softcap):
    import zoo.loss

    monkeypatch.setattr(zoo.loss, "CHUNK_ELEMENTS", 3 * 2 * 40)  # 3 positions per chunk: 4 chunks, one padded
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(2, 11, 8), jnp.float32)
    head = jnp.asarray(rng.randn(8, 40) * 0.5, jnp.float32)
    y = jnp.asarray(rng.randint(0, 40, (2, 11)), jnp.int32)
    g = jnp.asarray(rng.randn(2, 11), jnp.float32)  # an arbitrary cotangent per token, as a DPO loss gives

    def plain(x):
        z = x @ head
        if softcap:
            z = softcap * jnp.tanh(z / softcap)
        return jnp.take_along_axis(jax.nn.log_softmax(z), y[..., None], -1)[..., 0], z.mean(-1)

    want, want_mean = plain(x)
    for head_grad in (True, False):
        got, mean = token_logps(x, head, y, softcap, head_grad=head_grad)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(mean), np.asarray(want_mean), rtol=1e-5, atol=1e-6)
    dx_want = jax.grad(lambda x: (plain(x)[0] * g).sum())(x)
    for head_grad in (True, False):
        dx = jax.grad(lambda x: (token_logps(x, head, y, softcap, head_grad=head_grad)[0] * g).sum())(x)
        np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_want), rtol=1e-5, atol=1e-6)
    # A trained head still gets its gradient on the rematerialized path.
    dh_want = jax.grad(lambda h: (jnp.take_along_axis(jax.nn.log_softmax(
        softcap * jnp.tanh(x @ h / softcap) if softcap else x @ h), y[..., None], -1)[..., 0] * g).sum())(head)
    dh = jax.grad(lambda h: (token_logps(x, h, y, softcap)[0] * g).sum())(head)
    np.testing.assert_allclose(np.asarray(dh), np.asarray(dh_want), rtol=1e-5, atol=1e-6)


def test_frozen_head_path_skips_the_recomputed_logits(monkeypatch):
    """With the loss value needed too (as in training), the fused path costs fewer FLOPs than the
    rematerialized one: no second logits matmul."""
    import zoo.loss

    monkeypatch.setattr(zoo.loss, "CHUNK_ELEMENTS", 16 * 2 * 512)  # 4 chunks of 16 positions
    x = jnp.ones((2, 64, 32), jnp.float32)
    head = jnp.ones((32, 512), jnp.float32)
    y = jnp.zeros((2, 64), jnp.int32)

    def flops(head_grad):
        f = jax.jit(jax.value_and_grad(lambda x: token_logps(x, head, y, None, head_grad=head_grad)[0].sum()))
        return f.lower(x).compile().cost_analysis()["flops"]

    assert flops(False) < 0.8 * flops(True)
