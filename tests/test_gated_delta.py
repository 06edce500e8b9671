"""The gated delta rule (zoo.kernels.gated_delta): the chunked scan and the one-token step against a plain
token-by-token reference written here (outputs and gradients, float32, 1e-5), with chunk sizes that do not divide
the sequence, packed documents and padding; the causal convolution against a plain loop; and a TPU program
compiled on this CPU machine that holds the chunked form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.kernels.gated_delta import causal_conv, gated_delta_chunked, gated_delta_step

B, T, H, DK, DV = 2, 37, 2, 8, 6


def _resets(seg):
    """Per token (numpy): whether it starts a fresh state (a real token whose id differs from the last real id
    before it; the row's first real id before the start), and whether it is real."""
    reset = np.zeros(seg.shape, bool)
    for r, ids in enumerate(seg):
        prev = next((i for i in ids if i), 0)
        for i, x in enumerate(ids):
            if x:
                reset[r, i], prev = x != prev, x
    return reset, seg != 0


def _reference(q, k, v, g, beta, seg, state=None):
    """The recurrence token by token (a scan over tokens): a state reset where a document starts, padding leaves
    the state as it is and outputs zero."""
    reset, real = _resets(np.asarray(seg))
    s0 = jnp.zeros((q.shape[0], H, DK, DV)) if state is None else state

    def step(s, xs):
        q, k, v, g, beta, reset, real = xs
        s_in = jnp.where(reset[:, None, None, None], 0.0, s)
        s_new = s_in * jnp.exp(g)[..., None, None]
        u = (v - jnp.einsum("bhkv,bhk->bhv", s_new, k)) * beta[..., None]
        s_new = s_new + k[..., :, None] * u[..., None, :]
        out = jnp.einsum("bhkv,bhk->bhv", s_new, q)
        return jnp.where(real[:, None, None, None], s_new, s), jnp.where(real[:, None, None], out, 0.0)

    xs = tuple(jnp.moveaxis(jnp.asarray(a), 1, 0) for a in (q, k, v, g, beta, reset, real))
    s, out = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(out, 0, 1), s


def _inputs(seed=0):
    rng = np.random.RandomState(seed)
    q = rng.randn(B, T, H, DK).astype(np.float32)
    k = rng.randn(B, T, H, DK).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the layer l2-normalizes keys: the delta rule's regime
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(DK)
    v = rng.randn(B, T, H, DV).astype(np.float32)
    g = -np.exp(rng.randn(B, T, H)).astype(np.float32) * 0.3
    beta = (1 / (1 + np.exp(-rng.randn(B, T, H)))).astype(np.float32)
    return q, k, v, g, beta


# Row 0: three documents (the second starts mid-chunk, the third at a chunk's first token for chunk 8) then
# padding; row 1: one document with leading padding.
PACKED = np.stack([np.r_[np.full(11, 1), np.full(5, 2), np.full(17, 3), np.zeros(4)],
                   np.r_[np.zeros(3), np.full(34, 5)]]).astype(np.int32)


@pytest.mark.parametrize("chunk, seg", [(8, "packed"), (16, "one"), (64, "packed")])
def test_chunked_equals_the_token_by_token_reference_with_gradients(chunk, seg):
    """Outputs, final state and the gradients of q, k, v, g, beta and the initial state at 1e-5 (37 tokens: 8 and
    16 do not divide it, 64 is one padded chunk)."""
    q, k, v, g, beta = _inputs()
    segs = PACKED if seg == "packed" else np.ones((B, T), np.int32)
    s0 = np.random.RandomState(1).randn(B, H, DK, DV).astype(np.float32) * 0.1
    cot = np.random.RandomState(2).randn(B, T, H, DV).astype(np.float32)
    cots = np.random.RandomState(3).randn(B, H, DK, DV).astype(np.float32)

    def loss(fn):
        def f(*args):
            o, s = fn(*args)
            return jnp.sum(o * cot) + jnp.sum(s * cots), (o, s)
        return jax.jit(jax.value_and_grad(f, argnums=range(6), has_aux=True))  # one program: outputs and gradients

    ours = lambda q, k, v, g, beta, s0: gated_delta_chunked(q, k, v, g, beta, segs, chunk, s0)  # noqa: E731
    ref = lambda q, k, v, g, beta, s0: _reference(q, k, v, g, beta, segs, s0)  # noqa: E731
    run = loss(ours)
    (_, (o1, s1)), g1 = run(q, k, v, g, beta, s0)
    (_, (o2, s2)), g2 = loss(ref)(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o1, o2, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s1, s2, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)
    if seg == "packed":  # the documents are independent: the third's outputs do not move with the first's inputs
        scaled = v * np.r_[np.full(11, 2.0), np.ones(T - 11)][None, :, None, None].astype(np.float32)
        (_, (o3, _)), _ = run(q, k, scaled, g, beta, s0)
        np.testing.assert_array_equal(np.asarray(o3)[0, 16:], np.asarray(o1)[0, 16:])
        assert not np.allclose(np.asarray(o3)[0, :11], np.asarray(o1)[0, :11])


def test_one_token_steps_continue_the_chunked_prefill():
    """A prefill of 30 tokens then 7 one-token steps from its state give the reference's outputs and state."""
    q, k, v, g, beta = _inputs(4)
    ones = np.ones((B, T), np.int32)
    want, want_s = _reference(q, k, v, g, beta, ones)
    o, s = jax.jit(lambda *a: gated_delta_chunked(*a, chunk=8))(q[:, :30], k[:, :30], v[:, :30], g[:, :30],
                                                                 beta[:, :30])
    step = jax.jit(gated_delta_step)
    outs = [o]
    for i in range(30, T):
        oi, s = step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
        outs.append(oi[:, None])
    np.testing.assert_allclose(np.concatenate(outs, 1), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, want_s, atol=1e-5, rtol=1e-5)


def test_causal_conv_equals_a_plain_loop_and_rolls_its_state():
    """Outputs (SiLU after the convolution, within documents) and gradients against a loop over taps; a
    prefill's state then continues the row exactly as the whole sequence would."""
    rng = np.random.RandomState(5)
    x = rng.randn(B, T, 5).astype(np.float32)
    w = rng.randn(4, 5).astype(np.float32)

    def loop(x, w, seg):
        """Each tap's input: the token 3 - tap before, where it lies in the same (real) document."""
        acc = jnp.zeros(x.shape)
        for tap in range(4):
            lag = 3 - tap
            same = np.zeros(seg.shape, bool)
            same[:, lag:] = (seg[:, lag:] == seg[:, :T - lag]) & (seg[:, lag:] != 0)
            shifted = jnp.pad(x, ((0, 0), (lag, 0), (0, 0)))[:, :T]
            acc = acc + jnp.where(same[..., None], shifted * w[tap], 0.0)
        return jax.nn.silu(acc)

    conv = jax.jit(causal_conv)
    segs = np.stack([PACKED[0], np.ones(T, np.int32)])  # row 1 without padding (padding's outputs are not read)
    y, _ = conv(x, w, segs)
    keep = (segs != 0)[..., None]
    np.testing.assert_allclose(np.where(keep, y, 0), loop(x, w, segs) * keep, atol=1e-6)
    ga = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.where(keep, conv(x, w, segs)[0], 0) ** 2), (0, 1)))(x, w)
    gb = jax.jit(jax.grad(lambda x, w: jnp.sum((loop(x, w, segs) * keep) ** 2), (0, 1)))(x, w)
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    ones = np.ones((B, T), np.int32)
    whole, _ = conv(x, w, ones)
    # A prefill of 20 real tokens (row 1 padded after 15), then the rest from its state.
    pre = np.ones((B, 20), np.int32)
    pre[1, 15:] = 0
    _, st = conv(x[:, :20], w, pre)
    rest0, _ = conv(x[:1, 20:], w, None, st[:1])
    rest1, _ = conv(x[1:, 15:], w, None, st[1:])
    np.testing.assert_allclose(rest0, whole[:1, 20:], atol=1e-6)
    np.testing.assert_allclose(rest1, whole[1:, 15:], atol=1e-6)


@pytest.mark.slow
def test_the_chunked_form_compiles_for_a_tpu_slice():
    """The chunked rule's forward and backward lowered and compiled for one v5e chip of a 2x2 slice with libtpu (no
    TPU needed), with no [seq, seq] array in it."""
    pytest.importorskip("libtpu")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from zoo.compiled.compiler import compile_lowered
    from zoo.compiled.topology import topology_devices

    dev = topology_devices("v5e:2x2")[0]
    one = NamedSharding(Mesh([dev], ("chip",)), PartitionSpec())
    t, h, dk, dv = 256, 4, 128, 128

    def loss(q, k, v, g, beta, seg):
        return jnp.sum(gated_delta_chunked(q, k, v, g, beta, seg, 64)[0] ** 2)

    shapes = [(2, t, h, dk), (2, t, h, dk), (2, t, h, dv), (2, t, h), (2, t, h)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=one) for s in shapes]
    args.append(jax.ShapeDtypeStruct((2, t), jnp.int32, sharding=one))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args)
    text = compile_lowered(lowered, "tpu", device_kind=dev.device_kind).as_text()
    # The program's arrays are the chunks' [64, 64] (and the inputs'), never [256, 256] (tokens by tokens).
    assert "64,64]" in text and "256,256]" not in text
