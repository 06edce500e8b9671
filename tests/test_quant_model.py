"""A model whose frozen base is quantized (QLoRA) runs and trains its adapters exactly as the same model on the
dequantized weights, keeps the base quantized for the backward pass, and gives the base no gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.lora_fixtures import lora_lm_loss
from tests.processes import devices_env
from tests.quant_fixtures import quantized_projections, random_params, tiny_config
from zoo.lora.params import LoraConfig, init_lora
from zoo.model import quant
from zoo.model.params import flatten, nest


@jax.jit
def _dequantized(flat: dict) -> dict:
    """Every quantized weight dequantized (jitted: one compilation, not one per eager op and shape)."""
    return {k: quant.dequantize(v) if isinstance(v, quant.QuantizedWeight) else v for k, v in flat.items()}


# A dense model with biases (qwen2: llama's projections, each quantized the same way, plus q/k/v biases beside them;
# llama itself ran every check below the same way and was dropped as a case for time) and an MoE one (mixtral).
# Cached per family, not only per fixture: the 8-device test below reads mixtral's without the fixtures' parameters.
LORA = dict(rank=4, alpha=8.0, targets="all")  # MESH_CHILD's too


@functools.cache
def _setup(family: str):
    cfg = tiny_config(family)
    qflat = quantized_projections(cfg, random_params(cfg, std=0.1))
    lcfg = LoraConfig(**LORA)
    lora = jax.jit(init_lora, static_argnums=(0, 1))(cfg, lcfg, jax.random.PRNGKey(1))
    # NumPy, float32 before it is placed: jax.random and eager conversions compile a program per shape
    rng = np.random.RandomState(2)
    lora = jax.tree.map(lambda a: jax.device_put((np.asarray(a) + rng.normal(0, 0.05, a.shape)).astype(np.float32)),
                        lora)  # B != 0
    # 8 rows: the batch the 8-device test splits over its (data, fsdp) mesh
    tokens = jax.device_put(rng.randint(0, cfg.vocab_size, (8, 16)).astype(np.int32))
    return cfg, qflat, lcfg, lora, tokens


@functools.cache
def _quantized_grads(family: str):
    """The quantized model's loss and gradients of the adapters and of the base (remat none), from one compiled
    program that three tests read: the adapters' against the dequantized weights' and the 8-device mesh's, the
    base's that it gets none."""
    cfg, qflat, lcfg, lora, tokens = _setup(family)
    return jax.jit(jax.value_and_grad(lambda l, p: lora_lm_loss(cfg, p, l, lcfg, tokens), argnums=(0, 1),
                                      allow_int=True))(lora, nest(qflat))


@pytest.fixture(scope="module", params=["qwen2", "mixtral"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def setup(family):
    return _setup(family)


@pytest.fixture(scope="module")
def quantized_grads(family):
    return _quantized_grads(family)


@pytest.mark.slow
def test_every_projection_is_quantized_and_nothing_else(setup):
    """Slow (about 82 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    cfg, qflat, *_ = setup
    quantized = {k for k, v in qflat.items() if isinstance(v, quant.QuantizedWeight)}
    assert quantized == set(quant.quantized_paths(cfg))
    names = {k.rpartition(".")[2] for k in quantized}
    assert {"q", "k", "v", "o"} <= names and ({"gate", "up", "down"} <= names
                                              or {"expert_gate", "expert_up", "expert_down"} <= names)
    assert not any(n in k for k in quantized for n in ("embed", "head", "norm", "router", "bias"))


@functools.cache
def _dequantized_grads(family: str):
    """The same model's loss and adapter gradients on the dequantized weights (remat none): the reference each
    remat policy's quantized run is held to."""
    cfg, qflat, lcfg, lora, tokens = _setup(family)
    return jax.jit(jax.value_and_grad(lambda l, p: lora_lm_loss(cfg, p, l, lcfg, tokens)))(lora,
                                                                                         nest(_dequantized(qflat)))


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_adapter_gradients_equal_lora_on_the_dequantized_weights(family, setup, quantized_grads, remat):
    """Every remat policy's quantized run against one reference, LoRA on the dequantized weights without remat
    (remat recomputes the same values: one compiled reference per model, not one per policy).
    Slow (about 153 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    cfg, qflat, lcfg, lora, tokens = setup
    if remat == "full" and cfg.num_experts:
        remat = "save_dots"  # the third policy, on the MoE model
    if remat == "none":  # the quantized run's program, shared with test_the_quantized_base_gets_no_gradient
        lq, (gq, _) = quantized_grads
    else:  # jitted, the weights as arguments (not constants): one compilation, cheaper than running op by op
        lq, gq = jax.jit(jax.value_and_grad(lambda l, p: lora_lm_loss(cfg, p, l, lcfg, tokens, remat)))(
            lora, nest(qflat))
    ld, gd = _dequantized_grads(family)
    assert abs(float(lq) - float(ld)) <= 1e-6
    for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gd)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5
    assert max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(gq)) > 1e-4  # the check has teeth


@pytest.mark.slow
def test_the_quantized_base_gets_no_gradient(setup, quantized_grads):
    cfg = setup[0]
    grads = quantized_grads[1][1]  # d(loss)/d(base), allow_int: float0 for the integer fields
    for path, g in flatten(grads).items():
        if path in quant.quantized_paths(cfg):
            continue
        assert g.dtype != jax.dtypes.float0
    for path in quant.quantized_paths(cfg):
        node = grads
        for part in path.split("."):
            node = node[part]
        for leaf in jax.tree.leaves(node):
            assert leaf.dtype == jax.dtypes.float0 or not np.any(np.asarray(leaf)), path


@pytest.mark.slow
def test_backward_pass_keeps_the_base_quantized(setup):
    """No float array the size of a stacked projection is saved for the backward pass.

    Slow (slow lane): builds and quantizes a tiny model per family (10-17 s each)."""
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints

    cfg, qflat, lcfg, lora, tokens = setup
    stacked = {tuple(jax.eval_shape(quant.dequantize, v).shape) for v in qflat.values()  # shapes: nothing run
               if isinstance(v, quant.QuantizedWeight)}
    per_layer = {s[1:] for s in stacked}
    res = saved_residuals(lambda l: lora_lm_loss(cfg, nest(qflat), l, lcfg, tokens), lora)
    floats = [r[0] for r in res if jnp.issubdtype(r[0].dtype, jnp.floating)]
    assert not [r for r in floats if tuple(r.shape) in stacked | per_layer], floats
    # ... while on the float base, the same step does keep them (the check can fail)
    res_d = saved_residuals(lambda l: lora_lm_loss(cfg, nest(_dequantized(qflat)), l, lcfg, tokens), lora)
    assert [r for r, _ in res_d if tuple(r.shape) in stacked | per_layer]


# The quantized QLoRA step on the mesh, of _setup("mixtral")'s model (rebuilt here: NumPy, seeded), adapters and
# tokens (handed over): its loss and adapter gradients written back for the parent to hold to its one-device run.
MESH_CHILD = """
import sys
sys.modules["torch"] = None  # transformers' config classes (tiny_config) would import it: seconds, not needed
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tests.lora_fixtures import lora_lm_loss
from tests.quant_fixtures import quantized_projections, random_params, tiny_config
from zoo.model import quant
from zoo.lora.params import LoraConfig
from zoo.model.params import flatten, nest
from zoo.model.sharding import make_mesh
assert len(jax.devices()) == 8
cfg = tiny_config("mixtral")
qflat = quantized_projections(cfg, random_params(cfg, std=0.1))
lora = dict(np.load(sys.argv[1]))
tokens = lora.pop("tokens")
lcfg = LoraConfig(rank=4, alpha=8.0, targets="all")
step = jax.jit(jax.value_and_grad(lambda l, p, t: lora_lm_loss(cfg, nest(p), l, lcfg, t)))
mesh = make_mesh(data=2, fsdp=4)
rep = NamedSharding(mesh, P())
# The quantized fields split over fsdp as training places them (zoo.model.quant.place), the rest replicated.
placed = {k: quant.place(v, mesh) if isinstance(v, quant.QuantizedWeight) else jax.device_put(v, rep)
          for k, v in qflat.items()}
assert any(not x.sharding.is_fully_replicated for v in placed.values() if isinstance(v, quant.QuantizedWeight)
           for x in jax.tree.leaves(v))
loss, grads = step(jax.device_put(nest(lora), rep), placed,
                   jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp")))))
np.savez(sys.argv[2], loss=np.asarray(loss), **{k: np.asarray(v) for k, v in flatten(grads).items()})
print("ok")
"""


@pytest.mark.slow
def test_qlora_on_an_8_device_mesh_equals_one_device(tmp_path):
    """Slow (slow lane): a subprocess on 8 simulated devices compiles the QLoRA step on the mesh; the one-device
    run is this process's (the gradient tests' own program)."""
    import subprocess
    import sys
    from pathlib import Path

    _, _, lcfg, lora, tokens = _setup("mixtral")
    assert {"rank": lcfg.rank, "alpha": lcfg.alpha, "targets": lcfg.targets} == LORA  # what the child builds
    np.savez(tmp_path / "in.npz", tokens=np.asarray(tokens), **{k: np.asarray(v) for k, v in flatten(lora).items()})
    p = subprocess.run([sys.executable, "-c", MESH_CHILD, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                       capture_output=True, text=True, env=devices_env(8), timeout=600,
                       cwd=Path(__file__).resolve().parent.parent)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
    many = dict(np.load(tmp_path / "out.npz"))
    loss, (grads, _) = _quantized_grads("mixtral")
    assert abs(float(loss) - float(many.pop("loss"))) <= 1e-6, (loss, many)
    one = flatten(grads)
    assert many.keys() == one.keys()
    for k, g in one.items():
        assert np.abs(np.asarray(g) - many[k]).max() <= 1e-5, k


@pytest.mark.slow
def test_kv_cache_decoding_reads_the_quantized_base(setup):
    """Generation (training-time eval tasks, GRPO's rollouts) runs on the quantized base as on its dequantized
    weights.
    Slow (about 58 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    from zoo.model.decode import forward_cached, init_cache

    cfg, qflat, *_ = setup
    tokens = np.arange(1, 6, dtype=np.int32)[None]
    outs = []
    # the cache made inside: one compilation each, not one per eager op and shape
    run = jax.jit(lambda params, tokens: forward_cached(cfg, params, tokens, init_cache(cfg, 1, 16)))
    for params in (qflat, _dequantized(qflat)):
        out = run(nest(params), tokens)
        outs.append(np.asarray(out[0] if isinstance(out, tuple) else out))
    assert outs[0].shape[-1] == cfg.vocab_size and np.abs(outs[0] - outs[1]).max() <= 1e-5
