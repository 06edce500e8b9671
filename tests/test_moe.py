"""Mixture of experts: Mixtral, DeepSeek-V2 (MLA, with and without q_lora_rank) and DeepSeek-V3; expert parallelism on 8
simulated devices (loading, training, LoRA and QLoRA adapters on the experts) in one subprocess."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_logits, hf_tensors, make_hf, mean_kl, random_tokens
from tests.processes import devices_env
from zoo.cli import main

# The variants of a family's tiny model (tests/hf_models.py FAMILIES) take 2 layers, a dense one and an MoE one: what
# each variant changes lives in every layer, and each further layer costs compile time (scans of several dense and
# MoE layers: deepseek-v2's and deepseek-v3's own models).
TWO = dict(num_hidden_layers=2, first_k_dense_replace=1)
VARIANTS = {
    "mixtral": ("mixtral", {}),
    "deepseek-v2": ("deepseek_v2", {}),
    # q_lora_rank (the queries through their low-rank projection) and greedy routing (no groups) in one model: two
    # traits of separate code (attention's queries, the router), each against transformers, one compilation
    "deepseek-v2-q-lora-greedy": ("deepseek_v2", dict(q_lora_rank=24, topk_method="greedy", n_group=None,
                                                      topk_group=None, **TWO)),
    "deepseek-v3": ("deepseek_v3", {}),
    "deepseek-v3-no-lora-no-interleave": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False,
                                                              norm_topk_prob=False, **TWO)),
}
SEQ = 24


def _convert(tmp_path, variant):
    family, kw = VARIANTS[variant]
    hf = make_hf(tmp_path / "hf", family, **kw)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """variant -> (its transformers model, its folder: hf/ (transformers' save) and zoo/ (`zoo convert`)), each
    made once for the module's tests, which only read them."""

    class Lazy(dict):
        def __missing__(self, variant: str):
            root = tmp_path_factory.mktemp(variant)
            self[variant] = (_convert(root, variant), root)
            return self[variant]

    return Lazy()


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(converted, variant):
    hf, root = converted[variant]
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    ref = hf_logits(hf, tokens)
    got = np.asarray(zoo.load(root / "zoo")(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5


@pytest.mark.parametrize("variant", ["mixtral", "deepseek-v2-q-lora-greedy", "deepseek-v3"])
def test_round_trip_is_bit_identical(converted, tmp_path, variant):
    root = converted[variant][1]
    assert main(["export", str(root / "zoo"), "--out", str(tmp_path / "back")]) == 0
    assert hf_tensors(root / "hf") == hf_tensors(tmp_path / "back")


def test_experts_and_dense_layers_are_stacked(converted):
    meta = zoo.checkpoints.format.read_meta(converted["deepseek-v3"][1] / "zoo")["params"]
    assert meta["layers.expert_gate"]["shape"] == [2, 8, 64, 16]  # [moe layers, experts, embed, mlp]
    assert meta["layers.expert_gate"]["axes"] == ["layers", "expert", "embed", "mlp"]
    assert meta["dense_layers.gate"]["shape"] == [2, 64, 96]
    assert "dense_layers.expert_gate" not in meta and "layers.gate" not in meta


def _hf_router_logits(hf, tokens):
    with torch.no_grad():
        out = hf(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
    return out.router_logits


def test_load_balancing_loss_matches_transformers(converted):
    """Our aux loss against transformers' own load_balancing_loss_func on the same router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf, root = converted["mixtral"]
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    ref = float(load_balancing_loss_func(_hf_router_logits(hf, tokens), 4, 2))
    _, aux = zoo.load(root / "zoo")(jnp.asarray(tokens), return_aux=True)
    assert abs(float(aux["load_balancing_loss"]) - ref) <= 1e-5
    assert float(aux["loss"]) == pytest.approx(0.02 * ref, abs=1e-6)  # router_aux_loss_coef from the config
    counts = np.asarray(aux["expert_counts"])
    assert counts.shape == (3, 4) and counts.sum() == 3 * tokens.size * 2  # layers x experts; k=2 per token


@pytest.mark.slow
def test_aux_losses_on_a_hand_computed_example():
    """Independent numbers: 2 tokens, 2 experts, top-1, uniform logits for token 0."""
    from zoo.layers.moe import aux_losses, route
    from zoo.model.config import ModelConfig

    cfg = ModelConfig(family="mixtral", vocab_size=8, hidden_size=2, intermediate_size=4, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=2, num_experts=2, experts_per_token=1,
                      moe_intermediate_size=4, aux_loss_coef=0.5, z_loss_coef=0.1)
    # route and aux_losses jitted, their inputs and outputs NumPy: a program each, not one per eager op
    x = np.asarray([[0.0, 0.0], [1.0, 0.0]], np.float32)
    p = {"router": np.asarray([[2.0, 0.0], [0.0, 0.0]], np.float32)}  # token 1: logits (2, 0)
    ids, w, logits = map(np.asarray, jax.jit(route, static_argnums=2)(x, p, cfg))
    assert ids[1, 0] == 0 and float(w[1, 0]) == pytest.approx(1.0)  # renormalized top-1
    probs = np.array([[0.5, 0.5], [np.exp(2) / (np.exp(2) + 1), 1 / (np.exp(2) + 1)]])
    counts = np.zeros(2)
    counts[int(ids[0, 0])] += 1
    counts[0] += 1
    stats = {"expert_counts": counts[None], "router_prob_sum": probs.sum(0)[None],
             "router_lse_sq_sum": np.asarray([(np.log(2) ** 2 + np.log(np.exp(2) + 1) ** 2)]),
             "dropped_tokens": np.zeros(1), "tokens": np.asarray([2.0])}
    aux = jax.jit(aux_losses, static_argnums=1)({k: v.astype(np.float32) for k, v in stats.items()}, cfg)
    lb = 2 * np.sum(counts / 2 * probs.mean(0))
    z = (np.log(2) ** 2 + np.log(np.exp(2) + 1) ** 2) / 2
    assert float(aux["load_balancing_loss"]) == pytest.approx(lb, rel=1e-6)
    assert float(aux["router_z_loss"]) == pytest.approx(z, rel=1e-6)
    assert float(aux["loss"]) == pytest.approx(0.5 * lb + 0.1 * z, rel=1e-6)


@pytest.mark.slow
def test_capacity_factor_drops_and_reports(converted):
    import dataclasses

    hf, root = converted["mixtral"]
    model = zoo.load(root / "zoo")
    tokens = jnp.asarray(random_tokens(hf.config.vocab_size, seq=SEQ))
    exact, aux = model(tokens, return_aux=True)
    assert float(aux["dropped_tokens"]) == 0
    # A generous capacity keeps every token: same logits as dropless.
    roomy = zoo.Decoder(dataclasses.replace(model.cfg, capacity_factor=4.0), model.param_dict())
    got, aux = roomy(tokens, return_aux=True)
    assert float(aux["dropped_tokens"]) == 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol=1e-5)
    # A tight one drops assignments and says how many.
    tight = zoo.Decoder(dataclasses.replace(model.cfg, capacity_factor=0.25), model.param_dict())
    got, aux = tight(tokens, return_aux=True)
    assert float(aux["dropped_tokens"]) > 0
    assert np.abs(np.asarray(got) - np.asarray(exact)).max() > 1e-3


# --- expert parallelism on 8 simulated devices: one subprocess for every check below -------------------------
# ARGV[1]: JSON {"load": {variant: [zoo checkpoint, tokens .npy, logits .npy to write]}, "gemma4": its config}.
# Each section compares against the one-device run of the same program (or the parent's logits), on a
# (fsdp 2, expert 4) mesh; its results go to one JSON line under the section's name.
EP_SCRIPT = r"""
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
import zoo
from zoo.lora.params import LoraConfig, _lead, lora_scale, lora_specs
from zoo.lora.weights import Weights
from zoo.model import quant
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward
from zoo.model.from_hf import model_config_from_hf
from zoo.model.params import flatten, nest, param_specs
from zoo.model.sharding import make_mesh, named_sharding
from zoo.registry.catalogue import DEEPSEEK_V3_TINY
assert len(jax.devices()) == 8
args = json.loads(sys.argv[1])
mesh = make_mesh(data=1, fsdp=2, tensor=1, expert=4)
out = {"load": {}, "qlora": {}}

def manual(lowered):  # the experts ran expert-parallel (shard_map)
    return "sdy.manual_computation" in lowered.as_text() or "shard_map" in lowered.as_text()

# Adapters as init_lora draws them (A ~ U(+-1/sqrt(fan_in)), B = 0) plus N(0, 0.05) on both: B != 0, so that both
# their gradients and their outputs count. Drawn with NumPy: init_lora jitted compiles a program of its own.
def random_adapters(cfg, lcfg, rng):
    return nest({k: ((rng.uniform(-1, 1, s.shape) / np.sqrt(np.prod(s.shape[_lead(s):-1])) if s.init == "lora_a" else 0)
                     + rng.normal(0, 0.05, s.shape)).astype(np.float32) for k, s in sorted(lora_specs(cfg, lcfg).items())})

def max_diff(one, many):  # compared in NumPy: eager jnp ops on sharded results compile a program per shape
    one, many = jax.device_get(one), jax.device_get(many)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)))

# 1. A converted checkpoint loaded expert-parallel (zoo.load with a mesh): its logits to ARGV's file.
for variant, (folder, tokens, logits) in args["load"].items():
    model = zoo.load(folder, mesh=mesh)
    gate = model.param_dict()["layers"]["expert_gate"]
    np.save(logits, np.asarray(model(jnp.asarray(np.load(tokens)))))
    out["load"][variant] = {"spec": [str(s) for s in gate.sharding.spec],
                            "shard": list(gate.addressable_shards[0].data.shape),
                            "devices": len(gate.sharding.device_set)}

# 2. Training: `zoo init deepseek-v3-tiny`'s model cut to 3 layers (its dense one, then two MoE layers: the MoE stack
# still a scan of more than one layer), LoRA on every projection, packed rows with padding.
cfg = dataclasses.replace(model_config_from_hf(DEEPSEEK_V3_TINY), num_layers=3)
rng = np.random.default_rng(0)
# its weights as `zoo init` draws them (N(0, 0.02), norms 1, biases 0), drawn with NumPy: jax.random compiles a
# kernel per shape, seconds each
params = nest({k: (rng.normal(0, 0.02, s.shape) if s.init == "normal" else np.full(s.shape, float(s.init == "ones")))
               .astype(np.float32) for k, s in param_specs(cfg).items()})
lcfg = LoraConfig(rank=4, alpha=8, targets="all-linear")
adapters = random_adapters(cfg, lcfg, rng)
tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 32)), jnp.int32)
seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 8 + [0] * 4], 4, 0), jnp.int32)  # packed, with padding

def loss(params, adapters, tokens, seg):
    logits, aux = forward(cfg, Weights(params, adapters, lora_scale(lcfg)), tokens, segment_ids=seg,
                          return_aux=True)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    return (nll * (seg[:, 1:] > 0)).sum() / (seg[:, 1:] > 0).sum() + aux["loss"]

grad = jax.value_and_grad(loss, argnums=(0, 1))
one = jax.jit(grad)(params, adapters, tokens, seg)  # one device: the dropless path as written
put = lambda tree, specs: nest({k: jax.device_put(v, named_sharding(mesh, specs[k].axes, v.shape))
                               for k, v in flatten(tree).items()})
rows = named_sharding(mesh, ("batch", None), tokens.shape)
placed = (put(params, param_specs(cfg)), put(adapters, lora_specs(cfg, lcfg)), jax.device_put(tokens, rows),
          jax.device_put(seg, rows))
with jax.set_mesh(mesh):  # as the train step is lowered (zoo.model.sharding.mesh_context)
    lowered = jax.jit(grad).lower(*placed)
    many = lowered.compile()(*placed)  # the program inspected is the one run (traced once)
out["train"] = {"diff": max_diff(one, many), "loss": [float(one[0]), float(many[0])], "manual": manual(lowered)}

# 3. QLoRA: expert adapters on NF4 experts, a Mixtral (gate, up and down apart) and a Gemma 4 MoE block (one fused
# gate/up stack beside a dense MLP, its adapter one). One layer each: XLA drops a one-trip layer scan, which halves
# these programs' compile time (an expert-parallel scan of several layers: section 2's).
mixtral = ModelConfig(family="mixtral", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=16, num_experts=8, experts_per_token=2, moe_intermediate_size=16)
cases = {"mixtral": (mixtral, ["experts.gate_proj", "experts.up_proj", "experts.down_proj"], "expert_gate"),
         "gemma4": (ModelConfig.from_dict(args["gemma4"]), ["experts.gate_up_proj", "experts.down_proj"],
                    "expert_gate_up")}
for name, (cfg, targets, gate) in cases.items():
    lc = LoraConfig(rank=2, alpha=4.0, targets=targets)
    rng = np.random.RandomState(0)
    # experts and router 10x the rest, so that routing is far from uniform and every expert's adapter counts
    flat = {k: rng.normal(0, (1.0 if "expert" in k or "router" in k else 0.1) if s.init == "normal" else 0,
                          s.shape).astype(np.float32) + (s.init == "ones")
            for k, s in param_specs(cfg).items()}
    adapters = random_adapters(cfg, lc, rng)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (4, 16)), jnp.int32)
    params = dict(flat)  # the experts' stacks in NF4
    for path, (lead, contract) in quant.quantized_paths(cfg).items():
        if "expert" in path:
            params[path] = quant.quantize(params[path], lead, contract, "nf4", True)

    def qloss(adapters, params):
        logits = forward(cfg, Weights(params, adapters, lora_scale(lc)), tokens)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1).mean()

    grad = jax.value_and_grad(qloss)
    one = jax.jit(grad)(adapters, nest(params))  # one device: the dropless path
    specs = lora_specs(cfg, lc)
    placed_lora = nest({k: jax.device_put(v, named_sharding(mesh, specs[k].axes, v.shape))
                        for k, v in flatten(adapters).items()})
    pspecs = param_specs(cfg)
    placed = nest({k: quant.place(v, mesh) if isinstance(v, quant.QuantizedWeight)
                   else jax.device_put(v, named_sharding(mesh, pspecs[k].axes, v.shape)) for k, v in params.items()})
    with jax.set_mesh(mesh):
        lowered = jax.jit(grad).lower(placed_lora, placed)
        many = lowered.compile()(placed_lora, placed)
    a = flatten(placed_lora)[f"layers.{gate}.a"]
    q = flatten(placed)[f"layers.{gate}"]
    out["qlora"][name] = {
        "diff": max_diff(one, many), "loss": [float(one[0]), float(many[0])], "experts": cfg.num_experts,
        "teeth": min(float(np.abs(g).max()) for g in jax.tree.leaves(jax.device_get(one[1]))),
        "manual": manual(lowered), "adapter_spec": [str(s) for s in a.sharding.spec],
        "adapter_shard": list(a.addressable_shards[0].data.shape), "adapter_shape": list(a.shape),
        "quant_spec": [str(s) for s in q.data["packed"].sharding.spec]}
print(json.dumps(out))
"""
EP_VARIANTS = ["mixtral", "deepseek-v3"]


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory, converted):
    """EP_SCRIPT's results, one subprocess on 8 simulated devices for the three tests below: (results, {variant:
    (its transformers model, its logits on one device, its logits expert-parallel)})."""
    from transformers import Gemma4TextConfig

    from tests.hf_models import BASE, FAMILIES
    from zoo.model.from_hf import model_config_from_hf

    root = tmp_path_factory.mktemp("expert_parallel")
    load, ones = {}, {}
    for variant in EP_VARIANTS:
        hf, folder = converted[variant]
        tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
        (root / variant).mkdir()
        np.save(root / variant / "tokens.npy", tokens)
        ones[variant] = hf, np.asarray(zoo.load(folder / "zoo")(jnp.asarray(tokens)))
        load[variant] = [str(folder / "zoo"), *(str(root / variant / f) for f in ("tokens.npy", "logits.npy"))]
    # Gemma 4's MoE block, as transformers configures it (one layer: see EP_SCRIPT's section 3)
    gemma4 = model_config_from_hf(Gemma4TextConfig(**{
        **BASE, **FAMILIES["gemma4"][2], "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "layer_types": ["full_attention"]}).to_dict())
    p = subprocess.run([sys.executable, "-c", EP_SCRIPT, json.dumps({"load": load, "gemma4": gemma4.to_dict()})],
                       capture_output=True, text=True, env=devices_env(8), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return out, {v: (*ones[v], np.load(root / v / "logits.npy")) for v in EP_VARIANTS}


@pytest.mark.slow
@pytest.mark.parametrize("variant", EP_VARIANTS)
def test_expert_parallel_on_8_devices(expert_parallel, variant):
    """Slow (the expert_parallel subprocess): a converted checkpoint loaded expert-parallel (zoo.load with a
    (fsdp 2, expert 4) mesh) splits its experts over the expert axis and gives the one-device logits."""
    out, runs = expert_parallel
    hf, one, many = runs[variant]
    info = out["load"][variant]
    experts = hf.config.num_local_experts if variant == "mixtral" else hf.config.n_routed_experts
    assert info["spec"][1] == "expert" and info["devices"] == 8
    assert info["shard"][1] == experts // 4  # each device holds a quarter of the experts
    np.testing.assert_allclose(many, one, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_expert_parallel_training_equals_one_device(expert_parallel):
    """Slow (the expert_parallel subprocess: two compilations of a tiny DeepSeek-V3's loss and gradients).
    Under the train step's mesh context with an expert axis, the routed experts run expert-parallel
    (zoo.layers.moe._experts_parallel: each device its experts, a psum over the axis): the loss and the gradients of the
    weights and of LoRA adapters on every projection equal the one-device dropless run's (float32, 1e-6)."""
    out = expert_parallel[0]["train"]
    assert out["manual"], "the experts did not run expert-parallel"
    assert out["loss"][0] == pytest.approx(out["loss"][1], abs=1e-6) and out["diff"] <= 1e-6, out


@pytest.mark.slow
def test_expert_adapters_shard_over_the_expert_axis_and_run_expert_parallel(expert_parallel):
    """Slow (the expert_parallel subprocess: four compilations of tiny models' loss and adapter gradients).
    On a (fsdp 2, expert 4) mesh each expert adapter is split over the expert axis like its stack (a quarter of
    the experts a device), the experts run expert-parallel (shard_map), and the loss and adapter gradients equal
    the one-device run's, on NF4 (QLoRA) bases whose quantized expert fields are placed split over the expert axis
    too: a Mixtral (gate, up and down apart) and a Gemma 4 MoE block (one fused gate/up stack). (A float base with
    adapters on every weight, experts included: test_expert_parallel_training_equals_one_device above.)"""
    out = expert_parallel[0]["qlora"]
    assert set(out) == {"mixtral", "gemma4"}
    for name, r in out.items():
        assert r["manual"], f"{name}: the experts did not run expert-parallel"
        # [layers, experts / 4, embed / 2 (fsdp, as its base), rank]
        assert r["adapter_spec"][:2] == ["None", "expert"], (name, r)
        assert r["adapter_shard"][1] == r["experts"] // 4 and r["adapter_shard"][2] == r["adapter_shape"][2] // 2, r
        assert r["loss"][0] == pytest.approx(r["loss"][1], abs=1e-6) and r["diff"] <= 1e-6, (name, r)
        assert r["teeth"] > 1e-4, (name, r)
        assert r["quant_spec"][:2] == ["None", "expert"], (name, r)


@pytest.mark.slow
def test_tiny_deepseek_v3_registry_entry_builds_and_exports(tmp_path):
    """`zoo init deepseek-v3-tiny` -> export -> transformers builds the same model.
    Slow (about 96 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    from transformers import AutoModelForCausalLM

    assert main(["init", "deepseek-v3-tiny", "--out", str(tmp_path / "zoo"), "--seed", "3"]) == 0
    model = zoo.load(tmp_path / "zoo")
    assert model.cfg.family == "deepseek_v3" and model.cfg.num_experts == 16
    assert main(["export", str(tmp_path / "zoo"), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = random_tokens(512, seq=SEQ)
    ref = hf_logits(hf, tokens)
    got = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4


def test_fp8_weights_are_refused_clearly(tmp_path, capsys):
    import struct

    hf = tmp_path / "hf"
    make_hf(hf, "mixtral")
    header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    capsys.readouterr()
    assert main(["convert", str(hf), "--out", str(tmp_path / "zoo")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # No quantization_config says how to scale it: the one line names the tensor, its dtype and the fix.
    assert len(err) == 1 and "'w'" in err[0] and "float8_e4m3fn" in err[0] and "quantization_config" in err[0]


def test_moe_stacks_compile_independent_of_depth():
    import dataclasses

    from tests.program_checks import count_eqns
    from zoo.model.config import ModelConfig
    from zoo.model.decoder import forward
    from zoo.model.params import nest, param_specs

    base = ModelConfig(family="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                       num_heads=2, num_kv_heads=2, head_dim=12, num_experts=4, experts_per_token=2,
                       moe_intermediate_size=8, dense_layers=1, kv_lora_rank=8, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8)

    def size(layers: int, dense: int) -> int:
        cfg = dataclasses.replace(base, num_layers=layers, dense_layers=dense)
        params = {k: jax.ShapeDtypeStruct(s.shape, jnp.float32) for k, s in param_specs(cfg).items()}
        f = jax.make_jaxpr(lambda p, t: forward(cfg, p, t))
        return count_eqns(f(nest(params), jax.ShapeDtypeStruct((1, 8), jnp.int32)).jaxpr)

    assert size(3, 1) == size(12, 3)


@pytest.mark.parametrize("rows,groups", [(61, 5), (640, 32)])
def test_the_tiled_grouped_matmul_equals_ragged_dot(rows, groups):
    """Off TPUs the experts' grouped matmul runs in blocks of one expert each (zoo.layers.grouped: XLA's CPU ragged_dot
    multiplies every row by every expert): equal to jax.lax.ragged_dot, values and both gradients, with an empty
    group, unequal groups and rows past the groups' total (which come out 0). So is the one with each group's LoRA
    adapter in the same blocks (grouped_matmul_lora), against three ragged_dots: values and every gradient."""
    from zoo.layers.grouped import grouped_matmul, grouped_matmul_lora

    rng = np.random.RandomState(rows)
    sizes = rng.multinomial(rows - 3, np.ones(groups) / groups).astype(np.int32)
    sizes[1] = 0
    sizes[0] += rows - 3 - sizes.sum()
    # float32 in NumPy, then placed: jnp.asarray(..., jnp.float32) compiles a conversion per shape
    x, w, a, b, cot = (jnp.asarray(rng.randn(*shape).astype(np.float32)) for shape in
                       ((rows, 24), (groups, 24, 10), (groups, 24, 4), (groups, 4, 10), (rows, 10)))
    s = jnp.asarray(sizes)

    def values_and_grads(f, *args):
        y, vjp = jax.vjp(f, *args)
        return (y, *vjp(cot))

    def lora_ref(x, w, a, b, scale):
        return jax.lax.ragged_dot(x, w, s) + scale * jax.lax.ragged_dot(jax.lax.ragged_dot(x, a, s), b, s)

    def run(plain, lora):  # jitted, both kinds together: one program, not one compilation per eager op
        return jax.jit(lambda *args: (values_and_grads(plain, *args[:2]), values_and_grads(lora, *args)))(*args)

    args = (x, w, a, b, jnp.float32(0.7))
    want, want_lora = run(lambda x, w: jax.lax.ragged_dot(x, w, s), lora_ref)
    got, got_lora = run(lambda x, w: grouped_matmul(x, w, s, platform="cpu"),
                        lambda *args: grouped_matmul_lora(*args, s, platform="cpu"))
    for name, u, v in zip(("y", "dx", "dw"), want, got, strict=True):
        np.testing.assert_allclose(np.asarray(v), np.asarray(u), rtol=1e-5, atol=1e-4, err_msg=name)
    assert not np.asarray(got[0])[-3:].any()
    want, got = want_lora, got_lora
    for name, u, v in zip(("y", "dx", "dw", "da", "db", "dscale"), want, got, strict=True):
        np.testing.assert_allclose(np.asarray(v), np.asarray(u), rtol=1e-5, atol=1e-4, err_msg=name)
    assert not np.asarray(got[0])[-3:].any() and not np.asarray(got[1])[-3:].any()
