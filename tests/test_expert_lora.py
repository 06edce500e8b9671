"""LoRA on MoE experts: the expert targets, adapters per expert inside the grouped (ragged) expert matmul against
a dense per-expert loop written here, training that moves only the adapters, and the PEFT export (peft's
target_parameters) loaded by peft with the same logits; the router and what peft cannot express are one-line errors.
The adapters sharded over the ``expert`` mesh axis and run expert-parallel (QLoRA bases too): tests/test_moe.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.lora_fixtures import (
    LORA_CONFIGS,
    LORA_TOKENS,
    lora_base_params,
    peft_logits_against_ours,
    random_lora,
    write_adapter_checkpoint,
)
from tests.program_checks import ragged_dots
from zoo.errors import UserError
from zoo.lora.params import LoraConfig, lora_specs, target_modules
from zoo.model import quant
from zoo.model.params import flatten

EXPERTS = ["experts.gate_proj", "experts.up_proj", "experts.down_proj"]
TOL = 1e-4


def _adapted(cfg, targets) -> set[str]:
    return {p.rpartition(".")[0] for p in lora_specs(cfg, LoraConfig(rank=2, targets=targets))}


def test_expert_targets_name_only_their_weights():
    cfg = LORA_CONFIGS["deepseek"]  # a dense first layer, routed and shared experts, MLA (no attention adapters)
    routed = {"layers.expert_gate", "layers.expert_up", "layers.expert_down"}
    shared = {"layers.shared_gate", "layers.shared_up", "layers.shared_down"}
    dense = {"dense_layers.gate", "dense_layers.up", "dense_layers.down"}
    assert _adapted(cfg, EXPERTS) == routed
    assert _adapted(cfg, ["experts.gate_up_proj", "experts.down_proj"]) == routed  # transformers 5's fused names
    assert _adapted(cfg, ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]) == shared
    assert _adapted(cfg, ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]) == dense
    assert _adapted(cfg, ["experts.down_proj"]) == {"layers.expert_down"}
    assert _adapted(cfg, ["gate_proj", "up_proj", "down_proj"]) == routed | shared | dense  # as before: every MLP's
    assert _adapted(cfg, r".*\.experts\..*") == routed  # a regex on peft's module path
    assert _adapted(cfg, "all") == routed | shared | dense
    # The record (on the model: a regex meets its towers' paths alone) keeps the fewest names: a regex picking
    # gate_proj does not list experts.gate_proj besides it.
    assert target_modules(LoraConfig(targets=r".*gate_proj"), cfg) == ("gate_proj",)
    assert target_modules(LoraConfig(targets="all")) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj")
    a, b = (lora_specs(cfg, LoraConfig(rank=2, targets=EXPERTS))[f"layers.expert_up.{x}"] for x in "ab")
    assert a.shape == (2, 8, 64, 2) and a.axes == ("layers", "expert", "embed", None)  # [layers, experts, in, r]
    assert b.shape == (2, 8, 2, 16) and b.axes == ("layers", "expert", None, "mlp")


@pytest.mark.parametrize("targets", [["gate"], "router", ["experts.up_proj", "mlp.gate"], ["block_sparse_moe.gate"]])
def test_naming_the_router_is_a_one_line_error(targets):
    with pytest.raises(UserError) as e:
        LoraConfig(rank=2, targets=targets)
    msg = str(e.value)
    assert "\n" not in msg and "router" in msg and "stays frozen" in msg and "experts.gate_proj" in msg


def test_expert_targets_on_a_dense_model_are_a_one_line_error():
    with pytest.raises(UserError) as e:
        lora_specs(LORA_CONFIGS["llama"], LoraConfig(rank=2, targets=EXPERTS))
    assert "\n" not in str(e.value) and "name no weight of this llama model" in str(e.value)


# --- adapters per expert inside the grouped matmul, against a dense loop over the experts ----------------------

MOE = dataclasses.replace(LORA_CONFIGS["mixtral"], hidden_size=32, num_heads=2, head_dim=16, num_experts=4,
                          experts_per_token=2, moe_intermediate_size=16, shared_experts=1)
MOE_NAMES = ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down")


def _one_layer(tree: dict) -> dict:  # in NumPy: eager indexing compiles a program per shape
    return {k: jax.tree.map(lambda x: np.asarray(x)[0], v) for k, v in tree["layers"].items()}


def _dense_loop(x, p, lora, scale):
    """The MoE layer written out: every expert on every token (a dense loop), each weighted by its routing weight
    (zero where the token did not pick it); softmax routing, top 2, renormalized; the shared expert on all."""
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    kth = jnp.sort(probs, axis=-1)[:, -MOE.experts_per_token][:, None]
    picked = jnp.where(probs >= kth, probs, 0.0)
    picked = picked / picked.sum(-1, keepdims=True)

    def proj(h, name, e=None):
        w, a, b = p[name], lora[name]["a"], lora[name]["b"]
        if e is not None:
            w, a, b = w[e], a[e], b[e]
        return h @ w + scale * (h @ a) @ b

    out = jnp.zeros_like(x)
    for e in range(MOE.num_experts):
        h = jax.nn.silu(proj(x, "expert_gate", e)) * proj(x, "expert_up", e)
        out = out + picked[:, e:e + 1] * proj(h, "expert_down", e)
    h = jax.nn.silu(proj(x, "shared_gate")) * proj(x, "shared_up")
    return out + proj(h, "shared_down")


@pytest.mark.parametrize("base", ["float", pytest.param("nf4", marks=pytest.mark.slow)])
def test_expert_adapter_gradients_equal_a_dense_loop(base):
    """moe_mlp's dropless path (one ragged_dot per projection and per adapter factor, whatever the expert count)
    gives the dense loop's output and adapter gradients; on an NF4 base (QLoRA) the loop reads the dequantized
    stacks. Every adapter (A and B of the experts' and the shared expert's three projections) has a gradient."""
    from zoo.layers.moe import moe_mlp
    from zoo.lora.projections import LayerLora

    lc = LoraConfig(rank=2, targets=[*EXPERTS, "shared_experts.gate_proj", "shared_experts.up_proj",
                                     "shared_experts.down_proj"])
    p = _one_layer(lora_base_params(MOE))
    # weights ~0.2: teeth (scaled in NumPy, then placed: a closed-over NumPy array cannot be indexed by a tracer)
    p = {k: jax.device_put(v * 10 if k.startswith(("expert", "shared")) else v) for k, v in p.items()}
    lora = _one_layer(random_lora(MOE, lc, random=True))
    assert set(lora) == set(MOE_NAMES)
    if base == "nf4":
        p = {k: quant.quantize(np.asarray(v), 1 if k.startswith("expert") else 0, 1, "nf4", True)
             if k in MOE_NAMES else v for k, v in p.items()}
    # jitted: one program, not one compilation per eager op and shape
    ref_p = jax.jit(lambda p: {k: quant.materialize(v) for k, v in p.items()})(p)
    x = jnp.asarray(np.random.RandomState(1).normal(0, 1, (2, 6, MOE.hidden_size)), jnp.float32)
    scale = 2.0

    def ours(lora):
        return moe_mlp(x, p, MOE, jnp.ones(x.shape[:2], bool), LayerLora(lora, scale))[0]

    def loop(lora):
        return _dense_loop(x.reshape(-1, MOE.hidden_size), ref_p, lora, scale).reshape(x.shape)

    cot = jnp.asarray(np.random.RandomState(2).normal(0, 1, x.shape), jnp.float32)
    got, got_g = jax.jit(jax.value_and_grad(lambda lo: jnp.sum(ours(lo) * cot)))(lora)
    want, want_g = jax.jit(jax.value_and_grad(lambda lo: jnp.sum(loop(lo) * cot)))(lora)
    assert abs(float(got) - float(want)) <= 1e-4 * abs(float(want))
    for path, g in flatten(want_g).items():
        np.testing.assert_allclose(np.asarray(flatten(got_g)[path]), np.asarray(g), atol=1e-5, rtol=1e-4,
                                   err_msg=path)
        assert float(np.abs(np.asarray(g)).max()) > 1e-3, path  # each adapter matters: the comparison has teeth
    # grouped, not a loop: 3 base + 6 adapter grouped matmuls, whatever the expert count (ragged_dot as traced for
    # a TPU; other platforms tile it: zoo.layers.grouped)
    from zoo.kernels.choice import target

    with target("tpu", 1):
        assert ragged_dots(jax.make_jaxpr(ours)(lora).jaxpr) == 9


@pytest.mark.slow  # slow lane: a LoRA train step's compilation, three steps
def test_training_steps_move_only_the_expert_adapters():
    """Three optimizer steps of the LoRA train step (pretrain.jit_step) with expert targets: every expert adapter
    moves (A too, after B left zero), the base weights are a frozen input left as they were, no other weight has
    an adapter, and the loss falls."""
    import optax

    from pretrain.batch import TokenBatch
    from pretrain.jit_step import init_state, make_step
    from zoo.lora.weights import LoraRun
    from zoo.model.sharding import make_mesh

    cfg, lc = dataclasses.replace(MOE, num_layers=1, shared_experts=0), LoraConfig(rank=4, alpha=8.0, targets=EXPERTS)
    params = lora_base_params(cfg)
    before = {k: np.asarray(v) for k, v in flatten(params).items()}
    lora = random_lora(cfg, lc)  # B = 0, as a run starts
    assert {p.rpartition(".")[0] for p in flatten(lora)} == {f"layers.{w}" for w in ("expert_gate", "expert_up",
                                                                                      "expert_down")}
    tx = optax.adam(1e-2)
    t = np.asarray(LORA_TOKENS)
    mb = {"inputs": t[:, :-1], "targets": t[:, 1:], "weights": np.ones(t[:, 1:].shape, np.float32),
          "segment_ids": np.ones(t[:, 1:].shape, np.int32),
          "positions": np.tile(np.arange(t.shape[1] - 1, dtype=np.int32), (t.shape[0], 1))}
    batch = TokenBatch.of({k: jnp.asarray(v[None]) for k, v in mb.items()})
    step, _ = make_step(cfg, tx, jnp.float32, "none", None, None, None, LoraRun.of(lc))
    mesh = make_mesh(devices=jax.devices()[:1])
    # Copies (the step donates its state) placed on the mesh as a run places them (init_state keeps its input's
    # placement): the state the step returns then has the first call's shardings, and the three steps run one
    # compiled program, not two.
    placed = jax.device_put(jax.tree.map(np.array, lora), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    state = init_state(tx, placed, mesh)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch, params)
        losses.append(float(metrics["loss"]))
    assert len(step.compiled) == 1  # one program for every step
    assert losses[-1] < losses[0]
    start, trained = flatten(lora), flatten(state["params"])
    assert set(trained) == set(start)
    for path, v in trained.items():
        moved = np.abs(np.asarray(v) - np.asarray(start[path])).max(axis=tuple(range(2, v.ndim)))  # [layer, expert]
        assert (moved > 0).all(), path  # every layer's every expert's adapter (each expert got tokens)
    for path, v in flatten(params).items():
        np.testing.assert_array_equal(np.asarray(v), before[path], err_msg=path)


# Sharded over the expert axis and run expert-parallel on 8 simulated devices (float and QLoRA bases): tests/test_moe.py's
# test_expert_adapters_shard_over_the_expert_axis_and_run_expert_parallel (one subprocess for every expert-parallel
# check).


# --- PEFT export: target_parameters on transformers 5's fused experts, loaded by peft -------------------------

def test_fused_factors_give_each_experts_delta():
    """lora_A / lora_B of a fused gate_up_proj (gate and up adapted, or up alone) and of down_proj, combined as
    peft's ParamWrapper combines them (its einsum, written here), give each expert's per-part delta in
    transformers' [experts, out, in] layout; an interleaved layout (gpt-oss) alternates the parts' rows."""
    from convert.peft_experts import FusedParam, lora_a, lora_b

    rng = np.random.RandomState(0)
    experts, embed, mlp, r = 3, 5, 4, 2
    a = {n: rng.normal(size=(experts, embed, r)) for n in ("expert_gate", "expert_up")}
    b = {n: rng.normal(size=(experts, r, mlp)) for n in ("expert_gate", "expert_up")}

    def peft_delta(la, lb):  # peft's ParamWrapper.get_delta_weight (experts, swapped in/out), scaling 1
        rank = la.shape[0] // experts
        return np.einsum("ore,eri->eoi", lb.reshape(lb.shape[0], rank, experts), la.reshape(experts, rank, -1))

    gate = np.einsum("eir,ero->eoi", a["expert_gate"], b["expert_gate"])  # zoo A @ B, as [experts, out, in]
    up = np.einsum("eir,ero->eoi", a["expert_up"], b["expert_up"])
    blocks = FusedParam("gate_up_proj", ("expert_gate", "expert_up"))
    both = ("expert_gate", "expert_up")
    np.testing.assert_allclose(peft_delta(lora_a(blocks, both, a), lora_b(blocks, both, b)),
                               np.concatenate([gate, up], axis=1), atol=1e-12)
    np.testing.assert_allclose(peft_delta(lora_a(blocks, ("expert_up",), a), lora_b(blocks, ("expert_up",), b)),
                               np.concatenate([np.zeros_like(gate), up], axis=1), atol=1e-12)
    woven = FusedParam("gate_up_proj", ("expert_gate", "expert_up"), interleaved=True)
    want = np.stack([gate, up], axis=2).reshape(experts, 2 * mlp, embed)  # rows gate0, up0, gate1, up1 ...
    np.testing.assert_allclose(peft_delta(lora_a(woven, both, a), lora_b(woven, both, b)), want, atol=1e-12)
    want = np.stack([np.zeros_like(up), up], axis=2).reshape(experts, 2 * mlp, embed)  # up alone: gate rows zero
    np.testing.assert_allclose(peft_delta(lora_a(woven, ("expert_up",), a), lora_b(woven, ("expert_up",), b)), want,
                               atol=1e-12)


@pytest.fixture(scope="module")
def bases(tiny_family):
    """family -> (HF folder, zoo base), shared read-only (conftest.py's tiny_family)."""

    class Lazy(dict):
        def __missing__(self, family: str) -> tuple[Path, Path]:
            _, root = tiny_family(family)
            self[family] = (root / "hf", root / "zoo")
            return self[family]

    return Lazy()


@pytest.mark.slow
@pytest.mark.parametrize("family,lc", [
    ("mixtral", LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", *EXPERTS])),
    ("deepseek_v3", LoraConfig(rank=4, alpha=6.0, rslora=True, targets=["experts.gate_proj", "experts.down_proj"])),
    ("qwen3_moe", LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", *EXPERTS])),
    ("glm4_moe", LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", *EXPERTS])),
    ("gpt_oss", LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", *EXPERTS])),
    ("minimax_m2", LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", *EXPERTS])),
])
def test_peft_loads_expert_adapters_with_equal_logits(bases, tmp_path, family, lc):
    """Slow (a conversion, the export, and peft + transformers on each tiny model: about 20 s each).
    `zoo export --adapter` writes the experts' adapters as peft's target_parameters on transformers 5's fused
    mlp.experts.gate_up_proj / down_proj (rank and alpha patterns where gate and up share one), which peft 0.21
    loads key for key with our logits (1e-4); DeepSeek's case adapts gate without up, with rsLoRA; gpt-oss's
    gate_up_proj is stored [in, out] with gate and up interleaved, its SwiGLU clamped (limit 1.5 bites here)."""
    from safetensors.numpy import load_file

    from zoo.cli import main

    hf, base = bases[family]
    adapter = write_adapter_checkpoint(base, tmp_path / "adapter", lc)
    assert main(["export", str(adapter), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    # deepseek_v3's two first layers are dense, qwen3_moe's layer 1 (mlp_only_layers), glm4_moe's layer 0
    experts, layer = {"mixtral": (4, 0), "deepseek_v3": (8, 3), "qwen3_moe": (8, 2), "glm4_moe": (8, 1),
                      "gpt_oss": (4, 0), "minimax_m2": (8, 0)}[family]
    fused = f"base_model.model.model.layers.{layer}.mlp.experts.base_layer.lora_A.weight"
    if family != "deepseek_v3":
        assert config["target_modules"] == ["q_proj", "o_proj"]
        assert (config["rank_pattern"], config["alpha_pattern"]) == ({"mlp.experts.gate_up_proj": 8},
                                                                     {"mlp.experts.gate_up_proj": 16})
        assert saved[fused].shape == (8 * experts, 64)  # gate and up: rank 2 x 4, expert-major
    else:
        assert config["target_modules"] == [] and config["rank_pattern"] == {} and config["use_rslora"]
        assert saved[fused].shape == (4 * experts, 64)
    card = (tmp_path / "peft" / "README.md").read_text()
    assert "mlp.experts.gate_up_proj, mlp.experts.down_proj" in card  # the card names what the adapter adapts
    diff, teeth = peft_logits_against_ours(hf, adapter, tmp_path / "peft")
    assert teeth > 0.1 and diff <= TOL, (diff, teeth)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.slow
def test_peft_export_refuses_what_peft_cannot_express(bases, tmp_path, capsys, monkeypatch):
    """Slow (a DeepSeek-V3 and a GLM-4.5 conversion, shared with the test above). peft 0.21 rewrites a
    deepseek_v3 (or glm4_moe) model's gate_proj / up_proj / down_proj targets to the fused routed experts, so
    adapters on its shared experts (or dense MLP) cannot load as such: one line, nothing written; a family without
    a fused-experts layout refuses its expert adapters in one line."""
    from convert import peft_experts
    from zoo.cli import main

    _, base = bases["deepseek_v3"]
    adapter = write_adapter_checkpoint(base, tmp_path / "shared", LoraConfig(rank=2, targets=[
        "experts.gate_proj", "shared_experts.up_proj"]))
    capsys.readouterr()
    assert main(["export", str(adapter), "--adapter", "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert "layers.shared_up" in line and "peft rewrites up_proj" in line and "export the merged model" in line
    assert not (tmp_path / "out").exists()
    _, glm = bases["glm4_moe"]  # GLM-4.5's dense first layer: a Linear down_proj that peft rewrites too
    dense = write_adapter_checkpoint(glm, tmp_path / "dense", LoraConfig(rank=2, targets=["mlp.down_proj", *EXPERTS]))
    capsys.readouterr()  # the conversion's progress
    assert main(["export", str(dense), "--adapter", "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert "dense_layers.down" in line and "glm4_moe model peft rewrites down_proj" in line
    assert not (tmp_path / "out").exists()
    experts = write_adapter_checkpoint(base, tmp_path / "experts", LoraConfig(rank=2, targets=EXPERTS))
    monkeypatch.delitem(peft_experts.EXPERTS_LAYOUTS, "deepseek_v3")
    assert main(["export", str(experts), "--adapter", "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert "routed experts" in line and "no PEFT layout for deepseek_v3" in line and not (tmp_path / "out").exists()
