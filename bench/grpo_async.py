"""Benchmark: asynchronous against synchronous GRPO rollouts on the calculator example, with a tool latency.

Command (from the repository root, virtualenv active; the calculator example's SFT warm start first, as
docs/training/grpo.md's calculator example makes it)::

    sft train --config examples/agents/calculator_sft.yaml model.path=runs/quickstart/smollm2
    python bench/grpo_async.py --model runs/calc-sft/final --steps 8 --rounds 2 --out grpo_async.json

Both sides run the example's step 2 (`grpo train --config examples/agents/calculator_grpo.yaml`: LoRA GRPO from the
warm start, 16 episodes a step of up to 3 turns, the calculator environment, the final_number reward) with the
environment of bench/slow_calculator.py, whose every call answers after ``--latency`` seconds (0.5: a sandbox or
a web request; sleeping, no CPU). ``sync`` is ``grpo.rollout: sync``; ``async`` is ``grpo.rollout: async`` with
``grpo.max_staleness: 1`` (the batch of step k + 1 sampled, its tools called, while step k trains) and the sampler
correction on (``grpo.importance_sampling_correction``). Each run is a child ``grpo train`` process of ``--steps``
steps, no held-out evaluation, no checkpoint. Its steps' ``step_time`` (metrics.jsonl) after the first (which
compiles) are the timed ones; steps/s = 1 / their median. The reward is the training reward of the same samples
count (``--steps`` x 16 episodes): its mean over the steps, and over the second half. Sides alternate round by
round (sync, async, then async, sync, ...); the ratio is computed per round and its median reported, with the
target (async >= 1.5x sync's steps/s at the same reward: within 0.1 of sync's mean).
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

ROOT = Path(__file__).resolve().parents[1]


def run_side(side: str, model: Path, steps: int, latency: float, out: Path) -> dict:
    """One `grpo train` child of ``side`` (sync or async); its per-step metrics and wall time."""
    overrides = [f"model.path={model}", f"grpo.environment={ROOT / 'bench' / 'slow_calculator.py'}:calculator",
                 f"max_steps={steps}", "eval_every=0", "checkpoint.every=100000", f"output_dir={out}",
                 "grpo.log_completions_every=0"]
    if side == "async":
        overrides += ["grpo.rollout=async", "grpo.max_staleness=1", "grpo.importance_sampling_correction=true"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", LMZOO_TOOL_LATENCY=str(latency))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "grpo.cli", "train", "--config",
                           str(ROOT / "examples" / "agents" / "calculator_grpo.yaml"), *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows[1:]]
    rewards = [r["reward"] for r in rows]
    half = rewards[len(rewards) // 2:]
    res = {"side": side, "wall_s": wall, "step_times": [r["step_time"] for r in rows], "rewards": rewards,
           "steps_per_s": 1 / statistics.median(times), "reward_mean": statistics.fmean(rewards),
           "reward_second_half": statistics.fmean(half),
           "tool_calls": statistics.fmean(r.get("tool_calls", 0.0) for r in rows),
           "staleness_max": max((r.get("sample/staleness_max", 0.0) for r in rows), default=0.0),
           "dropped": rows[-1].get("sample/dropped_stale_total", 0.0),
           "generation_share": statistics.median(r["generation_share"] for r in rows[1:])}
    print(f"  {side:5} {res['steps_per_s']:.4f} steps/s (median step {statistics.median(times):.1f} s), reward "
          f"{res['reward_mean']:.3f} (second half {res['reward_second_half']:.3f}), {res['tool_calls']:.2f} calls "
          f"an episode, wall {wall:.0f} s", file=sys.stderr, flush=True)
    return res


def main() -> None:
    """Run the rounds and print (and write) the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the calculator example's SFT warm start (final)")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps a run (the first not timed)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; the sides alternate their order each round")
    p.add_argument("--latency", type=float, default=0.5, help="seconds each calculator call takes")
    p.add_argument("--out", type=Path, default=None, help="write the result (JSON) here too")
    args = p.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
            got = {side: run_side(side, args.model.resolve(), args.steps, args.latency, Path(tmp) / f"{side}{r}")
                   for side in order}
            rounds.append(got)
    ratios = [g["async"]["steps_per_s"] / g["sync"]["steps_per_s"] for g in rounds]
    gaps = [g["async"]["reward_mean"] - g["sync"]["reward_mean"] for g in rounds]
    ratio, gap = statistics.median(ratios), statistics.median(gaps)
    result = {"benchmark": "grpo_async", "steps": args.steps, "latency_s": args.latency, "rounds": rounds,
              "ratio_steps_per_s": ratio, "ratio_per_round": ratios, "reward_gap": gap,
              "target": ">= 1.5x steps/s, reward within 0.1", "pass": ratio >= 1.5 and abs(gap) <= 0.1,
              "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    print(f"async/sync steps/s: {ratio:.2f}x (per round {', '.join(f'{x:.2f}' for x in ratios)}), reward gap "
          f"{gap:+.3f}: {'PASS' if result['pass'] else 'FAIL'} (target {result['target']})")
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
