"""Context parallelism (mesh.context, zoo.model.context): the sequence split over devices, attention gathering the keys.
Loss and gradients on 8 simulated devices against one device (text models, and a Gemma 3 vision-language model
whose image blocks straddle the shards), and the config's refusal of rows that do not split."""

import json
import subprocess
import sys

import numpy as np
import pytest

from pretrain.config import load_config
from tests.processes import devices_env
from tests.vlm_models import IMAGE_TOKEN, gemma3_row, image, make_gemma3
from zoo.checkpoints.format import read_config
from zoo.cli import main
from zoo.data.vision_layout import image_patches, layout_rows
from zoo.errors import UserError

# One subprocess, 8 simulated CPU devices: a tiny Llama (packed rows, padding) and a tiny Gemma-2-like model
# (sliding and full layers, logit soft-caps), each unsharded on one device, then under the meshes named; a tiny
# Gemma 3 vision-language model likewise (its image blocks across the shards); then splash attention under context parallelism on 2 of the devices against blockwise attention on one (SPLASH).
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
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from pretrain.batch import TokenBatch
from pretrain.task import next_token_loss_sums
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.params import flatten, param_specs, nest
from zoo.model.sharding import make_mesh, named_sharding

def positions(seg):
    pos = np.zeros_like(seg)
    for i in range(1, seg.shape[1]):
        pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
    return pos

def sharded(cfg, flat, batch, sizes, f, ref, n, g_ref):
    # f's loss and gradients on the mesh of sizes (weights by their specs, rows over data x fsdp) against ref's
    mesh = make_mesh(**sizes, devices=jax.devices())
    specs = param_specs(cfg)
    p = nest({k: jax.device_put(v, named_sharding(mesh, specs[k].axes, v.shape)) for k, v in flat.items()})
    rows = NamedSharding(mesh, P(("data", "fsdp"), None))
    b = jax.tree.map(lambda x: jax.device_put(x, rows), batch)
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).lower(p, b).compile()
    hlo = compiled.as_text()
    (got, m), g = compiled(p, b)
    # Attention's key bias (the vision tower's) has no gradient: it adds one constant to a query's every logit,
    # which softmax ignores. Its float noise is no measure, so it is held to zero in both instead.
    flat_g, flat_ref = (flatten(x) for x in (g, g_ref))
    zero = [k for k in flat_g if k.endswith("k_bias")]
    diffs = [float(np.max(np.abs(np.asarray(flat_g[k]) - np.asarray(flat_ref[k])))
                   / (np.max(np.abs(np.asarray(flat_ref[k]))) + 1e-12)) for k in flat_g if k not in zero]
    return {"loss": float(got), "ref": float(ref), "count": [float(m), float(n)], "grad_rel": max(diffs),
            "zero_grad": max([float(np.max(np.abs(np.asarray(x[k])))) for k in zero for x in (flat_g, flat_ref)] +
                             [0.0]),
            "all_gather": "all-gather" in hlo, "hlo": hlo}

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
                                     attn_softcap=20.0, final_softcap=15.0),
          # Llama 4's chunks (5 positions, restarting with each document: they straddle the shards) and a NoPE
          # layer with the query temperature
          "llama4-like": ModelConfig(family="llama4", **base, layer_types=("chunked", "full"), attention_chunk_size=5,
                                     nope_layers=(1,), temperature_tuning=True, temperature_floor=2.0,
                                     qk_l2_norm=True)}
meshes = {"llama": [dict(fsdp=2, context=4), dict(fsdp=1, context=8)], "gemma2-like": [dict(fsdp=2, context=4)],
          "llama4-like": [dict(fsdp=2, context=4)]}
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
        key = name + " " + " x ".join(f"{k} {v}" for k, v in sizes.items())
        out[key] = sharded(cfg, flat, batch, sizes, f, ref, n, g_ref)
        out[key]["q_shard"] = f"f32[{2 // sizes['fsdp']},2,2,{t // sizes['context']},8]" in out[key].pop("hlo")

# A tiny Gemma 3 vision-language model (sys.argv[1]: its checkpoint and rows, from the fixture) under fsdp 2 x
# context 4: its image blocks (4 tokens, bidirectional; a sliding window of 3) straddle the shards' boundaries.
import zoo
from pretrain.batch import VisionBatch
data = np.load(sys.argv[1] + "/rows.npz")
cfg = zoo.read_config(sys.argv[1] + "/zoo")
flat = {k: np.asarray(v) for k, v in flatten(zoo.load_params(sys.argv[1] + "/zoo")).items()}
params = nest(flat)
seg = data["segment_ids"]
vis = {k[len("vision_"):]: data[k] for k in data.files if k.startswith("vision_")}
vis["patches"] = vis["patches"].reshape(len(seg), -1)
batch = TokenBatch(inputs=data["tokens"][:, :-1], targets=data["tokens"][:, 1:], weights=data["weights"],
                   segment_ids=seg, positions=positions(seg), vision=VisionBatch(**vis))
def vlm_loss(c):
    def loss(p, b):
        o = next_token_loss_sums(c, Weights(p), b, jnp.float32, "none")
        return o.loss, o.count
    return loss
f = jax.value_and_grad(vlm_loss(cfg), has_aux=True)
(ref, n), g_ref = jax.jit(f)(params, batch)
sizes = dict(fsdp=2, context=4)
out["gemma3 vlm"] = sharded(cfg, flat, batch, sizes, f, ref, n, g_ref)
out["gemma3 vlm"]["q_shard"] = f"f32[1,2,2,{seg.shape[1] // 4},16]" in out["gemma3 vlm"].pop("hlo")
# the blocks matter: the same loss with image tokens causal, unsharded
causal = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, image_blocks=False))
out["gemma3 vlm"]["causal"] = float(jax.jit(vlm_loss(causal))(params, batch)[0])  # the loss alone: no gradients
""" + SPLASH


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """SCRIPT's results, run once for the tests below: {"context": by model and mesh, "splash": by window}.

    Its Gemma 3 vision-language model, converted from transformers' here (the subprocess imports no torch): two
    rows of 32 tokens, images at 6 and 22 (tokens 6-9 and 22-25, across the context shards' boundaries at 8 and
    24) and at 14 (14-17, across 16) with padding after it, so each shard sees half of a block."""
    root = tmp_path_factory.mktemp("context_vlm")
    make_gemma3(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    cfg = read_config(root / "zoo")
    tokens = np.stack([gemma3_row(33, [6, 22], seed=1), gemma3_row(33, [14], seed=2)])
    seg = np.array([[1] * 32, [1] * 28 + [0] * 4], np.int32)
    laid = [[image_patches(cfg.vision, image(k)[0]) for k in ks] for ks in ([1, 2], [3])]
    vision = layout_rows(cfg.vision, laid, 2 * 16)
    weights = ((seg != 0) & (tokens[:, 1:] != IMAGE_TOKEN)).astype(np.float32)
    np.savez(root / "rows.npz", tokens=tokens, segment_ids=seg, weights=weights,
             **{"vision_" + k: v for k, v in vision.items()})
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(root)], capture_output=True, text=True,
                       env=devices_env(8), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_context_parallel_loss_and_gradients_equal_one_device(runs):
    """Slow (one 8-device subprocess, shared with the splash test below: five compiles of a two-layer model's
    loss and gradients): context 4 x fsdp 2 and context 8 against the unsharded step in float32, packed documents
    with padding, a sliding-window model with soft-caps and one with Llama 4's chunks under context 4 x fsdp 2.
    Each device attends a quarter
    (an eighth) of every row, so the offsets of its queries, the gathered keys' segment ids and the window across
    shard boundaries all count."""
    got = {k: v for k, v in runs["context"].items() if k != "gemma3 vlm"}
    assert len(got) == 4, got
    for name, r in got.items():
        assert r["count"][0] == r["count"][1], name
        np.testing.assert_allclose(r["loss"], r["ref"], rtol=1e-5, err_msg=name)
        assert r["grad_rel"] < 1e-5, (name, r["grad_rel"])
        assert r["all_gather"], name  # the keys gathered over the context devices
        assert r["q_shard"], name  # each device's queries: [b, kv, g, t / context, d]


@pytest.mark.slow
def test_image_blocks_across_context_shards_equal_one_device(runs):
    """Slow (the 8-device subprocess above): a tiny Gemma 3 vision-language model's loss and gradients (tower,
    projector and language model) under fsdp 2 x context 4 equal one device's in float32, with image blocks
    straddling the shards' boundaries: each shard's queries read their block's keys gathered from the next shard
    (the keys' block ids gathered as the segment ids are), and the image features are scattered over the sharded
    tokens by GSPMD. The blocks matter: with image tokens causal the loss differs."""
    r = runs["context"]["gemma3 vlm"]
    assert r["count"][0] == r["count"][1]
    np.testing.assert_allclose(r["loss"], r["ref"], rtol=1e-5)
    assert r["grad_rel"] < 1e-5, r["grad_rel"]
    assert r["zero_grad"] < 1e-6, r["zero_grad"]  # the tower's key bias: no gradient (see SCRIPT's sharded)
    assert r["all_gather"] and r["q_shard"]  # each device's queries: [1, kv, g, 32 / 4, d]
    assert abs(r["causal"] - r["ref"]) > 1e-3 * abs(r["ref"]), r


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
