"""`zoo init`: a random-weight zoo checkpoint from a built-in (or given) Hugging Face config."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from convert.convert import DTYPES
from zoo.checkpoints.format import HF_CONFIG_FILE, folder_of
from zoo.checkpoints.writer import CheckpointWriter, checkpoint_output, local_files
from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.from_hf import model_config_from_hf
from zoo.model.params import flatten, init_params, param_specs
from zoo.registry import catalogue as registry
from zoo.storage import RunPath


def init_random(source: str, out: str | Path, seed: int = 0, dtype: str = "float32", std: float = 0.02
                ) -> Path | RunPath:
    """Write a checkpoint with random weights for SOURCE: a registry entry with a built-in config,
    or a config.json path. Norms start at their identity, biases at zero, matrices ~ N(0, std)."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    hf = registry.hf_config_of(source, "zoo init")
    cfg = model_config_from_hf(hf, source)
    # One jitted program draws every tensor: op by op, each new shape compiled its own (a tiny model's dozens of
    # shapes cost seconds, more than the draws).
    params = flatten(jax.jit(lambda key: init_params(cfg, key, DTYPES[dtype], std))(jax.random.PRNGKey(seed)))
    write_params(out, hf, cfg, params, f"random init of {source} (seed {seed})")
    return folder_of(out)


def write_params(out: str | Path, hf: dict, cfg: ModelConfig, params: dict, source: str,
                 extra_files: Callable[[Path], None] | None = None) -> None:
    """Write ``params`` (flat path -> array) of the model ``cfg`` with its Hugging Face config ``hf`` as a zoo
    checkpoint at ``out`` (a gs:// or s3:// prefix: written there; model.json last). Each array is popped from
    ``params`` as it is written, so it is freed then. ``extra_files(folder)`` writes more files (a tokenizer) into
    a local folder that becomes the checkpoint's, before it is complete."""
    specs = param_specs(cfg)
    with checkpoint_output(out) as folder:
        writer = CheckpointWriter(folder, {p: (a.shape, a.dtype) for p, a in params.items()})
        for path in sorted(params):
            writer.add(path, np.asarray(params.pop(path)), specs[path].axes)
        (folder / HF_CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
        if extra_files is not None:
            with local_files(folder) as files:  # on object storage: written locally, then uploaded
                extra_files(files)
        writer.finish(cfg, source=source, source_format="init")
