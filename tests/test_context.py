"""Context parallelism (mesh.context, zoo.model.context): the sequence split over devices, attention gathering the keys.
Loss and gradients on 8 simulated devices against one device, and the config's refusal of rows that do not split."""

import json
import subprocess
import sys

import numpy as np
import pytest

from pretrain.config import load_config
from tests.processes import devices_env
from zoo.errors import UserError

# One subprocess, 8 simulated CPU devices: a tiny Llama (packed rows, padding) and a tiny Gemma-2-like model
# (sliding and full layers, logit soft-caps), each unsharded on one device, then under the meshes named; then
# splash attention under context parallelism on 2 of the devices against blockwise attention on one (SPLASH).
SPLASH = r"""
from zoo.layers.attention import attend
from zoo.model.masks import visibility
rng = np.random.RandomState(0)
b, hk, g, t, d = 2, 1, 2, 256, 16
# NumPy inputs: a jax array on one device would be resliced onto the mesh by a program compiled per shape
q, k, v, dout = (rng.randn(*s).astype(np.float32)
                 for s in [(b, hk, g, t, d), (b, hk, t, d), (b, hk, t, d), (b, t, hk * g * d)])
seg = np.stack([np.r_[np.full(100, 1), np.full(120, 2), np.zeros(36)], np.ones(t)]).astype(np.int32)
cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=d, attention="blockwise", attn_softcap=5.0)
splash = {}
for window in (None, 50):
    f = lambda q, k, v, c: jnp.sum(attend(q, k, v, visibility(seg, window), c) * dout)
    # jitted (one compilation, not one per eager op): the unsharded blockwise path on one device
    want = jax.jit(jax.value_and_grad(f, (0, 1, 2)), static_argnums=3)(q, k, v, cfg)
    with jax.set_mesh(make_mesh(fsdp=1, context=2, devices=jax.devices()[:2])):
        got = jax.jit(jax.value_and_grad(f, (0, 1, 2)), static_argnums=3)(
            q, k, v, dataclasses.replace(cfg, attention="splash"))
    splash[str(window)] = [[np.asarray(a).tolist(), np.asarray(c).tolist()]
                           for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
print(json.dumps({"context": out, "splash": splash}))
"""

SCRIPT = r"""
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from pretrain.batch import TokenBatch
from pretrain.task import next_token_loss_sums
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs, nest
from zoo.model.sharding import make_mesh, named_sharding

def positions(seg):
    pos = np.zeros_like(seg)
    for i in range(1, seg.shape[1]):
        pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
    return pos

t = 32
seg = np.array([[1] * 9 + [2] * 13 + [3] * 6 + [0] * 4, [1] * 20 + [2] * 12], np.int32)
rng = np.random.RandomState(0)
tokens = rng.randint(0, 64, (2, t + 1)).astype(np.int32)
# NumPy arrays throughout (batch and weights): device_put of a host array onto a mesh compiles nothing, of a
# jax array on one device it compiles a reslicing program per shape; jax.jit(init_params) compiles for seconds.
batch = TokenBatch(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                   weights=((seg != 0) & (np.roll(seg, -1, 1) == seg)).astype(np.float32),
                   segment_ids=seg, positions=positions(seg))
base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, attention="blockwise")
models = {"llama": ModelConfig(family="llama", **base),
          "gemma2-like": ModelConfig(family="llama", **base, layer_types=("sliding", "full"), sliding_window=5,
                                     attn_softcap=20.0, final_softcap=15.0)}
meshes = {"llama": [dict(fsdp=2, context=4), dict(fsdp=1, context=8)], "gemma2-like": [dict(fsdp=2, context=4)]}
out = {}
for name, cfg in models.items():
    rng = np.random.RandomState(1)  # weights ~ N(0, 0.02), norms 1, drawn with NumPy (see the batch above)
    flat = {k: (rng.normal(0, 0.02, s.shape) if s.init == "normal" else
                np.full(s.shape, 1.0 if s.init == "ones" else 0.0)).astype(np.float32)
            for k, s in sorted(param_specs(cfg).items())}
    params = nest(flat)
    def loss(p, b):
        o = next_token_loss_sums(cfg, Weights(p), b, jnp.float32, "none")
        return o.loss, o.count
    f = jax.value_and_grad(loss, has_aux=True)
    (ref, n), g_ref = jax.jit(f)(params, batch)
    for sizes in meshes[name]:
        mesh = make_mesh(**sizes, devices=jax.devices())
        specs = param_specs(cfg)
        p = nest({k: jax.device_put(v, named_sharding(mesh, specs[k].axes, v.shape)) for k, v in flat.items()})
        rows = NamedSharding(mesh, P(("data", "fsdp"), None))
        b = jax.tree.map(lambda x: jax.device_put(x, rows), batch)
        with jax.set_mesh(mesh):
            lowered = jax.jit(f).lower(p, b)
        compiled = lowered.compile()
        hlo = compiled.as_text()
        (got, m), g = compiled(p, b)
        key = name + " " + " x ".join(f"{k} {v}" for k, v in sizes.items())
        diffs = jax.tree.leaves(jax.tree.map(lambda a, c: float(np.max(np.abs(np.asarray(a) - np.asarray(c)))
                                                            / (np.max(np.abs(np.asarray(c))) + 1e-12)), g, g_ref))
        out[key] = {"loss": float(got), "ref": float(ref), "count": [float(m), float(n)], "grad_rel": max(diffs),
                    "all_gather": "all-gather" in hlo,
                    "q_shard": f"f32[{2 // sizes['fsdp']},2,2,{t // sizes['context']},8]" in hlo}
""" + SPLASH


@pytest.fixture(scope="module")
def runs() -> dict:
    """SCRIPT's results, run once for both tests below: {"context": by model and mesh, "splash": by window}."""
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=devices_env(8),
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_context_parallel_loss_and_gradients_equal_one_device(runs):
    """Slow (one 8-device subprocess, shared with the splash test below: five compiles of a two-layer model's
    loss and gradients): context 4 x fsdp 2 and context 8 against the unsharded step in float32, packed documents
    with padding, and a sliding-window model with soft-caps under context 4 x fsdp 2. Each device attends a quarter
    (an eighth) of every row, so the offsets of its queries, the gathered keys' segment ids and the window across
    shard boundaries all count."""
    got = runs["context"]
    assert len(got) == 3, got
    for name, r in got.items():
        assert r["count"][0] == r["count"][1], name
        np.testing.assert_allclose(r["loss"], r["ref"], rtol=1e-5, err_msg=name)
        assert r["grad_rel"] < 1e-5, (name, r["grad_rel"])
        assert r["all_gather"], name  # the keys gathered over the context devices
        assert r["q_shard"], name  # each device's queries: [b, kv, g, t / context, d]


@pytest.mark.slow
def test_splash_under_context_parallelism_equals_blockwise_on_one_device(runs):
    """Slow (the 8-device subprocess above, 2 of its devices; interpret-mode splash): each of 2 context shards
    runs the splash kernel of its own query offset against the gathered keys (packed documents, padding, soft-cap;
    full and sliding-window masks); the attention's value and dq, dk, dv equal the unsharded blockwise path."""
    for window, pairs in runs["splash"].items():
        for name, (got, want) in zip(("value", "dq", "dk", "dv"), pairs):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                       err_msg=f"window {window}: {name}")


def test_rows_must_split_over_the_context_devices():
    with pytest.raises(UserError, match=r"^data.seq_len 30 must be a multiple of mesh.context 4 "):
        load_config(None, ["model.path=x", "data.path=d.jsonl", "max_steps=1", "data.seq_len=30",
                           "mesh.context=4"]).check()
