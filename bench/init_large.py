"""A random-weight zoo checkpoint written one layer at a time: ``zoo init`` for models larger than memory.

``zoo init`` (convert/init.py) draws every parameter in memory first (``zoo.model.params.init_params``), then writes
them: at Llama-3-8B's shape in bfloat16 that is 16 GB of weights plus a float32 draw and its random bits for the
largest stacked parameter (32 x 4096 x 14336: 7.5 GB each), more than a 24 GiB machine holds. This script writes
the same kind of checkpoint (matrices ~ N(0, 0.02), norms at one, biases at zero; the same model.json, params
and hf_config.json) with ``zoo.checkpoints.writer.CheckpointWriter``: the stacked per-layer parameters reserved and
written slice by slice (one layer in memory at a time, numpy's generator), the others whole. The values differ
from ``zoo init``'s (another generator); weights do not change a step's cost.

Command (issue 26's 8B memory measurement; about 16 GB on disk, a few minutes on 2 CPUs)::

    python bench/init_large.py bench/configs/llama3-8b.json --out /tmp/l8b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def init_streamed(config: str, out: str, dtype: str = "bfloat16", seed: int = 0, std: float = 0.02) -> Path:
    """Write the random checkpoint of the Hugging Face ``config`` (a config.json path) to ``out``."""
    from convert.convert import DTYPES
    from zoo.checkpoints.format import HF_CONFIG_FILE
    from zoo.checkpoints.writer import CheckpointWriter, atomic_output
    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import param_specs

    hf = json.loads(Path(config).read_text())
    cfg = model_config_from_hf(hf, config)
    np_dt = np.dtype(DTYPES[dtype])
    rng = np.random.default_rng(seed)

    def draw(spec, shape):
        if spec.init == "normal":
            return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np_dt)
        return np.full(shape, 1.0 if spec.init == "ones" else 0.0, np_dt)

    specs = param_specs(cfg)
    with atomic_output(out) as folder:
        writer = CheckpointWriter(folder)
        stacked = []
        for path, spec in sorted(specs.items()):
            if spec.axes and spec.axes[0] == "layers":
                writer.reserve(path, spec.shape, np_dt, spec.axes, 1)
                stacked.append(path)
            else:
                writer.add(path, draw(spec, spec.shape), spec.axes)
        for path in stacked:
            spec = specs[path]
            writer.write_slices(path, (((i,), draw(spec, spec.shape[1:])) for i in range(spec.shape[0])))
        (folder / HF_CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
        writer.finish(cfg, source=f"random init of {config} (seed {seed}, bench/init_large.py)", source_format="init")
    return Path(out).absolute()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a Hugging Face config.json (e.g. bench/configs/llama3-8b.json)")
    ap.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="parameter dtype (default bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = init_streamed(args.config, args.out, args.dtype, args.seed)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
