"""Reading any zoo checkpoint as the model it describes: ``zoo.load``, ``zoo.load_params`` and streaming readers.

A plain checkpoint (converted, or a full fine-tuning run) is read as it is
stored (:mod:`zoo.checkpoints.readers`). An adapter checkpoint (a LoRA run,
:mod:`zoo.checkpoints.adapter`) is read as its base checkpoint with the adapters merged in,
resolved recursively: the base may itself be an adapter checkpoint.

Layering, bottom up: :mod:`zoo.checkpoints.format`, ``readers`` and ``writer`` (plain checkpoint files) <-
:mod:`zoo.checkpoints.adapter` (adapter checkpoints, their base, the merged reader) <-
this module; nothing below imports it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax

from zoo.checkpoints import quantized as quant_checkpoint
from zoo.checkpoints.adapter import (
    MergedParamReader,
    WholeWeightReader,
    base_checkpoint,
    is_adapter,
    load_adapters,
    lora_config,
)
from zoo.checkpoints.format import read_config, read_meta
from zoo.checkpoints.readers import ParamReader, load_stored_params
from zoo.lora.params import merge_lora, whole_weights
from zoo.model import quant
from zoo.model.config import ModelConfig
from zoo.model.decoder import Decoder
from zoo.model.params import param_specs
from zoo.model.sharding import make_mesh


def load_params(
    ckpt: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = None,
    paths: list[str] | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint's model parameters (nested dict of jax Arrays) sharded on ``mesh`` by the
    logical-axis rules; for an adapter checkpoint, its base's with the adapters merged in.

    ``paths`` restores only those dotted parameters (Orbax partial load), which
    is how streaming readers take one parameter at a time.
    """
    meta = read_meta(ckpt)
    if quant_checkpoint.is_quantized(meta):  # `zoo quantize`: the projections dequantized on load
        return quant_checkpoint.load_params(ckpt, meta, mesh or make_mesh(), dtype, paths)
    if not is_adapter(meta):
        return load_stored_params(ckpt, mesh, dtype, paths)
    mesh = mesh or make_mesh()
    base_ckpt = base_checkpoint(ckpt, meta)
    cfg = ModelConfig.from_dict(meta["config"])
    whole = whole_weights(cfg)  # stored with the adapters (a reward model's score head), maybe not in the base
    base = load_params(base_ckpt, mesh, dtype, None if paths is None else [p for p in paths if p not in whole])
    # QLoRA adapters merge into the dequantized base they were trained beside: a float base is quantized and
    # dequantized as training did; a base stored quantized (`zoo quantize`) already loads dequantized.
    if meta["lora"].get("base_quant") and not quant_checkpoint.is_quantized(read_meta(base_ckpt)):
        from zoo.model.quant import as_trained

        bq = meta["lora"]["base_quant"]
        base = as_trained(cfg, base, bq["kind"], bool(bq.get("double")))
    return merge_lora(cfg, base, load_adapters(ckpt, meta, mesh), lora_config(meta))


def param_reader(ckpt: str | os.PathLike, path: str
                 ) -> ParamReader | MergedParamReader | WholeWeightReader | quant_checkpoint.DequantizedParamReader:
    """A streaming reader of one parameter; for an adapter checkpoint, of the merged parameter; for a quantized
    checkpoint, of the dequantized parameter."""
    meta = read_meta(ckpt)
    if quant_checkpoint.is_quantized(meta):
        return quant_checkpoint.DequantizedParamReader(ckpt, meta, path)
    if is_adapter(meta):
        if path in meta["lora"]["params"]:  # trained whole beside the adapters (zoo.lora.params.whole_weights)
            return WholeWeightReader(ckpt, meta, path)
        return MergedParamReader(ckpt, meta, path, param_reader(base_checkpoint(ckpt, meta), path))
    return ParamReader(ckpt, path)


def quantized_param(ckpt: str | os.PathLike, path: str, kind: str, double: bool = False, dtype: Any = None
                    ) -> quant.QuantizedWeight:
    """Projection ``path`` of ``ckpt`` quantized (host arrays, every layer): a checkpoint stored quantized gives
    its fields as they are; any other is read and quantized one matrix (layer, expert) at a time, each cast to
    ``dtype`` first, so the float projection is never whole in memory."""
    meta = read_meta(ckpt)
    if quant_checkpoint.is_quantized(meta):
        return quant_checkpoint.load_quantized(ckpt, meta, path, dtype)
    cfg = read_config(ckpt)
    lead, contract = quant.quantized_paths(cfg)[path]
    lead_shape = param_specs(cfg)[path].shape[:lead]
    return quant.quantize_matrices(param_reader(ckpt, path).read, lead_shape, contract, kind, double, dtype)


def load(ckpt: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, dtype: Any = None,
         attention: str = "auto") -> Decoder:
    """Load a zoo checkpoint as a :class:`zoo.model.decoder.Decoder` on all local devices (or ``mesh``); ``attention``
    is its forward's kernel (``auto``, ``blockwise``, ``cudnn`` or ``splash``: :mod:`zoo.kernels.choice`).
    ``ckpt`` may be a ``gs://`` or ``s3://`` URL: Orbax reads its arrays there; its small files (model.json, the
    tokenizer) come from a local copy (:func:`zoo.checkpoints.paths.checkpoint_dir`)."""
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.storage import is_remote

    if is_remote(ckpt):
        ckpt = checkpoint_dir(os.fspath(ckpt))
    cfg = dataclasses.replace(read_config(ckpt), attention=attention)
    return Decoder(cfg, load_params(ckpt, mesh, dtype))


def reference_dir(path: str, key: str, also: str) -> Path:
    """The zoo checkpoint folder ``path`` of a task's reference model (config key ``key``, which may also be
    ``also``), or a UserError saying so."""
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.errors import UserError

    try:
        return checkpoint_dir(path, key)
    except UserError as e:
        raise UserError(f"{e} ({key} may also be {also})") from None


def load_reference(path: str, key: str, also: str, mcfg: ModelConfig, mesh: jax.sharding.Mesh, dtype: Any) -> dict:
    """A task's frozen reference checkpoint at ``path`` (config key ``key``), sharded like the policy; it must be
    the policy's architecture."""
    from zoo.errors import UserError

    ckpt = reference_dir(path, key, also)
    if read_config(ckpt).architecture() != mcfg.architecture():
        raise UserError(f"{key} {path}: its architecture differs from the policy's (a reference must be the same "
                        "model, e.g. the checkpoint the policy starts from)")
    return load_params(ckpt, mesh, dtype)
