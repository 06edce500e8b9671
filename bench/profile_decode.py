"""Profile: where one decoding step of the inference engine spends its time, per XLA fusion, on this machine.

Command (from a checkout's root; SmolLM2-135M-Instruct, the bundled GGUF, float32)::

    python bench/profile_decode.py --rows 64 --tokens 128

Runs :func:`eval.engine.paged.decode` for ``--rows`` rows whose page tables span ``--tokens`` positions (pages
of 16), warms it up, times a few steps, then traces ``--steps`` more with ``jax.profiler`` (a Perfetto trace,
readable without TensorBoard) and prints the milliseconds a step of the fusions that took the most: on the CPU
``copy_bitcast_fusion`` are the page gathers, ``dynamic-slice_bitcast_fusion`` the layer scan's weight slices and
``ynn_fusion`` the matmuls. Proportions, not a benchmark: no peer, one configuration.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run the profile (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="rows decoding at once (default 64)")
    ap.add_argument("--tokens", type=int, default=128, help="positions each row's page table spans (default 128)")
    ap.add_argument("--greedy", action="store_true", help="greedy rows (default: temperature 1.0)")
    ap.add_argument("--steps", type=int, default=3, help="traced steps (default 3)")
    ap.add_argument("--top", type=int, default=25, help="fusions printed (default 25)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import zoo
    from convert.convert import convert
    from eval.engine.paged import decode, init_pool
    from eval.engine.sampling import RowSampling
    from zoo.lora.weights import Weights
    from zoo.model.decode import place_for_decoding
    from zoo.registry.catalogue import bundled_gguf

    with tempfile.TemporaryDirectory() as tmp:
        convert(str(bundled_gguf()), str(Path(tmp) / "smol"), progress=False)
        cfg, params = zoo.read_config(Path(tmp) / "smol"), zoo.load_params(Path(tmp) / "smol")
    params, _ = place_for_decoding(cfg, params)
    weights, page, b = Weights(params), 16, args.rows
    width = -(-args.tokens // page)
    pool = init_pool(cfg, b * width, page, jnp.float32)
    tables = jnp.asarray(np.arange(b * width, dtype=np.int32).reshape(b, width))
    lengths = jnp.full((b,), max(1, args.tokens - 8), jnp.int32)
    sampling = RowSampling.of([(0.0 if args.greedy else 1.0, 0, 1.0, np.zeros(2, np.uint32), 3)] * b)
    tokens, active = jnp.zeros(b, jnp.int32), jnp.ones(b, bool)

    def step() -> None:
        nonlocal pool
        (drawn, _), pool = decode(cfg, weights, pool, tokens, active, tables, lengths, None, sampling)
        drawn.block_until_ready()

    for _ in range(3):
        step()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"{b} rows x {width * page} positions: {1000 * float(np.median(times)):.1f} ms a step (median of 5)")
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.steps):
            step()
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(path))["traceEvents"]
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "fusion" in e["name"]:
            spent[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    for name, us in spent.most_common(args.top):
        print(f"{us / 1000 / args.steps:8.2f} ms a step  x{calls[name] // args.steps:3d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
