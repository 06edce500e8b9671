"""``train --compile-only --topology NAME``: the run's train step compiled for a TPU slice from this machine.

The step is the one the run would execute, set up by the run's own set-up (:mod:`pretrain.setup`: the mesh, the
model the task trains, its :meth:`~pretrain.task.Task.prepare`, the train state and
:func:`pretrain.jit_step.make_step`) on layouts alone (:data:`pretrain.setup.LAYOUT`: ``jax.ShapeDtypeStruct`` s
with their shardings, from ``jax.eval_shape`` of the jitted functions that make arrays and from the layouts
checkpoints are read into), and lowered with the task's declared batch layout over the devices of
``jax.experimental.topologies.get_topology_desc``: no weights, no data, no tokenizer, no device memory, no TPU. The
compiler's ``memory_analysis()`` gives the bytes a chip needs; FLOPs come from the model's arithmetic
(:mod:`pretrain.flops`), never XLA's estimates (which count a loop body once). What it shares with generation's
``--compile-only`` (the topology, each chip's bytes, the largest buffers) is in :mod:`zoo.compiled`.

Exit codes: 0 fits, 3 does not fit, 2 a user error (no libtpu, an unknown topology, a config that cannot run).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.config import TrainConfig
from zoo.compiled.topology import GIB

if TYPE_CHECKING:
    from pretrain.loop import Step
    from pretrain.setup import Model


@dataclasses.dataclass
class Report:
    """What ``--compile-only`` found: the keys of ``--report`` JSON."""

    topology: str
    chips: int
    hbm_bytes_per_chip: int
    fits: bool
    bytes_per_chip: dict[str, int]
    model_flops_per_step: float
    tokens_per_step: int
    compile_seconds: float  # the XLA compile of the train step alone
    device_kind: str = ""
    remat: str = ""
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    advice: list[str] = dataclasses.field(default_factory=list)
    # The task's other programs (GRPO's sampler): their temporaries and their total beside the resident state.
    programs: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # The step's largest temporary buffers, with their shapes and the line of the model that makes them.
    largest_buffers: list[str] = dataclasses.field(default_factory=list)
    trace_seconds: float = 0.0  # tracing and lowering the step and the task's other programs
    programs_seconds: float = 0.0  # compiling the task's other programs (GRPO's sampler)


@dataclasses.dataclass
class AbstractRun:
    """The run's set-up (:mod:`pretrain.setup`, the same as training's) as ``jax.ShapeDtypeStruct`` s with
    shardings on a topology's mesh: the model, the task's frozen inputs, the train state and its step, and the
    batch."""

    model: Model
    frozen_inputs: Any
    step: Step
    batch: Any

    @property
    def state(self) -> dict[str, Any]:
        """The train state: the trained params (adapters with LoRA), the optimizer's state and the step count."""
        return self.step.state

    @property
    def trainable(self) -> Any:
        """The trained params: the adapters with LoRA, else the whole model."""
        return self.state["params"]


def compile_only(cfg: TrainConfig, task: Any, topology: str, report_path: str | None = None,
                 num_slices: int = 1) -> int:
    """Compile the run's train step for ``topology`` and report bytes per chip; returns the exit code (0 fits,
    3 does not)."""
    from pretrain.setup import check_base_quant
    from zoo.compiled.chip_bytes import DOES_NOT_FIT
    from zoo.compiled.hlo_buffers import largest_buffers
    from zoo.compiled.topology import hbm_bytes, topology_devices
    from zoo.kernels.choice import target

    check_base_quant(cfg)
    devices = topology_devices(topology, num_slices)
    kind = devices[0].device_kind
    hbm = hbm_bytes(devices[0])  # the compiler's own limit: fits, the report and the advice use it alike
    run = abstract_run(cfg, task, topology, devices)
    clock = [time.perf_counter()]
    with target("tpu", len(devices)):  # backend-dependent sizes and kernels follow the TPU, not this host
        lowered = run.step.train.lower(run.state, run.batch, run.model.frozen, frozen_inputs=run.frozen_inputs)
        lowered_programs = task.compile_programs(run.model.weights(run.trainable), run.frozen_inputs)
    clock.append(time.perf_counter())
    dump = tempfile.TemporaryDirectory(prefix="lmzoo-hlo-")  # the compiler's buffer report, read for largest_buffers
    parts, refused = _compile_step(run, lowered, kind, dump.name)
    clock.append(time.perf_counter())
    programs = _compile_programs(run, lowered_programs, task.program_kv_cache(), kind)
    clock.append(time.perf_counter())
    rep = _report(cfg, run, topology, num_slices, len(devices), kind, hbm, parts, clock[2] - clock[1])
    rep.trace_seconds, rep.programs_seconds = round(clock[1] - clock[0], 2), round(clock[3] - clock[2], 2)
    if programs:
        rep.programs = programs
        rep.fits = rep.fits and all(p["total"] <= hbm for p in programs.values())
    if refused is not None:
        rep.fits = False
    rep.largest_buffers = [b.line() for b in largest_buffers(dump.name)]
    dump.cleanup()
    if not rep.fits:
        rep.advice = advice(cfg, parts, hbm if refused is None else refused[1])
        if refused is not None:
            rep.advice.append(f"the TPU compiler refused the program: {refused[2]}")
        rep.advice += [f"largest buffer {line}" for line in rep.largest_buffers]
    print(table(rep))
    if report_path:
        Path(report_path).write_text(json.dumps(dataclasses.asdict(rep), indent=1) + "\n")
    return 0 if rep.fits else DOES_NOT_FIT


def abstract_run(cfg: TrainConfig, task: Any, topology: str, devices: list[Any]) -> AbstractRun:
    """The run's :class:`AbstractRun` on the mesh of ``devices`` (a TPU topology's): the set-up training runs
    (:mod:`pretrain.setup`: the model the task trains, its weights laid out as a run places them, QLoRA's
    quantized base too, the task's frozen inputs and the sharded train step), on layouts alone."""
    import jax

    from pretrain.loop import build_step, prepare_task
    from pretrain.setup import LAYOUT, TokenIds, run_mesh, set_up_model
    from zoo.kernels.choice import check_platform, target

    mesh = run_mesh(cfg, devices, f"chips of {topology}")
    with target("tpu", len(devices)):  # the TPU program has no cuDNN: said as a run on TPUs would say it
        check_platform(cfg.model.attention, cfg.dtype.compute)
    model = set_up_model(cfg, mesh, LAYOUT)
    model, _, frozen_inputs = prepare_task(cfg, task, model, LAYOUT, TokenIds.stand_in(model.mcfg))
    # the schedule's length: max_steps, else one step (a run that only compiles may have no length; the schedule's
    # constants are not the program's shapes)
    step = build_step(cfg, task, model, frozen_inputs, LAYOUT, max(1, cfg.max_steps or 1))
    layout = task.batch_layout(cfg.grad_accum, cfg.batch_size // cfg.grad_accum, cfg.data.seq_len)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=step.batch_sharding), layout)
    return AbstractRun(model, frozen_inputs, step, batch)


def _compile_step(run: AbstractRun, lowered: Any, kind: str, dump: str) -> tuple[dict[str, int],
                                                                               tuple[int, int, str] | None]:
    """(bytes a chip by part, the compiler's refusal or None) of the lowered train step compiled for TPU chips of
    ``kind``, its buffer report dumped into ``dump``."""
    from zoo.compiled.chip_bytes import compiled_bytes, compiler_refusal, host_bytes, shard_bytes
    from zoo.compiled.compiler import compile_lowered, dump_options

    refused = None
    host = 0
    try:
        compiled = compile_lowered(lowered, "tpu", dump_options(dump), kind)
        arguments, temps, outputs, code = compiled_bytes(compiled)
        host = host_bytes(compiled)
    except Exception as e:  # the TPU compiler refuses a program over the chip's HBM: its figure is the answer
        refused = compiler_refusal(str(e))
        if refused is None:
            raise
        # the temporaries the compiler needed; the arguments are the shards the step reads
        arguments = (shard_bytes(run.state) + shard_bytes(run.model.frozen) + shard_bytes(run.frozen_inputs)
                     + shard_bytes(run.batch))
        temps, outputs, code = refused[0], 0, 0
    parts = {"params": shard_bytes(run.model.params) + shard_bytes(run.frozen_inputs),
             "optimizer": shard_bytes(run.state["opt_state"]),
             "adapters": shard_bytes(run.trainable) if run.model.lora else 0,
             "activations": temps,
             "outputs": outputs,
             "total": arguments + temps + outputs + code,
             "host": host}  # beside the HBM total: the host memory remat: offload keeps activations in
    return parts, refused


def _compile_programs(run: AbstractRun, lowered: dict[str, Any], caches: dict[str, int],
                      kind: str) -> dict[str, dict[str, int]]:
    """The task's other programs (a sampler) compiled: each one's temporaries and its total beside the resident
    train state (and its KV cache, where it has one)."""
    from zoo.compiled.chip_bytes import compiled_bytes, shard_bytes
    from zoo.compiled.compiler import compile_lowered

    programs = {}
    for name, low in lowered.items():  # the sampler runs beside the resident train state
        p_parts = compiled_bytes(compile_lowered(low, "tpu", device_kind=kind))
        programs[name] = {"temporaries": p_parts[1],
                          "total": sum(p_parts) + shard_bytes(run.state["opt_state"]) + shard_bytes(run.frozen_inputs)}
        if name in caches:  # a sampler's cache lives in its temporaries
            programs[name]["kv_cache"] = caches[name]
    return programs


def _report(cfg: TrainConfig, run: AbstractRun, topology: str, num_slices: int, chips: int, kind: str, hbm: int,
            parts: dict[str, int], seconds: float) -> Report:
    """The :class:`Report` of the train step: its bytes a chip, whether they fit, its tokens and model FLOPs."""
    from pretrain.flops import flops_per_token, image_flops_per_step

    inputs = run.batch.inputs.shape
    rows, row_len = math.prod(inputs[:2]), inputs[2]  # GRPO's rows hold completions too
    tokens = rows * row_len
    return Report(topology=topology + (f" x{num_slices}" if num_slices > 1 else ""), chips=chips,
                  hbm_bytes_per_chip=hbm, fits=parts["total"] <= hbm, bytes_per_chip=parts,
                  model_flops_per_step=flops_per_token(run.model.mcfg, row_len, frozen_base=run.model.lora is not None)
                  * tokens + image_flops_per_step(run.model.mcfg, run.batch, run.model.lora is not None,
                                                  cfg.model.freeze),
                  tokens_per_step=tokens, compile_seconds=round(seconds, 2), device_kind=kind, remat=cfg.remat,
                  mesh=dict(run.model.mesh.shape))


# The remat settings that may keep less on the chip than the config's. offload keeps less than full on paper, but
# measured on Llama-3.1-8B at 8,192 tokens on v6e:16x16 it needed 19.99 GiB a chip (two stacked bf16 activations
# staged on the chip beside the 28 GiB on the host) where full needed 14.64: each names the other.
_LIGHTER_REMAT = {
    "none": "set remat: full (each layer recomputed in the backward pass), or remat: offload (the layers' inputs "
            "and attention projections kept in host memory)",
    "save_dots": "set remat: full (no matmul outputs kept), or remat: offload (the layers' inputs and attention "
                 "projections kept in host memory)",
    "full": "set remat: offload (the layers' inputs kept in host memory, not on the chip)",
    "offload": "set remat: full (each layer recomputed, nothing kept in host memory)",
}


def advice(cfg: TrainConfig, parts: dict[str, int], hbm: int) -> list[str]:
    """What to change when the step does not fit: the largest parts first, each with its remedies, none of them a
    setting the config already has."""
    over = parts["total"] - hbm
    lora = cfg.lora.rank > 0
    smaller = ("lower batch_size per chip (raise grad_accum to keep the global batch) or data.seq_len")
    lighter = _LIGHTER_REMAT.get(cfg.remat)
    says = {
        "activations": f"activations (the step's temporaries) are the largest part with remat: {cfg.remat}: "
                       + (f"{lighter}, or {smaller}" if lighter else smaller),
        "params": "the weights: spread them over more chips (a larger slice"
                  + (", mesh.fsdp: -1)" if cfg.mesh.fsdp != -1 else ")") + ("" if lora else " or train LoRA"),
        "optimizer": "the optimizer state: shard it over more chips (a larger slice)"
                     + ("" if lora else " or use LoRA")
                     + (", or dtype.params: bfloat16 (its moments follow the weights' dtype)"
                        if cfg.dtype.params != "bfloat16" else ""),
        "adapters": "the adapters: a smaller lora.rank",
        "outputs": "the step's outputs beyond the donated state: lower batch_size per chip",
    }
    ranked = sorted((k for k in says if parts.get(k)), key=lambda k: -parts[k])
    lines = [f"over by {over / GIB:.2f} GiB of {hbm / GIB:.2f} GiB a chip"]
    lines += [f"{k} {parts[k] / GIB:.2f} GiB: {says[k]}" for k in ranked[:3]]
    return lines


def table(rep: Report) -> str:
    """The report as a small table of GiB per chip."""
    rows = [("topology", f"{rep.topology} ({rep.chips} chips, {rep.device_kind}, "
                         f"{rep.hbm_bytes_per_chip / GIB:.2f} GiB HBM a chip)"),
            ("mesh", " x ".join(f"{k} {v}" for k, v in rep.mesh.items() if v > 1) or "one chip"),
            ("remat", rep.remat)]
    rows += [(f"{'host memory' if k == 'host' else k} GiB/chip", f"{v / GIB:.3f}")
             for k, v in rep.bytes_per_chip.items()]
    rows += [(f"{name} GiB/chip", f"{p['total'] / GIB:.3f} (temporaries {p['temporaries'] / GIB:.3f}"
                                  + (f", KV cache {p['kv_cache'] / GIB:.3f})" if "kv_cache" in p else ")"))
             for name, p in rep.programs.items()]
    rows += [("fits", "yes" if rep.fits else "NO"),
             ("model TFLOPs/step", f"{rep.model_flops_per_step / 1e12:.3f}"),
             ("tokens/step", str(rep.tokens_per_step)), ("compile s", f"{rep.compile_seconds:.1f} (the step; tracing {rep.trace_seconds:.1f}"
                                   + (f", other programs {rep.programs_seconds:.1f})" if rep.programs else ")"))]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"  {a}" for a in rep.advice]
    return "\n".join(lines)
