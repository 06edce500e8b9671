"""DeepSeek Sparse Attention's kernel (zoo/kernels/sparse_topk.py) against a plain dense reference: the indexer's
scores summed over index heads, the top-k per query among the keys it sees (numpy's stable sort, ties to the lower
index), and masked softmax attention over the whole [t, t] score matrix (tiny shapes only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.kernels.sparse_topk import indexer_scores, sparse_attention, topk_visible
from zoo.model.masks import attention_mask, visibility

B, H, T, D, DV, IH, ID, TOPK = 2, 2, 24, 8, 6, 3, 8, 5


def _inputs(seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, H, T, D))
    k = jax.random.normal(ks[1], (B, H, T, D))
    v = jax.random.normal(ks[2], (B, H, T, DV))
    iq = jax.random.normal(ks[3], (B, T, IH, ID))
    ik = jax.random.normal(ks[4], (B, T, ID))
    iw = jax.random.normal(ks[5], (B, T, IH))
    return q, k, v, iq, ik, iw


def _segments() -> jnp.ndarray:
    """Row 0: one document; row 1: two packed documents (9 and 11 tokens) then 4 of padding."""
    return jnp.array([[1] * T, [1] * 9 + [2] * 11 + [0] * 4], jnp.int32)


def _reference_selection(iq, ik, iw, mask: np.ndarray, topk: int) -> np.ndarray:
    """The indexer's top-k per query, in numpy float64: scores by loops over heads, a stable descending sort."""
    iq, ik, iw = (np.asarray(a, np.float64) for a in (iq, ik, iw))
    scores = np.zeros(mask.shape)
    for h in range(iq.shape[2]):
        dots = np.einsum("bqd,bkd->bqk", iq[:, :, h], ik) / np.sqrt(iq.shape[-1])
        scores += iw[:, :, h, None] * np.maximum(dots, 0.0)
    chosen = np.zeros(mask.shape, bool)
    for b in range(mask.shape[0]):
        for i in range(mask.shape[1]):
            keys = np.flatnonzero(mask[b, i])
            order = keys[np.argsort(-scores[b, i, keys], kind="stable")]
            chosen[b, i, order[:topk]] = True
    return chosen


def _dense(q, k, v, keep, scale):
    """Masked softmax attention over the whole [t, t] scores -> [b, t, h * dv]."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    p = jax.nn.softmax(jnp.where(keep[:, None], s, -1e30), axis=-1)
    out = jnp.einsum("bhqk,bhkd->bhqd", p, v)
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)


@pytest.fixture(scope="module")
def case():
    seg = _segments()
    mask = np.asarray(attention_mask(seg))[:, 0]
    q, k, v, iq, ik, iw = _inputs()
    keep = _reference_selection(iq, ik, iw, mask, TOPK)
    return seg, mask, (q, k, v, iq, ik, iw), keep


def test_the_indexer_scores_are_relu_sums_over_heads():
    """indexer_scores equals the loop over index heads of w_h * relu(q_h . k / sqrt(dim))."""
    _, _, _, iq, ik, iw = _inputs(1)
    got = np.asarray(indexer_scores(iq, ik, iw))
    want = np.zeros(got.shape)
    for h in range(IH):
        dots = np.einsum("bqd,bkd->bqk", np.asarray(iq[:, :, h]), np.asarray(ik)) / np.sqrt(ID)
        want += np.asarray(iw[:, :, h, None]) * np.maximum(dots, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 4 s: the jitted backward of three blocks
def test_selection_matters_and_outputs_and_gradients_equal_the_dense_reference(case):
    """With top-5 of up to 24 keys, query blocks of 8 (three blocks; the last ones see three times top-k keys),
    packed documents and padding: output and the gradients of q, k, v equal the dense masked reference at 1e-5,
    the selection differs from plain causal attention, and the indexer's inputs get no gradient (transformers runs
    the indexer under torch.no_grad)."""
    seg, mask, (q, k, v, iq, ik, iw), keep = case
    assert (keep != mask).sum() > 100  # the top-k narrows many queries
    vis, scale = visibility(seg), D ** -0.5
    cot = jax.random.normal(jax.random.key(9), (B, T, H * DV))
    valid = (seg != 0)[:, :, None]  # padding rows: compared too (they see each other), but weigh nothing special

    def loss(fn, *args):
        return jnp.sum(jnp.where(valid, fn(*args), 0) * cot)

    def ours(q, k, v, iq, ik, iw):
        return sparse_attention(q, k, v, iq, ik, iw, vis, scale, TOPK, block=8)

    def ref(q, k, v, iq, ik, iw):
        return _dense(q, k, v, jnp.asarray(keep), scale)

    args = (q, k, v, iq, ik, iw)
    np.testing.assert_allclose(jax.jit(ours)(*args), ref(*args), rtol=1e-5, atol=1e-5)
    g_ours = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=tuple(range(6))))(*args)
    g_ref = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(*args)
    for a, b in zip(g_ours[:3], g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert all(not np.any(np.asarray(g)) for g in g_ours[3:])


def test_ties_go_to_the_lower_key_index():
    """All scores equal (zero head weights): every query keeps its first top-k visible keys, in index order."""
    seg = _segments()
    mask = attention_mask(seg)[:, 0]
    _, _, _, iq, ik, _ = _inputs(2)
    chosen = np.asarray(topk_visible(indexer_scores(iq, ik, jnp.zeros((B, T, IH))), mask, TOPK))
    m = np.asarray(mask)
    want = m & (np.cumsum(m, axis=-1) <= TOPK)
    np.testing.assert_array_equal(chosen, want)


def test_fewer_visible_keys_than_topk_keep_them_all(case):
    """A query that sees at most top-k keys attends to all of them (the first tokens of each document)."""
    seg, mask, (q, k, v, iq, ik, iw), _ = case
    chosen = np.asarray(topk_visible(indexer_scores(iq, ik, iw), jnp.asarray(mask), TOPK))
    few = mask.sum(-1) <= TOPK
    np.testing.assert_array_equal(chosen[few], mask[few])
    assert (chosen.sum(-1) == np.minimum(mask.sum(-1), TOPK)).all()


def test_no_seq_by_seq_array_in_the_program():
    """Only [block, keys] slabs: no value of the forward and backward program is [.., t, t]-shaped."""
    t = 64
    seg = jnp.ones((1, t), jnp.int32)
    args = (jnp.ones((1, 1, t, 4)), jnp.ones((1, 1, t, 4)), jnp.ones((1, 1, t, 4)), jnp.ones((1, t, 2, 4)),
            jnp.ones((1, t, 4)), jnp.ones((1, t, 2)))

    def loss(q, k, v, iq, ik, iw):
        return sparse_attention(q, k, v, iq, ik, iw, visibility(seg), 0.5, 8, block=16).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).as_text()
    assert f"{t}x{t}x" not in text and f"x{t}x{t}x" not in text


@pytest.mark.slow  # a libtpu compilation (about 3 s)
def test_it_compiles_for_a_tpu_slice():
    """Forward and backward lower and compile for a v5e:2x2 slice (libtpu, from this CPU machine)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from zoo.compiled.compiler import compile_lowered
    from zoo.compiled.topology import topology_devices

    devices = topology_devices("v5e:2x2")
    mesh = Mesh(np.array(devices), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    t = 512

    def spec(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows)

    def loss(q, k, v, iq, ik, iw, seg):
        return sparse_attention(q, k, v, iq, ik, iw, visibility(seg), 0.1, 64).astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        spec(4, 4, t, 64), spec(4, 4, t, 64), spec(4, 4, t, 32), spec(4, t, 4, 32), spec(4, t, 32), spec(4, t, 4),
        spec(4, t, dtype=jnp.int32))
    compiled = compile_lowered(lowered, "tpu", device_kind=devices[0].device_kind)
    assert compiled.memory_analysis().temp_size_in_bytes > 0
