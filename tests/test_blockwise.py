"""The hand-written backward passes (blockwise attention, dense, glu_down, rms_norm) against autodiff of the
plain formulas, and what the layer scan keeps for the backward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.lora_fixtures import lora_base_params
from tests.program_checks import saved_residuals
from zoo.kernels.blockwise import blockwise_attention, key_ranges
from zoo.layers.blocks import ACTIVATIONS, dense, glu_down, normed_dense, rms_norm
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward
from zoo.model.masks import Visibility, attention_mask, visibility


def _plain_attention(q, k, v, mask, scale, cap):
    """softmax(mask(cap(q k^T scale))) v over all keys at once: the reference."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    s = jnp.where(mask[:, :, None], s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhgqk,bhkd->bhgqd", jax.nn.softmax(s, axis=-1), v)


@functools.partial(jax.jit, static_argnames=("cap", "window", "block"))
def _attention_and_grads(q, k, v, dout, seg, cap, window, block):
    """(output, its q, k, v gradients for the output's cotangent ``dout``) of blockwise attention, each block's
    mask built in the block from the segment ids, or with ``block`` None of the plain formula on the whole mask:
    jitted, one compilation a case, not one per eager op."""
    b, kv, g, t, d = q.shape

    def attend(q, k, v):
        if block is None:
            return _plain_attention(q, k, v, attention_mask(seg, window), 0.3, cap)
        out = blockwise_attention(q, k, v, visibility(seg, window), 0.3, cap, window, block)  # [b, t, kv * g * d]
        return out.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4)

    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(dout)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block", [16, 50, 64])
def test_blockwise_attention_matches_plain_softmax_and_its_gradients(cap, window, block):
    """Slow (about 43 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    rng = np.random.RandomState(0)
    b, kv, g, t, d = 2, 2, 3, 50, 8  # 3 query heads per key/value head; blocks that do not divide t
    q, k, v, dout = (jnp.asarray(rng.randn(*s), jnp.float32)
                     for s in [(b, kv, g, t, d), (b, kv, t, d), (b, kv, t, d), (b, kv, g, t, d)])
    # Two packed documents and trailing padding.
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 25 + [0] * 5], b, axis=0), jnp.int32)
    got, g_got = _attention_and_grads(q, k, v, dout, seg, cap=cap, window=window, block=block)
    want, g_want = _attention_and_grads(q, k, v, dout, seg, cap=cap, window=window, block=None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for name, x, y in zip("qkv", g_got, g_want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("window, prefix", [(None, False), (5, False), (None, True)])
def test_visibility_blocks_are_the_whole_masks_blocks(window, prefix):
    """Each block a Visibility builds (a context shard's queries too: offset, the keys' ids gathered) equals the
    same block of attention_mask's whole [t, t] mask: packed documents, padding, a window, shared prefixes."""
    t = 24
    seg = jnp.asarray([[1] * 7 + [2] * 9 + [3] * 5 + [0] * 3, [4] * 10 + [5] * 14], jnp.int32)
    pre = jnp.asarray([[0] * 7 + [1] * 9 + [1] * 5 + [0] * 3, [0] * 10 + [4] * 14], jnp.int32) if prefix else None
    spans = [(0, 24, 0, 24), (5, 13, 2, 20), (16, 24, 8, 24)]

    @jax.jit  # one compilation, not one per eager op
    def masks(seg, pre):
        blocks = [visibility(seg, window, pre).block(qs, qe, ks, ke) for qs, qe, ks, ke in spans]
        shards = []
        for shard in range(3):  # 3 devices of 8 queries each, every one seeing all 24 keys
            rows = slice(8 * shard, 8 * shard + 8)
            vis = Visibility(seg[:, rows], seg, None if pre is None else pre[:, rows], jnp.int32(8 * shard), window)
            shards.append(vis.block(0, 8, 0, t))
        return attention_mask(seg, window, pre)[:, 0], blocks, shards

    whole, blocks, shards = jax.tree.map(np.asarray, masks(seg, pre))
    for (qs, qe, ks, ke), block in zip(spans, blocks, strict=True):
        np.testing.assert_array_equal(block, whole[:, qs:qe, ks:ke])
    for shard, block in enumerate(shards):
        np.testing.assert_array_equal(block, whole[:, 8 * shard:8 * shard + 8])


def _chunked_mask(seg: np.ndarray, pos: np.ndarray, chunk: int) -> np.ndarray:
    """Bool [b, 1, t, t], one pair at a time: query i sees key j of its document at or before it whose position
    lies in its chunk of ``chunk`` positions (transformers' ``chunked_overlay``), no padding."""
    b, t = seg.shape
    m = np.zeros((b, 1, t, t), bool)
    for r in range(b):
        for i in range(t):
            for j in range(i + 1):
                m[r, 0, i, j] = seg[r, i] == seg[r, j] != 0 and pos[r, i] // chunk == pos[r, j] // chunk
    return m


def test_chunked_attention_matches_the_plain_reference_and_its_gradients():
    """Llama 4's chunked layers: blockwise attention under a Visibility with chunk ids (positions // 6, restarting
    with each packed document; the window of 6 lets blocks skip keys) against the plain softmax over a mask built
    pair by pair; outputs and q/k/v gradients within 1e-5. 3 query blocks of 16 over 40 rows."""
    rng = np.random.RandomState(0)
    b, kv, g, t, d, chunk = 2, 2, 2, 40, 8, 6
    q, k, v, dout = (jnp.asarray(rng.randn(*s), jnp.float32)
                     for s in [(b, kv, g, t, d), (b, kv, t, d), (b, kv, t, d), (b, kv, g, t, d)])
    seg = np.asarray([[1] * 17 + [2] * 20 + [0] * 3, [3] * 40])
    pos = np.concatenate([np.r_[np.arange(17), np.arange(20), np.zeros(3, int)][None], np.arange(40)[None]])
    mask = jnp.asarray(_chunked_mask(seg, pos, chunk))
    dout = dout * jnp.asarray(seg != 0)[:, None, None, :, None]  # padding rows (no key to see) send no gradient
    vis = visibility(jnp.asarray(seg, jnp.int32), chunk, chunk_ids=jnp.asarray(pos // chunk, jnp.int32))

    @jax.jit
    def both(q, k, v, dout):
        def blockwise(q, k, v):
            return blockwise_attention(q, k, v, vis, 0.3, None, chunk, 16).reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4)

        outs = []
        for f in (blockwise, lambda q, k, v: _plain_attention(q, k, v, mask, 0.3, None)):
            out, vjp = jax.vjp(f, q, k, v)
            outs.append((out, vjp(dout)))
        window_only = blockwise_attention(q, k, v, visibility(jnp.asarray(seg, jnp.int32), chunk), 0.3, None, chunk, 16)
        return outs, window_only

    ((got, g_got), (want, g_want)), plain = both(q, k, v, dout)
    real = seg != 0  # padding queries see no key: their rows are not defined
    np.testing.assert_allclose(np.asarray(got).transpose(0, 3, 1, 2, 4)[real],
                               np.asarray(want).transpose(0, 3, 1, 2, 4)[real], rtol=1e-5, atol=1e-5)
    for name, x, y in zip("qkv", g_got, g_want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
    # The chunks matter: without them (the window alone) the outputs differ.
    assert np.abs(np.asarray(plain).reshape(b, t, kv, g, d)[real] - np.asarray(got).transpose(0, 3, 1, 2, 4)[real]).max() > 0.1


def test_key_ranges_skip_the_blocks_a_causal_window_cannot_see():
    assert key_ranges(10, 4, None) == [(0, 4, 0, 4), (4, 8, 0, 8), (8, 10, 0, 10)]
    # Query 8 with window 3 sees keys 6..8: the first six keys are never scored.
    assert key_ranges(10, 4, 3) == [(0, 4, 0, 4), (4, 8, 2, 8), (8, 10, 6, 10)]
    # A context shard's queries (offset known only on the device) score every gathered key.
    assert key_ranges(8, 4, 3, keys=16) == [(0, 4, 0, 16), (4, 8, 0, 16)]


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

    @jax.jit  # one compilation, not one per eager op
    def both(x, w):
        got = jax.grad(lambda x, w: jnp.sum(dense(x, w) * dy), (0, 1))(x, w)
        want = jax.grad(lambda x, w: jnp.sum((x @ w) * dy), (0, 1))(x, w)
        return got, want, dense(x, w), x @ w

    got, want, y, y_ref = both(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_glu_down_gradients_equal_autodiff(act):
    rng = np.random.RandomState(2)
    gate, up = (jnp.asarray(rng.randn(2, 3, 6), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.randn(6, 4), jnp.float32)
    dy = jnp.asarray(rng.randn(2, 3, 4), jnp.float32)
    got, want = jax.jit(lambda *a: (  # one compilation, not one per eager op
        jax.grad(lambda *a: jnp.sum(glu_down(*a, act) * dy), (0, 1, 2))(*a),
        jax.grad(lambda g, u, w: jnp.sum((ACTIVATIONS[act](g) * u) @ w * dy), (0, 1, 2))(*a)))(gate, up, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dense_contracts_the_leading_axes_of_a_stored_weight():
    """q's [embed, heads, head_dim] and o's [heads, head_dim, embed] used as stored (contract 1 and 2)."""
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(2, 3, 6), jnp.float32)
    for w_shape, contract, spec in (((6, 2, 4), 1, "btk,khd->bthd"), ((2, 3, 5), 2, "bthd,hde->bte")):
        w = jnp.asarray(rng.randn(*w_shape), jnp.float32)
        x_heads = (2, 3) + w_shape[:contract]  # x as the einsum reference reads it
        n = int(np.prod(w_shape[contract:]))
        dy = jnp.asarray(rng.randn(2, 3, n), jnp.float32)
        got, want = jax.jit(lambda x, w: (  # one compilation a weight, not one per eager op
            jax.grad(lambda x, w: jnp.sum(dense(x, w, contract=contract) * dy), (0, 1))(x, w),
            jax.grad(lambda x, w: jnp.sum(jnp.einsum(spec, x.reshape(x_heads), w).reshape(2, 3, n) * dy),
                     (0, 1))(x, w)))(x, w)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_gradients_equal_autodiff(offset, dtype):
    def plain(x, w):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)
        return ((offset + w.astype(jnp.float32)) * xf).astype(x.dtype)

    rng = np.random.RandomState(4)
    x = jnp.asarray(rng.randn(2, 3, 4, 8), dtype)  # the [b, t, heads, head_dim] of a q/k norm
    w = jnp.asarray(rng.randn(8), dtype)
    dy = jnp.asarray(rng.randn(2, 3, 4, 8), jnp.float32)
    got, want = jax.jit(lambda x, w: (  # one compilation, not one per eager op
        jax.grad(lambda x, w: jnp.sum(rms_norm(x, w, 1e-5, offset).astype(jnp.float32) * dy), (0, 1))(x, w),
        jax.grad(lambda x, w: jnp.sum(plain(x, w).astype(jnp.float32) * dy), (0, 1))(x, w)))(x, w)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for a, b in zip(got, want):
        assert a.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_normed_dense_gradients_equal_autodiff_of_norm_then_matmuls(offset):
    rng = np.random.RandomState(5)
    x = jnp.asarray(rng.randn(2, 3, 8), jnp.float32)
    nw = jnp.asarray(rng.randn(8), jnp.float32)
    ws = (jnp.asarray(rng.randn(8, 2, 3), jnp.float32), jnp.asarray(rng.randn(8, 5), jnp.float32))
    dys = (jnp.asarray(rng.randn(2, 3, 6), jnp.float32), jnp.asarray(rng.randn(2, 3, 5), jnp.float32))

    def plain(x, nw, ws):
        n = rms_norm(x, nw, 1e-6, offset)
        return sum(jnp.sum((n @ w.reshape(8, -1)) * dy) for w, dy in zip(ws, dys))

    def fused(x, nw, ws):
        return sum(jnp.sum(y * dy) for y, dy in zip(normed_dense(x, nw, ws, 1e-6, offset), dys))

    @jax.jit  # one compilation, not one per eager op
    def both(x, nw, ws):
        return fused(x, nw, ws), plain(x, nw, ws), jax.grad(fused, (0, 1, 2))(x, nw, ws), \
            jax.grad(plain, (0, 1, 2))(x, nw, ws)

    y, y_ref, got, want = both(x, nw, ws)
    np.testing.assert_allclose(float(y), float(y_ref), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [None, ("sliding", "full")])
def test_layer_scan_does_not_stack_copies_of_the_weights(kinds):
    """The backward pass needs each layer's matrices. With one kind of layer they must be the parameters
    themselves; with alternating kinds (Gemma 2/3, scanned in blocks) one strided slice of them, made
    before the scan. Never copies the scan stacks up, one slice per layer (a copy of every weight per step)."""
    extra = {} if kinds is None else {"layer_types": kinds * 2, "sliding_window": 8}
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8, **extra)
    params = lora_base_params(cfg)  # random weights drawn with NumPy: nnx's init compiles a kernel per shape
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 16)), jnp.int32)
    residuals = saved_residuals(lambda p: forward(cfg, p, tokens).sum(), params)
    period = len(kinds or ("full",))
    weights = {(a.shape[0] // period,) + a.shape[1:] for a in jax.tree.leaves(params["layers"]) if a.ndim > 2}
    kept = [(shape, src) for shape, src in residuals if shape in weights]
    assert len(kept) == 7 * period  # q, k, v, o, gate, up, down
    assert not [r for r in kept if "output of scan" in r[1]], kept
    if kinds is None:
        assert all(src.startswith("from the argument") for _, src in kept), kept
        # And of the [tokens, embed] activations only three per layer: the layer's input, the attention
        # output (kept once, for both the attention's and the o projection's backward) and the stream
        # after attention; the norms' outputs are recomputed (normed_dense, rms_norm).
        assert sum(shape == (4, 2, 16, 32) for shape, _ in residuals) == 3, residuals
        assert sum(shape == (4, 2, 2, 2, 16, 8) for shape, _ in residuals) == 1, residuals  # q; no 2nd output
