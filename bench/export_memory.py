"""Benchmark: `zoo convert` and `zoo export` side by side with a plain copy, at 1B and 8B scale.

Builds a synthetic bf16 Hugging Face checkpoint (random weights, real tensor
names; Llama-3.2-1B shape ~2.5 GB, or Llama-3-8B shape ~16 GB), times a plain
copy of its shards, then runs ``zoo convert`` (HF -> zoo) and ``zoo export``
(zoo -> HF) as child processes, recording wall time and peak RSS of each
(``ru_maxrss`` from ``os.wait4``). It finally checks that a sample of tensors
came back bit-identical.

Target: peak RSS of each direction <= 0.5 x the checkpoint size.

Usage::

    python bench/export_memory.py --shape 1b [--workdir DIR] [--keep] [--json FILE]
    python bench/export_memory.py --shape 8b
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_memory import CONFIG as LLAMA32_1B  # noqa: E402
from convert_memory import TARGET_RATIO, GiB, build_checkpoint, code_version, machine, run_zoo, time_copy  # noqa: E402

# meta-llama/Meta-Llama-3-8B config.json (untied embeddings), bf16.
LLAMA3_8B = {
    **LLAMA32_1B,
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "rope_theta": 500000.0, "rope_scaling": None,
}
SHAPES = {"1b": (LLAMA32_1B, 2), "8b": (LLAMA3_8B, 4)}


def sample_identical(a: Path, b: Path, names: int = 12, seed: int = 0) -> bool:
    """Bit-compare a random sample of tensors (plus the first and last) between two HF folders."""
    import torch
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        idx = folder / "model.safetensors.index.json"
        if idx.is_file():
            return {k: folder / v for k, v in json.loads(idx.read_text())["weight_map"].items()}
        return {k: folder / "model.safetensors" for k in safe_open(folder / "model.safetensors", "np").keys()}

    wa, wb = where(a), where(b)
    if sorted(wa) != sorted(wb):
        return False
    keys = sorted(wa)
    pick = {keys[0], keys[-1], *np.random.default_rng(seed).choice(keys, names, replace=False)}
    for k in pick:
        with safe_open(wa[k], "pt") as fa, safe_open(wb[k], "pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            # Compare the bits (as int16), not the values: -0.0 == 0.0 and NaN != NaN would mislead.
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.int16), y.view(torch.int16)):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table plus one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b",
                    help="model shape: 1b = Llama-3.2-1B (~2.5 GB), 8b = Llama-3-8B (~16 GB) (default %(default)s)")
    ap.add_argument("--workdir", type=Path, default=None, help="where to build the checkpoints (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir afterwards")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the result JSON here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    args = ap.parse_args(argv)
    config, shards = SHAPES[args.shape]
    work = args.workdir or Path(tempfile.mkdtemp(prefix=f"zoo-bench-export-{args.shape}-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    code = code_version()
    try:
        hf = work / "hf"
        t0 = time.perf_counter()
        files = build_checkpoint(hf, args.seed, shards, config)
        build_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in files)
        print(f"built {size / GiB:.2f} GiB in {build_s:.0f} s", file=sys.stderr)
        copy_s = time_copy(files, work / "copy")
        conv = run_zoo(["convert", str(hf), "--out", str(work / "zoo")])
        exp = run_zoo(["export", str(work / "zoo"), "--out", str(work / "back")])
        same = sample_identical(hf, work / "back")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    m = machine()
    result = {
        "benchmark": "export_memory", "shape": args.shape, "code": code,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": m,
        "checkpoint_bytes": size, "copy_s": round(copy_s, 2),
        "convert_s": round(conv["wall_s"], 2), "convert_peak_rss_bytes": conv["peak_rss_bytes"],
        "export_s": round(exp["wall_s"], 2), "export_peak_rss_bytes": exp["peak_rss_bytes"],
        "sample_bit_identical": same,
    }
    rows = [
        ("machine", f"{m['nproc']} CPUs, {m['ram_gib']} GiB RAM, {m['cpu']}"),
        ("lmzoo code", code),
        ("shape", f"{args.shape} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']})"),
        ("checkpoint size", f"{size / GiB:.3f} GiB"),
        ("copy time", f"{copy_s:.2f} s"),
        ("convert time", f"{conv['wall_s']:.2f} s ({conv['wall_s'] / copy_s:.1f} x copy)"),
        ("convert peak RSS", f"{conv['peak_rss_bytes'] / GiB:.3f} GiB ({conv['peak_rss_bytes'] / size:.3f} x size)"),
        ("export time", f"{exp['wall_s']:.2f} s ({exp['wall_s'] / copy_s:.1f} x copy)"),
        ("export peak RSS", f"{exp['peak_rss_bytes'] / GiB:.3f} GiB ({exp['peak_rss_bytes'] / size:.3f} x size)"),
        ("round trip (sampled)", "bit-identical" if same else "DIFFERS"),
        ("target", f"peak RSS <= {TARGET_RATIO} x size: "
                   + ("PASS" if max(conv["peak_rss_bytes"], exp["peak_rss_bytes"]) <= TARGET_RATIO * size else "FAIL")),
    ]
    for k, v in rows:
        print(f"{k:<22}{v}")
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
