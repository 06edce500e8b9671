"""``zoo generate --compile-only --topology NAME``: the inference engine's programs compiled for a TPU slice from
this machine.

The programs are the two :mod:`eval.engine.paged` runs for `zoo generate` (and every sampler on the engine): the
prefill of a batch of prompts (padded as :class:`eval.engine.engine.Engine` pads them) and the decoding step of
``--max-seqs`` rows, each reading its page table at its widest (every sequence at its longest), on the mesh
``zoo.load`` builds (every chip on fsdp), with the weights laid out for decoding
(:func:`zoo.model.decode.decode_shardings`) and the page pool split like their k/v heads
(:func:`eval.engine.paged.abstract_pool`). They are lowered from ``jax.ShapeDtypeStruct`` s over the topology's
devices (no weights, no tokenizer, no TPU); the compiler's ``memory_analysis()`` gives each chip's bytes, reported
as train ``--compile-only`` reports its own (:mod:`zoo.compiled`).

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

    ``bytes_per_chip``: ``weights`` (the shards of the weights) and ``kv_cache`` (the engine's page pool as the
    chip holds it: the bytes the programs are donated, or its shards' arithmetic where none compiled),
    ``temporaries`` (the largest program's), ``total`` (the largest program's arguments, temporaries, outputs and
    code). ``programs``: each compiled program's (``prefill``, ``decode``) ``arguments``, ``donated``,
    ``temporaries`` and ``total`` (a program the compiler refused: its figure for the temporaries, and the
    weights and pool beside them). ``max_seqs`` sequences decode at once, each of at most ``cache_length``
    tokens, in ``pages`` pages of ``page_size`` tokens; the prefill runs ``prefill_rows`` prompts of
    ``prefill_tokens`` (padded).
    """

    topology: str
    chips: int
    device_kind: str
    hbm_bytes_per_chip: int
    mesh: dict[str, int]
    fits: bool
    bytes_per_chip: dict[str, int]
    programs: dict[str, dict[str, int]]
    max_seqs: int
    page_size: int
    pages: int
    prefill_rows: int
    prefill_tokens: int
    prompt_length: int
    max_new_tokens: int
    cache_length: int
    dtype: str
    compile_seconds: float
    advice: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The engine's shapes for ``max_seqs`` sequences of at most ``max_len`` tokens in pages of ``page_size``:
    the pool's ``pages`` (as many as :class:`eval.engine.engine.Engine` makes by default: every sequence its
    longest), the decoding step's page table at its widest (``table_width`` pages, every row at max_len), and the
    prefill of the prompts admitted together: ``prefill_rows`` (as many as one prefill admits within
    :data:`eval.engine.engine.PREFILL_TOKENS`, up to a power of two) of
    ``prefill_tokens`` (the prompt up to a power of two of at least TOKEN_BUCKET), reading ``prefill_width``
    pages (as ``Engine._prefill`` pads them); a prompt of more than PREFILL_TOKENS goes in chunks of that many, the
    widest (its last) reading the pages of the chunks before it (``prefill_fresh`` False)."""

    max_seqs: int
    max_len: int
    page_size: int
    pages: int
    table_width: int
    prefill_rows: int
    prefill_tokens: int
    prefill_width: int
    prefill_fresh: bool = True

    @classmethod
    def of(cls, max_seqs: int, prompt_length: int, max_new_tokens: int, page_size: int) -> EngineShape:
        """The shapes ``zoo generate`` runs for ``max_seqs`` prompts of ``prompt_length`` tokens and
        ``max_new_tokens`` (:func:`eval.generate.generate`'s max_len: their sum rounded up to its bucket)."""
        from eval.engine.engine import PREFILL_TOKENS, TOKEN_BUCKET, _pow2, prefill_rows, view_tokens
        from eval.generate import _round_up

        max_len = _round_up(prompt_length + max_new_tokens)
        per_seq = -(-max_len // page_size)
        tokens = min(_pow2(prompt_length, TOKEN_BUCKET), PREFILL_TOKENS)
        chunks = -(-prompt_length // PREFILL_TOKENS)
        view = view_tokens(chunks * tokens)  # Engine._width of the (last) prefill's rows
        rows = _pow2(prefill_rows(max_seqs, prompt_length), 1)  # what one prefill admits (Engine._admit)
        return cls(max_seqs, max_len, page_size, max_seqs * per_seq, per_seq, rows, tokens,
                   min(-(-view // page_size), per_seq), chunks == 1)


@dataclasses.dataclass
class Lowered:
    """The engine's programs lowered for a mesh: by name (``prefill``, ``decode``), with the abstract weights and
    page pool they read."""

    programs: dict[str, Any]
    params: dict[str, Any]
    pool: Any


def lower_engine(cfg: Any, mesh: Any, shape: EngineShape, dtype: Any) -> Lowered:
    """The engine's programs (:func:`eval.engine.paged.prefill` of a fresh batch of prompts and
    :func:`eval.engine.paged.decode` of every row at its widest page table) lowered on ``mesh`` (a mesh of a TPU
    topology's devices) from ``jax.ShapeDtypeStruct`` s: the weights (``dtype``) laid out for decoding, the pool
    split like their k/v heads (:func:`eval.engine.paged.abstract_pool`). The rows' small inputs (tokens, page
    tables, lengths, sampling settings) carry no sharding, as the engine hands them over from the host."""
    import jax
    import jax.numpy as jnp

    from eval.engine.paged import abstract_pool, decode, prefill
    from eval.engine.sampling import RowSampling
    from zoo.kernels.choice import target
    from zoo.lora.weights import Weights
    from zoo.model.decode import decode_shardings
    from zoo.model.params import flatten, nest, param_specs

    placed = flatten(decode_shardings(cfg, mesh))
    params = nest({k: jax.ShapeDtypeStruct(s.shape, dtype, sharding=placed[k])
                   for k, s in param_specs(cfg).items()})
    pool = abstract_pool(cfg, shape.pages, shape.page_size, dtype, mesh, shape.max_seqs)
    banned = (cfg.vision.image_token_id,) if cfg.vision is not None else ()

    def arg(*dims: int, dt: Any = jnp.int32) -> Any:
        return jax.ShapeDtypeStruct(dims, dt)

    def rows(b: int) -> tuple[Any, Any]:  # (sampling settings, rope delta) of b rows
        sampling = RowSampling(arg(b, dt=jnp.float32), arg(b), arg(b, dt=jnp.float32), arg(b, 2, dt=jnp.uint32),
                               arg(b), banned)
        return sampling, (arg(b) if cfg.rope.mrope_section else None)

    weights = Weights(params)
    b, t, s = shape.prefill_rows, shape.prefill_tokens, shape.max_seqs
    lowered = {}
    with target("tpu", mesh.size):  # backend-dependent sizes and kernels follow the TPU, not this host
        sampling, delta = rows(b)
        lowered["prefill"] = prefill.lower(cfg, weights, pool, arg(b, t), arg(b, t, dt=bool),
                                           arg(b, shape.prefill_width), arg(b), delta, sampling,
                                           shape.prefill_fresh, seq_rows=arg(b))
        sampling, delta = rows(s)
        lowered["decode"] = decode.lower(cfg, weights, pool, arg(s), arg(s, dt=bool), arg(s, shape.table_width),
                                         arg(s), delta, sampling, seq_rows=arg(s))
    return Lowered(lowered, params, pool)


def compile_generation(cfg: Any, topology: str, shape: EngineShape, prompt_length: int, max_new_tokens: int,
                       report_path: str | None = None, num_slices: int = 1, dtype: str = "float32") -> int:
    """Compile the engine's programs of the model ``cfg`` (its ModelConfig) at ``shape`` (for prompts of
    ``prompt_length`` tokens and ``max_new_tokens``; weights and pool in ``dtype``, as ``zoo generate`` loads
    them) for ``topology``; print the table, write ``report_path`` and return the exit code (0 fits, 3 does
    not)."""
    import jax.numpy as jnp

    from zoo.compiled.compiler import compile_lowered
    from zoo.model.sharding import make_mesh

    devices = topology_devices(topology, num_slices)
    kind = devices[0].device_kind
    hbm = hbm_bytes(devices[0])
    mesh = make_mesh(devices=devices)  # zoo.load's mesh: every chip on fsdp
    started = time.perf_counter()
    low = lower_engine(cfg, mesh, shape, jnp.dtype(dtype))
    weights, kv = shard_bytes(low.params), shard_bytes(low.pool)
    programs: dict[str, dict[str, int]] = {}
    refusals: list[tuple[str, tuple[int, int, str]]] = []  # (program, the compiler's refusal)
    for name, program in low.programs.items():
        try:
            compiled = compile_lowered(program, "tpu", device_kind=kind)
            sizes = compiled_bytes(compiled)
        except Exception as e:  # the compiler refuses a program over the chip's HBM: its figure is the answer
            refused = compiler_refusal(str(e))
            if refused is None:
                raise
            refusals.append((name, refused))
            programs[name] = {"temporaries": refused[0], "total": weights + kv + refused[0]}
            continue  # the other program's figures still say what fits
        programs[name] = {"arguments": sizes[0], "donated": donated_bytes(compiled), "temporaries": sizes[1],
                          "total": sum(sizes)}
    seconds = time.perf_counter() - started
    # The pool as the chip holds it (the donated buffers: its tiled layout may pad small trailing dimensions, a
    # head_dim of 16 in pages of 16 8 times over), where a program compiled; else its shards' arithmetic.
    kv = max([p["donated"] for p in programs.values() if "donated" in p], default=kv)
    parts = {"weights": weights, "kv_cache": kv, "temporaries": max(p["temporaries"] for p in programs.values()),
             "total": max(p["total"] for p in programs.values())}
    rep = GenerateReport(topology=topology + (f" x{num_slices}" if num_slices > 1 else ""), chips=len(devices),
                         device_kind=kind, hbm_bytes_per_chip=hbm, mesh=dict(mesh.shape),
                         fits=not refusals and parts["total"] <= hbm, bytes_per_chip=parts, programs=programs,
                         max_seqs=shape.max_seqs, page_size=shape.page_size, pages=shape.pages,
                         prefill_rows=shape.prefill_rows, prefill_tokens=shape.prefill_tokens,
                         prompt_length=prompt_length, max_new_tokens=max_new_tokens, cache_length=shape.max_len,
                         dtype=dtype, compile_seconds=round(seconds, 2))
    if not rep.fits:
        rep.advice = _advice(parts, refusals[0][1][1] if refusals else hbm)
        rep.advice += [f"the TPU compiler refused the {name} program: {r[2]}" for name, r in refusals]
    print(table(rep))
    if report_path:
        Path(report_path).write_text(json.dumps(dataclasses.asdict(rep), indent=1) + "\n")
    return 0 if rep.fits else DOES_NOT_FIT


def _advice(parts: dict[str, int], hbm: int) -> list[str]:
    """What to change when generation does not fit: the largest parts first."""
    says = {"weights": "the weights: a larger slice (they are split over every chip)",
            "kv_cache": "the page pool: fewer sequences at once (--max-seqs), a shorter --prompt-length or "
                        "--max-new-tokens, or a larger slice",
            "temporaries": "the programs' temporaries: fewer sequences at once (--max-seqs: each decoding step "
                           "reads every sequence's pages) or a shorter --prompt-length"}
    lines = [f"over by {(parts['total'] - hbm) / GIB:.2f} GiB of {hbm / GIB:.2f} GiB a chip"]
    lines += [f"{k} {parts[k] / GIB:.2f} GiB: {says[k]}" for k in sorted(says, key=lambda k: -parts[k])]
    return lines


def table(rep: GenerateReport) -> str:
    """The report as a small table of GiB per chip (as train ``--compile-only`` prints its own)."""
    rows = [("topology", f"{rep.topology} ({rep.chips} chips, {rep.device_kind}, "
                         f"{rep.hbm_bytes_per_chip / GIB:.2f} GiB HBM a chip)"),
            ("mesh", " x ".join(f"{k} {v}" for k, v in rep.mesh.items() if v > 1) or "one chip"),
            ("engine", f"{rep.max_seqs} sequences x {rep.cache_length} tokens ({rep.prompt_length} prompt + "
                       f"{rep.max_new_tokens} new), {rep.pages} pages of {rep.page_size}, {rep.dtype}"),
            ("prefill", f"{rep.prefill_rows} rows x {rep.prefill_tokens} tokens")]
    rows += [(f"{k} GiB/chip", f"{v / GIB:.3f}") for k, v in rep.bytes_per_chip.items()]
    rows += [(f"{name} GiB/chip", f"{p['total'] / GIB:.3f} (temporaries {p['temporaries'] / GIB:.3f})")
             for name, p in rep.programs.items()]
    rows += [("fits", "yes" if rep.fits else "NO"), ("compile s", f"{rep.compile_seconds:.1f}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + [f"  {a}" for a in rep.advice])


def generate_compile_command(args: argparse.Namespace, model_config_of: Callable[[str, str], Any]) -> int:
    """`zoo generate MODEL --compile-only --topology NAME`: the engine's programs compiled for a TPU slice
    (:func:`compile_generation`) for ``--max-seqs`` sequences at once (default ``--batch-size``) of
    ``--prompt-length`` prompt tokens and ``--max-new-tokens``, in pages of ``--page-size``. The model's config is
    read without weights by ``model_config_of(name, key)`` (a zoo checkpoint, a registry name or a Hugging Face
    ``config.json``; the command passes :func:`pretrain.setup.model_config_of`, which reads Hugging Face configs
    with convert/). The sampling flags are checked as `zoo generate` checks them; they no longer shape a program
    (the engine's settings are per row)."""
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
    max_seqs = args.batch_size if args.max_seqs is None else args.max_seqs
    page_size = engine_page_size() if args.page_size is None else args.page_size
    if prompt_length < 1 or max_seqs < 1 or page_size < 1:
        raise UserError("--compile-only needs --prompt-length >= 1, --max-seqs >= 1 and --page-size >= 1")
    shape = EngineShape.of(max_seqs, prompt_length, args.max_new_tokens, page_size)
    return compile_generation(model_config_of(args.ckpt, "zoo generate"), args.topology, shape, prompt_length,
                              args.max_new_tokens, args.report, args.num_slices, args.dtype)


def engine_page_size() -> int:
    """The page size `zoo generate`'s engine runs with: :class:`eval.engine.engine.Engine`'s default (read from its
    signature, so the two cannot drift apart)."""
    import inspect

    from eval.engine.engine import Engine

    return int(inspect.signature(Engine).parameters["page_size"].default)


def donated_bytes(compiled: Any) -> int:
    """Bytes a chip of a compiled program's outputs that reuse its donated arguments (``memory_analysis()``'s
    alias size): the engine's programs donate the page pool alone, so this is the pool as the chip lays it out."""
    return int(compiled.memory_analysis().alias_size_in_bytes)
