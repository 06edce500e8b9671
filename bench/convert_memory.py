"""Benchmark: wall time and peak memory of `zoo convert` on a Llama-3.2-1B-shaped checkpoint.

Builds a synthetic Hugging Face folder (config.json + two bf16 safetensors
shards + index, ~2.5 GB, random weights with the real tensor names), times a
plain file copy of the shards as the baseline, then runs
``zoo convert <hf> --out <workdir>/zoo`` as a subprocess and records its wall
time and peak resident set size (``ru_maxrss`` from ``os.wait4``).

Target: peak RSS of the conversion <= 0.5 x checkpoint size (the converter
streams one parameter at a time, so it must not hold the model in memory).

The synthetic checkpoint is itself written tensor by tensor (safetensors
format by hand), so this process never holds more than one chunk of random
numbers.

Usage::

    python bench/convert_memory.py [--fp8] [--workdir DIR] [--keep] [--json FILE] [--trace FILE]

With ``--fp8`` the synthetic checkpoint is FP8 block-scaled, as DeepSeek-V3/R1 ship (every projection
float8_e4m3fn with a float32 ``_scale_inv`` per 128 x 128 block, ~1.3 GB), and the conversion dequantizes
it to bf16 while streaming; the target is then stated against the bf16 size of the same model (2.3 GB),
which is what the conversion writes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

GiB = 2**30
TARGET_RATIO = 0.5
CHUNK_VALUES = 16 * 2**20  # random values generated per chunk (64 MiB of float32)

# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json), bf16, tied embeddings.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def tensor_table(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in the order Hugging Face lists them."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (q, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, q)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
        ]
    out.append(("model.norm.weight", (d,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, d)))
    return out


def _nbytes(shape: tuple[int, ...]) -> int:
    return 2 * int(np.prod(shape, dtype=np.int64))


def _split_shards(tensors: list[tuple[str, tuple[int, ...]]], n: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of roughly equal byte size (a layer may straddle two shards, as on the Hub)."""
    total = sum(_nbytes(s) for _, s in tensors)
    shards: list[list] = [[] for _ in range(n)]
    done = 0
    for name, shape in tensors:
        k = min(n - 1, done * n // total)
        shards[k].append((name, shape))
        done += _nbytes(shape)
    return shards


def _write_bf16(fh, shape: tuple[int, ...], rng: np.random.Generator, is_norm: bool) -> None:
    """Random bf16 values for one tensor, generated and written chunk by chunk."""
    count = int(np.prod(shape, dtype=np.int64))
    left = count
    while left:
        n = min(left, CHUNK_VALUES)
        if is_norm:  # RMSNorm scales sit near 1
            x = 1.0 + 0.02 * rng.standard_normal(n, dtype=np.float32)
        else:
            x = rng.standard_normal(n, dtype=np.float32)
            x *= 0.02
        bf16 = (x.view(np.uint32) >> 16).astype("<u2")
        fh.write(memoryview(bf16).cast("B"))
        left -= n


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng: np.random.Generator) -> int:
    """Write one safetensors file by hand (header first, then each tensor streamed); returns its size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in tensors:
        nb = _nbytes(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, like the safetensors library
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape in tensors:
            _write_bf16(fh, shape, rng, is_norm=name.endswith("norm.weight"))
    return 8 + len(raw) + off


FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _write_fp8(fh, count: int, rng: np.random.Generator) -> None:
    """Random e4m3 bytes of small magnitude (NaN patterns left out), chunk by chunk."""
    left = count
    while left:
        n = min(left, CHUNK_VALUES)
        # sign bit random, exponent field 1..13 (|x| in [2^-6, 2^6]): finite, never a NaN pattern
        b = rng.integers(8, 111, size=n, dtype=np.uint8) | (rng.integers(0, 2, size=n, dtype=np.uint8) << 7)
        fh.write(memoryview(b))
        left -= n


def write_fp8_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng: np.random.Generator) -> int:
    """One safetensors file of an FP8 block-scaled checkpoint, written by hand: every 2-D projection as F8_E4M3
    with an F32 ``_scale_inv`` of one scale per 128 x 128 block; embeddings, head and norms BF16."""
    entries, off = [], 0
    for name, shape in tensors:
        if name.endswith("proj.weight"):
            n = int(np.prod(shape, dtype=np.int64))
            grid = (-(-shape[0] // 128), -(-shape[1] // 128))
            entries += [(name, "F8_E4M3", shape, n), (name + "_scale_inv", "F32", grid, 4 * grid[0] * grid[1])]
        else:
            entries.append((name, "BF16", shape, _nbytes(shape)))
    header: dict = {"__metadata__": {"format": "pt"}}
    for name, dt, shape, nb in entries:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, dt, shape, nb in entries:
            if dt == "F8_E4M3":
                _write_fp8(fh, nb, rng)
            elif dt == "F32":
                fh.write(memoryview((0.002 * rng.uniform(0.5, 1.5, size=nb // 4)).astype("<f4")).cast("B"))
            else:
                _write_bf16(fh, shape, rng, is_norm=name.endswith("norm.weight"))
    return 8 + len(raw) + off


def build_fp8_checkpoint(hf: Path, seed: int = 0, shards: int = 2, config: dict | None = None) -> list[Path]:
    """Synthetic FP8 block-scaled HF folder (DeepSeek-V3's Hub format, on a Llama-3.2-1B shape unless ``config``
    says otherwise); returns the safetensors files."""
    config = {**(config or CONFIG), "quantization_config": FP8_QUANT}
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    groups = _split_shards(tensor_table(config), shards)
    rng = np.random.default_rng(seed)
    files = []
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{shards:05d}.safetensors"
        write_fp8_safetensors(hf / fname, group, rng)
        files.append(hf / fname)
    weight_map = {}
    for f in files:  # the index lists every tensor, scales included, as the Hub's does
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            names = [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
        weight_map.update({name: f.name for name in names})
    index = {"metadata": {"total_size": sum(f.stat().st_size for f in files)}, "weight_map": weight_map}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def build_checkpoint(hf: Path, seed: int = 0, shards: int = 2, config: dict | None = None) -> list[Path]:
    """Synthetic HF folder (Llama-3.2-1B-shaped unless ``config`` says otherwise); returns the safetensors files."""
    config = config or CONFIG
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = tensor_table(config)
    groups = _split_shards(tensors, shards)
    rng = np.random.default_rng(seed)
    files, weight_map, total = [], {}, 0
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{shards:05d}.safetensors"
        write_safetensors(hf / fname, group, rng)
        files.append(hf / fname)
        for name, shape in group:
            weight_map[name] = fname
            total += _nbytes(shape)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def time_copy(files: list[Path], dest: Path) -> float:
    """Seconds to shutil.copyfile every shard into ``dest`` (deleted afterwards)."""
    dest.mkdir(parents=True, exist_ok=True)
    os.sync()
    t0 = time.perf_counter()
    for f in files:
        shutil.copyfile(f, dest / f.name)
    dt = time.perf_counter() - t0
    shutil.rmtree(dest)
    return dt


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_convert(hf: Path, out: Path, trace_every: float = 0.1) -> dict:
    """Run `zoo convert` as a child; wall time, peak RSS (wait4) and a sampled RSS trace."""
    return run_zoo(["convert", str(hf), "--out", str(out)], trace_every)


def run_zoo(args: list[str], trace_every: float = 0.1) -> dict:
    """Run `zoo ARGS...` as a child; wall time, peak RSS (wait4) and a sampled RSS trace."""
    zoo = Path(sys.executable).parent / "zoo"
    if not zoo.exists():
        raise SystemExit(f"no `zoo` executable next to {sys.executable}; install lmzoo into this environment")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [str(zoo), *args]
    os.sync()
    t0 = time.perf_counter()
    # The child's stdout goes to our stderr, so our stdout holds only the table and JSON line.
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
    trace: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            r = _rss_kib(proc.pid)
            if r is not None:
                trace.append((round(time.perf_counter() - t0, 3), r))
            stop.wait(trace_every)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}")
    return {"wall_s": wall, "peak_rss_bytes": ru.ru_maxrss * 1024, "trace": trace, "cmd": cmd}


def machine() -> dict:
    """nproc, total RAM and CPU model of this machine."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"nproc": nproc, "ram_gib": round(mem / GiB, 1), "cpu": model, "python": platform.python_version()}


def code_version() -> str:
    """Commit of the lmzoo checkout being measured (``+dirty`` with uncommitted changes), or "unknown"."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Time `zoo convert` on a synthetic Llama-3.2-1B-shaped bf16 checkpoint (~2.5 GB; with --fp8 an "
                    "FP8 block-scaled one, ~1.3 GB) and check its peak RSS against the target "
                    f"(<= {TARGET_RATIO} x the model's bf16 size).",
    )
    ap.add_argument("--workdir", type=Path, default=None,
                    help="folder for the synthetic checkpoint, the copy and the converted output "
                         "(default: a fresh temporary folder under /tmp, deleted at the end unless --keep)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work folder (synthetic HF checkpoint and converted zoo checkpoint) afterwards")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="write the JSON result line to FILE instead of stdout")
    ap.add_argument("--trace", type=Path, default=None, metavar="FILE",
                    help="also write the child's sampled RSS over time (every 0.1 s, from /proc) to FILE as JSON")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    ap.add_argument("--fp8", action="store_true",
                    help="make the synthetic checkpoint FP8 block-scaled (DeepSeek-V3's Hub format) instead of bf16; "
                         "the target is then against the same model's bf16 size")
    args = ap.parse_args(argv)

    made_tmp = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="zoo-bench-convert-", dir="/tmp")) if made_tmp else args.workdir.absolute()
    if not made_tmp:
        work.mkdir(parents=True, exist_ok=True)
        for sub in ("hf", "copy", "zoo"):
            if (work / sub).exists():
                raise SystemExit(f"{work / sub} already exists; pass an empty or new --workdir")
    hf, copy_dir, zoo_out = work / "hf", work / "copy", work / "zoo"
    mach = machine()
    print(f"machine: {mach['nproc']} CPUs ({mach['cpu']}), {mach['ram_gib']} GiB RAM; workdir {work}", file=sys.stderr)
    try:
        t0 = time.perf_counter()
        files = (build_fp8_checkpoint if args.fp8 else build_checkpoint)(hf, seed=args.seed)
        build_s = time.perf_counter() - t0
        ckpt_bytes = sum(f.stat().st_size for f in files)
        # What the target is stated against: the model at bf16 (for --fp8, what the conversion writes).
        bf16_bytes = sum(_nbytes(shape) for _, shape in tensor_table(CONFIG))
        print(f"built synthetic checkpoint: {ckpt_bytes / GiB:.2f} GiB in {build_s:.1f} s", file=sys.stderr)

        copy_s = time_copy(files, copy_dir)
        print(f"copy baseline: {copy_s:.2f} s", file=sys.stderr)

        code = code_version()  # what the child imports now (the tree may change while we run)
        res = run_convert(hf, zoo_out)
        out_bytes = _dir_bytes(zoo_out)
        peak = res["peak_rss_bytes"]
        ratio_rss = peak / bf16_bytes
        passed = ratio_rss <= TARGET_RATIO
        result = {
            "benchmark": "convert_memory_fp8" if args.fp8 else "convert_memory",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": mach,
            "code": code,
            "checkpoint_bytes": ckpt_bytes,
            "bf16_bytes": bf16_bytes,
            "output_bytes": out_bytes,
            "build_s": round(build_s, 2),
            "copy_s": round(copy_s, 3),
            "convert_s": round(res["wall_s"], 3),
            "convert_over_copy": round(res["wall_s"] / copy_s, 2),
            "peak_rss_bytes": peak,
            "peak_rss_over_bf16_size": round(ratio_rss, 3),
            "peak_rss_over_checkpoint": round(peak / ckpt_bytes, 3),
            "target_ratio": TARGET_RATIO,
            "pass": passed,
        }
        rows = [
            ("machine", f"{mach['nproc']} CPUs, {mach['ram_gib']} GiB RAM, {mach['cpu']}"),
            ("lmzoo code", result["code"]),
            ("checkpoint size", f"{ckpt_bytes / GiB:.3f} GiB ({ckpt_bytes:,} bytes, 2 shards, "
                                f"{'FP8 block-scaled' if args.fp8 else 'bf16'})"),
            ("model at bf16", f"{bf16_bytes / GiB:.3f} GiB"),
            ("zoo output size", f"{out_bytes / GiB:.3f} GiB"),
            ("copy time", f"{copy_s:.2f} s"),
            ("convert time", f"{res['wall_s']:.2f} s"),
            ("convert / copy", f"{res['wall_s'] / copy_s:.1f} x"),
            ("peak RSS (convert)", f"{peak / GiB:.3f} GiB"),
            ("peak RSS / bf16 size", f"{ratio_rss:.3f}"),
            ("peak RSS / ckpt size", f"{peak / ckpt_bytes:.3f}"),
            ("target", f"<= {TARGET_RATIO}"),
            ("result", "PASS" if passed else "FAIL"),
        ]
        w = max(len(k) for k, _ in rows)
        print()
        for k, v in rows:
            print(f"{k:<{w}}  {v}")
        print()
        line = json.dumps(result)
        if args.json:
            args.json.write_text(line + "\n")
        else:
            print(line)
        if args.trace:
            args.trace.write_text(json.dumps({"t_s_rss_kib": res["trace"]}) + "\n")
        sys.stdout.flush()
        return 0
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        elif made_tmp:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for sub in (hf, copy_dir, zoo_out):
                shutil.rmtree(sub, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
