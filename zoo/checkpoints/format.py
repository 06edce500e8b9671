"""The zoo checkpoint format: plain checkpoint folders written (streaming, atomic), verified and read.

Layout of a checkpoint folder::

    model.json      format version, family, ModelConfig, parameter table, provenance
    params/         Orbax checkpoint (OCDBT/zarr3), one array per dotted parameter path
    tokenizer/      tokenizer files incl. the chat template (optional)
    hf_config.json  the source Hugging Face config, kept for export (optional)

Converted checkpoints and training-run checkpoints share this layout, so
``zoo.load`` and ``zoo export`` read both the same way.

This module is the bottom layer: it reads and writes the arrays a checkpoint
stores and knows nothing of what a checkpoint may refer to. A checkpoint that
stores other arrays than its model's parameters (a LoRA adapter checkpoint
stores only adapters) describes them in a :class:`StoredSection` of its
model.json, which the writer's completeness check follows. Adapter checkpoints
are built on this module in :mod:`zoo.checkpoints.adapter`, and :mod:`zoo.checkpoints.loading` reads
any checkpoint as the model it describes (``zoo.load``, ``zoo.load_params``).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from zoo.errors import UserError
from zoo.memory import release_free_memory
from zoo.model.config import ModelConfig
from zoo.model.params import ParamSpec, flatten, nest, param_specs

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


def prepare_output(out: Path, overwrite: bool = False) -> None:
    """Refuse a non-empty output folder unless ``overwrite``."""
    if out.exists():
        if not out.is_dir():
            raise UserError(f"--out {out} exists and is not a folder; choose another path")
        if any(out.iterdir()) and not overwrite:
            raise UserError(f"--out {out} exists and is not empty; choose a new folder or remove it")


@contextmanager
def atomic_output(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a hidden scratch folder beside ``out``; on success it is renamed onto ``out``.

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
        self.folder = Path(folder).absolute()
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


def verify_complete(ckpt: str | os.PathLike, section: str | None = None,
                    specs: dict[str, ParamSpec] | None = None) -> None:
    """Check, without reading the weights, that a just-written checkpoint is complete; a RuntimeError if not.

    Every writer calls it (through :meth:`CheckpointWriter.finish`) before its checkpoint is renamed into
    place, so a checkpoint that "wrote" also loads. It checks that:

    * the manifest (model.json) lists every parameter the config implies, with the implied shape; for
      a checkpoint that stores other arrays (a :class:`StoredSection`), the manifest is model.json's
      ``section`` entry's ``params`` table and ``specs`` what it must list (for an adapter checkpoint:
      every adapter its LoRA settings imply);
    * each listed parameter is in Orbax's tree metadata and has a stored array (its ``zarr.json`` in the
      OCDBT store under ``params/state``) of the listed shape and dtype;
    * every chunk of every array is stored: the array's chunk keys are listed from the OCDBT b-tree
      (chunks are entries of the b-tree, not files: a missing one is what TensorStore leaves when it skips
      a chunk equal to the fill value, which Orbax then fails to read); for an unsharded uncompressed
      chunk its last byte is read (present and full length); for an Orbax shard (``sharding_indexed``)
      its index is read and every inner chunk inside the array must have an entry.

    Cost: the b-tree listing plus one small read per stored chunk (a few bytes each), independent of
    the weights' size.
    """
    import tensorstore as ts

    ckpt = Path(ckpt).absolute()
    try:
        meta = json.loads((ckpt / MODEL_FILE).read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{ckpt}: unreadable {MODEL_FILE} ({e})") from None
    table = meta["params"] if section is None else meta[section]["params"]
    if specs is None:
        specs = param_specs(ModelConfig.from_dict(meta["config"]))
    for p, spec in specs.items():
        if p not in table:
            raise RuntimeError(f"{ckpt}: parameter '{p}' is missing from the manifest ({MODEL_FILE})")
        if tuple(table[p]["shape"]) != tuple(spec.shape):
            raise RuntimeError(f"{ckpt}: parameter '{p}' has shape {table[p]['shape']} in the manifest, "
                               f"the config implies {list(spec.shape)}")
    state = ckpt / PARAMS_DIR / STATE_DIR
    try:
        tree = json.loads((state / "_METADATA").read_text())["tree_metadata"]
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"{ckpt}: Orbax's tree metadata is unreadable ({e})") from None
    if (state / "manifest.ocdbt").is_file():
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state}/"}).result()
    else:  # Orbax's layout without OCDBT: the same keys as plain files
        kv = ts.KvStore.open(f"file://{state}/").result()
    keys = set(kv.list().result())
    zarr = {p: kv.read(f"{p}/zarr.json".encode()) for p in table}
    # (parameter, chunk key, byte range, bytes expected, the shard's layout for an inner-chunk check or None)
    checks: list[tuple[str, bytes, slice, int, tuple[Any, ...] | None]] = []
    for p, info in table.items():
        if str(tuple(p.split("."))) not in tree:
            raise RuntimeError(f"{ckpt}: parameter '{p}' is not in Orbax's tree metadata")
        r = zarr[p].result()
        if r.state != "value":
            raise RuntimeError(f"{ckpt}: parameter '{p}' has no stored array ({p}/zarr.json is missing)")
        z = json.loads(r.value)
        if list(z["shape"]) != list(info["shape"]) or z["data_type"] != info["dtype"]:
            raise RuntimeError(f"{ckpt}: parameter '{p}' is stored as {z['data_type']}{z['shape']}, "
                               f"the manifest says {info['dtype']}{info['shape']}")
        shape, chunk = z["shape"], z["chunk_grid"]["configuration"]["chunk_shape"]
        itemsize = np_dtype(z["data_type"]).itemsize
        sharding = next((c["configuration"] for c in z["codecs"] if c["name"] == "sharding_indexed"), None)
        for pos in np.ndindex(*[-(-s // c) for s, c in zip(shape, chunk)]):
            key = _chunk_key(p, z.get("chunk_key_encoding", {"name": "default"}), pos)
            if key not in keys:
                raise RuntimeError(f"{ckpt}: parameter '{p}' is incomplete: chunk {key.decode()} is not stored")
            if sharding is None:
                size = int(np.prod(chunk)) * itemsize
                plain = all(c["name"] in ("bytes", "transpose") for c in z["codecs"])
                rng = slice(size - 1, size) if plain else slice(0, 1)
                checks.append((p, key, rng, 1, None))
            else:
                rng, n = _shard_index_range(sharding, chunk)
                checks.append((p, key, rng, n, (sharding, chunk, pos, shape, itemsize)))
    reads = [kv.read(key, byte_range=rng) for _, key, rng, _, _ in checks]
    for (p, key, _rng, n, shard), fut in zip(checks, reads):
        try:
            r = fut.result()
            value = r.value if r.state == "value" else b""
        except Exception:  # out of range: a truncated chunk
            value = b""
        if len(value) != n:
            raise RuntimeError(f"{ckpt}: parameter '{p}' is incomplete: chunk {key.decode()} is missing or truncated")
        if shard is not None:
            missing = _missing_inner_chunks(value, *shard)
            if missing:
                raise RuntimeError(f"{ckpt}: parameter '{p}' is incomplete: shard {key.decode()} lacks "
                                   f"inner chunk(s) {missing[:4]}")


def _chunk_key(path: str, encoding: dict[str, Any], pos: tuple[int, ...]) -> bytes:
    """The zarr3 store key of chunk ``pos`` of array ``path``."""
    if encoding["name"] == "v2":
        sep = encoding.get("configuration", {}).get("separator", ".")
        return f"{path}/{sep.join(map(str, pos)) or '0'}".encode()
    sep = encoding.get("configuration", {}).get("separator", "/")
    return f"{path}/{sep.join(['c', *map(str, pos)])}".encode()


def _shard_index_range(sharding: dict[str, Any], shard_shape: list[int]) -> tuple[slice, int]:
    """Byte range and length of a sharding_indexed shard's index: 16 bytes per inner chunk (+4 with a crc32c)."""
    n = int(np.prod([-(-s // c) for s, c in zip(shard_shape, sharding["chunk_shape"])]))
    size = 16 * n + 4 * any(c["name"] == "crc32c" for c in sharding.get("index_codecs", []))
    return (slice(0, size) if sharding.get("index_location", "end") == "start" else slice(-size, None)), size


def _missing_inner_chunks(index: bytes, sharding: dict[str, Any], shard_shape: list[int], pos: tuple[int, ...],
                          shape: list[int], itemsize: int) -> list[tuple[int, ...]]:
    """Inner chunks of shard ``pos`` that lie inside the array but have no (or a wrong-size) index entry."""
    inner = sharding["chunk_shape"]
    grid = [-(-s // c) for s, c in zip(shard_shape, inner)]
    big = any(c.get("configuration", {}).get("endian") == "big" for c in sharding.get("index_codecs", []))
    entries = np.frombuffer(index, dtype=">u8" if big else "<u8", count=2 * int(np.prod(grid))).reshape(-1, 2)
    plain = all(c["name"] in ("bytes", "transpose") for c in sharding.get("codecs", []))
    size = int(np.prod(inner)) * itemsize
    missing = []
    for i, j in enumerate(np.ndindex(*grid)):
        origin = [q * s + k * c for q, s, k, c in zip(pos, shard_shape, j, inner)]
        if any(o >= n for o, n in zip(origin, shape)):
            continue  # beyond the array's edge: never stored
        offset, nbytes = (int(x) for x in entries[i])
        if offset == 2**64 - 1 or (plain and nbytes != size):
            missing.append(j)
    return missing


def save_params(folder: str | os.PathLike, params: dict[str, Any], axes: dict[str, tuple[str, ...]]) -> dict:
    """Write sharded (possibly multi-host) parameters into ``folder``; every process calls it.

    Orbax writes each process's own shards, so no host ever gathers the whole
    model. Returns the per-parameter metadata for :meth:`CheckpointWriter.adopt`.
    """
    ocp = orbax_v1()
    with _save_context():
        ocp.save(Path(folder).absolute() / PARAMS_DIR, params)
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


def read_meta(ckpt: str | os.PathLike) -> dict[str, Any]:
    """model.json of a checkpoint, validated (exists, parses, format version known)."""
    ckpt = Path(ckpt)
    f = ckpt / MODEL_FILE
    if not ckpt.is_dir():
        raise UserError(f"{ckpt}: no such checkpoint folder")
    if not f.is_file() or not (ckpt / PARAMS_DIR).is_dir():
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


# A Hub repo id as a source names it: a registry description ends in "(owner/repo)"; a Hub source is the bare id.
_REPO_ID = r"[\w.-]+/[\w.-]+"
HUB_ID = "hub_id"  # model.json: the Hub repo the checkpoint's model comes from (`zoo convert` records it)


def hub_repo_of(source: str) -> str | None:
    """The Hub repo id a checkpoint's ``source`` names, or None (a local folder or GGUF file)."""
    m = re.search(rf"\(({_REPO_ID})\)$", source)
    if m:
        return m.group(1)
    # A relative local folder can look like owner/repo too; `zoo convert` prefers an existing folder, so do we.
    if re.fullmatch(_REPO_ID, source) and not source.startswith(".") and not Path(source).exists():
        return source
    return None


def hub_id(meta: dict[str, Any]) -> str | None:
    """The Hub repo a checkpoint's model comes from: converted from it, maybe quantized or trained since.

    ``zoo convert`` records it (model.json's ``hub_id``), and ``zoo quantize`` and training runs copy it from
    the checkpoint they start from. A checkpoint converted before the field existed has it read from its
    ``source``. None: a local folder, a GGUF file, a random init, or a run started from one.
    """
    if meta.get(HUB_ID):
        return str(meta[HUB_ID])
    if str(meta.get("source_format", "")).startswith("hf"):
        return hub_repo_of(str(meta.get("source", "")))
    return None


def hub_weights(meta: dict[str, Any]) -> str | None:
    """The Hub repo whose model a checkpoint *is*, tensor for tensor as ``zoo export`` writes it; else None.

    Only a direct conversion qualifies: not a quantized or trained checkpoint (other weights), nor the language
    model of a multimodal repo (other module names: ``source_format`` ``hf-gemma3-multimodal``).
    """
    return hub_id(meta) if meta.get("source_format") == "hf" else None


def provenance_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``hub_id`` entry a checkpoint derived from ``meta``'s checkpoint carries (empty when none is known):
    pass it to :meth:`CheckpointWriter.finish`."""
    repo = hub_id(meta)
    return {HUB_ID: repo} if repo else {}


def read_config(ckpt: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a checkpoint."""
    return ModelConfig.from_dict(read_meta(ckpt)["config"])


def load_stored_params(
    ckpt: str | os.PathLike,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = None,
    paths: list[str] | None = None,
) -> dict[str, Any]:
    """Restore the parameters a checkpoint stores (nested dict of jax Arrays), sharded on ``mesh`` by the
    logical-axis rules, in their stored dtype or ``dtype``.

    ``paths`` restores only those dotted parameters (Orbax partial load), which
    is how streaming readers take one parameter at a time. This reads a plain
    checkpoint only; :func:`zoo.checkpoints.loading.load_params` (``zoo.load_params``) reads
    any checkpoint as its model, an adapter checkpoint's merged onto its base.
    """
    from zoo.model.sharding import make_mesh, named_sharding

    ocp = orbax_v1()
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"])
    mesh = mesh or make_mesh()
    specs = param_specs(cfg)
    stored = meta["params"]
    wanted = paths or list(specs)
    abstract = {}
    for p in wanted:
        if p not in stored:
            raise UserError(f"{ckpt}: parameter '{p}' is missing from the checkpoint; it is damaged, convert it again")
        shape = tuple(stored[p]["shape"])
        if shape != specs[p].shape:
            raise UserError(f"{ckpt}: parameter '{p}' has shape {shape}, the config implies {specs[p].shape}")
        dt = np.dtype(dtype) if dtype is not None else np_dtype(stored[p]["dtype"])
        abstract[p] = jax.ShapeDtypeStruct(shape, dt, sharding=named_sharding(mesh, specs[p].axes, shape))
    # Parameters restored in groups of at most max(the largest one, 64 MiB) bytes: each group's staging buffers (the
    # host copy Orbax reads into before the device array exists) are freed and handed back before the next,
    # so the load peaks at the weights plus about the largest parameter, not at twice the weights (measured
    # on SmolLM2-135M: 0.63 GB above the weights restoring all at once, of which 0.4 GB could stay resident).
    # A model that fits in one group (tests' tiny ones) restores in one call, without a collection (a full
    # gc.collect() takes 0.25 s with transformers imported).
    groups = restore_groups(abstract)
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = paths is not None or len(groups) > 1
    flat = {}
    # The objects alive before the load cannot be part of a group's garbage: frozen, a collection skips them
    # (with transformers imported, a full collection otherwise scans millions of them: 0.25 s a group, 0.84 -> 0.40 s
    # a SmolLM2 load). A caller's own freeze (a server about to fork) is left as it is.
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    try:
        with ctx:
            for group in groups:
                loaded = flatten(ocp.load(Path(ckpt).absolute() / PARAMS_DIR, nest({p: abstract[p] for p in group})))
                # The copies into device arrays finish asynchronously and hold their host staging buffers until
                # then: wait, so that the trim below hands those buffers back (without it the memory a load
                # leaves resident depended on the timing).
                jax.block_until_ready(loaded)
                flat.update(loaded)
                if len(groups) > 1:
                    gc.collect()  # the staging buffers of this group, some held in reference cycles
                release_free_memory()
    finally:
        if ours:
            gc.unfreeze()
    return nest(flat)


def restore_groups(abstract: dict[str, jax.ShapeDtypeStruct], floor: int = 64 << 20) -> list[list[str]]:
    """``abstract``'s parameter names in consecutive groups of at most max(largest parameter, ``floor``) bytes."""
    size = {p: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for p, a in abstract.items()}
    budget = max([floor, *size.values()])
    groups: list[list[str]] = []
    used = budget
    for p in abstract:
        if used + size[p] > budget:
            groups.append([])
            used = 0
        groups[-1].append(p)
        used += size[p]
    return groups


def load_param_numpy(ckpt: str | os.PathLike, path: str, info: dict[str, Any] | None = None) -> np.ndarray:
    """One stored parameter as a host NumPy array in its stored dtype (for streaming readers).

    Restoring into NumPy rather than a device array avoids an extra
    device-to-host copy, keeping peak memory near the parameter's own size.
    ``info`` (shape, dtype) defaults to the parameter's entry in model.json.
    """
    ocp = orbax_v1()
    info = info or read_meta(ckpt)["params"].get(path)
    if info is None:
        raise UserError(f"{ckpt}: parameter '{path}' is missing from the checkpoint; it is damaged, convert it again")
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = True
    with ctx:
        tree = ocp.load(Path(ckpt).absolute() / PARAMS_DIR, nest({path: np.empty(info["shape"], np_dtype(info["dtype"]))}))
    for part in path.split("."):
        tree = tree[part]
    return tree


class ParamSource(Protocol):
    """What streams one parameter: :class:`ParamReader`, :class:`zoo.checkpoints.adapter.MergedParamReader` (adapters merged
    in) and :class:`zoo.checkpoints.quantized.DequantizedParamReader` (a quantized checkpoint's, dequantized)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray: ...

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray: ...


class ParamReader:
    """Reads one stored parameter whole or one leading-axis slice (one layer) at a time.

    Fast path: open the parameter's zarr3 array in the OCDBT store directly with
    TensorStore, with a cache large enough for one stored chunk, so per-layer
    reads decode the chunk once and peak memory stays near 1x the parameter
    (Orbax's restore peaks at 2x: a decode buffer plus the result). Checkpoints
    laid out differently fall back to :func:`load_param_numpy`.
    """

    def __init__(self, ckpt: str | os.PathLike, path: str):
        self.ckpt, self.path = Path(ckpt).absolute(), path
        info = read_meta(ckpt)["params"].get(path)
        if info is None:
            raise UserError(f"{ckpt}: parameter '{path}' is missing from the checkpoint; it is damaged, convert it again")
        self.shape, self.dtype = tuple(info["shape"]), np_dtype(info["dtype"])
        self._store = self._open_store()
        self._array: np.ndarray | None = None

    def _open_store(self):
        import tensorstore as ts

        base = self.ckpt / PARAMS_DIR / STATE_DIR
        if not (base / "manifest.ocdbt").is_file():
            return None
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{base}/", "path": self.path}}
        try:
            probe = ts.open(spec, read=True).result()
            chunk = probe.chunk_layout.read_chunk.shape or probe.shape
            # Room for one stored chunk, so slices of it are decoded once.
            limit = int(np.prod(chunk, dtype=np.int64)) * self.dtype.itemsize + 2**26
            store = ts.open(spec, read=True, context=ts.Context({"cache_pool": {"total_bytes_limit": limit}})).result()
        except Exception:  # not this layout: use Orbax's own restore
            return None
        if tuple(store.shape) != self.shape or store.dtype.numpy_dtype != self.dtype:
            return None
        return store

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray:
        """The whole parameter (``index=None``) or its slice ``[index]`` (e.g. ``(layer, expert)``)."""
        if index is None:
            return self.read_block(0, None, None)
        if self._store is not None:
            return np.asarray(self._store[index].read().result())
        if self._array is None:
            self._array = load_param_numpy(self.ckpt, self.path)
        return self._array[index]

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray:
        """``param[..., start:stop, ...]`` along ``axis`` (``squeeze`` drops that axis when it has length 1)."""
        idx = (slice(None),) * axis + (slice(start, stop),)
        if self._store is not None:
            out = np.asarray(self._store[idx].read().result())
        else:
            if self._array is None:
                self._array = load_param_numpy(self.ckpt, self.path)
            out = self._array[idx]
        return out.squeeze(axis) if squeeze else out

