"""The completeness check every checkpoint writer runs before its checkpoint is renamed into place.

It reads no weights: the manifest against the config, Orbax's tree metadata, and every stored chunk's
presence (and length) in the OCDBT store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from zoo.checkpoints.format import MODEL_FILE, PARAMS_DIR, STATE_DIR, folder_of, kvstore_base, np_dtype
from zoo.model.config import ModelConfig
from zoo.model.params import ParamSpec, param_specs
from zoo.storage import RunPath


def verify_complete(ckpt: str | os.PathLike, section: str | None = None,
                    specs: dict[str, ParamSpec] | None = None, meta: dict[str, Any] | None = None) -> None:
    """Check, without reading the weights, that a just-written checkpoint is complete; a RuntimeError if not.

    Every writer calls it (through :meth:`zoo.checkpoints.writer.CheckpointWriter.finish`) before its
    checkpoint is renamed into place, so a checkpoint that "wrote" also loads. It checks that:

    * the manifest (model.json) lists every parameter the config implies, with the implied shape; for
      a checkpoint that stores other arrays (a :class:`zoo.checkpoints.writer.StoredSection`), the manifest
      is model.json's ``section`` entry's ``params`` table and ``specs`` what it must list (for an adapter
      checkpoint: every adapter its LoRA settings imply);
    * each listed parameter is in Orbax's tree metadata and has a stored array (its ``zarr.json`` in the
      OCDBT store under ``params/state``) of the listed shape and dtype;
    * every chunk of every array is stored: the array's chunk keys are listed from the OCDBT b-tree
      (chunks are entries of the b-tree, not files: a missing one is what TensorStore leaves when it skips
      a chunk equal to the fill value, which Orbax then fails to read); for an unsharded uncompressed
      chunk its last byte is read (present and full length); for an Orbax shard (``sharding_indexed``)
      its index is read and every inner chunk inside the array must have an entry.

    Cost: the b-tree listing plus one small read per stored chunk (a few bytes each), independent of
    the weights' size. ``meta``: model.json's content, for a writer that writes it after this check (on object
    storage, where model.json is the checkpoint's commit marker); by default model.json is read.
    """
    ckpt = folder_of(ckpt)  # on object storage: read there
    if meta is None:
        try:
            meta = json.loads((ckpt / MODEL_FILE).read_text())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"{ckpt}: unreadable {MODEL_FILE} ({e})") from None
    table = meta["params"] if section is None else meta[section]["params"]
    if specs is None:
        specs = param_specs(ModelConfig.from_dict(meta["config"]))
    _check_manifest(ckpt, table, specs)
    tree, kv = _open_state(ckpt)
    _read_chunk_checks(ckpt, kv, _chunk_checks(ckpt, table, tree, kv))


# (parameter, chunk key, byte range, bytes expected, the shard's layout for an inner-chunk check or None)
ChunkCheck = tuple[str, bytes, slice, int, tuple[Any, ...] | None]


def _check_manifest(ckpt: Path | RunPath, table: dict[str, Any], specs: dict[str, ParamSpec]) -> None:
    """Every parameter of ``specs`` is in the manifest ``table``, with its implied shape."""
    for p, spec in specs.items():
        if p not in table:
            raise RuntimeError(f"{ckpt}: parameter '{p}' is missing from the manifest ({MODEL_FILE})")
        if tuple(table[p]["shape"]) != tuple(spec.shape):
            raise RuntimeError(f"{ckpt}: parameter '{p}' has shape {table[p]['shape']} in the manifest, "
                               f"the config implies {list(spec.shape)}")


def _open_state(ckpt: Path | RunPath) -> tuple[Any, Any]:
    """Orbax's tree metadata and the key-value store (OCDBT or plain files) under ``params/state``."""
    import tensorstore as ts

    state = ckpt / PARAMS_DIR / STATE_DIR
    base = kvstore_base(state)  # TensorStore's own driver for a bucket URL
    try:
        tree = json.loads((state / "_METADATA").read_text())["tree_metadata"]
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"{ckpt}: Orbax's tree metadata is unreadable ({e})") from None
    if (state / "manifest.ocdbt").is_file():
        kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    else:  # Orbax's layout without OCDBT: the same keys as plain files
        kv = ts.KvStore.open(base).result()
    return tree, kv


def _chunk_checks(ckpt: Path | RunPath, table: dict[str, Any], tree: Any, kv: Any) -> list[ChunkCheck]:
    """Each listed array's metadata checked, and the read that checks each of its chunks."""
    keys = set(kv.list().result())
    zarr = {p: kv.read(f"{p}/zarr.json".encode()) for p in table}
    checks: list[ChunkCheck] = []
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
    return checks


def _read_chunk_checks(ckpt: Path | RunPath, kv: Any, checks: list[ChunkCheck]) -> None:
    """Run the chunk reads: each must return its expected length, a shard's index an entry per inner chunk."""
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

