"""The fused, chunked head + cross-entropy (zoo.model.loss) equals the plain logits -> log_softmax computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo.model.loss
from zoo.model.loss import next_token_nll_sum


def _plain(x, head, targets, weights, cap):
    z = jnp.einsum("btk,kv->btv", x, head, precision="highest")
    if cap:
        z = cap * jnp.tanh(z / cap)
    logp = jax.nn.log_softmax(z, axis=-1)
    return -(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weights).sum()


@pytest.mark.slow
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("shape", [(2, 37, 16, 50), (3, 8, 8, 300)])
def test_fused_loss_and_gradients_equal_the_plain_ones(monkeypatch, cap, shape):
    b, t, h, v = shape
    # Chunks of 3 positions: several chunks, and padding in the last one when 3 does not divide t.
    monkeypatch.setattr(zoo.model.loss, "CHUNK_ELEMENTS", 3 * v * b)
    r = np.random.RandomState(1)
    x = jnp.asarray(r.randn(b, t, h), jnp.float32)
    head = jnp.asarray(r.randn(h, v) * 0.5, jnp.float32)
    targets = jnp.asarray(r.randint(0, v, (b, t)), jnp.int32)
    weights = jnp.asarray((r.rand(b, t) > 0.3) * r.rand(b, t) * 2, jnp.float32)  # zeros and non-unit weights

    def fused(x, hd):
        return 1.7 * next_token_nll_sum(x, hd, targets, weights, cap)

    def plain(x, hd):
        return 1.7 * _plain(x, hd, targets, weights, cap)

    got, (gx, gh) = jax.value_and_grad(fused, (0, 1))(x, head)
    want, (wx, wh) = jax.value_and_grad(plain, (0, 1))(x, head)
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    np.testing.assert_allclose(np.asarray(gx), np.asarray(wx), atol=1e-5)
    np.testing.assert_allclose(np.asarray(gh), np.asarray(wh), atol=1e-5)
    assert float(jax.jit(fused)(x, head)) == pytest.approx(float(want), rel=1e-5)  # the primal (no gradients)
    # A frozen head (LoRA): the same x gradient, and the head's is zero, not computed.
    gx2, gh2 = jax.grad(lambda x, hd: 1.7 * next_token_nll_sum(x, hd, targets, weights, cap, head_grad=False),
                        (0, 1))(x, head)
    np.testing.assert_allclose(np.asarray(gx2), np.asarray(wx), atol=1e-5)
    assert not np.asarray(gh2).any()
    # The head as a tied embedding stores it ([vocab, hidden]): the same loss and gradients, transposed.
    got_t, (gx_t, gh_t) = jax.value_and_grad(
        lambda x, e: 1.7 * next_token_nll_sum(x, e, targets, weights, cap, vocab_major=True), (0, 1))(x, head.T)
    assert float(got_t) == pytest.approx(float(want), rel=1e-5)
    np.testing.assert_allclose(np.asarray(gx_t), np.asarray(wx), atol=1e-5)
    np.testing.assert_allclose(np.asarray(gh_t), np.asarray(wh).T, atol=1e-5)


def test_one_chunk_holds_about_chunk_elements_logits():
    assert zoo.model.loss.chunk_length(49152, 8, 512) == zoo.model.loss.CHUNK_ELEMENTS // (49152 * 8)
    assert zoo.model.loss.chunk_length(96, 2, 48) == 48  # a tiny model: one chunk


def test_on_accelerators_a_chunk_is_thick_and_per_device():
    """On a GPU or TPU the chunk counts each device's share of the batch and about 2^27 logits: 1,044 tokens of
    Llama 3's vocabulary at 4 rows a device, whatever the device count (CPU-sized chunks gave 64-token matmuls)."""
    from zoo.kernels.choice import target

    for devices in (1, 8):
        with target("gpu", devices):
            assert zoo.model.loss.chunk_length(128256, 4 * devices, 4096) == 2**27 // (128256 * 4) == 261
    with target("tpu", 8):
        assert zoo.model.loss.chunk_length(128256, 32, 128) == 128  # never past the sequence
    assert zoo.model.loss.chunk_length(128256, 4, 4096) == zoo.model.loss.CHUNK_ELEMENTS // (128256 * 4)  # the CPU's again
