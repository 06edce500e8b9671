"""The attention kernel choice (model.attention, zoo.kernels.choice): where each kernel runs, what cuDNN refuses, and, on
an NVIDIA GPU (marked ``gpu``), cuDNN's flash attention against the blockwise path on the masks the families use."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.errors import UserError
from zoo.kernels.blockwise import blockwise_attention, query_block
from zoo.kernels.choice import (
    check_platform,
    cudnn_attention,
    cudnn_obstacle,
    cudnn_rows_obstacle,
    kernel_for,
    packed_layout,
)
from zoo.model.config import ModelConfig
from zoo.model.masks import attention_mask, visibility


def _cfg(**kw) -> ModelConfig:
    base = dict(family="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                num_kv_heads=2, head_dim=64)
    return ModelConfig(**{**base, **kw})


def test_attention_is_a_runs_choice_never_saved():
    cfg = _cfg(attention="blockwise")
    assert "attention" not in cfg.to_dict()
    assert ModelConfig.from_dict(cfg.to_dict()).attention == "auto"
    assert cfg != _cfg() and cfg.architecture() == _cfg()  # jit caches keyed by the config tell them apart
    with pytest.raises(UserError, match="attention 'flash' is not one of auto, blockwise, cudnn, splash"):
        _cfg(attention="flash")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's answers")
def test_on_the_cpu_auto_is_blockwise_and_cudnn_an_error():
    assert kernel_for(_cfg(), jnp.bfloat16) == "blockwise"
    assert kernel_for(_cfg(attention="blockwise"), jnp.bfloat16) == "blockwise"
    with pytest.raises(UserError, match="cuDNN attention runs on NVIDIA GPUs, not on cpu"):
        kernel_for(_cfg(attention="cudnn"), jnp.bfloat16)
    with pytest.raises(UserError, match="runs on NVIDIA GPUs"):
        check_platform("cudnn", "bfloat16")
    check_platform("auto", "float32")
    check_platform("blockwise", "float32")


def test_what_cudnn_cannot_run_is_named():
    assert cudnn_obstacle(_cfg(), jnp.bfloat16) is None
    assert "soft-cap" in cudnn_obstacle(_cfg(attn_softcap=50.0), jnp.bfloat16)
    assert "head_dim 256" in cudnn_obstacle(_cfg(head_dim=256), jnp.bfloat16)
    assert "float32" in cudnn_obstacle(_cfg(), jnp.float32)
    mla = _cfg(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    assert "latent" in cudnn_obstacle(mla, jnp.bfloat16)
    # Rows it takes without a [seq, seq] mask: a bound on their documents, no shared prefixes.
    assert cudnn_rows_obstacle(1) is None and cudnn_rows_obstacle(16) is None
    assert "set data.max_segments" in cudnn_rows_obstacle(None)
    assert "shared prefixes" in cudnn_rows_obstacle(3, prefix=True)
    with pytest.raises(ValueError, match="shared prefixes"):
        q, k, v = _qkv(1, 8, 1, 1, 8)
        cudnn_attention(q, k, v, visibility(jnp.ones((1, 8), jnp.int32), prefix_ids=jnp.ones((1, 8), jnp.int32),
                                            segments=3), 1.0)


def test_train_with_cudnn_on_the_cpu_stops_before_writing(tmp_path, capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("the CPU's answer")
    from pretrain.cli import main

    f = tmp_path / "run.yaml"
    f.write_text(f"model:\n  init: random\n  config: deepseek-v3-tiny\n  tokenizer: tok\n  attention: cudnn\n"
                 f"data:\n  path: d.jsonl\nmax_steps: 1\ndtype:\n  compute: bfloat16\n"
                 f"output_dir: {tmp_path / 'run'}\n")
    assert main(["train", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: model.attention cudnn: cuDNN attention runs on NVIDIA GPUs, not on cpu; use attention: "
                   "auto or blockwise"]
    assert not (tmp_path / "run").exists()


def _qkv(b, t, hk, g, d, seed=0):
    rng = np.random.RandomState(seed)  # NumPy: jax.random compiles a kernel per shape
    return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(b, hk, g, t, d), (b, hk, t, d), (b, hk, t, d)])


SEGMENTS = {
    "one document": lambda t: np.ones((2, t), np.int32),
    "packed with padding": lambda t: np.stack([np.r_[np.full(t // 3, 1), np.full(t // 3, 2),
                                                     np.zeros(t - 2 * (t // 3))],
                                               np.r_[np.full(t - 7, 1), np.full(7, 2)]]).astype(np.int32),
}


def test_the_cudnn_call_reads_and_writes_the_blockwise_layouts():
    """Rows of one document each (``segments`` 1): the same jax.nn.dot_product_attention call through XLA (so on
    the CPU), with the causal mask type, the rows' lengths and the local window and no mask, equals the blockwise
    path under the whole boolean mask in float32: GQA's head order, padding and the output layout. The padding's
    own rows come out 0 (no target reads them)."""
    b, t, hk, g, d = 2, 96, 2, 3, 16
    q, k, v = _qkv(b, t, hk, g, d)
    padded = np.stack([np.r_[np.ones(t - 10), np.zeros(10)], np.ones(t)]).astype(np.int32)

    @functools.partial(jax.jit, static_argnums=1)  # one compilation a window, not one per eager op
    def both(seg, window):
        want = blockwise_attention(q, k, v, attention_mask(seg, window), d ** -0.5, None, window, 32)
        return want, cudnn_attention(q, k, v, visibility(seg, window, segments=1), d ** -0.5, implementation="xla")

    for seg, window in ((SEGMENTS["one document"](t), None), (padded, None), (padded, 24)):
        want, got = both(jnp.asarray(seg), window)
        real = (seg != 0)[..., None]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want) * real, atol=1e-5, rtol=1e-5,
                                   err_msg=f"window {window}")


def test_packed_layout_names_each_document_by_its_start_and_length():
    """cuDNN's packed layout of packed rows (the documents' starts and lengths, -1 past the last, [b, M] and
    [b, M + 1]): by hand, then as a mask read the way cuDNN documents it (a query sees the earlier keys of its own
    document, within the window) through XLA's attention, equal to the blockwise path under the segment ids."""
    layout = jax.jit(packed_layout, static_argnums=1)  # one compilation a shape, not one per eager op
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [5, 6, 6, 6, 6, 6, 6], [0, 0, 0, 0, 0, 0, 0]], np.int32)
    lengths, starts = layout(jnp.asarray(seg), 3)
    assert np.asarray(lengths).tolist() == [[3, 2, -1], [1, 6, -1], [-1, -1, -1]]
    assert np.asarray(starts).tolist() == [[0, 3, -1, -1], [0, 1, -1, -1], [-1, -1, -1, -1]]
    assert np.asarray(layout(jnp.asarray(seg), 1)[0]).tolist() == [[3], [1], [-1]]  # more: left out

    b, t, hk, g, d = 2, 96, 2, 3, 16
    q, k, v = _qkv(b, t, hk, g, d)
    seg = np.stack([np.r_[np.full(30, 1), np.full(40, 2), np.full(6, 3), np.zeros(20)],
                    np.r_[np.full(50, 4), np.full(46, 7)]]).astype(np.int32)
    lengths, starts = (np.asarray(x) for x in layout(jnp.asarray(seg), 4))
    doc = np.full((b, t), -1)
    for r in range(b):
        for j in range(4):
            if lengths[r, j] > 0:
                doc[r, starts[r, j]:starts[r, j] + lengths[r, j]] = j
    i = np.arange(t)

    @functools.partial(jax.jit, static_argnums=2)  # one compilation a window, not one per eager op
    def both(sees, seg, window):
        qh = q.transpose(0, 3, 1, 2, 4).reshape(b, t, hk * g, d)
        got = jax.nn.dot_product_attention(qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                           mask=sees[:, None], scale=d ** -0.5, implementation="xla")
        return got, blockwise_attention(q, k, v, attention_mask(seg, window), d ** -0.5, None, window, 32)

    for window in (None, 24):
        sees = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0) & (i[None, None] <= i[None, :, None])
        if window is not None:
            sees &= i[None, :, None] - i[None, None] < window
        got, want = both(jnp.asarray(sees), jnp.asarray(seg), window)
        real = (seg != 0)[..., None]
        np.testing.assert_allclose(np.asarray(got).reshape(b, t, -1) * real, np.asarray(want) * real, atol=1e-5,
                                   rtol=1e-5, err_msg=f"window {window}")


# --- on an NVIDIA GPU ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 96])
@pytest.mark.parametrize("segments", sorted(SEGMENTS))
@pytest.mark.parametrize("d", [64, 128])
def test_cudnn_equals_blockwise_outputs_and_gradients(segments, window, d):
    """bfloat16 q/k/v through cuDNN and through the blockwise path, both against the blockwise path in float32 on
    the same (rounded) inputs: cuDNN's error is within bfloat16's, as the blockwise kernel's own is."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU")
    b, t, hk, g = 2, 512, 2, 4
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(b, t, hk, g, d))
    mask = attention_mask(jnp.asarray(SEGMENTS[segments](t)), window)
    # Rows of one document go through cuDNN's causal mask type and lengths, packed ones through its packed layout.
    vis = visibility(jnp.asarray(SEGMENTS[segments](t)), window, segments=1 if segments == "one document" else 4)
    scale = d ** -0.5
    cot = jax.random.normal(jax.random.PRNGKey(9), (b, t, hk * g * d), jnp.float32)

    real = jnp.asarray(SEGMENTS[segments](t) != 0)[..., None]

    def blockwise(q, k, v):  # padding rows read as 0, as cuDNN's come out
        return jnp.where(real, blockwise_attention(q, k, v, mask, scale, None, window, query_block(t)), 0)

    def cudnn(q, k, v):
        return cudnn_attention(q, k, v, vis, scale)

    def value_and_grads(f, dtype):
        args = tuple(x.astype(dtype) for x in (q, k, v))
        out, vjp = jax.vjp(jax.jit(f), *args)
        return [np.asarray(x, np.float32) for x in (out, *vjp(cot.astype(dtype)))]

    ref = value_and_grads(blockwise, jnp.float32)
    ours = value_and_grads(cudnn, jnp.bfloat16)
    theirs = value_and_grads(blockwise, jnp.bfloat16)
    for name, r, o, th in zip(("out", "dq", "dk", "dv"), ref, ours, theirs, strict=True):
        err_cudnn = np.abs(o - r).max() / (np.abs(r).max() + 1e-6)
        err_blockwise = np.abs(th - r).max() / (np.abs(r).max() + 1e-6)
        print(f"{segments}, window {window}, d {d}: {name} relative error cudnn {err_cudnn:.2e}, "
              f"blockwise {err_blockwise:.2e}")
        assert err_cudnn < max(2 * err_blockwise, 1e-2), (name, err_cudnn, err_blockwise)


@pytest.mark.gpu
def test_a_model_step_with_cudnn_equals_blockwise():
    """A tiny Llama's bfloat16 loss and gradients through the model with each kernel: within bfloat16's rounding."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU")
    from zoo.model.decoder import forward, head_weight
    from zoo.model.loss import next_token_nll_sum
    from zoo.model.params import init_params

    cfg = _cfg(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256, intermediate_size=512, vocab_size=512)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, jax.random.PRNGKey(0)))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 257), 0, cfg.vocab_size)
    seg = jnp.asarray(SEGMENTS["packed with padding"](257))

    def loss(p, kernel):
        c = dataclasses.replace(cfg, attention=kernel)
        h = forward(c, p, tokens[:, :-1], seg[:, :-1], return_hidden=True, max_segments=2)
        weights = (seg[:, 1:] != 0).astype(jnp.float32)
        return next_token_nll_sum(h, head_weight(c, p), tokens[:, 1:], weights) / weights.sum()

    got = {k: jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, k) for k in ("blockwise", "cudnn")}
    assert kernel_for(dataclasses.replace(cfg, attention="auto"), jnp.bfloat16) == "cudnn"
    (lb, gb), (lc, gc) = got["blockwise"], got["cudnn"]
    assert abs(float(lb) - float(lc)) < 2e-2 * abs(float(lb))
    for a, c in zip(jax.tree.leaves(gb), jax.tree.leaves(gc), strict=True):
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.abs(a - c).max() <= 0.05 * np.abs(a).max() + 1e-6


def test_cudnn_packed_rows_trace_without_a_seq_by_seq_array(monkeypatch):
    """The packed layout's forward and backward as traced for a Hopper GPU (cuDNN's version and compute capability
    stood in for, as on a GPU host): cuDNN's own fused calls and no [seq, seq] array anywhere (the old path built
    the whole [b, 1, t, t] mask)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
    b, t, hk, g, d = 2, 384, 2, 2, 64  # t unlike any other size
    q, k = jnp.zeros((b, hk, g, t, d), jnp.bfloat16), jnp.zeros((b, hk, t, d), jnp.bfloat16)

    def loss(q, k, v, seg):
        return cudnn_attention(q, k, v, visibility(seg, 64, segments=8), d ** -0.5).astype(jnp.float32).sum()

    traced = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k, jnp.ones((b, t), jnp.int32))
    shapes, names = [], set()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            names.add(e.primitive.name)
            shapes.extend(tuple(v.aval.shape) for v in e.outvars)
            for p in e.params.values():
                if hasattr(p, "jaxpr"):
                    walk(p.jaxpr)

    walk(traced.jaxpr)
    assert {"dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"} <= names
    assert shapes and not [s for s in shapes if s.count(t) >= 2]
