"""DPO's per-token log-probabilities: the fused frozen-head path against the rematerialized one and log_softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.model.logps import token_logps


@pytest.mark.slow
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_frozen_head_logps_and_gradients_match_the_plain_computation(monkeypatch, softcap):
    """Slow (about 58 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    import zoo.model.loss

    monkeypatch.setattr(zoo.model.loss, "CHUNK_ELEMENTS", 3 * 2 * 40)  # 3 positions per chunk: 4 chunks, one padded
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
    # vocab_major: the head as a tied embedding stores it ([vocab, hidden]); the same values and gradients.
    layouts = ((head, False), (head.T, True))
    for (h, vm), head_grad in [(lay, hg) for lay in layouts for hg in (True, False)]:
        got, mean = token_logps(x, h, y, softcap, head_grad=head_grad, vocab_major=vm)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(mean), np.asarray(want_mean), rtol=1e-5, atol=1e-6)
    dx_want = jax.grad(lambda x: (plain(x)[0] * g).sum())(x)
    for (h, vm), head_grad in [(lay, hg) for lay in layouts for hg in (True, False)]:
        dx = jax.grad(lambda x: (token_logps(x, h, y, softcap, head_grad=head_grad, vocab_major=vm)[0] * g).sum())(x)
        np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_want), rtol=1e-5, atol=1e-6)
    # A trained head still gets its gradient on the rematerialized path, in its own layout.
    dh_want = jax.grad(lambda h: (jnp.take_along_axis(jax.nn.log_softmax(
        softcap * jnp.tanh(x @ h / softcap) if softcap else x @ h), y[..., None], -1)[..., 0] * g).sum())(head)
    dh = jax.grad(lambda h: (token_logps(x, h, y, softcap)[0] * g).sum())(head)
    np.testing.assert_allclose(np.asarray(dh), np.asarray(dh_want), rtol=1e-5, atol=1e-6)
    de = jax.grad(lambda e: (token_logps(x, e, y, softcap, vocab_major=True)[0] * g).sum())(head.T)
    np.testing.assert_allclose(np.asarray(de), np.asarray(dh_want).T, rtol=1e-5, atol=1e-6)


def test_frozen_head_path_skips_the_recomputed_logits(monkeypatch):
    """With the loss value needed too (as in training), the fused path costs fewer FLOPs than the
    rematerialized one: no second logits matmul."""
    import zoo.model.loss

    monkeypatch.setattr(zoo.model.loss, "CHUNK_ELEMENTS", 16 * 2 * 512)  # 4 chunks of 16 positions
    x = jnp.ones((2, 64, 32), jnp.float32)
    head = jnp.ones((32, 512), jnp.float32)
    y = jnp.zeros((2, 64), jnp.int32)

    def flops(head_grad):
        f = jax.jit(jax.value_and_grad(lambda x: token_logps(x, head, y, None, head_grad=head_grad)[0].sum()))
        return f.lower(x).compile().cost_analysis()["flops"]

    assert flops(False) < 0.8 * flops(True)


@pytest.mark.slow
def test_a_tied_head_is_read_in_place_not_transposed(monkeypatch):
    """batch_logps scores with the tied embedding as stored: the compiled scoring pass holds no
    [hidden, vocab] copy of it (embed.T would be one, 108 MiB at SmolLM2's size, carried through the
    chunk loop)."""
    import zoo.model.loss
    from zoo.model.config import ModelConfig
    from zoo.model.logps import batch_logps
    from zoo.model.params import init_params

    cfg = ModelConfig(family="llama", vocab_size=80, hidden_size=48, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=12, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(0))
    monkeypatch.setattr(zoo.model.loss, "CHUNK_ELEMENTS", 3 * 2 * 80)  # 3 positions per chunk: a loop of 4 chunks
    t = 12
    mb = {"inputs": jnp.zeros((2, t), jnp.int32), "targets": jnp.zeros((2, t), jnp.int32),
          "segment_ids": jnp.ones((2, t), jnp.int32), "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (2, 1))}
    hlo = jax.jit(lambda p: batch_logps(cfg, p, mb)[0]).lower(params).compile().as_text()
    transposed = f"f32[{cfg.hidden_size},{cfg.vocab_size}]"
    assert f"f32[{cfg.vocab_size},{cfg.hidden_size}]" in hlo  # the embedding itself
    assert transposed not in hlo, f"a transposed copy of the tied embedding ({transposed}) is built"
