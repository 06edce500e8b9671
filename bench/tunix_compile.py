"""Benchmark: Tunix's fine-tuning step beside lmzoo's, both compiled by the TPU compiler from this machine (issue 42).

Command (from the repository root; Tunix 0.1.7 and qwix importable, e.g. installed with ``pip install --target
/tmp/tunix_site --no-deps google-tunix==0.1.7 qwix ...``)::

    PYTHONPATH=/tmp/tunix_site:. python bench/tunix_compile.py --case full-8b-v5p --out full.json
    PYTHONPATH=/tmp/tunix_site:. python bench/tunix_compile.py --case lora-8b-v5e --out lora.json

Options: ``--repeat N`` (rounds; the order of the sides alternates each round), ``--attention blockwise,auto``
(lmzoo's attention kernels, one lmzoo side each), ``--layers N`` (both models cut to N layers: a quick check),
``--seq 2048``, ``--sides tunix,lmzoo``, ``--out FILE.json``. Quick cases at Llama-3.2-1B's shapes on
v5e:2x2: ``--case full-1b-v5e`` / ``lora-1b-v5e`` (with ``--layers 2``, seconds a compile).

The cases (the same settings on both sides: batch 1 a chip, seq 2048, remat none, bf16 weights and compute, AdamW,
fsdp over every chip):

- ``full-8b-v5p``: Llama-3.1-8B full fine-tuning on v5p:2x2x2 (8 chips);
- ``lora-8b-v5e``: Llama-3.1-8B LoRA rank 16 on v5e:2x4 (8 chips), on q, k, v, o, gate, up and down (lmzoo's
  default ``lora.targets: all`` is these seven).

Each side compiles in its own child process (its own libtpu client and Python state; Tunix's import changes
flax's config):

- **Tunix**: ``tunix.models.llama3.model.Llama3`` with ``ModelConfig.llama3p1_8b()`` (its default
  ``ShardingConfig``: weights over ``fsdp``, activations over ``fsdp`` and ``tp``; mesh ``fsdp`` = every chip,
  ``tp`` = 1; ``RematConfig.NONE``, its XLA einsum attention), built abstractly (``nnx.get_abstract_model``:
  ``nnx.eval_shape`` under the mesh, no weights), its weights cast to bfloat16 as
  ``create_model_from_safe_tensors(..., dtype=jnp.bfloat16)`` loads them; for LoRA, ``qwix.apply_lora_to_model``
  with ``qwix.LoraProvider(module_path=".*q_proj|...|.*down_proj", rank=16)`` as ``tunix/cli/utils/model.py``
  does (qwix makes the adapters in the base weights' dtype: bfloat16); ``nnx.Optimizer(model, optax.adamw(...),
  wrt=nnx.LoRAParam or nnx.Param)`` as ``PeftTrainer.__init__`` makes it (Adam's moments follow the trained
  weights: bfloat16). The step is ``PeftTrainer._train_step`` itself (its ``_default_loss_fn`` and
  ``tunix/cli/peft_main.py``'s ``gen_model_input_fn``: positions and the [B, L, L] causal mask built in the
  step), jitted as ``PeftTrainer.jit_train_and_eval_step`` jits it (``nnx.jit(train_step,
  donate_argnames=("optimizer",))``) and lowered with abstract inputs sharded as ``PeftTrainer.train`` shards
  them (``P("fsdp")``). The trainer object is made without its ``__init__`` (which would initialize an
  optimizer on real weights and open checkpoint and metrics writers), with the four attributes the step reads.
  **Patched**: ``tunix.models.llama3.model.shard``, which returns its input unconstrained whenever
  ``jax.devices()[0].platform == "cpu"`` (here, a CPU host compiling for a TPU topology, it always is) and
  otherwise reads the mesh of ``with mesh:``; the patch constrains as Tunix does on a TPU host, to
  ``NamedSharding(mesh, PartitionSpec(*axes))`` of the benchmark's mesh. Nothing else is changed.
- **lmzoo**: ``sft train --config C --compile-only --topology T --report R.json``, C a temporary config with
  ``model.path`` ``llama3.1-8b`` (or a ``config.json`` with ``--layers``), ``model.attention`` (``blockwise``,
  the closest to Tunix's XLA einsum attention, and ``auto``: splash attention's kernel on TPU), ``data.seq_len``,
  ``batch_size`` = chips, ``remat: none``, ``dtype`` bfloat16 for params and compute, ``lora.rank``. lmzoo's
  adapters are float32 (and so their Adam moments); a full fine-tuning's moments follow the bfloat16 weights.

Bytes a chip are the TPU compiler's (``memory_analysis()``, through ``zoo.compiled.chip_bytes.compiled_bytes``):
arguments, temporaries, outputs not aliased to a donated argument, and the program's code; total = their sum
(lmzoo's report gives ``total``, ``activations`` = temporaries and ``outputs``; its arguments + code are the rest).
A program the compiler refuses as over the chip's HBM reports the temporaries the compiler needed (its message)
and arguments = the shards of the step's inputs, as ``--compile-only`` does. Ratios are lmzoo / Tunix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
ROOT = Path(__file__).resolve().parent.parent
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: the model (Tunix's ModelConfig factory, lmzoo's registry name), the slice and LoRA rank."""

    tunix_model: str  # a classmethod of tunix.models.llama3.model.ModelConfig
    lmzoo_model: str  # a registry name with a released config
    topology: str
    chips: int
    lora_rank: int


CASES = {
    "full-8b-v5p": Case("llama3p1_8b", "llama3.1-8b", "v5p:2x2x2", 8, 0),
    "lora-8b-v5e": Case("llama3p1_8b", "llama3.1-8b", "v5e:2x4", 8, 16),
    "full-1b-v5e": Case("llama3p2_1b", "llama3.2-1b", "v5e:2x2", 4, 0),
    "lora-1b-v5e": Case("llama3p2_1b", "llama3.2-1b", "v5e:2x2", 4, 16),
}


def tunix_side(case: Case, seq: int, layers: int | None) -> dict:
    """Compile Tunix's PeftTrainer train step for ``case`` (in this process); its bytes a chip."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import qwix
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
    from tunix.models.llama3 import model as llama
    from tunix.sft import peft_trainer
    from tunix.sft import utils as sft_utils

    from zoo.compiled.chip_bytes import compiled_bytes, compiler_refusal, shard_bytes
    from zoo.compiled.compiler import compile_lowered
    from zoo.compiled.topology import hbm_bytes, topology_devices

    devices = topology_devices(case.topology)
    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)

    def shard(x, s):
        # Tunix's shard() without its `jax.devices()[0].platform == "cpu"` early return: a TPU host constrains.
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*s)))

    llama.shard = shard
    cfg = getattr(llama.ModelConfig, case.tunix_model)()
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    assert cfg.remat_config == llama.RematConfig.NONE

    def init():
        model = llama.Llama3(cfg, rngs=nnx.Rngs(0))
        for _, v in nnx.iter_graph(model):  # bfloat16 weights, as create_model_from_safe_tensors(dtype=bf16)
            if isinstance(v, nnx.Param):
                v.set_value(v.get_value().astype(jnp.bfloat16))
        if case.lora_rank:  # as tunix/cli/utils/model.py's apply_lora_to_model
            provider = qwix.LoraProvider(module_path="|".join(f".*{t}" for t in LORA_TARGETS),
                                         rank=case.lora_rank, alpha=2.0 * case.lora_rank)
            model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1), **model.get_model_input())
        optimizer = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.LoRAParam if case.lora_rank else nnx.Param)
        return model, optimizer

    graphdef, abstract = nnx.get_abstract_model(init, mesh)
    model, optimizer = nnx.merge(graphdef, abstract)

    def gen_model_input_fn(x: peft_trainer.TrainingInput) -> dict:
        # tunix/cli/peft_main.py's, verbatim (pad id 0)
        pad_mask = x.input_tokens != 0
        positions = sft_utils.build_positions_from_mask(pad_mask)
        attention_mask = sft_utils.make_causal_attn_mask(pad_mask)
        return {"input_tokens": x.input_tokens, "input_mask": x.input_mask, "positions": positions,
                "attention_mask": attention_mask}

    trainer = object.__new__(peft_trainer.PeftTrainer)  # the attributes PeftTrainer._train_step reads
    trainer.loss_fn = peft_trainer._default_loss_fn
    trainer.gen_model_input_fn = gen_model_input_fn
    trainer._lora_enabled = sft_utils.is_lora_enabled(model)
    trainer._has_aux = False
    assert trainer._lora_enabled == bool(case.lora_rank)
    step = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",))
    rows = len(devices)  # batch 1 a chip
    data = NamedSharding(mesh, PartitionSpec("fsdp"))
    inputs = peft_trainer.TrainingInput(input_tokens=jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=data),
                                        input_mask=jax.ShapeDtypeStruct((rows, seq), jnp.bool_, sharding=data))
    started = time.perf_counter()
    lowered = step.lower(model, optimizer, inputs)
    refused = None
    try:
        arguments, temps, outputs, code = compiled_bytes(compile_lowered(lowered, "tpu"))
    except Exception as e:  # over the chip's HBM: the compiler's figure for the temporaries is the answer
        refused = compiler_refusal(str(e))
        if refused is None:
            raise
        arguments, temps, outputs, code = shard_bytes(abstract) + shard_bytes(inputs), refused[0], 0, 0
    seconds = time.perf_counter() - started
    trained = nnx.state(model, nnx.LoRAParam if case.lora_rank else nnx.Param)
    opt_state = nnx.state(optimizer)
    return {"arguments": arguments, "temporaries": temps, "outputs": outputs, "code": code,
            "total": arguments + temps + outputs + code, "compile_seconds": round(seconds, 1),
            "refused": refused[2] if refused else None, "hbm_bytes_per_chip": hbm_bytes(devices[0]),
            "weights_bytes": shard_bytes(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))), "trained_bytes": shard_bytes(trained),
            "optimizer_bytes": shard_bytes(opt_state),
            "dtypes": {"weights": "bfloat16", "trained": _dtype_of(trained), "optimizer": _dtype_of(opt_state)}}


def _dtype_of(tree) -> str:
    """The float dtypes of ``tree``'s arrays, joined (the optimizer's step count is left out)."""
    import jax
    import jax.numpy as jnp

    return ",".join(sorted({str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}))


def lmzoo_side(case: Case, seq: int, layers: int | None, attention: str) -> dict:
    """Run ``sft train --compile-only`` for ``case`` with ``attention`` in a child process; its report's bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        model = case.lmzoo_model
        if layers:  # the registry's released config with fewer layers
            from zoo.registry.catalogue import hf_config_of

            (t / "config.json").write_text(json.dumps({**hf_config_of(model, "model"), "num_hidden_layers": layers}))
            model = str(t / "config.json")
        lora = f"lora:\n  rank: {case.lora_rank}\n" if case.lora_rank else ""
        (t / "run.yaml").write_text(
            f"model:\n  path: {model}\n  attention: {attention}\ndata:\n  path: {t / 'absent.jsonl'}\n"
            f"  seq_len: {seq}\nbatch_size: {case.chips}\nmax_steps: 1\nremat: none\n"
            f"dtype:\n  params: bfloat16\n  compute: bfloat16\n{lora}output_dir: {t / 'run'}\n")
        cmd = [sys.executable, "-c", "import sys; from sft.cli import main; sys.exit(main(sys.argv[1:]))", "train",
               "--config", str(t / "run.yaml"), "--compile-only", "--topology", case.topology,
               "--report", str(t / "report.json")]
        proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True)
        if proc.returncode not in (0, 3):  # 3: does not fit, with a report
            raise SystemExit(f"lmzoo ({attention}) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rep = json.loads((t / "report.json").read_text())
    parts = rep["bytes_per_chip"]
    temps, outputs = parts["activations"], parts["outputs"]
    return {"arguments_and_code": parts["total"] - temps - outputs, "temporaries": temps, "outputs": outputs,
            "total": parts["total"], "compile_seconds": rep["compile_seconds"], "fits": rep["fits"],
            "hbm_bytes_per_chip": rep["hbm_bytes_per_chip"], "weights_bytes": parts["params"],
            "trained_bytes": parts["adapters"] or parts["params"], "optimizer_bytes": parts["optimizer"],
            "advice": rep.get("advice", []),
            "dtypes": {"weights": "bfloat16", "trained": "float32" if case.lora_rank else "bfloat16",
                       "optimizer": "float32" if case.lora_rank else "bfloat16"}}


def _child_env() -> dict:
    """The children's environment: the CPU host's JAX, several libtpu clients allowed, the repository importable."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                PYTHONPATH=f"{path}{os.pathsep}{ROOT}" if path else str(ROOT))


def run_tunix(case_name: str, seq: int, layers: int | None) -> dict:
    """Tunix's side in a child process (this script with ``--child``)."""
    cmd = [sys.executable, __file__, "--case", case_name, "--seq", str(seq), "--child"]
    if layers:
        cmd += ["--layers", str(layers)]
    proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tunix failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(x: int) -> str:
    return f"{x / GIB:.2f}"


def table(sides: dict[str, dict]) -> str:
    """GiB a chip per side, and each lmzoo side's ratio to Tunix (total, and temporaries alone)."""
    head = f"{'side':<16}{'args+code':>10}{'temps':>8}{'outputs':>9}{'total':>8}  {'lmzoo/Tunix':>11}  temps ratio"
    lines = [head]
    base = sides.get("tunix")
    for name, s in sides.items():
        args = s.get("arguments_and_code", s.get("arguments", 0) + s.get("code", 0))
        ratio = tratio = ""
        if base and name != "tunix":
            ratio, tratio = f"{s['total'] / base['total']:.2f}x", f"{s['temporaries'] / base['temporaries']:.2f}x"
        lines.append(f"{name:<16}{_gib(args):>10}{_gib(s['temporaries']):>8}{_gib(s['outputs']):>9}"
                     f"{_gib(s['total']):>8}  {ratio:>11}  {tratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Compile both sides of a case (``--repeat`` rounds, alternating their order) and print and write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=sorted(CASES), required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=None, help="cut both models to this many layers (a quick check)")
    p.add_argument("--attention", default="blockwise,auto", help="lmzoo's model.attention values, one side each")
    p.add_argument("--sides", default="tunix,lmzoo")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    case = CASES[a.case]
    if a.child:
        print(json.dumps(tunix_side(case, a.seq, a.layers)), flush=True)
        return 0
    wanted = a.sides.split(",")
    order = (["tunix"] if "tunix" in wanted else []) + \
        ([f"lmzoo-{k}" for k in a.attention.split(",")] if "lmzoo" in wanted else [])
    rounds: list[dict[str, dict]] = []
    for r in range(a.repeat):
        names = order if r % 2 == 0 else order[::-1]  # alternate which side compiles first
        got = {}
        for name in names:
            print(f"round {r + 1}: compiling {name} ...", file=sys.stderr, flush=True)
            got[name] = (run_tunix(a.case, a.seq, a.layers) if name == "tunix"
                         else lmzoo_side(case, a.seq, a.layers, name.removeprefix("lmzoo-")))
            print(f"  {name}: {_gib(got[name]['total'])} GiB a chip, compiled in {got[name]['compile_seconds']} s",
                  file=sys.stderr, flush=True)
        rounds.append({k: got[k] for k in order})
    sides = rounds[0]
    # The compiler is deterministic: every round's bytes should agree; say so if they do not.
    differ = sorted(k for k in order if any(rd[k]["total"] != sides[k]["total"] for rd in rounds))
    print(f"{a.case}: {case.topology} ({case.chips} chips), seq {a.seq}, batch 1 a chip, remat none, bf16 weights"
          + (f", {a.layers} layers" if a.layers else "") + (f", LoRA r{case.lora_rank}" if case.lora_rank else ""))
    print(table(sides))
    if differ:
        print(f"bytes differ between rounds for: {', '.join(differ)} (see per_round in the JSON)")
    result = {"case": a.case, **dataclasses.asdict(case), "seq": a.seq, "layers": a.layers, "sides": sides,
              "ratios": {k: {"total": sides[k]["total"] / sides["tunix"]["total"],
                             "temporaries": sides[k]["temporaries"] / sides["tunix"]["temporaries"]}
                         for k in sides if k != "tunix" and "tunix" in sides},
              "per_round": rounds}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
