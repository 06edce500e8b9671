"""The zoo checkpoint format: a checkpoint folder's layout, its model.json read and validated.

Layout of a checkpoint folder::

    model.json      format version, family, ModelConfig, parameter table, provenance
    params/         Orbax checkpoint (OCDBT/zarr3), one array per dotted parameter path
    tokenizer/      tokenizer files incl. the chat template (optional)
    hf_config.json  the source Hugging Face config, kept for export (optional)

Converted checkpoints and training-run checkpoints share this layout, so
``zoo.load`` and ``zoo export`` read both the same way.

A checkpoint may lie on object storage (``gs://``, ``s3://``): its arrays are then written and read there by
Orbax and TensorStore through their own drivers (:func:`params_dir`, :func:`kvstore_base`), its small files
through :mod:`zoo.storage`; ``model.json`` is written last, so a folder without it is no checkpoint.

The format's modules are the bottom layer: they read and write the arrays a checkpoint stores and know
nothing of what a checkpoint may refer to. :mod:`zoo.checkpoints.writer` writes a checkpoint (streaming,
atomic), :mod:`zoo.checkpoints.verify` checks that a written one is complete, :mod:`zoo.checkpoints.readers`
reads its stored arrays and :mod:`zoo.checkpoints.provenance` names the Hub repo its model comes from.
Adapter checkpoints are built on them in :mod:`zoo.checkpoints.adapter`, and :mod:`zoo.checkpoints.loading`
reads any checkpoint as the model it describes (``zoo.load``, ``zoo.load_params``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.storage import RunPath, is_remote, origin, run_path

FORMAT_VERSION = 1
MODEL_FILE = "model.json"
PARAMS_DIR = "params"
STATE_DIR = "state"  # where Orbax's partial saves put the OCDBT store inside params/
TOKENIZER_DIR = "tokenizer"
# a model folder's weight files, never part of a tokenizer (a tokenizer folder may be a whole model's)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf", "*.pt",
                "*.pth", "*.msgpack", "*.h5")
HF_CONFIG_FILE = "hf_config.json"


def orbax_v1() -> Any:
    """Orbax's v1 checkpointing API (``orbax.checkpoint.experimental.v1``), imported on first use."""
    import orbax.checkpoint.experimental.v1 as ocp

    return ocp


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name as model.json stores it (``bfloat16`` from ml_dtypes)."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if name in ("bfloat16",) else np.dtype(name)


def folder_of(ckpt: str | os.PathLike) -> Path | RunPath:
    """The checkpoint folder ``ckpt``: a local one made absolute, one on object storage as a run path."""
    return run_path(ckpt, "checkpoint") if is_remote(ckpt) else Path(ckpt).absolute()


def params_dir(ckpt: str | os.PathLike) -> Path | RunPath:
    """Where a checkpoint's arrays are (its ``params/``): in the folder, or, for the local copy of a checkpoint on
    object storage (:func:`zoo.storage.fetched`, which leaves ``params/`` out), at its URL, where Orbax reads them."""
    url = None if is_remote(ckpt) else origin(ckpt)
    return folder_of(url or ckpt) / PARAMS_DIR


def kvstore_base(folder: Path | RunPath) -> dict[str, Any]:
    """TensorStore's key-value store spec of ``folder`` (a local folder or a URL), as Orbax builds it for its own
    arrays: the same driver (file, gcs, or any scheme Orbax is taught) reads and writes them beside Orbax."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    spec = tensorstore_utils.build_kvstore_tspec(os.fspath(folder), use_ocdbt=False)
    if isinstance(spec.get("path"), str) and not spec["path"].endswith("/"):
        spec["path"] += "/"  # a folder: its keys go under it, not beside it
    return spec


def read_meta(ckpt: str | os.PathLike) -> dict[str, Any]:
    """model.json of a checkpoint, validated (exists, parses, format version known)."""
    ckpt = run_path(ckpt, "checkpoint") if is_remote(ckpt) else Path(ckpt)
    f = ckpt / MODEL_FILE
    if not ckpt.is_dir():
        raise UserError(f"{ckpt}: no such checkpoint folder")
    # On object storage (and in a local copy of a checkpoint there) model.json, written last, vouches for params/.
    remote = is_remote(ckpt) or origin(ckpt) is not None
    if not f.is_file() or not (remote or (ckpt / PARAMS_DIR).is_dir()):
        raise UserError(f"{ckpt} is not a zoo checkpoint (no {MODEL_FILE} and {PARAMS_DIR}/); create one with `zoo convert`")
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{f} is not valid JSON ({e}); the checkpoint is damaged, convert it again") from None
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise UserError(f"{f} has no format_version; it is not a zoo checkpoint")
    if version > FORMAT_VERSION:
        raise UserError(
            f"{ckpt} has checkpoint format version {version}, newer than this lmzoo reads ({FORMAT_VERSION}); upgrade lmzoo"
        )
    return meta


def read_config(ckpt: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a checkpoint."""
    return ModelConfig.from_dict(read_meta(ckpt)["config"])

