"""``zoo generate --compile-only --topology NAME``: generation's programs compiled for a TPU slice from this machine.

The programs are the ones :func:`eval.generate.generate` runs for a batch of prompts: the prefill of the padded
prompts and the one-token step at every cache view it reaches (:data:`eval.generate.VIEW`), on the mesh
``zoo.load`` builds (every chip on fsdp), with the weights laid out for decoding
(:func:`zoo.model.decode.decode_shardings`) and the KV cache sharded like their heads (:func:`zoo.model.decode.abstract_cache`).
They are lowered from ``jax.ShapeDtypeStruct`` s over the topology's devices (no weights, no tokenizer, no TPU);
the compiler's ``memory_analysis()`` gives each chip's bytes, reported as train ``--compile-only`` reports its own
(:mod:`zoo.compiled`).

Exit codes: 0 fits, 3 does not fit, 2 a user error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zoo.compiled.chip_bytes import DOES_NOT_FIT, compiled_bytes, compiler_refusal, shard_bytes
from zoo.compiled.topology import GIB, hbm_bytes, topology_devices
from zoo.errors import UserError


@dataclasses.dataclass
class GenerateReport:
    """What ``zoo generate --compile-only`` found: the keys of ``--report`` JSON.

    ``bytes_per_chip``: ``weights`` and ``kv_cache`` (resident shards), ``temporaries`` (the largest program's),
    ``total`` (the largest program's arguments, temporaries, outputs and code). ``programs``: each compiled
    program's ``temporaries`` and ``total``.
    """

    topology: str
    chips: int
    device_kind: str
    hbm_bytes_per_chip: int
    mesh: dict[str, int]
    fits: bool
    bytes_per_chip: dict[str, int]
    programs: dict[str, dict[str, int]]
    batch: int
    prompt_length: int
    max_new_tokens: int
    cache_length: int
    dtype: str
    compile_seconds: float
    advice: list[str] = dataclasses.field(default_factory=list)


def step_views(prompt_length: int, max_new_tokens: int) -> list[int]:
    """The cache views generation's one-token step is compiled for (:func:`eval.generate.generate`'s loop), for
    prompts of ``prompt_length`` tokens (the longest of the batch)."""
    from eval.generate import VIEW, _round_up

    max_len = _round_up(_round_up(prompt_length) + max_new_tokens)
    return sorted({min(_round_up(prompt_length + i, VIEW), max_len) for i in range(max_new_tokens - 1)})


@dataclasses.dataclass
class Lowered:
    """Generation's programs lowered for a mesh: by name (``prefill``, ``step@VIEW``), with the abstract weights
    and cache they read."""

    programs: dict[str, Any]
    params: dict[str, Any]
    cache: Any
    cache_length: int


def lower_generation(cfg: Any, mesh: Any, batch: int, prompt_length: int, max_new_tokens: int, sampler: Any,
                     dtype: Any) -> Lowered:
    """Generation's programs (:func:`eval.generate.generate`'s prefill and one-token steps) lowered on ``mesh``
    (a mesh of a TPU topology's devices) from ``jax.ShapeDtypeStruct`` s: the weights (``dtype``) laid out for
    decoding, the cache sharded like them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from eval.generate import _prefill, _round_up, _step
    from zoo.kernels.choice import target
    from zoo.model.decode import abstract_cache, decode_shardings
    from zoo.model.params import flatten, nest, param_specs

    placed = flatten(decode_shardings(cfg, mesh))
    params = nest({k: jax.ShapeDtypeStruct(s.shape, dtype, sharding=placed[k])
                   for k, s in param_specs(cfg).items()})
    plen = _round_up(prompt_length)
    max_len = _round_up(plen + max_new_tokens)
    cache = abstract_cache(cfg, batch, max_len, dtype, mesh)
    rows = cache.lengths.sharding  # the rows' layout: the cache's

    def arg(shape: tuple[int, ...], dt: Any, sharding: Any = rows) -> Any:
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    key = arg((2,), jnp.uint32, NamedSharding(mesh, PartitionSpec()))
    lowered = {}
    with target("tpu", mesh.size):  # backend-dependent sizes and kernels follow the TPU, not this host
        lowered["prefill"] = _prefill.lower(cfg, params, arg((batch, plen), jnp.int32), arg((batch, plen), bool),
                                            cache, sampler, key)
        for view in step_views(prompt_length, max_new_tokens):
            lowered[f"step@{view}"] = _step.lower(cfg, params, arg((batch,), jnp.int32), cache, sampler, key, view)
    return Lowered(lowered, params, cache, max_len)


def compile_generation(cfg: Any, topology: str, batch: int, prompt_length: int, max_new_tokens: int,
                       sampler: Any, report_path: str | None = None, num_slices: int = 1,
                       dtype: str = "float32") -> int:
    """Compile generation's programs of the model ``cfg`` (its ModelConfig) for ``batch`` prompts of
    ``prompt_length`` tokens and ``max_new_tokens`` (with ``sampler``, a :class:`eval.generate.Sampler`; weights
    in ``dtype``, as ``zoo generate`` loads them) for ``topology``; print the table, write ``report_path`` and
    return the exit code (0 fits, 3 does not)."""
    import jax.numpy as jnp

    from zoo.compiled.compiler import compile_lowered
    from zoo.model.decode import kv_cache_bytes
    from zoo.model.sharding import make_mesh

    devices = topology_devices(topology, num_slices)
    kind = devices[0].device_kind
    hbm = hbm_bytes(devices[0])
    mesh = make_mesh(devices=devices)  # zoo.load's mesh: every chip on fsdp
    pdt = jnp.dtype(dtype)
    started = time.perf_counter()
    low = lower_generation(cfg, mesh, batch, prompt_length, max_new_tokens, sampler, pdt)
    params, cache, max_len = low.params, low.cache, low.cache_length
    programs: dict[str, dict[str, int]] = {}
    refused = None
    for name, program in low.programs.items():
        try:
            sizes = compiled_bytes(compile_lowered(program, "tpu", device_kind=kind))
        except Exception as e:  # the compiler refuses a program over the chip's HBM: its figure is the answer
            refused = compiler_refusal(str(e))
            if refused is None:
                raise
            programs[name] = {"temporaries": refused[0], "total": shard_bytes((params, cache)) + refused[0]}
            break
        programs[name] = {"temporaries": sizes[1], "total": sum(sizes)}
    seconds = time.perf_counter() - started
    weights, kv = shard_bytes(params), kv_cache_bytes(cfg, batch, max_len, pdt, mesh)
    parts = {"weights": weights, "kv_cache": kv, "temporaries": max(p["temporaries"] for p in programs.values()),
             "total": max(p["total"] for p in programs.values())}
    rep = GenerateReport(topology=topology + (f" x{num_slices}" if num_slices > 1 else ""), chips=len(devices),
                         device_kind=kind, hbm_bytes_per_chip=hbm, mesh=dict(mesh.shape),
                         fits=refused is None and parts["total"] <= hbm, bytes_per_chip=parts, programs=programs,
                         batch=batch, prompt_length=prompt_length, max_new_tokens=max_new_tokens,
                         cache_length=max_len, dtype=dtype, compile_seconds=round(seconds, 2))
    if not rep.fits:
        rep.advice = _advice(parts, hbm if refused is None else refused[1])
        if refused is not None:
            rep.advice.append(f"the TPU compiler refused the program: {refused[2]}")
    print(table(rep))
    if report_path:
        Path(report_path).write_text(json.dumps(dataclasses.asdict(rep), indent=1) + "\n")
    return 0 if rep.fits else DOES_NOT_FIT


def _advice(parts: dict[str, int], hbm: int) -> list[str]:
    """What to change when generation does not fit: the largest parts first."""
    says = {"weights": "the weights: a larger slice (they are split over every chip)",
            "kv_cache": "the KV cache: fewer prompts (--batch-size), a shorter --prompt-length or --max-new-tokens, "
                        "or a larger slice",
            "temporaries": "the programs' temporaries: fewer prompts (--batch-size) or a shorter --prompt-length"}
    lines = [f"over by {(parts['total'] - hbm) / GIB:.2f} GiB of {hbm / GIB:.2f} GiB a chip"]
    lines += [f"{k} {parts[k] / GIB:.2f} GiB: {says[k]}" for k in sorted(says, key=lambda k: -parts[k])]
    return lines


def table(rep: GenerateReport) -> str:
    """The report as a small table of GiB per chip (as train ``--compile-only`` prints its own)."""
    rows = [("topology", f"{rep.topology} ({rep.chips} chips, {rep.device_kind}, "
                         f"{rep.hbm_bytes_per_chip / GIB:.2f} GiB HBM a chip)"),
            ("mesh", " x ".join(f"{k} {v}" for k, v in rep.mesh.items() if v > 1) or "one chip"),
            ("generation", f"{rep.batch} prompts x {rep.prompt_length} tokens + {rep.max_new_tokens} new "
                           f"(cache {rep.cache_length} slots, {rep.dtype})")]
    rows += [(f"{k} GiB/chip", f"{v / GIB:.3f}") for k, v in rep.bytes_per_chip.items()]
    rows += [(f"{name} GiB/chip", f"{p['total'] / GIB:.3f} (temporaries {p['temporaries'] / GIB:.3f})")
             for name, p in rep.programs.items()]
    rows += [("fits", "yes" if rep.fits else "NO"), ("compile s", f"{rep.compile_seconds:.1f}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + [f"  {a}" for a in rep.advice])


def generate_compile_command(args: argparse.Namespace, model_config_of: Callable[[str, str], Any]) -> int:
    """`zoo generate MODEL --compile-only --topology NAME`: generation's programs compiled for a TPU slice
    (:func:`compile_generation`), for the flags' batch, prompt length, new tokens and sampling. The model's config
    is read without weights by ``model_config_of(name, key)`` (a zoo checkpoint, a registry name or a Hugging Face
    ``config.json``; the command passes :func:`pretrain.setup.model_config_of`, which reads Hugging Face
    configs with convert/)."""
    if not args.topology:
        raise UserError("--compile-only needs --topology, e.g. --topology v5e:2x4")
    if getattr(args, "image", None):  # the compiled programs are text-only for now: never ignore a flag silently
        raise UserError("--image does not go with --compile-only yet (generation with images compiles for the "
                        "CPU only); drop --image to compile the text programs")
    if args.num_slices < 1:
        raise UserError(f"--num-slices must be at least 1, got {args.num_slices}")
    if (args.max_new_tokens < 1 or args.batch_size < 1 or args.temperature < 0 or args.top_k < 0
            or not 0 < args.top_p <= 1):
        raise UserError("need --max-new-tokens >= 1, --batch-size >= 1, --temperature >= 0, --top-k >= 0 "
                        "and 0 < --top-p <= 1")
    prompt_length = 512 if args.prompt_length is None else args.prompt_length
    if prompt_length < 1:
        raise UserError("--compile-only needs --batch-size >= 1, --prompt-length >= 1 and --max-new-tokens >= 1")
    from eval.generate import Sampler

    sampler = Sampler(float(args.temperature), int(args.top_k), float(args.top_p))
    return compile_generation(model_config_of(args.ckpt, "zoo generate"), args.topology, args.batch_size, prompt_length, args.max_new_tokens,
                              sampler, args.report, args.num_slices)
