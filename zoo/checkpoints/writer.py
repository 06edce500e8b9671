"""Writing a zoo checkpoint: streaming (one parameter or one layer at a time) into a scratch folder that is
renamed into place only once :func:`zoo.checkpoints.verify.verify_complete` finds it complete.

A checkpoint that stores other arrays than its model's parameters (a LoRA adapter checkpoint stores only
adapters) describes them in a :class:`StoredSection` of its model.json, which the completeness check follows.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zoo.checkpoints.format import FORMAT_VERSION, MODEL_FILE, PARAMS_DIR, STATE_DIR, np_dtype, orbax_v1
from zoo.checkpoints.verify import verify_complete
from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.params import ParamSpec, flatten, nest
from zoo.storage import RunPath, is_remote, run_path


class StoredSection(dict):
    """A model.json section listing the arrays a checkpoint stores when they are not its model's parameters.

    Such a checkpoint (e.g. a LoRA adapter checkpoint, :mod:`zoo.checkpoints.adapter`) keeps its model's parameter table
    in model.json's ``params`` and stores other arrays under ``params/``, listed in this section's own
    ``params`` table. Passed to :meth:`CheckpointWriter.finish` as a provenance entry it is written like any
    dict, and tells the writer's completeness check which arrays to expect, with the shapes :meth:`specs`
    implies for them. Subclasses implement :meth:`specs`.
    """

    def specs(self, cfg: ModelConfig) -> dict[str, ParamSpec]:
        """Every array this section's ``params`` table must list, with the shape ``cfg`` implies for it."""
        raise NotImplementedError


def _save_context() -> Any:
    ocp = orbax_v1()
    ctx = ocp.Context()
    # One zarr chunk per host array: TensorStore then writes straight from the
    # caller's buffer, while splitting into smaller chunks makes it stage a full
    # copy of the array until the write commits (measured: +1x the array).
    # Weights are close to incompressible; zstd would only cost CPU time.
    ctx.array.saving.use_compression = False
    # Saves are synchronous and the writer never mutates an array it handed over,
    # so Orbax's defensive copy of host arrays would only double peak memory.
    ctx.memory.deepcopy_host_arrays = False
    # No cap on OCDBT data-file size: with the default 2 GB cap, an array larger
    # than that is staged in a second buffer to be split (measured: +0.5x a
    # 2.6 GiB array). Each partial save still writes its own data file.
    ctx.array.saving.ocdbt_target_data_file_size = 0
    return ctx


def prepare_output(out: Path, overwrite: bool | None = None, flag: str = "--out") -> None:
    """Refuse a non-empty output folder (given as ``flag``) unless ``overwrite``; None: the command has no
    ``--overwrite`` flag, so the message does not offer one."""
    if out.exists():
        if not out.is_dir():
            raise UserError(f"{flag} {out} exists and is not a folder; choose another path")
        if any(out.iterdir()) and not overwrite:
            fix = "add --overwrite to replace it" if overwrite is not None else "remove it"
            raise UserError(f"{flag} {out} exists and is not empty; choose a new folder or {fix}")


@contextmanager
def atomic_output(out: str | os.PathLike, overwrite: bool | None = None) -> Iterator[Path]:
    """Yield a hidden scratch folder beside ``out``; on success it is renamed onto ``out``. ``overwrite``: as
    :func:`prepare_output` takes it.

    Any error (or a kill) leaves ``out`` untouched: a failed writer's scratch
    folder is deleted, a killed one's is removed by the next writer.
    """
    out = Path(out).absolute()
    prepare_output(out, overwrite)
    tmp = out.parent / f".{out.name}.incomplete-{os.getpid()}"
    remove_stale_scratch(out)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class CheckpointWriter:
    """Writes a zoo checkpoint into ``folder`` one parameter (or one layer) at a time.

    Whole parameters go in with Orbax partial saves (:meth:`add`). Stacked
    parameters, which can be far larger than memory (a Mixtral expert stack
    is ~30 GB), are reserved in the Orbax tree first (:meth:`reserve`) and,
    once the tree is committed, written slice by slice straight into the same
    OCDBT store with TensorStore, chunked one layer (one expert) per chunk
    (:meth:`write_slices`): memory holds one slice at a time.

    Use it inside :func:`atomic_output` so that nothing half-written is ever
    visible at the destination.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = _folder(folder)  # a bucket URL for a writer that only adopts and finishes (pretrain/final.py)
        self.params: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, int] = {}  # reserved path -> number of leading slice axes
        self._committed = False
        self._ctx = _save_context()

    def add(self, path: str, array: np.ndarray | jax.Array, axes: tuple[str | None, ...] = ()) -> None:
        """Write one whole parameter (dotted path); the caller may free it afterwards."""
        self._save(path, array)
        self.params[path] = {"shape": list(array.shape), "dtype": str(array.dtype), "axes": list(axes)}

    def reserve(self, path: str, shape: tuple[int, ...], dtype: Any, axes: tuple[str | None, ...], slice_axes: int) -> None:
        """Declare a parameter whose data :meth:`write_slices` supplies later, ``slice_axes`` leading axes at a time."""
        dtype = np.dtype(dtype)
        self._save(path, np.zeros((1,), dtype))  # registers the key in Orbax's tree metadata
        self.params[path] = {"shape": list(shape), "dtype": str(dtype), "axes": list(axes)}
        self._pending[path] = slice_axes

    def _save(self, path: str, array: Any) -> None:
        if self._committed:
            raise RuntimeError("the checkpoint tree is already committed")
        ocp = orbax_v1()
        with self._ctx:
            ocp.partial.save(self.folder / PARAMS_DIR, nest({path: array}))

    def commit_structure(self) -> None:
        """Finalize the Orbax tree; after this only reserved parameters' slices can be written."""
        if not self._committed:
            ocp = orbax_v1()
            with self._ctx:
                ocp.partial.finalize(self.folder / PARAMS_DIR)
            self._committed = True

    def write_slices(self, path: str, slices: Iterator[tuple[tuple[int, ...], np.ndarray]]) -> None:
        """Write a reserved parameter from ``(index, array)`` pieces covering it, one chunk each."""
        import tensorstore as ts

        self.commit_structure()
        k = self._pending.pop(path)
        info = self.params[path]
        shape = info["shape"]
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "ocdbt", "base": f"file://{self.folder / PARAMS_DIR / STATE_DIR}/", "path": path},
            # Every chunk is stored, also one equal to the fill value (an all-zero slice: a fresh Gemma's norms,
            # DeepSeek's correction bias): Orbax reads with missing chunks as errors, not as fill values.
            "store_data_equal_to_fill_value": True,
            "metadata": {
                "shape": shape,
                "data_type": info["dtype"],
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1] * k + shape[k:]}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            },
        }
        store = ts.open(spec, create=True, delete_existing=True).result()
        seen = 0
        for index, piece in slices:
            store[index].write(np.asarray(piece, dtype=np_dtype(info["dtype"]))).result()
            seen += 1
        if seen != int(np.prod(shape[:k])):
            raise RuntimeError(f"{path}: wrote {seen} slices of {int(np.prod(shape[:k]))}")

    def adopt(self, params: dict[str, dict[str, Any]]) -> None:
        """Take over parameters that :func:`save_params` already wrote (their tree is committed)."""
        if self.params or self._committed:
            raise RuntimeError("adopt() must come before any other write")
        self.params = dict(params)
        self._committed = True

    def finish(self, cfg: ModelConfig, manifest: dict[str, dict[str, Any]] | None = None, **provenance: Any) -> None:
        """Commit the checkpoint (every reserved parameter must be written), write model.json and verify it.

        ``provenance`` entries go into model.json as they are. One that is a :class:`StoredSection` names
        the arrays :func:`verify_complete` expects instead of the model's parameters. ``manifest`` is then the
        model's parameter table for model.json's ``params`` (default: the arrays written, or adopted).
        """
        sections = [k for k, v in provenance.items() if isinstance(v, StoredSection)]
        if len(sections) > 1:
            raise RuntimeError(f"more than one section lists the stored arrays: {sections}")
        self.commit_structure()
        if self._pending:
            raise RuntimeError(f"reserved parameters never written: {sorted(self._pending)}")
        meta = {
            "format_version": FORMAT_VERSION,
            "family": cfg.family,
            "config": cfg.to_dict(),
            "params": dict(sorted((self.params if manifest is None else manifest).items())),
            **provenance,
        }
        (self.folder / MODEL_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if sections:
            verify_complete(self.folder, sections[0], provenance[sections[0]].specs(cfg))
        else:
            verify_complete(self.folder)


def save_params(folder: str | os.PathLike, params: dict[str, Any], axes: dict[str, tuple[str, ...]]) -> dict:
    """Write sharded (possibly multi-host) parameters into ``folder``; every process calls it.

    Orbax writes each process's own shards, so no host ever gathers the whole
    model. Returns the per-parameter metadata for :meth:`CheckpointWriter.adopt`.
    """
    ocp = orbax_v1()
    ctx = _save_context()
    if is_remote(folder):  # no rename on a bucket (on s3:// it would copy every object): Orbax's commit file
        ctx.atomicity.mode = ocp.options.AtomicityMode.COMMIT_FILE
    with ctx:
        ocp.save(_folder(folder) / PARAMS_DIR, params)
    flat = flatten(params)
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype), "axes": list(axes[k])} for k, v in sorted(flat.items())}


def _folder(folder: str | os.PathLike) -> Path | RunPath:
    """``folder`` made absolute; a bucket URL as a run path (Orbax and TensorStore write to it themselves)."""
    return run_path(folder, "checkpoint") if is_remote(folder) else Path(folder).absolute()


def remove_stale_scratch(out: Path) -> None:
    """Delete scratch folders left beside ``out`` by writers that were killed."""
    for d in out.parent.glob(f".{out.name}.incomplete-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue  # that writer is still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        shutil.rmtree(d, ignore_errors=True)

