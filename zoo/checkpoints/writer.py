"""Writing a zoo checkpoint: streaming (one parameter or one layer at a time) into a scratch folder that is
renamed into place only once :func:`zoo.checkpoints.verify.verify_complete` finds it complete.

On object storage (``gs://``, ``s3://``) there is no rename: the checkpoint is written in place, its arrays
straight into the bucket by Orbax and TensorStore (:class:`CheckpointWriter`), and committed by its
``model.json``, written last (:func:`checkpoint_output`); a folder without it is no checkpoint to any reader.

A checkpoint that stores other arrays than its model's parameters (a LoRA adapter checkpoint stores only
adapters) describes them in a :class:`StoredSection` of its model.json, which the completeness check follows.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zoo.checkpoints.format import (
    FORMAT_VERSION,
    MODEL_FILE,
    PARAMS_DIR,
    STATE_DIR,
    folder_of,
    kvstore_base,
    np_dtype,
    orbax_v1,
)
from zoo.checkpoints.verify import verify_complete
from zoo.errors import UserError
from zoo.model.config import ModelConfig
from zoo.model.params import ParamSpec, flatten, nest
from zoo.orbax_s3 import BUCKET_ATOMICITY
from zoo.storage import RunPath, check_writable, empty_prefix, is_remote, run_path, upload_tree

# On object storage: written first by a writer and removed once its model.json is; a prefix holding it and no
# model.json is a writer's unfinished checkpoint, which the next writer clears.
INCOMPLETE = ".lmzoo-incomplete"
# What a checkpoint on object storage will store, for :class:`CheckpointWriter`: dotted path -> (shape, dtype).
Layout = Mapping[str, tuple[tuple[int, ...], Any]]


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


def _save_context(folder: Path | RunPath) -> Any:
    """Orbax's settings for saving into ``folder``."""
    ocp = orbax_v1()
    # On object storage a save is written in place and committed by Orbax's commit file (its default on gs://,
    # chosen here for every scheme): its other protocol renames the save's folder, a copy of every object there.
    ctx = ocp.Context(atomicity_options=ocp.options.AtomicityOptions(mode=BUCKET_ATOMICITY.mode)
                      ) if is_remote(folder) else ocp.Context()
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


def prepare_output(out: str | os.PathLike, overwrite: bool | None = None, flag: str = "--out") -> None:
    """Refuse a non-empty output folder (given as ``flag``) unless ``overwrite``; None: the command has no
    ``--overwrite`` flag, so the message does not offer one. On object storage the prefix must be writable
    (a probe object), and a writer's unfinished checkpoint there counts as empty (:func:`checkpoint_output`
    clears it)."""
    fix = "add --overwrite to replace it" if overwrite is not None else "remove it"
    if is_remote(out):
        remote = run_path(out, flag)
        check_writable(remote, flag)
        if remote.is_dir() and not _unfinished(remote, flag) and any(remote.iterdir()) and not overwrite:
            raise UserError(f"{flag} {out} exists and is not empty; choose a new prefix or {fix}")
        return
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise UserError(f"{flag} {out} exists and is not a folder; choose another path")
        if any(out.iterdir()) and not overwrite:
            raise UserError(f"{flag} {out} exists and is not empty; choose a new folder or {fix}")


def _unfinished(remote: RunPath, flag: str) -> bool:
    """Whether the prefix ``remote`` holds an unfinished checkpoint (:data:`INCOMPLETE`, no model.json) whose
    writer is gone; one whose writer still runs on this host is one line."""
    marker = remote / INCOMPLETE
    if (remote / MODEL_FILE).exists() or not marker.exists():
        return False
    try:
        writer = json.loads(marker.read_text())
    except ValueError:  # cut short by a kill
        return True
    if writer.get("host") == socket.gethostname() and _alive(int(writer.get("pid", 0))):
        raise UserError(f"{flag} {remote}: another writer (process {writer['pid']}) is writing a checkpoint "
                        "there; wait for it or choose another prefix")
    return True


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def checkpoint_output(out: str | os.PathLike, overwrite: bool | None = None
                      ) -> AbstractContextManager[Path | RunPath]:
    """Where a checkpoint writer writes ``out``: :func:`atomic_output` on the local disk, the prefix itself on
    object storage (:func:`_in_place`)."""
    if is_remote(out):
        return _in_place(run_path(out, "--out"), overwrite)
    return atomic_output(out, overwrite)


@contextmanager
def _in_place(out: RunPath, overwrite: bool | None) -> Iterator[RunPath]:
    """Yield the prefix ``out`` on object storage, where a checkpoint is written in place: no rename there.

    :data:`INCOMPLETE` is written first; then what an earlier writer left unfinished, or, with ``overwrite``, the
    old checkpoint (its model.json first) is removed. The checkpoint's model.json, written last
    (:meth:`CheckpointWriter.finish`), commits it; then the marker goes. An error removes what was written
    (model.json first); a killed writer's objects are cleared by the next one.
    """
    prepare_output(out, overwrite)
    (out / INCOMPLETE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    (out / MODEL_FILE).unlink(missing_ok=True)
    empty_prefix(out, keep=(INCOMPLETE,))
    try:
        yield out
    except BaseException:
        (out / MODEL_FILE).unlink(missing_ok=True)
        empty_prefix(out)
        raise
    (out / INCOMPLETE).unlink()


@contextmanager
def local_files(folder: Path | RunPath) -> Iterator[Path]:
    """A local folder whose files end up in the checkpoint folder ``folder``: ``folder`` itself on the local disk;
    on object storage a temporary one, uploaded into it on leaving (small files a library writes to a local path
    only: a tokenizer's)."""
    if not is_remote(folder):
        yield Path(os.fspath(folder))
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="lmzoo-files-") as tmp:
        yield Path(tmp)
        upload_tree(Path(tmp), folder)


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


# Whole parameters are saved in batches of up to this many bytes (CheckpointWriter._save): past a few MiB a
# save's fixed cost is small beside its writes, and a batch this size adds nothing that matters to a conversion's
# peak memory (its bound is the largest tensor, often hundreds of MiB).
BATCH_BYTES = 16 * 2**20


class CheckpointWriter:
    """Writes a zoo checkpoint into ``folder`` one parameter (or one layer) at a time.

    Whole parameters go in with Orbax partial saves (:meth:`add`). Stacked
    parameters, which can be far larger than memory (a Mixtral expert stack
    is ~30 GB), are reserved in the Orbax tree first (:meth:`reserve`) and,
    once the tree is committed, written slice by slice straight into the same
    OCDBT store with TensorStore, chunked one layer (one expert) per chunk
    (:meth:`write_slices`): memory holds one slice at a time.

    On object storage Orbax's partial saves cannot run: each gathers its arrays in a folder that is then renamed
    into the tree, twice (orbax.checkpoint.experimental.v1's ``partial``), and Orbax's commit-file protocol, its
    default where there is no rename, refuses them ("Snapshot is not supported for CommitFileTemporaryPath"); a
    rename there would be a copy of every object. So there the writer needs the checkpoint's ``layout`` (every
    array it will store) up front: Orbax saves the tree once, every array a placeholder, and each array, whole
    (:meth:`add`) or slice by slice, is then written into its place with TensorStore through the bucket's own
    driver: each byte crosses once, memory bounded as on the local disk.

    Use it inside :func:`checkpoint_output` (or :func:`atomic_output`) so that nothing half-written is ever
    visible at the destination.
    """

    def __init__(self, folder: str | os.PathLike, layout: Layout | None = None):
        self.folder = folder_of(folder)  # a bucket URL: Orbax and TensorStore write to it themselves
        self.params: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, int] = {}  # reserved path -> number of leading slice axes
        self._committed = False
        self._batch: dict[str, Any] = {}  # whole parameters queued for one partial save (_save)
        self._batch_bytes = 0
        self._ctx = _save_context(self.folder)
        self._in_place = is_remote(self.folder)
        self._layout = {p: (tuple(shape), np.dtype(dt)) for p, (shape, dt) in (layout or {}).items()}
        if self._in_place and layout is not None:
            ocp = orbax_v1()
            with self._ctx:  # the whole tree at once, each array a placeholder its writes replace
                ocp.save(self.folder / PARAMS_DIR, nest({p: np.zeros((1,), dt) for p, (_, dt) in self._layout.items()}))
            self._committed = True

    def add(self, path: str, array: np.ndarray | jax.Array, axes: tuple[str | None, ...] = ()) -> None:
        """Write one whole parameter (dotted path); the caller may free it afterwards."""
        if self._in_place:
            self._planned(path, array.shape, array.dtype)
            self._write_pieces(path, list(array.shape), str(array.dtype), 0, iter([((), np.asarray(array))]))
        else:
            self._save(path, array)
        self.params[path] = {"shape": list(array.shape), "dtype": str(array.dtype), "axes": list(axes)}

    def reserve(self, path: str, shape: tuple[int, ...], dtype: Any, axes: tuple[str | None, ...], slice_axes: int) -> None:
        """Declare a parameter whose data :meth:`write_slices` supplies later, ``slice_axes`` leading axes at a time."""
        dtype = np.dtype(dtype)
        if self._in_place:
            self._planned(path, shape, dtype)  # its placeholder is in the tree already
        else:
            self._save(path, np.zeros((1,), dtype))  # registers the key in Orbax's tree metadata
        self.params[path] = {"shape": list(shape), "dtype": str(dtype), "axes": list(axes)}
        self._pending[path] = slice_axes

    def _planned(self, path: str, shape: tuple[int, ...], dtype: Any) -> None:
        """On object storage: ``path`` must be in the layout given, with this shape and dtype."""
        if not self._committed:
            raise RuntimeError(f"{self.folder}: a checkpoint on object storage is written with its layout given up "
                               "front (CheckpointWriter(folder, layout))")
        if self._layout.get(path) != (tuple(shape), np.dtype(dtype)):
            raise RuntimeError(f"{path}: {np.dtype(dtype)}{list(shape)} is not in the layout given "
                               f"({self._layout.get(path)})")

    def _save(self, path: str, array: Any) -> None:
        """Queue ``array`` for the next Orbax partial save (:meth:`_flush`), which comes once the queue holds
        :data:`BATCH_BYTES`: each partial save is a fixed cost (its own data file, tree metadata and merge, about
        50 ms), so a small model's dozens of parameters and placeholders go in one save, not one save each, while
        memory holds at most one batch beyond the parameter being written."""
        if self._committed:
            raise RuntimeError("the checkpoint tree is already committed")
        self._batch[path] = array
        self._batch_bytes += array.nbytes
        if self._batch_bytes >= BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Write the queued parameters in one Orbax partial save."""
        if self._batch:
            ocp = orbax_v1()
            with self._ctx:
                ocp.partial.save(self.folder / PARAMS_DIR, nest(self._batch))
            self._batch, self._batch_bytes = {}, 0

    def commit_structure(self) -> None:
        """Finalize the Orbax tree; after this only reserved parameters' slices can be written."""
        if not self._committed:
            self._flush()
            ocp = orbax_v1()
            with self._ctx:
                ocp.partial.finalize(self.folder / PARAMS_DIR)
            self._committed = True

    def write_slices(self, path: str, slices: Iterator[tuple[tuple[int, ...], np.ndarray]]) -> None:
        """Write a reserved parameter from ``(index, array)`` pieces covering it, one chunk each."""
        self.commit_structure()
        info = self.params[path]
        self._write_pieces(path, info["shape"], info["dtype"], self._pending.pop(path), slices)

    def _write_pieces(self, path: str, shape: list[int], dtype: str, k: int,
                      pieces: Iterator[tuple[tuple[int, ...], np.ndarray]]) -> None:
        """Write the array ``path`` into the OCDBT store with TensorStore, one chunk per index of its ``k``
        leading axes, from ``pieces`` covering it (``k`` = 0: one piece, the whole array)."""
        import tensorstore as ts

        spec = {
            "driver": "zarr3",
            # the bucket's own driver on object storage; no cap on a data file's size (as _save_context sets it)
            "kvstore": {"driver": "ocdbt", "base": kvstore_base(self.folder / PARAMS_DIR / STATE_DIR), "path": path,
                        "target_data_file_size": 0},
            # Every chunk is stored, also one equal to the fill value (an all-zero slice: a fresh Gemma's norms,
            # DeepSeek's correction bias): Orbax reads with missing chunks as errors, not as fill values.
            "store_data_equal_to_fill_value": True,
            "metadata": {
                "shape": shape,
                "data_type": dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1] * k + shape[k:]}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            },
        }
        store = ts.open(spec, create=True, delete_existing=True).result()
        seen = 0
        # Small pieces are written in transactions of up to BATCH_BYTES: each piece committed alone is one OCDBT
        # commit (about 10 ms, most of a small model's conversion), a transaction's pieces one commit together. A
        # transaction stages a copy of its pieces until it commits, so a large piece goes alone, from the caller's
        # buffer (as Orbax writes), not from a copy: the piece is not changed until its write has committed.
        txn, staged = ts.Transaction(), 0
        for index, piece in pieces:
            piece = np.asarray(piece, dtype=np_dtype(dtype))
            seen += 1
            if piece.nbytes >= BATCH_BYTES:
                store[index].write(piece, can_reference_source_data_indefinitely=True).result()
                continue
            store.with_transaction(txn)[index].write(piece).result()
            staged += piece.nbytes
            if staged >= BATCH_BYTES:
                txn.commit_async().result()
                txn, staged = ts.Transaction(), 0
        txn.commit_async().result()
        if seen != int(np.prod(shape[:k])):
            raise RuntimeError(f"{path}: wrote {seen} slices of {int(np.prod(shape[:k]))}")

    def adopt(self, params: dict[str, dict[str, Any]]) -> None:
        """Take over parameters that :func:`save_params` already wrote (their tree is committed)."""
        if self.params or self._committed:
            raise RuntimeError("adopt() must come before any other write")
        self.params = dict(params)
        self._committed = True

    def finish(self, cfg: ModelConfig, manifest: dict[str, dict[str, Any]] | None = None, **provenance: Any) -> None:
        """Commit the checkpoint (every reserved parameter must be written), verify it, then write model.json.

        ``provenance`` entries go into model.json as they are. One that is a :class:`StoredSection` names
        the arrays :func:`verify_complete` expects instead of the model's parameters. ``manifest`` is then the
        model's parameter table for model.json's ``params`` (default: the arrays written, or adopted).
        model.json comes last: on object storage it is what commits the checkpoint.
        """
        sections = [k for k, v in provenance.items() if isinstance(v, StoredSection)]
        if len(sections) > 1:
            raise RuntimeError(f"more than one section lists the stored arrays: {sections}")
        self.commit_structure()
        unwritten = sorted(self._pending) + sorted(set(self._layout) - set(self.params))
        if unwritten:
            raise RuntimeError(f"reserved parameters never written: {unwritten}")
        meta = {
            "format_version": FORMAT_VERSION,
            "family": cfg.family,
            "config": cfg.to_dict(),
            "params": dict(sorted((self.params if manifest is None else manifest).items())),
            **provenance,
        }
        if sections:
            verify_complete(self.folder, sections[0], provenance[sections[0]].specs(cfg), meta=meta)
        else:
            verify_complete(self.folder, meta=meta)
        (self.folder / MODEL_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def save_params(folder: str | os.PathLike, params: dict[str, Any], axes: dict[str, tuple[str, ...]]) -> dict:
    """Write sharded (possibly multi-host) parameters into ``folder``; every process calls it.

    Orbax writes each process's own shards, so no host ever gathers the whole
    model. Returns the per-parameter metadata for :meth:`CheckpointWriter.adopt`.
    """
    ocp = orbax_v1()
    with _save_context(folder_of(folder)):
        ocp.save(folder_of(folder) / PARAMS_DIR, params)
    flat = flatten(params)
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype), "axes": list(axes[k])} for k, v in sorted(flat.items())}


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

