"""HF/GGUF -> zoo checkpoint: streaming, driven by the target parameters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from zoo.checkpoint import HF_CONFIG_FILE, TOKENIZER_DIR, CheckpointWriter, atomic_output, prepare_output
from zoo.config import ModelConfig
from zoo.errors import UserError
from zoo.memory import release_free_memory
from zoo.params import param_specs

from convert.hf_config import model_config_from_hf, source_format
from convert.source import Source, open_source
from convert.tables import Rule, table_for
from convert.transforms import TRANSFORMS

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _shape_only(shape: tuple[int, ...]) -> np.ndarray:
    """A zero-stride array of this shape: lets transforms compute shapes without memory."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape, (0,) * len(shape))


def _hf_names(rule: Rule, cfg: ModelConfig) -> list[str]:
    return [rule.hf.format(i=i) for i in range(cfg.num_layers)] if rule.stacked else [rule.hf]


def check_source(src: Source, cfg: ModelConfig, rules: list[Rule]) -> None:
    """Every needed tensor exists with the shape the config implies (before anything is written)."""
    specs = param_specs(cfg)
    have = set(src.reader.names())
    for rule in rules:
        spec = specs[rule.zoo]
        layer_shape = spec.shape[1:] if rule.stacked else spec.shape
        want = TRANSFORMS[rule.transform].inverse(_shape_only(layer_shape), cfg).shape
        for name in _hf_names(rule, cfg):
            if name not in have:
                raise UserError(f"{src.description}: tensor {name!r} is missing from the checkpoint")
            got = src.reader.shape(name)
            if tuple(got) != tuple(want):
                raise UserError(
                    f"{src.description}: tensor {name!r} has shape {tuple(got)} but the config implies {tuple(want)}"
                )


def build_param(src: Source, cfg: ModelConfig, rule: Rule, dtype: np.dtype | None) -> np.ndarray:
    """One zoo parameter, assembled from its HF tensor(s); stacked ones are filled layer by layer."""
    t = TRANSFORMS[rule.transform]
    names = _hf_names(rule, cfg)
    dt = dtype or src.reader.dtype(names[0])
    if not rule.stacked:
        return np.ascontiguousarray(t.forward(src.reader.get(names[0]), cfg), dtype=dt)
    spec = param_specs(cfg)[rule.zoo]
    out = np.empty(spec.shape, dt)
    for i, name in enumerate(names):
        out[i] = t.forward(src.reader.get(name), cfg)
    return out


def convert(source: str, out: str | Path, dtype: str | None = None, progress: bool | None = None) -> Path:
    """Convert SOURCE into a zoo checkpoint at ``out``; returns the checkpoint path.

    ``dtype`` (float32|bfloat16) casts every parameter; None keeps the stored
    dtype (float32 for dequantized GGUF tensors).
    """
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    out = Path(out)
    prepare_output(out)
    src = open_source(source)
    cfg = model_config_from_hf(src.hf_config, f"{src.description}: config")
    fmt = src.fmt if src.fmt == "gguf" else source_format(src.hf_config)
    rules = table_for(cfg.family, fmt, cfg)
    check_source(src, cfg, rules)
    if fmt == "hf-gemma3-multimodal":
        left = len(src.reader.names()) - sum(cfg.num_layers if r.stacked else 1 for r in rules)
        print(f"note: {src.description} is multimodal: converting its language model; the vision tower and "
              f"projector ({left} tensors) are left out", file=sys.stderr)
    specs = param_specs(cfg)
    with atomic_output(out) as folder:
        writer = CheckpointWriter(folder)
        bar = tqdm(rules, desc="convert", unit="param", disable=None if progress is None else not progress)
        for rule in bar:
            bar.set_postfix_str(rule.zoo)
            arr = build_param(src, cfg, rule, DTYPES.get(dtype))
            writer.add(rule.zoo, arr, specs[rule.zoo].axes)
            del arr
            release_free_memory()
        src.save_tokenizer(folder / TOKENIZER_DIR)
        (folder / HF_CONFIG_FILE).write_text(json.dumps(src.hf_config, indent=2, default=str) + "\n")
        writer.finish(cfg, source=src.description, source_format=fmt)
    return out.absolute()
