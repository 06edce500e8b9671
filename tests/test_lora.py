"""LoRA adapters (zoo.lora.params): beside the base matmuls in the layer scan, equal to merged weights, sharded like
their base, gradients for the adapters only."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.lora_fixtures import LORA_CONFIGS, LORA_TOKENS, lora_base_params, random_lora
from tests.processes import devices_env
from tests.program_checks import saved_residuals
from zoo.errors import UserError
from zoo.lora.params import LoraConfig, lora_scale, lora_specs, merge_lora
from zoo.lora.weights import LoraRun, Weights
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward
from zoo.model.params import flatten, nest, param_specs

_merge = jax.jit(merge_lora, static_argnums=(0, 3))
_forward = jax.jit(forward, static_argnums=(0,))


def _logits(cfg: ModelConfig, params: dict, lora: dict | None = None, scale: float | None = None) -> np.ndarray:
    """Jitted forward on LORA_TOKENS (the scale is traced, so scales share one compilation)."""
    scale = None if lora is None else jnp.float32(scale)
    return np.asarray(_forward(cfg, Weights(params, lora, scale), LORA_TOKENS))


def _max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_fresh_adapters_leave_the_model_unchanged(name):
    cfg, lc = LORA_CONFIGS[name], LoraConfig(rank=4)
    params = lora_base_params(cfg)
    lora = random_lora(cfg, lc)
    assert all(float(np.abs(np.asarray(v)).max()) > 0 for k, v in flatten(lora).items() if k.endswith(".a"))
    base = _logits(cfg, params)
    got = _logits(cfg, params, lora, lora_scale(lc))
    assert _max_diff(got, base) <= 1e-6


CASES = {
    "llama-all": ("llama", LoraConfig(rank=4)),
    "gemma2-all": ("gemma2", LoraConfig(rank=4, alpha=8.0)),
    "mixtral-experts": ("mixtral", LoraConfig(rank=4)),
    "mixtral-capacity": ("mixtral", LoraConfig(rank=4)),
    "deepseek-mla-experts": ("deepseek", LoraConfig(rank=4)),
    "llama-q-v": ("llama", LoraConfig(rank=4, targets=["q_proj", "v_proj"])),
    "llama-regex": ("llama", LoraConfig(rank=4, targets=r".*\.(o|down)_proj")),
}
# The base weights each case adapts (suffixes after the stack prefix).
ADAPTED = {
    "llama-q-v": {"layers.q", "layers.v"},
    "llama-regex": {"layers.o", "layers.down"},
    "mixtral-experts": {f"layers.{w}" for w in ("q", "k", "v", "o", "expert_gate", "expert_up", "expert_down")},
    "deepseek-mla-experts": {f"dense_layers.{w}" for w in ("gate", "up", "down")}
    | {f"layers.{w}" for w in ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up",
                               "shared_down")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_adapters_equal_merged_weights(case):
    name, lc = CASES[case]
    cfg = LORA_CONFIGS[name]
    if case == "mixtral-capacity":
        cfg = dataclasses.replace(cfg, capacity_factor=4.0)  # roomy: no token dropped
    params = lora_base_params(cfg)
    lora = random_lora(cfg, lc, random=True)
    if case in ADAPTED:
        assert {p.rpartition(".")[0] for p in flatten(lora)} == ADAPTED[case]
    got = _logits(cfg, params, lora, lora_scale(lc))
    merged = _logits(cfg, _merge(cfg, params, lora, lc))
    base = _logits(cfg, params)
    assert _max_diff(got, merged) <= 1e-5
    assert _max_diff(merged, base) > 1e-2  # the adapters do change the model: the comparison has teeth


def test_rslora_scales_by_the_square_root_of_the_rank():
    assert lora_scale(LoraConfig(rank=16, alpha=32.0)) == 2.0
    assert lora_scale(LoraConfig(rank=16, alpha=32.0, rslora=True)) == 8.0
    cfg = LORA_CONFIGS["llama"]
    params = lora_base_params(cfg)
    plain, rs = LoraConfig(rank=4, alpha=4.0), LoraConfig(rank=4, alpha=4.0, rslora=True)  # scale 1 vs 2
    lora = random_lora(cfg, plain, random=True)
    a = _logits(cfg, params, lora, lora_scale(plain))
    b = _logits(cfg, params, lora, lora_scale(rs))
    assert _max_diff(a, b) > 1e-2
    assert _max_diff(a, _logits(cfg, params, lora, 1.0)) == 0 and _max_diff(b, _logits(cfg, params, lora, 2.0)) == 0
    assert _max_diff(b, _logits(cfg, _merge(cfg, params, lora, rs))) <= 1e-5


def _loss(cfg, params, lora, scale):
    logp = jax.nn.log_softmax(forward(cfg, Weights(params, lora, scale), LORA_TOKENS))
    return -jnp.take_along_axis(logp[:, :-1], LORA_TOKENS[:, 1:, None], -1).mean()


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_gradients_reach_b_first_and_a_only_through_b(name):
    cfg, lc = LORA_CONFIGS[name], LoraConfig(rank=4)
    params = lora_base_params(cfg)
    lora = random_lora(cfg, lc)
    grad = jax.jit(jax.grad(lambda l, p: _loss(cfg, p, l, lora_scale(lc))))  # params: not differentiated
    g = flatten(grad(lora, params))
    assert set(g) == set(flatten(lora))
    for path, v in g.items():
        assert np.isfinite(np.asarray(v)).all(), path
        if path.endswith(".b"):
            assert float(np.abs(np.asarray(v)).max()) > 0, path
        else:  # dA = x^T (dy B^T) scale, and B is zero at step 0
            assert float(np.abs(np.asarray(v)).max()) == 0, path
    # in NumPy: eager jax ops compile a program per op and shape
    stepped = {k: np.asarray(v) - np.asarray(g[k]) if k.endswith(".b") else v for k, v in flatten(lora).items()}
    before = _logits(cfg, params)
    after = _logits(cfg, params, nest(stepped), lora_scale(lc))
    assert _max_diff(after, before) > 1e-3


def test_adapter_gradients_skip_the_base_weight_gradients():
    """Differentiating the adapters only must not compute the base weights' gradients (the price of merging
    A @ B into W): about 2/3 of the flops of a full backward pass (forward, dx, no dW)."""
    cfg = dataclasses.replace(LORA_CONFIGS["llama"], hidden_size=256, intermediate_size=512, head_dim=64,
                              num_layers=2)
    lc = LoraConfig(rank=4)
    params, lora = lora_base_params(cfg), random_lora(cfg, lc)

    def flops(argnums):
        # Counted on the lowered program, as JAX emits it, before XLA's optimizations: compiling can only drop work
        # (it gave the same ratio, 0.68), and costs two compilations of seconds each.
        f = jax.jit(jax.grad(lambda p, l: _loss(cfg, p, l, 2.0), argnums))
        return f.lower(params, lora).cost_analysis()["flops"]

    assert flops(1) < 0.8 * flops((0, 1))


def test_adapters_keep_no_extra_activations_and_no_weight_copies():
    """The A matmuls share the fused norm + projection (normed_dense, glu_dense), so LoRA keeps no normed x
    for the backward pass: still three [tokens, embed] arrays per layer, and the adapters are read from
    the argument, never from stacked copies."""
    cfg = dataclasses.replace(LORA_CONFIGS["llama"], num_layers=4)
    lc = LoraConfig(rank=4)
    params, lora = lora_base_params(cfg), random_lora(cfg, lc)
    tokens = LORA_TOKENS[:, :8]
    residuals = saved_residuals(lambda l: forward(cfg, Weights(params, l, 2.0), tokens).sum(), lora)
    assert sum(shape == (4, 2, 8, 64) for shape, _ in residuals) == 3, residuals
    adapter_shapes = {v.shape for v in flatten(lora).values()}  # stacked over layers, as scanned
    kept = [(shape, src) for shape, src in residuals if shape in adapter_shapes]
    assert kept and all(src.startswith("from the argument") for _, src in kept), kept


def test_bfloat16_base_with_float32_adapters():
    """float32 adapters on a bfloat16 base: the adapter path runs in float32 and is cast back, the gradients
    stay float32, and the result is the float32 model's up to bfloat16 rounding."""
    cfg, lc = LORA_CONFIGS["llama"], LoraConfig(rank=4)
    params, lora = lora_base_params(cfg), random_lora(cfg, lc, random=True)
    # cast in NumPy (round to nearest even, as XLA's convert): eager astype compiles a program per shape
    half = jax.tree.map(lambda x: jax.device_put(np.asarray(x).astype(jnp.bfloat16)), params)
    got = _logits(cfg, half, lora, lora_scale(lc))
    want = _logits(cfg, params, lora, lora_scale(lc))
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert _max_diff(got, want) < 0.05 * _max_diff(want, _logits(cfg, params))
    assert _merge(cfg, half, lora, lc)["layers"]["q"].dtype == jnp.bfloat16
    g = jax.jit(jax.grad(lambda l: _loss(cfg, half, l, lora_scale(lc))))(lora)
    assert all(v.dtype == jnp.float32 and np.isfinite(np.asarray(v)).all() for v in flatten(g).values())


def test_specs_follow_the_base_weight_axes():
    cfg = LORA_CONFIGS["mixtral"]
    base, specs = param_specs(cfg), lora_specs(cfg, LoraConfig(rank=4))
    assert specs["layers.q.a"].shape == (3, 64, 4) and specs["layers.q.a"].axes == ("layers", "embed", None)
    assert specs["layers.q.b"].shape == (3, 4, 4, 16)
    assert specs["layers.q.b"].axes == ("layers", None, "heads", "head_dim")
    assert specs["layers.o.a"].axes == ("layers", "heads", "head_dim", None)
    assert specs["layers.expert_down.a"].shape == (3, 4, 48, 4)
    assert specs["layers.expert_down.b"].axes == ("layers", "expert", None, "embed")
    for path, spec in specs.items():
        w = base[path.rpartition(".")[0]]
        assert spec.axes.count(None) >= 1 and len(spec.axes) == len(spec.shape), path
        assert set(spec.axes) - {None} <= set(w.axes), path


def test_bad_targets_are_user_errors():
    with pytest.raises(UserError, match="q_proj, k_proj"):
        LoraConfig(targets=["q_proj", "qkv_proj"])
    with pytest.raises(UserError, match="matches none"):
        LoraConfig(targets="attn.*")
    with pytest.raises(UserError, match="not a valid regex"):
        LoraConfig(targets="(q_proj")
    with pytest.raises(UserError, match="MLA"):
        lora_specs(LORA_CONFIGS["deepseek"], LoraConfig(targets=["q_proj", "o_proj"]))
    cfg = LORA_CONFIGS["llama"]
    with pytest.raises(ValueError, match="lora_scale"):
        forward(cfg, Weights(lora_base_params(cfg), random_lora(cfg, LoraConfig(rank=4))), LORA_TOKENS)


def test_a_runs_weights_are_made_from_its_lora_settings_once():
    """LoraRun.of: a run's LoRA settings as the step needs them (scale, dropout rate, the seed its masks come
    from; None: full fine-tuning). Weights.of joins the trained params to the frozen base with them, with LoRA
    dropout only where a key is given (the train step), none for rollouts and evaluation."""
    run = LoraRun.of(LoraConfig(rank=4, alpha=8.0, dropout=0.25, rslora=True), seed=7)
    assert run == LoraRun(4.0, 0.25, 7) and run.dropout_seed == 7
    assert LoraRun.of(None, 7) is None and LoraRun(4.0, 0.0, 7).dropout_seed is None
    base, adapters, key = {"w": jnp.ones(2)}, {"a": jnp.zeros(2)}, jax.random.key(0)
    whole = Weights.of(base, None, None, key)
    assert whole.base is base and whole.adapters is None and whole.trained is base and whole.rng is None
    trained = Weights.of(adapters, base, run, key)
    assert trained.base is base and trained.trained is adapters and trained.rng is key
    assert (trained.scale, trained.dropout) == (4.0, 0.25)
    sampled = Weights.of(adapters, base, run)
    assert sampled.trained is adapters and (sampled.scale, sampled.dropout, sampled.rng) == (4.0, 0.0, None)


MESH_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from tests.lora_fixtures import LORA_CONFIGS, LORA_TOKENS, lora_base_params, random_lora
from zoo.lora.params import LoraConfig, lora_scale, lora_specs
from zoo.lora.weights import Weights
from zoo.model.decoder import forward
from zoo.model.params import flatten, nest, param_specs
from zoo.model.sharding import make_mesh, named_sharding
assert len(jax.devices()) == 8
cfg, lc = LORA_CONFIGS["llama"], LoraConfig(rank=4)
params = lora_base_params(cfg)
lora = random_lora(cfg, lc, random=True)
f = jax.jit(lambda p, l: forward(cfg, Weights(p, l, lora_scale(lc)), LORA_TOKENS))
one = np.asarray(f(params, lora))
out = {}
for name, sizes in {"fsdp8": dict(fsdp=8), "fsdp2-tensor4": dict(fsdp=2, tensor=4)}.items():
    mesh = make_mesh(**sizes)
    def shard(tree, specs):
        # from host copies: placing an array of device 0 compiles a slicing program per shape
        return nest({k: jax.device_put(np.asarray(v), named_sharding(mesh, specs[k].axes, v.shape))
                     for k, v in flatten(tree).items()})
    p, l = shard(params, param_specs(cfg)), shard(lora, lora_specs(cfg, lc))
    got = np.asarray(f(p, l))
    out[name] = {"diff": float(np.abs(got - one).max()),
                 "q.a": [str(s) for s in l["layers"]["q"]["a"].sharding.spec],
                 "q.b": [str(s) for s in l["layers"]["q"]["b"].sharding.spec]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_adapters_on_8_devices_equal_one_device():
    """Slow (slow lane): a subprocess on 8 simulated devices compiles the forward once per sharding."""
    env = devices_env(8)
    p = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["diff"] <= 1e-5, (name, r)
    # The adapters really are split like their base: A's embed over fsdp, B's heads over tensor.
    assert out["fsdp8"]["q.a"] == ["None", "fsdp", "None"]
    assert out["fsdp2-tensor4"]["q.a"] == ["None", "fsdp", "None"]
    assert out["fsdp2-tensor4"]["q.b"] == ["None", "None", "tensor", "None"]


# LoRA dropout (peft's lora_dropout): the adapter reads dropout(x), the base weight x; training only.

_forward_drop = jax.jit(forward, static_argnums=(0,))  # the dropout rate, a Python float: static in Weights
DROP_KEY = jax.random.key(7)


def _dropped_logits(cfg: ModelConfig, params: dict, lora: dict, scale: float, rate: float,
                    key: jax.Array | None = DROP_KEY) -> np.ndarray:
    """Jitted forward on LORA_TOKENS with LoRA dropout ``rate`` drawn from ``key``."""
    return np.asarray(_forward_drop(cfg, Weights(params, lora, jnp.float32(scale), rate, key), LORA_TOKENS))


DROPOUT_MODELS = ["llama", "gemma2", "mixtral", "deepseek"]


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_no_dropout_rate_or_no_key_is_exactly_the_plain_forward(name):
    """Rate 0, or no key (evaluation), gives today's logits bit for bit, from the same fused program."""
    cfg, lc = LORA_CONFIGS[name], LoraConfig(rank=4)
    params, lora = lora_base_params(cfg), random_lora(cfg, lc, random=True)
    want = _logits(cfg, params, lora, lora_scale(lc))
    assert np.array_equal(_dropped_logits(cfg, params, lora, lora_scale(lc), 0.0), want)
    assert np.array_equal(_dropped_logits(cfg, params, lora, lora_scale(lc), 0.5, None), want)

    def program(**kw):
        return str(jax.make_jaxpr(lambda l: forward(cfg, Weights(params, l, 2.0, **kw), LORA_TOKENS))(lora))

    plain = program()
    assert program(dropout=0.0, rng=DROP_KEY) == plain
    assert program(dropout=0.5) == plain
    assert program(dropout=0.5, rng=DROP_KEY) != plain  # the comparison has teeth


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_dropout_is_deterministic_and_touches_only_the_adapter_branch(name):
    cfg, lc = LORA_CONFIGS[name], LoraConfig(rank=4)
    params = lora_base_params(cfg)
    lora = random_lora(cfg, lc, random=True)
    scale = lora_scale(lc)
    plain = _logits(cfg, params, lora, scale)
    a = _dropped_logits(cfg, params, lora, scale, 0.5)
    assert np.array_equal(a, _dropped_logits(cfg, params, lora, scale, 0.5))  # same key, same masks
    assert _max_diff(a, plain) > 1e-3
    assert _max_diff(a, _dropped_logits(cfg, params, lora, scale, 0.5, jax.random.key(8))) > 1e-3
    # With B = 0 the adapter branch is zero whatever its input: if the base weights read the dropped x,
    # the logits would move. They equal the same adapters' logits without dropout exactly (the same program but for
    # the dropout: against the base model's own program the compiler may round a matmul differently, ~1e-7).
    fresh = random_lora(cfg, lc)
    assert np.array_equal(_dropped_logits(cfg, params, fresh, scale, 0.5), _logits(cfg, params, fresh, scale))


@pytest.mark.slow
def test_dropout_is_unbiased():
    """Inverted dropout keeps the adapter's expected output: averaged over 64 masks, the logits come
    much closer to the no-dropout ones than any single sample does (the noise of the mean is 1/8 of a
    sample's; deterministic keys, so it cannot flake).

    A small scale keeps the logits linear in the adapters' outputs: the expectation passes through the
    adapter's matmuls, not through the softmax and activations after them (with large adapters that
    nonlinearity alone moves the mean)."""
    cfg, lc = LORA_CONFIGS["llama"], LoraConfig(rank=4)
    params, lora = lora_base_params(cfg), random_lora(cfg, lc, random=True)
    scale = 0.05
    plain = _logits(cfg, params, lora, scale)
    keys = jax.random.split(jax.random.key(3), 64)
    samples = np.asarray(jax.jit(jax.vmap(lambda k: forward(cfg, Weights(params, lora, scale, 0.5, k),
                                                            LORA_TOKENS)))(keys))

    def rms(x):
        return float(np.sqrt(np.mean(np.square(x - plain))))

    single = min(rms(s) for s in samples)
    assert single > 1e-3
    assert rms(samples.mean(0)) < 0.25 * single, (rms(samples.mean(0)), single)  # about 1/8 of it


def test_dropout_masks_differ_per_projection_and_scale_the_kept_inputs():
    from zoo.lora.projections import LoraDropout

    x = jnp.ones((4, 8, 64), jnp.float32)
    key1, key2 = jax.random.split(jax.random.key(0))
    # jitted: a program per projection name and dtype (eagerly, each of the draw's operations compiled its own)
    drop = jax.jit(lambda key, x, name: LoraDropout(0.25, key)(x, name), static_argnums=2)
    q, k = (np.asarray(drop(key1, x, name)) for name in ("q", "k"))
    assert set(np.unique(q)) == {0.0, np.float32(1 / 0.75)}  # zeroed, or kept and scaled by 1/(1 - p)
    assert 0.65 < (q != 0).mean() < 0.85
    assert not np.array_equal(q, k)  # each adapted projection draws its own mask
    assert not np.array_equal(q, np.asarray(drop(key2, x, "q")))  # and each layer
    half = drop(key1, np.ones(x.shape, jnp.bfloat16), "q")
    assert half.dtype == jnp.bfloat16


@functools.partial(jax.jit, static_argnums=(0, 1))
def _dropout_grad(cfg: ModelConfig, remat: str, lora: dict, params: dict, key: jax.Array) -> dict:
    """d(next-token loss)/d(adapters) with LoRA dropout 0.5 drawn from ``key`` (traced: one compilation)."""

    def loss(l):
        logits = forward(cfg, Weights(params, l, 2.0, 0.5, key), LORA_TOKENS, remat=remat)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp[:, :-1], LORA_TOKENS[:, 1:, None], -1).mean()

    return jax.grad(loss)(lora)


@pytest.mark.slow
@pytest.mark.parametrize("name,remat", [("llama", "full"), ("gemma2", "save_dots"), ("mixtral", "none"),
                                        ("deepseek", "none")])
def test_adapter_gradients_with_dropout_are_finite(name, remat):
    """Slow (about 31 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    cfg, lc = LORA_CONFIGS[name], LoraConfig(rank=4)
    params, lora = lora_base_params(cfg), random_lora(cfg, lc, random=True)
    g = flatten(_dropout_grad(cfg, remat, lora, params, DROP_KEY))
    other = flatten(_dropout_grad(cfg, remat, lora, params, jax.random.key(8)))
    assert set(g) == set(flatten(lora))
    for path, v in g.items():
        assert np.isfinite(np.asarray(v)).all(), path
        assert float(np.abs(np.asarray(v)).max()) > 0, path
    assert max(_max_diff(g[p], other[p]) for p in g) > 1e-4  # the masks reach the gradients


@pytest.mark.slow
def test_train_step_dropout_depends_on_seed_step_and_micro_batch_only():
    """The LoRA train step draws its masks from (seed, step, micro-batch): the same state and batch give
    the same update (so a resumed run is bit-identical), another step or micro-batch other masks, and
    evaluation applies none.
    Slow (about 73 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU. Three train-step programs (dropout on one and on two micro-batches, another seed), each
    called several times: a step without dropout would be two more."""
    import optax

    from pretrain.batch import TokenBatch
    from pretrain.jit_step import init_state, make_step
    from zoo.model.sharding import make_mesh

    cfg, lc = LORA_CONFIGS["llama"], LoraConfig(rank=4, dropout=0.5)
    params, lora = lora_base_params(cfg), random_lora(cfg, lc, random=True)
    tx = optax.sgd(0.1)
    mesh = make_mesh(devices=jax.devices()[:1])
    t = np.asarray(LORA_TOKENS)
    mb = {"inputs": t[:, :-1], "targets": t[:, 1:], "weights": np.ones(t[:, 1:].shape, np.float32),
          "segment_ids": np.ones(t[:, 1:].shape, np.int32),
          "positions": np.tile(np.arange(t.shape[1] - 1, dtype=np.int32), (t.shape[0], 1))}
    one = TokenBatch.of({k: jnp.asarray(v[None]) for k, v in mb.items()})
    two = TokenBatch.of({k: jnp.asarray(np.stack([v, v])) for k, v in mb.items()})  # the same micro-batch twice

    def steps(rate: float, seed: int = 0):
        return make_step(cfg, tx, jnp.float32, "none", None, None, None, LoraRun(lora_scale(lc), rate, seed))

    # made once, kept on the host: init_state compiles its program at each call, and eager copies one per shape
    start = jax.device_get(init_state(tx, lora, mesh))

    def state(step_number: int = 0, adapters: dict | None = None) -> dict:  # a fresh one each time: it is donated
        return jax.device_put({**start, "step": np.asarray(step_number, np.int32),
                               **({} if adapters is None else {"params": jax.device_get(adapters)})})

    dropped, plain = steps(0.5), steps(0.0)
    s0, m0 = dropped[0](state(), one, params)
    s1, m1 = dropped[0](state(), one, params)
    assert float(m0["loss"]) == float(m1["loss"])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s0["params"]), jax.tree.leaves(s1["params"])))
    loss = float(m0["loss"])
    batch = TokenBatch.of({k: jnp.asarray(v) for k, v in mb.items()})  # one micro-batch, as evaluation reads it
    before = dropped[1](start["params"], batch, params)  # evaluation: no dropout
    base = float(before.loss) / float(before.count)
    assert abs(loss - base) > 1e-3, (loss, base)  # the step's masks move the loss
    assert float(dropped[0](state(1), one, params)[1]["loss"]) != loss  # the next step: other masks
    assert float(steps(0.5, seed=1)[0](state(), one, params)[1]["loss"]) != loss  # another seed: other masks
    # Two equal micro-batches: the second draws other masks than the first (which shares the single batch's
    # key), so their mean loss is not the single batch's. The control, on the same two programs: with B = 0 the
    # adapter branch is zero whatever its masks, and the two mean losses agree to accumulation's rounding.
    fresh = random_lora(cfg, LoraConfig(rank=4))  # lc's shapes; the adapters other tests made (one compilation)
    assert abs(float(dropped[0](state(0, fresh), two, params)[1]["loss"])
               - float(dropped[0](state(0, fresh), one, params)[1]["loss"])) < 1e-6
    assert abs(float(dropped[0](state(), two, params)[1]["loss"]) - loss) > 1e-5
    # Evaluation applies no dropout: the trained adapters evaluate as without dropout, bit for bit.
    assert [float(x) for x in jax.tree.leaves(dropped[1](s0["params"], batch, params))] == \
        [float(x) for x in jax.tree.leaves(plain[1](s0["params"], batch, params))]
