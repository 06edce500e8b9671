"""HF/GGUF -> zoo checkpoint: streaming, driven by the target parameters."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from convert import fp8, mtp, mxfp4
from convert.dequantizing import DequantizingReader
from convert.fused import split_fused, with_expert_layout
from convert.rules import BoundRule
from convert.safetensors_out import write_streaming
from convert.source import Source, open_source
from convert.tables import table_for
from convert.transforms import TRANSFORMS, hf_shape
from convert.vision_tables import with_tower_spelling
from zoo.checkpoints.format import HF_CONFIG_FILE, TOKENIZER_DIR, folder_of
from zoo.checkpoints.provenance import HUB_ID
from zoo.checkpoints.writer import CheckpointWriter, checkpoint_output, local_files, prepare_output
from zoo.errors import UserError
from zoo.memory import release_free_memory
from zoo.model.config import ModelConfig
from zoo.model.from_hf import model_config_from_hf
from zoo.model.hf_families import source_format
from zoo.model.params import param_specs
from zoo.storage import RunPath

# multimodal formats whose language model converts alone (--text-only)
TEXT_ONLY_FORMATS = ("hf-gemma3-multimodal", "hf-gemma4-multimodal", "hf-llama4-multimodal",
                     "hf-qwen3_5-multimodal", "hf-qwen3_5_moe-multimodal")
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")  # Gemma 4's audio side: not converted

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
        want = hf_shape(rule.transform, piece, cfg)
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


def _dequantizing(src: Source, cast_to: np.dtype | None, stored_config: dict[str, Any]
                  ) -> DequantizingReader | None:
    """A Hugging Face source's quantized weights dequantized while streaming (gpt-oss's MXFP4 experts, FP8 block
    scaling), its reader swapped for one that does it and ``stored_config`` rid of its ``quantization_config``
    (the checkpoint holds the dequantized weights); None for a source without (a quantized tensor the config
    does not declare is refused)."""
    if src.fmt == "gguf":
        return None
    dequantizing: DequantizingReader
    if mxfp4.declared(src.hf_config):  # gpt-oss's experts
        dequantizing = mxfp4.DequantizingReader(src.reader, cast_to or mxfp4.DEFAULT_DTYPE, src.description)
    else:
        mxfp4.refuse_undeclared(src.reader, src.description)
        scaling = fp8.block_scaling(src.hf_config, f"{src.description}: config")
        if scaling is None:
            fp8.refuse_unscaled_fp8(src.reader, src.description)
            return None
        dequantizing = fp8.DequantizingReader(src.reader, scaling, cast_to or fp8.DEFAULT_DTYPE, src.description)
    src.reader = dequantizing
    stored_config.pop("quantization_config")
    return dequantizing


def _note_left_out(src: Source, fmt: str, cfg: ModelConfig, rules: list[BoundRule], dropped: list[str],
                   stored_config: dict[str, Any]) -> None:
    """Notes on what the conversion leaves out: a multimodal model's vision tower (converted text only), and the
    multi-token-prediction layer's tensors ``dropped`` (``stored_config`` then says the checkpoint has none)."""
    # Qwen3.5's releases also hold a multi-token-prediction layer under mtp. (not run by lmzoo either)
    mtp_left = sum(n.startswith("mtp.") for n in src.reader.names()) if fmt in TEXT_ONLY_FORMATS else 0
    if fmt in TEXT_ONLY_FORMATS and cfg.vision is None:
        left = len(src.reader.names()) - sum(len(r.hf_names()) for r in rules) - mtp_left
        also = f"; so is the multi-token-prediction layer ({mtp_left} tensors under mtp.)" if mtp_left else ""
        print(f"note: {src.description} is multimodal: converting its language model; the vision tower and "
              f"projector ({left} tensors) are left out{also}", file=sys.stderr)
    elif mtp_left:
        print(f"note: {src.description}: the multi-token-prediction layer ({mtp_left} tensors under mtp.) is left "
              "out: lmzoo's model does not run it", file=sys.stderr)
    audio = [n for n in src.reader.names() if n.startswith(AUDIO_PREFIXES)]
    if audio and cfg.vision is not None:
        print(f"note: {src.description} has an audio tower: converting its language model and vision tower; the "
              f"audio tower and its embedder ({len(audio)} tensors) are left out", file=sys.stderr)
        stored_config["audio_config"] = None  # what the checkpoint holds: the export loads without an audio tower
    if dropped:
        size = sum(int(np.prod(src.reader.shape(n), dtype=np.int64)) * src.reader.dtype(n).itemsize for n in dropped)
        from zoo.console import human_bytes

        print(f"note: dropped the multi-token-prediction layer ({len(dropped)} tensors, {human_bytes(size)} as "
              f"converted, from {dropped[0].rsplit('.', 3)[0]}.*): lmzoo's model does not run it; --keep-mtp keeps "
              "it for export", file=sys.stderr)
        stored_config["num_nextn_predict_layers"] = 0  # what the checkpoint holds


def convert(source: str, out: str | Path, dtype: str | None = None, progress: bool | None = None,
            keep_mtp: bool = False, text_only: bool = False) -> Path | RunPath:
    """Convert SOURCE into a zoo checkpoint at ``out`` (a folder, or a ``gs://``/``s3://`` prefix the arrays are
    written into straight from memory); returns the checkpoint path.

    ``dtype`` (float32|bfloat16) casts every parameter; None keeps the stored
    dtype (float32 for dequantized GGUF tensors, bfloat16 for dequantized FP8
    weights). ``keep_mtp`` keeps a DeepSeek checkpoint's multi-token-prediction
    layers (convert/mtp.py) instead of dropping them. ``text_only`` converts a multimodal Gemma 3's, Gemma 4's,
    Llama 4's or Qwen3.5's language model alone (exported as the family's *ForCausalLM); Gemma 4's audio tower is
    always left out, and so is Qwen3.5's multi-token-prediction layer (mtp.*).
    """
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    cast_to = None if dtype is None else DTYPES[dtype]
    prepare_output(out)
    src = open_source(source)
    cfg = model_config_from_hf(src.hf_config, f"{src.description}: config")
    fmt = src.fmt if src.fmt == "gguf" else source_format(src.hf_config)
    if text_only:
        if fmt not in TEXT_ONLY_FORMATS:
            raise UserError(f"--text-only: {src.description} is not a multimodal Gemma 3, Gemma 4, Llama 4 or "
                            "Qwen3.5 model; convert without --text-only")
        cfg = dataclasses.replace(cfg, vision=None)
    cfg = with_tower_spelling(cfg, fmt, src.reader.names(), src.description)  # as the source names Gemma 3's tower
    stored_config = dict(src.hf_config)
    dequantizing = _dequantizing(src, cast_to, stored_config)  # its summary ends the run
    extra = mtp.mtp_tensors(src.reader.names(), src.hf_config)
    if keep_mtp and not extra:
        raise UserError(f"--keep-mtp: {src.description} has no multi-token-prediction layer to keep "
                        "(its config sets no num_nextn_predict_layers, or the checkpoint has no tensors past "
                        "num_hidden_layers); convert without --keep-mtp")
    if fmt != "gguf":
        cfg = with_expert_layout(cfg, src.reader)  # the order of Qwen3-VL-MoE's fused experts' axes in the files
    if fmt != "gguf" or cfg.family == "qwen3_next":  # llama.cpp's qwen3next files fuse tensors too (convert.fused)
        src.reader = split_fused(src.reader, cfg, src.description)  # Phi-3's qkv_proj as q/k/v_proj, ...
    rules = table_for(cfg.family, fmt, cfg)
    check_source(src, cfg, rules)
    _note_left_out(src, fmt, cfg, rules, [] if keep_mtp else extra, stored_config)
    specs = param_specs(cfg)
    layout = {r.zoo: (specs[r.zoo].shape, cast_to or src.reader.dtype(r.hf_names()[0])) for r in rules}
    with checkpoint_output(out) as folder:
        writer = CheckpointWriter(folder, layout)
        bar = tqdm(total=sum(len(r.hf_names()) for r in rules) + (len(extra) if keep_mtp else 0), desc="convert",
                   unit="tensor", disable=None if progress is None else not progress)
        # Whole parameters first; stacked ones are reserved, then streamed slice by slice.
        for rule in rules:
            dt = cast_to or src.reader.dtype(rule.hf_names()[0])
            if rule.stacked:
                writer.reserve(rule.zoo, specs[rule.zoo].shape, dt, specs[rule.zoo].axes, rule.slice_axes)
                continue
            bar.set_postfix_str(rule.zoo)
            writer.add(rule.zoo, build_piece(src, cfg, rule, (), dt), specs[rule.zoo].axes)
            bar.update()
            release_free_memory()
        for rule in rules:
            if rule.stacked:
                dt = cast_to or src.reader.dtype(rule.hf_names()[0])
                bar.set_postfix_str(rule.zoo)
                writer.write_slices(rule.zoo, ((ix, build_piece(src, cfg, rule, ix, dt)) for ix in _counted(rule.indices(), bar)))
        with local_files(folder) as files:  # on object storage: written locally, then uploaded
            if keep_mtp:
                bar.set_postfix_str("multi-token prediction")
                kept = [(n, src.reader.shape(n), cast_to or src.reader.dtype(n)) for n in extra]
                write_streaming(files / mtp.EXTRA_FILE, kept, lambda n: _counted_read(src, n, bar))
            bar.close()
            src.save_tokenizer(files / TOKENIZER_DIR)
        (folder / HF_CONFIG_FILE).write_text(json.dumps(stored_config, indent=2, default=str) + "\n")
        hub: dict[str, Any] = {HUB_ID: src.hub_id} if src.hub_id else {}  # the Hub repo these weights are
        writer.finish(cfg, source=src.description, source_format=fmt, **hub)
    if dequantizing is not None:
        print(dequantizing.summary(), file=sys.stderr)
    return folder_of(out)


def _counted_read(src: Source, name: str, bar) -> np.ndarray:
    x = src.reader.get(name)
    bar.update()
    return x
