"""Benchmark: checkpoint save and restore throughput, GCS emulator against local disk, and the async overlap.

The checkpoints are the ones ``pretrain train`` writes (pretrain/checkpoints.py's ``Checkpoints`` hook: the train
state through Orbax, the data iterator's position, the config), of a synthetic state of ``--params`` parameters in
``--dtype`` split into 24 arrays, on one CPU device. Two stores: a local folder, and a bucket on the GCS emulator
(gcp-storage-emulator, in memory, in its own child process on loopback; Orbax writes through TensorStore's GCS
driver as it would to GCS). For each store and round:

- steps without a save in flight (a jitted step that rewrites the whole state, its buffers donated, as an
  optimizer update does), timed one by one;
- a save: the time the hook's ``save`` blocks the loop, then steps timed while the save is in flight (a step
  counts if the save was still in flight when it ended), then the time until the step is committed: save
  throughput = the state's bytes / (blocking + in-flight time to commit);
- a restore by a fresh hook (what a rerun does): restore throughput = bytes / its time.

Reported: medians over rounds; the overlap check is the median step time with a save in flight over the median
without (target <= 1.1x). The stores alternate (local first in odd rounds).

Usage::

    python bench/checkpoint_io.py [--params 5e8] [--dtype bfloat16] [--rounds 3] [--steps 4] [--json FILE]
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

ROOT = Path(__file__).resolve().parent.parent

# The emulator in its own process (tests/object_stores.py's, with the generation headers TensorStore needs): its
# HTTP server then takes no GIL from the process that trains and saves. Prints its URL, serves until killed.
EMULATOR = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.object_stores import gcs_store
with gcs_store() as store:
    store.bucket()
    print(store.env["STORAGE_EMULATOR_HOST"], flush=True)
    while True:
        time.sleep(60)
"""


def start_emulator() -> tuple[subprocess.Popen, dict[str, str]]:
    """The GCS emulator in a child process; the variables that point this process's clients at it."""
    proc = subprocess.Popen([sys.executable, "-c", EMULATOR, str(ROOT)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.kill()
        raise SystemExit("the GCS emulator did not start (pip install gcp-storage-emulator)")
    return proc, {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GOOGLE_CLOUD_PROJECT": "test"}


def make_bucket() -> str:
    """A new bucket on the emulator the environment points at; its URL."""
    import uuid

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    name = f"bench{uuid.uuid4().hex[:10]}"
    storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(name)
    return f"gs://{name}"


class Store:
    """One place checkpoints go: the hook over a run folder there, the state and the step that rewrites it."""

    def __init__(self, name: str, out: str, params: int, dtype: str):
        import grain
        import jax
        import jax.numpy as jnp

        from pretrain.checkpoints import Checkpoints
        from pretrain.config import TrainConfig
        from zoo.storage import run_path

        self.name, self.out = name, run_path(out)
        cfg = TrainConfig()
        cfg.checkpoint.keep = 1  # the emulator holds every object in memory
        self.cfg, self.batches = cfg, iter(grain.MapDataset.range(10**9).to_iter_dataset())
        n = params // 24
        keys = jax.random.split(jax.random.key(0), 24)
        self.state = {f"w{i:02d}": jax.random.normal(k, (n // 1024, 1024), jnp.float32).astype(dtype)
                      for i, k in enumerate(keys)}
        self.bytes = sum(x.nbytes for x in self.state.values())
        self.hook = Checkpoints(self.out, cfg, self.batches)
        self.step_fn = jax.jit(lambda s: jax.tree.map(lambda w: (w * 0.999 + 0.001).astype(w.dtype), s),
                               donate_argnums=0)
        self.step_no = 0
        self.step()  # compiles

    def step(self) -> float:
        """One step over the whole state (buffers donated); its wall time."""
        import jax

        t = time.perf_counter()
        self.state = jax.block_until_ready(self.step_fn(self.state))
        next(self.batches)
        self.step_no += 1
        return time.perf_counter() - t

    def round(self, steps: int) -> dict:
        """Steps without a save, a save with steps in flight, and a restore: their times."""
        import grain
        import jax

        from pretrain.checkpoints import Checkpoints

        plain = [self.step() for _ in range(steps)]
        saved_at, t0 = self.step_no, time.perf_counter()
        self.hook.save(saved_at, self.state, force=True)
        blocking = time.perf_counter() - t0
        in_flight, late = [], []
        while self.hook.manager.is_saving_in_progress() and len(in_flight) + len(late) < 100:
            dt = self.step()
            (in_flight if self.hook.manager.is_saving_in_progress() else late).append(dt)
        self.hook.manager.wait_until_finished()
        saved = time.perf_counter() - t0
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        t1 = time.perf_counter()
        fresh = iter(grain.MapDataset.range(10**9).to_iter_dataset())
        restored, at, _ = Checkpoints(self.out, self.cfg, fresh).restore(like)
        jax.block_until_ready(restored)
        restore = time.perf_counter() - t1
        assert at == saved_at, (at, saved_at)
        del restored
        return {"plain_step_s": plain, "in_flight_step_s": in_flight, "after_save_step_s": late,
                "save_blocking_s": blocking, "save_s": saved, "restore_s": restore}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=5e8)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps without a save, per round")
    ap.add_argument("--workdir", default=None, help="the local store's folder (default: a temporary one)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    emulator, env = start_emulator()
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    try:
        with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
            results = measure(a, {"local disk": str(Path(tmp) / "run"), "GCS emulator": make_bucket() + "/run"})
    finally:
        emulator.kill()
        emulator.wait()
    report(a, results)


def measure(a: argparse.Namespace, places: dict[str, str]) -> dict[str, list[dict]]:
    """Every round on every store (local first in odd rounds); each store's rounds."""
    stores = [Store(name, out, int(a.params), a.dtype) for name, out in places.items()]
    results: dict[str, list[dict]] = {s.name: [] for s in stores}
    for r in range(a.rounds):
        for s in stores if r % 2 == 0 else stores[::-1]:
            got = s.round(a.steps)
            results[s.name].append(got)
            print(f"round {r + 1} {s.name}: " + json.dumps({k: v if isinstance(v, float) else [round(x, 3) for x in v]
                                                            for k, v in got.items()}), file=sys.stderr, flush=True)
    for s in stores:
        results[s.name].append({"bytes": s.bytes})
    return results


def report(a: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    """The table, the checks, and the JSON record's figures (to --json)."""
    figures, checks = {}, []
    print(f"state: {a.params:.3g} parameters, {a.dtype}; {a.rounds} rounds, {a.steps} plain steps each")
    print(f"{'store':14} {'GiB':>6} {'save GB/s':>10} {'restore GB/s':>13} {'blocks':>8} {'step':>8} "
          f"{'in flight':>10} {'ratio':>6}")
    for name, rounds in results.items():
        size = rounds[-1]["bytes"]
        rounds = rounds[:-1]
        plain = statistics.median(x for r in rounds for x in r["plain_step_s"])
        flight = [x for r in rounds for x in r["in_flight_step_s"]]
        during = statistics.median(flight) if flight else float("nan")
        fig = {"state_gib": round(size / 2**30, 3),
               "save_gb_per_s": round(statistics.median(size / r["save_s"] for r in rounds) / 1e9, 3),
               "restore_gb_per_s": round(statistics.median(size / r["restore_s"] for r in rounds) / 1e9, 3),
               "save_s": [round(r["save_s"], 2) for r in rounds],
               "restore_s": [round(r["restore_s"], 2) for r in rounds],
               "save_blocking_s": round(statistics.median(r["save_blocking_s"] for r in rounds), 3),
               "step_s": round(plain, 3), "step_in_flight_s": round(during, 3),
               "steps_in_flight": len(flight), "in_flight_over_plain": round(during / plain, 2)}
        figures[name] = fig
        print(f"{name:14} {fig['state_gib']:6.2f} {fig['save_gb_per_s']:10.3f} {fig['restore_gb_per_s']:13.3f} "
              f"{fig['save_blocking_s']:7.3f}s {plain:7.3f}s {during:9.3f}s {during / plain:5.2f}x")
        checks.append({"check": f"step with a save in flight / without ({name})", "target": "≤ 1.1×",
                       "measured": f"{during / plain:.2f}×", "value": round(during / plain, 2),
                       "met": bool(during / plain <= 1.1)})
    gcs, local = figures["GCS emulator"], figures["local disk"]
    for what in ("save", "restore"):
        r = gcs[f"{what}_gb_per_s"] / local[f"{what}_gb_per_s"]
        checks.append({"check": f"{what} throughput, GCS emulator / local disk", "target": None,
                       "measured": f"{r:.2f}×", "value": round(r, 2), "met": None})
    for c in checks:
        print(f"{c['check']}: {c['measured']}" + (f" (target {c['target']})" if c["target"] else ""))
    record = {"figures": figures, "checks": checks}
    print(json.dumps(record))
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
