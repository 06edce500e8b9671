"""zoo checkpoint -> Hugging Face safetensors folder: the conversion tables run backwards, streaming.

The layout of every shard is planned up front from the checkpoint's parameter
table (names, shapes, dtypes), so each shard file gets its final header at
once; then parameters are read one at a time (layer by layer, see
:class:`zoo.checkpoints.readers.ParamReader`; an adapter checkpoint's merged with its
adapters, :func:`zoo.checkpoints.loading.param_reader`) and each per-layer tensor is written at
its planned offset. Memory stays bounded by one
parameter, while the shards keep the Hub's layer-major order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from convert.card_origin import origin_of
from convert.card_training import trained_with, training_of
from convert.convert import DTYPES
from convert.fused import fuse_planned, fused_named, join
from convert.hf_config import export_hf_config
from convert.model_card import (
    EvalResults,
    card_data,
    eval_lines,
    public_path,
    read_eval_results,
    render,
    training_lines,
)
from convert.mtp import EXTRA_FILE
from convert.readers import SafetensorsFolder
from convert.safetensors_out import ST_NAMES, encode_header
from convert.tables import export_format, table_for
from convert.transforms import TRANSFORMS, hf_shape
from zoo.checkpoints.format import HF_CONFIG_FILE, TOKENIZER_DIR, WEIGHT_FILES, read_meta
from zoo.checkpoints.loading import param_reader
from zoo.checkpoints.readers import ParamSource
from zoo.checkpoints.writer import atomic_output
from zoo.errors import UserError
from zoo.memory import release_free_memory
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs

DEFAULT_MAX_SHARD = "5GB"


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1234' -> 1234 (as transformers reads sizes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"--max-shard-size {text!r}: write a size like 5GB, 500MB or 2GiB")
    num, unit = float(m.group(1)), (m.group(2) or "").upper()
    powers = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if "I" in unit else 1000
    size = int(num * base ** powers[unit.replace("I", "").replace("B", "")])
    if size <= 0:
        raise UserError(f"--max-shard-size {text!r} must be positive")
    return size


@dataclass
class PlannedTensor:
    """One HF tensor of the export: where it comes from and where it goes."""

    name: str
    zoo: str
    index: tuple[int, ...] | None  # into the zoo parameter's stacked axes; None: the whole parameter
    transform: str
    shape: tuple[int, ...]
    dtype: str
    shard: int = 0
    offset: int = 0  # within the shard's data section
    # A fused tensor (convert.fused): (zoo parameter, transform) of each of its parts, the first being
    # ``zoo``/``transform``; empty for a tensor of one parameter.
    parts: tuple[tuple[str, str], ...] = ()

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES_ALL[self.dtype].itemsize


DTYPES_ALL = {**DTYPES, "float16": np.dtype(np.float16), "float64": np.dtype(np.float64)}


def plan_tensors(cfg: ModelConfig, meta: dict[str, Any], dtype: str | None) -> list[PlannedTensor]:
    """Every HF tensor of the export, in the Hub's order (embeddings, layer by layer, norm, head); the parts of a
    fused tensor (Phi-3's q/k/v_proj, gpt-oss's experts' gate/up) planned as that one tensor (convert.fused)."""
    specs = param_specs(cfg)
    rules = table_for(cfg.family, export_format(cfg), cfg)
    keyed = []
    for pos, rule in enumerate(rules):
        spec = specs[rule.zoo]
        dt = dtype or meta["params"][rule.zoo]["dtype"]
        if dt not in ST_NAMES:
            raise UserError(f"parameter {rule.zoo} has dtype {dt}, which safetensors export does not support")
        piece = spec.shape[rule.slice_axes:]
        shape = hf_shape(rule.transform, piece, cfg)
        for ix in rule.indices():
            layer = rule.layers[ix[0]] if rule.layers is not None else (-1 if rule.zoo == "embed" else cfg.num_layers)
            t = PlannedTensor(rule.hf_name(ix), rule.zoo, ix or None, rule.transform, shape, dt)
            keyed.append(((layer, pos, ix[1:]), t))
    keyed.sort(key=lambda kt: kt[0])
    return fuse_planned(cfg, [t for _, t in keyed])


# PlannedTensor.zoo of a tensor kept beside the model under its HF name (convert/mtp.py), written as stored.
EXTRA = "<extra>"


def plan_extra_tensors(ckpt: Path, dtype: str | None) -> list[PlannedTensor]:
    """The tensors a conversion kept beside the model (``--keep-mtp``), after the model's own."""
    path = Path(ckpt) / EXTRA_FILE
    if not path.is_file():
        return []
    reader = SafetensorsFolder(path.parent, [path])
    return [PlannedTensor(n, EXTRA, None, "identity", reader.shape(n), dtype or reader.dtype(n).name)
            for n in reader.names()]


def assign_shards(tensors: list[PlannedTensor], max_bytes: int) -> int:
    """Greedy, in order: a new shard when the next tensor would overflow this one. Returns the shard count."""
    shard, used = 0, 0
    for t in tensors:
        if used and used + t.nbytes > max_bytes:
            shard, used = shard + 1, 0
        t.shard, t.offset = shard, used
        used += t.nbytes
    return shard + 1


def shard_name(i: int, n: int) -> str:
    """The Hub's shard file names."""
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def safetensors_header(tensors: list[PlannedTensor]) -> bytes:
    """A safetensors file's header for ``tensors`` at their planned offsets."""
    return encode_header({t.name: {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                                   "data_offsets": [t.offset, t.offset + t.nbytes]} for t in tensors})


def model_card(meta: dict[str, Any], cfg: ModelConfig, repo_hint: str, ckpt: str | Path,
               eval_results: EvalResults | None = None) -> str:
    """README.md for the exported folder: its metadata (base model, license, tags, datasets), the model, what was
    done (a trained checkpoint: method, hyperparameters, data, final metrics: convert/model_card.py), the `zoo
    eval` results when given, and how to load it. ``ckpt``: where the checkpoint is (its run folder's records and
    the checkpoints it started from are read from there)."""
    from zoo.model.params import count_params

    source = public_path(meta.get("source", "unknown"))  # no path of this machine in a published card
    origin = origin_of(ckpt, meta)
    training = training_of(ckpt, meta)
    kind, what, auto = ("reward model", "a sequence classifier with one score, ", "AutoModelForSequenceClassification") \
        if cfg.num_labels else ("causal language model", "", "AutoModelForCausalLM")
    data = card_data("transformers", origin, training, base_model=origin.hub_repo,
                     pipeline_tag="text-classification" if cfg.num_labels else "text-generation")
    if meta.get("training"):
        record = meta["training"]
        came = f", which derives from the Hub's `{origin.hub_repo}`" if origin.hub_repo and origin.hub_repo != source else ""
        merged = (f"; its LoRA adapters (rank {meta['lora'].get('rank')}) are merged into the weights"
                  if meta.get("lora") else "")
        done = [f"{trained_with(record)} from `{source}`{came}{merged}.", ""]
        if training is not None:
            done += training_lines(training)
    else:
        done = [f"Converted with lmzoo from `{source}` ({meta.get('source_format', 'hf')}) and exported back "
                "unchanged: a lossless round trip.", ""]
    return render(data, [
        f"# {repo_hint}", "",
        f"A {cfg.family}-family {kind} ({what}{count_params(cfg):,} parameters).", "",
        "## What was done", "", *done,
        *eval_lines(eval_results),
        "## How to load", "", "```python",
        f"from transformers import {auto}, AutoTokenizer",
        f'model = {auto}.from_pretrained("{repo_hint}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_hint}")',
        "```", "",
    ])


def export(
    ckpt: str | Path,
    out: str | Path,
    dtype: str | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
    repo_hint: str | None = None,
    progress: bool | None = None,
    eval_results: str | Path | None = None,
) -> Path:
    """Write checkpoint ``ckpt`` as a Hugging Face folder at ``out`` (atomically); returns ``out``.

    ``eval_results``: a `zoo eval --out` results file, whose scores the model card lists (read before anything
    is written: a bad file writes nothing)."""
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    results = read_eval_results(eval_results) if eval_results is not None else None
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"])
    out = Path(out).absolute()
    tensors = plan_tensors(cfg, meta, dtype) + plan_extra_tensors(Path(ckpt), dtype)
    n = assign_shards(tensors, parse_size(max_shard_size))
    with atomic_output(out, overwrite) as tmp:
        _write_shards(Path(ckpt), cfg, tensors, n, tmp, progress)
        _write_side_files(Path(ckpt), meta, cfg, tensors, n, tmp, dtype, repo_hint or out.name, results)
    return out


def _write_shards(ckpt: Path, cfg: ModelConfig, tensors: list[PlannedTensor], n: int, tmp: Path,
                  progress: bool | None) -> None:
    """The shard files of ``tensors``: their headers, then each tensor at its offset, one zoo parameter (a fused
    tensor: its parts' parameters) at a time."""
    fds, data_start = [], []
    try:
        for i in range(n):
            mine = [t for t in tensors if t.shard == i]
            header = safetensors_header(mine)
            fd = os.open(tmp / shard_name(i, n), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, len(header) + sum(t.nbytes for t in mine))
            data_start.append(len(header))
        by_param: dict[str, list[PlannedTensor]] = {}
        for t in tensors:
            by_param.setdefault(t.zoo, []).append(t)
        bar = tqdm(by_param.items(), desc="export", unit="param", disable=None if progress is None else not progress)
        for zoo_path, items in bar:
            bar.set_postfix_str(zoo_path)
            if zoo_path == EXTRA:
                extra = SafetensorsFolder(ckpt, [ckpt / EXTRA_FILE])
                for t in items:
                    x = np.ascontiguousarray(extra.get(t.name), dtype=DTYPES_ALL[t.dtype])
                    os.pwrite(fds[t.shard], x.reshape(-1).view(np.uint8).data, data_start[t.shard] + t.offset)
                    del x
                continue
            # A fused tensor's parts are read together, layer by layer: a reader each, opened once.
            readers: dict[str, ParamSource] = {p: param_reader(ckpt, p) for p, _ in items[0].parts or [(zoo_path, "")]}
            for t in items:
                for offset, x in (_fused_piece(readers, t, cfg) if t.parts else _hf_pieces(readers[zoo_path], t, cfg)):
                    os.pwrite(fds[t.shard], x.reshape(-1).view(np.uint8).data, data_start[t.shard] + t.offset + offset)
                    del x
            del readers
            release_free_memory()
    finally:
        for fd in fds:
            os.close(fd)


# Row-sliceable layouts of un-stacked parameters: the zoo axis that runs along the HF tensor's rows.
_ROW_AXIS = {"identity": 0, "transpose": 1}
_BLOCK_BYTES = 64 * 2**20


def _hf_pieces(param: ParamSource, t: PlannedTensor, cfg: ModelConfig) -> Iterator[tuple[int, np.ndarray]]:
    """(byte offset within the HF tensor, contiguous array) pieces that make up tensor ``t``.

    A per-layer tensor is one piece. A large un-stacked one (embeddings, lm_head)
    comes in blocks of rows, so that reading it never needs a second full copy.
    """
    dt = DTYPES_ALL[t.dtype]
    axis = _ROW_AXIS.get(t.transform)
    if t.index is not None or axis is None or len(t.shape) != 2 or t.nbytes <= _BLOCK_BYTES:
        x = param.read(t.index)
        # np.asarray, not ascontiguousarray, which makes a scalar (Gemma 4's clip bounds) one-dimensional
        x = np.asarray(TRANSFORMS[t.transform].inverse(x, cfg), dtype=dt, order="C")
        if tuple(x.shape) != t.shape:
            raise UserError(f"parameter {t.zoo} does not match its config (got {x.shape}, want {t.shape})")
        yield 0, x
        return
    row_bytes = t.shape[1] * dt.itemsize
    step = max(1, _BLOCK_BYTES // row_bytes)
    for a in range(0, t.shape[0], step):
        b = min(a + step, t.shape[0])
        x = np.ascontiguousarray(TRANSFORMS[t.transform].inverse(param.read_block(axis, a, b), cfg), dtype=dt)
        yield a * row_bytes, x


def _fused_piece(readers: dict[str, ParamSource], t: PlannedTensor, cfg: ModelConfig
                 ) -> Iterator[tuple[int, np.ndarray]]:
    """The one piece of fused tensor ``t``: each part read (at t's layer) and placed in it (convert.fused)."""
    parts = [TRANSFORMS[transform].inverse(readers[zoo_path].read(t.index), cfg) for zoo_path, transform in t.parts]
    fusion = fused_named(cfg, t.name)
    x = join(fusion, parts, DTYPES_ALL[t.dtype], fusion.group_count(cfg))
    if tuple(x.shape) != t.shape:
        raise UserError(f"parameter {t.zoo} does not match its config (got {x.shape}, want {t.shape})")
    yield 0, x


def _write_side_files(ckpt: Path, meta: dict[str, Any], cfg: ModelConfig, tensors: list[PlannedTensor], n: int,
                      tmp: Path, dtype: str | None, repo_hint: str, eval_results: EvalResults | None = None) -> None:
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: shard_name(t.shard, n) for t in tensors},
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    source_cfg = None
    if (ckpt / HF_CONFIG_FILE).is_file():
        source_cfg = json.loads((ckpt / HF_CONFIG_FILE).read_text())
    out_dtype = dtype or _common_dtype(tensors)
    hf = export_hf_config(cfg, source_cfg, out_dtype)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tok = ckpt / TOKENIZER_DIR
    if tok.is_dir():  # the tokenizer's files and a vision-language model's processor files (convert/source.py)
        for f in tok.iterdir():
            # never over what the export wrote (weights, config.json), nor stray weights of a model's folder
            if f.is_file() and not (tmp / f.name).exists() and not any(f.match(w) for w in WEIGHT_FILES):
                shutil.copyfile(f, tmp / f.name)
    if not (tmp / "generation_config.json").is_file():
        gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps({**gen, "_from_model_config": True}, indent=2) + "\n")
    (tmp / "README.md").write_text(model_card(meta, cfg, repo_hint, ckpt, eval_results))


def _common_dtype(tensors: list[PlannedTensor]) -> str:
    """The dtype most bytes are stored in (what config.json's dtype should say)."""
    by: dict[str, int] = {}
    for t in tensors:
        by[t.dtype] = by.get(t.dtype, 0) + t.nbytes
    return max(by, key=lambda d: by[d])


def planned_files(ckpt: str | Path, dtype: str | None = None, max_shard_size: str = DEFAULT_MAX_SHARD) -> list[tuple[str, int]]:
    """(file name, size in bytes) of everything :func:`export` would write, without writing it.

    Shard sizes are exact; the small JSON/README files are estimated by the
    size they would have (config and card are generated, so this is close).
    """
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"])
    tensors = plan_tensors(cfg, meta, dtype) + plan_extra_tensors(Path(ckpt), dtype)
    n = assign_shards(tensors, parse_size(max_shard_size))
    files = []
    for i in range(n):
        mine = [t for t in tensors if t.shard == i]
        files.append((shard_name(i, n), len(safetensors_header(mine)) + sum(t.nbytes for t in mine)))
    if n > 1:
        files.append(("model.safetensors.index.json", 0))
    files += [("config.json", 0), ("README.md", 0)]
    tok = Path(ckpt) / TOKENIZER_DIR
    names = {f.name: f.stat().st_size for f in tok.iterdir() if f.is_file()} if tok.is_dir() else {}
    names.setdefault("generation_config.json", 0)
    files += sorted(names.items())
    return files
