"""The decoder itself: packed rows, scan over layers, logical axes, sharding rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.lora_fixtures import lora_base_params
from tests.program_checks import count_eqns
from zoo.model.config import ModelConfig
from zoo.model.decoder import Decoder, forward
from zoo.model.params import param_specs
from zoo.model.sharding import LOGICAL_RULES, logical_to_spec, make_mesh

CFG = ModelConfig(family="llama", vocab_size=80, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.slow
def test_packed_rows_equal_documents_run_alone():
    # Weights scaled up so that logits differ clearly between contexts (drawn with NumPy: nnx's init compiles a
    # kernel per shape). Every call passes segment ids and positions: one forward program for the three.
    params = jax.tree.map(lambda x: np.asarray(x) * np.float32(8) if x.ndim > 1 else x, lora_base_params(CFG))
    fwd = jax.jit(forward, static_argnums=0)
    rng = np.random.RandomState(0)
    a, b = rng.randint(0, 80, 13), rng.randint(0, 80, 19)
    packed = np.concatenate([a, b, np.zeros(4, int)])[None].astype(np.int32)
    seg = np.concatenate([np.full(13, 1), np.full(19, 2), np.zeros(4, int)])[None].astype(np.int32)
    pos = np.concatenate([np.arange(13), np.arange(19), np.zeros(4, int)])[None].astype(np.int32)
    got = np.asarray(fwd(CFG, params, jnp.asarray(packed), jnp.asarray(seg), jnp.asarray(pos)))
    t = len(packed[0])
    count = jnp.asarray(np.arange(t, dtype=np.int32)[None])

    def alone(doc):
        # The document alone in a row of the same length (the rest padding): the same shapes as the packed
        # run, so XLA's matmul tiling and the attention blocks cannot differ, only what each token sees.
        row, segs = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
        row[0, :len(doc)], segs[0, :len(doc)] = doc, 1
        return np.asarray(fwd(CFG, params, jnp.asarray(row), jnp.asarray(segs), count))[:, :len(doc)]

    alone_a, alone_b = alone(a), alone(b)
    np.testing.assert_allclose(got[0, :13], alone_a[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[0, 13:32], alone_b[0], atol=1e-5, rtol=0)
    assert np.isfinite(got).all()  # padding rows stay finite
    # Without segment ids (one segment, as a row of one document) the second document would see the first: the
    # check has teeth.
    leaky = np.asarray(fwd(CFG, params, jnp.asarray(packed), jnp.asarray(np.ones((1, t), np.int32)), count))
    assert np.abs(leaky[0, 13:32] - alone_b[0]).max() > 1e-3


def _jaxpr_size(num_layers: int) -> int:
    import dataclasses

    cfg = dataclasses.replace(CFG, num_layers=num_layers)
    params = {k: jax.ShapeDtypeStruct(s.shape, jnp.float32) for k, s in param_specs(cfg).items()}
    from zoo.model.params import nest

    jaxpr = jax.make_jaxpr(lambda p, t: forward(cfg, p, t))(nest(params), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    return count_eqns(jaxpr.jaxpr), "scan" in str(jaxpr)


def test_program_size_does_not_grow_with_depth():
    small, has_scan = _jaxpr_size(2)
    large, _ = _jaxpr_size(16)
    assert has_scan
    assert small == large


@pytest.mark.parametrize("pattern,period", [(("sliding", "full"), 2), (("sliding",) * 5 + ("full",), 6)])
def test_layer_patterns_compile_independent_of_depth(pattern, period):
    """Gemma 2/3 patterns: scan over the repeating block (plus a remainder), never unroll the depth."""
    import dataclasses

    def size(repeats: int, extra: int) -> int:
        kinds = pattern * repeats + pattern[:extra]
        cfg = dataclasses.replace(CFG, num_layers=len(kinds), layer_types=kinds, sliding_window=4)
        params = {k: jax.ShapeDtypeStruct(s.shape, jnp.float32) for k, s in param_specs(cfg).items()}
        from zoo.model.params import nest

        f = jax.make_jaxpr(lambda p, t: forward(cfg, p, t))
        return count_eqns(f(nest(params), jax.ShapeDtypeStruct((1, 8), jnp.int32)).jaxpr)

    assert size(2, 0) == size(10, 0)
    assert size(2, 1) == size(10, 1)  # a remainder costs the same at any depth


def _strided_slices(jaxpr) -> list[tuple[int, ...]]:
    """The operand shapes of every strided slice in a jaxpr and its nested ones."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "slice" and any(s != 1 for s in eqn.params.get("strides") or ()):
            out.append(eqn.invars[0].aval.shape)
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                out += _strided_slices(inner)
    return out


def test_a_repeated_block_reads_its_layers_without_a_strided_copy_under_remat():
    """Under remat, a (sliding, full) pattern scans each block position's layers as a view of the stack
    ([repeats, period, ...], a reshape, zoo.model.layer_scan.Strided) indexed in the body: no strided slice of a
    stack, which XLA copies (on Qwen3-Next-80B's step for 4 TPU chips, 12 copies of 3 GiB of experts). Without
    remat the strided slices stay (tests/test_blockwise.py: the backward reads them as they are)."""
    import dataclasses

    from zoo.model.params import nest

    kinds = ("sliding", "full") * 2
    cfg = dataclasses.replace(CFG, num_layers=len(kinds), layer_types=kinds, sliding_window=4)
    params = nest({k: jax.ShapeDtypeStruct(s.shape, jnp.float32) for k, s in param_specs(cfg).items()})
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: forward(cfg, p, t, remat="full"))(params, tokens)
    assert "scan" in str(jaxpr)
    assert _strided_slices(jaxpr.jaxpr) == []
    assert _strided_slices(jax.make_jaxpr(lambda p, t: forward(cfg, p, t))(params, tokens).jaxpr)


def test_every_parameter_carries_logical_axes():
    # A Decoder built from a parameter dict (NumPy-drawn: nnx's random init compiles a kernel per shape)
    model = Decoder(CFG, lora_base_params(CFG))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(flat) == len(param_specs(CFG))
    for path, var in flat:
        axes = var.get_metadata()["logical_axes"]
        assert len(axes) == var.get_value().ndim, path
        assert all(a in LOGICAL_RULES for a in axes), path


def test_rule_table_maps_to_mesh_axes_and_drops_what_does_not_divide():
    devices = [jax.devices()[0]]
    mesh = make_mesh(devices=devices)
    # The weights' embedding axis is shared by the FSDP and the context-parallel devices (zoo.model.context).
    assert logical_to_spec(("layers", "embed", "heads", "head_dim")) == jax.sharding.PartitionSpec(
        None, ("fsdp", "context"), "tensor", None)
    assert logical_to_spec(("batch", "sequence")) == jax.sharding.PartitionSpec(("data", "fsdp"), "context")
    # On a 1-device mesh nothing is split.
    assert logical_to_spec(("vocab", "embed"), (80, 48), mesh) == jax.sharding.PartitionSpec(None, None)


def test_mesh_size_errors_are_clear():
    with pytest.raises(ValueError, match="needs 4 devices"):
        make_mesh(data=2, fsdp=2, devices=[jax.devices()[0]])


def _remat_case(num_layers: int, rows: int, seq: int):
    """A tiny Llama's params and its next-token loss(params, remat) on fixed random tokens [rows, seq]."""
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=num_layers,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = lora_base_params(cfg)  # random weights drawn with NumPy: nnx's init compiles a kernel per shape
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (rows, seq)), jnp.int32)

    def loss(p, remat):
        logp = jax.nn.log_softmax(forward(cfg, p, tokens, remat=remat))
        return -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean()

    return params, loss


@pytest.mark.slow
def test_remat_policies_keep_gradients_and_cut_saved_activations():
    # Twelve layers, so that the activations saved across layers outweigh one layer's scratch memory; 8 rows of
    # 128 tokens (one attention block: a quarter less to compile than 4 rows of 256).
    """Slow (about 48 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    params, loss = _remat_case(num_layers=12, rows=8, seq=128)

    def grad_fn(remat):
        return jax.jit(jax.grad(lambda p: loss(p, remat)))

    compiled = {r: grad_fn(r).lower(params).compile() for r in ("none", "full", "save_dots")}
    ref = compiled["none"](params)
    temp = {}
    for remat, fn in compiled.items():
        for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(fn(params))):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
        temp[remat] = fn.memory_analysis().temp_size_in_bytes
    # Without remat the backward keeps every activation of every layer; "full" keeps only each layer's
    # input, and "save_dots" adds the weight matmuls' outputs (so it must sit strictly between the two).
    assert temp["full"] < 0.7 * temp["none"], temp
    assert temp["full"] < 0.9 * temp["save_dots"] < 0.9 * temp["none"], temp


def test_mlp_chunk_counts_divide_the_sequence():
    from zoo.layers.mlp import MLP_CHUNK_TOKENS, mlp_chunks

    assert mlp_chunks(8, 512) == 8 * 512 // MLP_CHUNK_TOKENS == 4
    assert mlp_chunks(16, 512) == 8
    assert mlp_chunks(1, MLP_CHUNK_TOKENS) == 1  # small batches run in one pass
    assert mlp_chunks(3, 1000) == 2  # the largest divisor of seq within the token budget
    assert mlp_chunks(1024, 7) == 7  # never more chunks than positions
    from zoo.kernels.choice import target

    with target("tpu", 8):
        assert mlp_chunks(16, 512) == 1  # a chip's own [tokens, mlp] buffers are small beside its HBM


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_chunked_mlp_equals_one_pass_and_shrinks_the_backward(monkeypatch, lora):
    """The MLP scanned over sequence chunks gives the one-pass logits and gradients (base weights, or LoRA
    adapters over a frozen base), and the backward pass's [tokens, mlp] temporaries shrink with the chunk.
    Slow (about 36 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    from zoo.layers import mlp as zoo_mlp
    from zoo.lora.params import LoraConfig, init_lora, lora_scale
    from zoo.lora.weights import Weights

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = lora_base_params(cfg)  # random weights drawn with NumPy: nnx's init compiles a kernel per shape
    lc = LoraConfig(rank=4)
    # init_lora jitted and B != 0 drawn with NumPy: eager jax ops and jax.random compile a kernel per shape
    rng = np.random.RandomState(2)
    adapters = jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + 0.05 * rng.normal(size=a.shape), jnp.float32),
                            jax.jit(init_lora, static_argnums=(0, 1))(cfg, lc, jax.random.key(1)))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (4, 128)), jnp.int32)

    def compiled():
        def loss(p, ad):
            w = Weights(p, ad, lora_scale(lc)) if lora else p
            logp = jax.nn.log_softmax(forward(cfg, w, tokens, remat="full"))
            return -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean()

        fn = jax.jit(jax.value_and_grad(loss, argnums=1 if lora else 0))
        return fn.lower(params, adapters).compile()

    monkeypatch.setattr(zoo_mlp, "MLP_CHUNK_TOKENS", 10**9)
    whole = compiled()
    monkeypatch.setattr(zoo_mlp, "MLP_CHUNK_TOKENS", 64)  # 4 x 128 tokens -> 8 chunks of [4, 16]
    assert zoo_mlp.mlp_chunks(4, 128) == 8
    chunked = compiled()
    (l1, g1), (l8, g8) = whole(params, adapters), chunked(params, adapters)
    np.testing.assert_allclose(float(l8), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    t1, t8 = (c.memory_analysis().temp_size_in_bytes for c in (whole, chunked))
    assert t8 < 0.75 * t1, (t8, t1)


def test_remat_offload_gives_the_loss_and_gradients_of_no_remat():
    """``remat: offload`` (the layers' inputs and attention projections' outputs kept in host memory) runs on the CPU, where
    host and device memory are one, and gives no-remat's loss and gradients (float32, one step's worth)."""
    params, loss = _remat_case(num_layers=3, rows=2, seq=32)

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, "none")))(params)
    off = jax.value_and_grad(lambda p: loss(p, "offload"))
    # The residuals go to the host (the CPU's lowering then drops the copies): each layer's input and its
    # attention projections' outputs, stacked over the 3 layers (k's and v's [3, 2, 32, 16] among them), as
    # MaxText offloads them; the MLP's gate and up ([3, 2, 32, 64]) are recomputed, kept nowhere.
    jaxpr = str(jax.make_jaxpr(off)(params))
    assert "f32<host>[3,2,32,16]" in jaxpr and "f32<host>[3,2,32,32]" in jaxpr
    assert "[3,2,32,64]" not in jaxpr
    got_loss, got_grads = jax.jit(off)(params)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(got_grads), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-6)
