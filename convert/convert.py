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
from convert.tables import BoundRule, table_for
from convert.transforms import TRANSFORMS

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def shape_only(shape: tuple[int, ...]) -> np.ndarray:
    """A zero-stride array of this shape: lets transforms compute shapes without memory (no data to read)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape, (0,) * len(shape))


def check_source(src: Source, cfg: ModelConfig, rules: list[BoundRule]) -> None:
    """Every needed tensor exists with the shape the config implies (before anything is written)."""
    specs = param_specs(cfg)
    have = set(src.reader.names())
    for rule in rules:
        piece = specs[rule.zoo].shape[rule.slice_axes:]
        want = TRANSFORMS[rule.transform].inverse(shape_only(piece), cfg).shape
        for name in rule.hf_names():
            if name not in have:
                raise UserError(f"{src.description}: tensor {name!r} is missing from the checkpoint")
            got = src.reader.shape(name)
            if tuple(got) != tuple(want):
                raise UserError(
                    f"{src.description}: tensor {name!r} has shape {tuple(got)} but the config implies {tuple(want)}"
                )


def build_piece(src: Source, cfg: ModelConfig, rule: BoundRule, index: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The zoo layout of one HF tensor of ``rule`` (the whole parameter when it is not stacked)."""
    x = TRANSFORMS[rule.transform].forward(src.reader.get(rule.hf_name(index)), cfg)
    return np.ascontiguousarray(x, dtype=dtype)


def _counted(items, bar):
    for item in items:
        yield item
        bar.update()


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
        left = len(src.reader.names()) - sum(len(r.hf_names()) for r in rules)
        print(f"note: {src.description} is multimodal: converting its language model; the vision tower and "
              f"projector ({left} tensors) are left out", file=sys.stderr)
    specs = param_specs(cfg)
    with atomic_output(out) as folder:
        writer = CheckpointWriter(folder)
        bar = tqdm(total=sum(len(r.hf_names()) for r in rules), desc="convert", unit="tensor",
                   disable=None if progress is None else not progress)
        # Whole parameters first; stacked ones are reserved, then streamed slice by slice.
        for rule in rules:
            dt = DTYPES.get(dtype) or src.reader.dtype(rule.hf_names()[0])
            if rule.stacked:
                writer.reserve(rule.zoo, specs[rule.zoo].shape, dt, specs[rule.zoo].axes, rule.slice_axes)
                continue
            bar.set_postfix_str(rule.zoo)
            writer.add(rule.zoo, build_piece(src, cfg, rule, (), dt), specs[rule.zoo].axes)
            bar.update()
            release_free_memory()
        for rule in rules:
            if rule.stacked:
                dt = DTYPES.get(dtype) or src.reader.dtype(rule.hf_names()[0])
                bar.set_postfix_str(rule.zoo)
                writer.write_slices(rule.zoo, ((ix, build_piece(src, cfg, rule, ix, dt)) for ix in _counted(rule.indices(), bar)))
        bar.close()
        src.save_tokenizer(folder / TOKENIZER_DIR)
        (folder / HF_CONFIG_FILE).write_text(json.dumps(src.hf_config, indent=2, default=str) + "\n")
        writer.finish(cfg, source=src.description, source_format=fmt)
    return out.absolute()
