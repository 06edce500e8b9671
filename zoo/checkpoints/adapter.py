"""LoRA adapter checkpoints: a training run's adapters plus a reference to their base checkpoint.

Such a checkpoint's ``model.json`` is the base's (config, parameter table), with
a ``lora`` entry: the LoRA settings, the base checkpoint's path and the adapter
parameter table; ``params/`` holds only the adapters. Readers see the merged
model (``W + scale * A @ B``): :func:`zoo.checkpoints.loading.load_params` merges on
load, and :class:`MergedParamReader` merges one layer at a time for streaming
export, so the merged model is never written or held whole.

Layering: this module builds on :mod:`zoo.checkpoints.format` (plain checkpoint files)
and :mod:`zoo.lora.params` (the LoRA math), and is used by :mod:`zoo.checkpoints.loading`, which
resolves "this checkpoint is an adapter run" into its merged model; neither of
the lower modules imports this one.

The base is referred to by three fields of the ``lora`` entry:

- ``base``: its absolute path at training time (the only one in older checkpoints);
- ``base_relative``: its path relative to the adapter checkpoint's own folder, so a
  run moved together with its base still finds it;
- ``base_digest``: sha256 digests of the base's config and of its parameter manifest
  (names, shapes, dtypes; for a base that is itself an adapter checkpoint, its
  adapters' too), so a base that changed since training is refused;

and, when the base is a Hub repo's model as converted, ``base_hub_id``: that repo's id.

The newer fields are optional additions within format version 1: older lmzoo
ignores them and reads ``base`` as before, and checkpoints without them load as
before (the recorded path, unchecked).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zoo.checkpoints.format import MODEL_FILE, np_dtype, orbax_v1, params_dir, read_meta
from zoo.checkpoints.paths import checkpoint_dir
from zoo.checkpoints.provenance import hub_weights
from zoo.checkpoints.readers import ParamSource, load_param_numpy
from zoo.checkpoints.writer import StoredSection
from zoo.errors import UserError
from zoo.lora.params import LoraConfig, adapter_lead, lora_delta, lora_scale, lora_specs, target_modules
from zoo.model.config import ModelConfig
from zoo.model.params import ParamSpec, nest
from zoo.model.sharding import make_mesh, named_sharding
from zoo.storage import is_remote


class AdapterSection(StoredSection):
    """The ``lora`` entry of an adapter checkpoint's model.json (a dict, as :func:`adapter_meta` builds it).

    A :class:`zoo.checkpoints.writer.StoredSection`: the adapters it lists are what the checkpoint stores, so
    :meth:`zoo.checkpoints.writer.CheckpointWriter.finish` checks those, against the adapters its LoRA settings imply.
    """

    def specs(self, cfg: ModelConfig) -> dict[str, ParamSpec]:
        """Every adapter the recorded LoRA settings imply on the model ``cfg``, with its shape."""
        return lora_specs(cfg, _lora_config(self))


def is_adapter(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's model.json is an adapter checkpoint's (its model: a base with adapters merged)."""
    return "lora" in meta


def lora_config(meta: dict[str, Any]) -> LoraConfig:
    """The LoraConfig recorded in an adapter checkpoint's model.json."""
    return _lora_config(meta["lora"])


def _lora_config(info: dict[str, Any]) -> LoraConfig:
    return LoraConfig(rank=info["rank"], alpha=info["alpha"], targets=tuple(info["target_modules"]),
                      rslora=info["rslora"])


def base_digest(base_meta: dict[str, Any]) -> dict[str, str]:
    """The ``base_digest`` of a base checkpoint's model.json: sha256 of its config and of its parameter manifest.

    Only what the adapters depend on counts: the config and every parameter's name, shape and dtype (not the
    logical axes, not provenance, not the weights, which would mean reading the whole base). A base that is
    itself an adapter checkpoint adds its LoRA settings and adapter table, so another run's adapters over the
    same base do not pass for it.
    """
    manifest: dict[str, Any] = {"params": _table(base_meta.get("params", {}))}
    if "quantized" in base_meta:  # a base stored quantized (`zoo quantize`) is not its float source
        manifest["quantized"] = [base_meta["quantized"]["kind"], base_meta["quantized"]["double"]]
    lora = base_meta.get("lora")
    if lora:
        manifest["lora"] = {"rank": lora["rank"], "alpha": lora["alpha"], "rslora": lora["rslora"],
                            "target_modules": list(lora["target_modules"]), "params": _table(lora["params"])}
    return {"config": _sha256(base_meta.get("config")), "manifest": _sha256(manifest)}


def _table(params: dict[str, dict[str, Any]]) -> dict[str, list]:
    return {p: [list(v["shape"]), v["dtype"]] for p, v in params.items()}


def _sha256(obj: Any) -> str:
    # Canonical JSON: the same model.json content digests the same whatever its key order or indentation.
    return "sha256:" + hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _candidates(ckpt: str | os.PathLike, info: dict[str, Any]) -> list[Path]:
    """Where the base may be, in order: relative to the adapter checkpoint, then the path recorded at training;
    a base on a bucket, recorded by its URL: its local copy (small files; its arrays are read in the bucket)."""
    if is_remote(info["base"]):
        return [checkpoint_dir(info["base"], "the LoRA base checkpoint")]
    here = Path(ckpt).absolute()
    found = []
    if info.get("base_relative"):
        # Lexical, like the user's view of the folders: `mv work elsewhere` keeps work/run/final/../../base valid
        # even where work/ is reached through a symbolic link.
        found.append(Path(os.path.normpath(here / info["base_relative"])))
    recorded = Path(info["base"])
    # Older checkpoints may hold a relative ``base``: relative to the adapter checkpoint, as they were read.
    found.append(recorded if recorded.is_absolute() else (here / recorded).resolve())
    return list(dict.fromkeys(found))


def _differences(meta: dict[str, Any], base_meta: dict[str, Any]) -> str | None:
    """What differs between a base (its ``base_meta``) and the one the adapters were trained on; None if nothing."""
    want, got = meta["lora"]["base_digest"], base_digest(base_meta)
    parts = []
    if want.get("config") != got["config"]:
        # The adapter checkpoint's own config is the base's at training: name the keys that changed.
        old, new = meta.get("config", {}), base_meta.get("config", {})
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        shown = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3]) + (", ..." if keys[3:] else "")
        parts.append(f"config differs ({shown})" if keys else "config differs")
    if want.get("manifest") != got["manifest"]:
        # Likewise its parameter table is the base's: name the first parameter that changed.
        old, new = _table(meta.get("params", {})), _table(base_meta.get("params", {}))
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if keys:
            k = keys[0]
            what = ("is new" if k not in old else "is gone" if k not in new
                    else f"{old[k][1]}{old[k][0]} -> {new[k][1]}{new[k][0]}")
            more = f", and {len(keys) - 1} more parameters" if keys[1:] else ""
            parts.append(f"parameter manifest differs ('{k}' {what}{more})")
        else:
            # The same parameter table: the base is an adapter checkpoint whose own adapters differ.
            parts.append("parameter manifest differs (its LoRA adapters)" if base_meta.get("lora")
                         else "parameter manifest differs")
    return "; ".join(parts) or None


def base_checkpoint(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """The base checkpoint an adapter checkpoint refers to, checked against the digest recorded at training.

    Tried in order: ``base_relative`` (relative to ``ckpt``), then the absolute ``base``; the first that exists
    and matches ``base_digest`` wins. A base whose digest differs, or none found, is a one-line UserError.
    Checkpoints written before ``base_relative``/``base_digest`` existed resolve ``base`` alone, unchecked.
    """
    info = meta["lora"]
    tried = _candidates(ckpt, info)
    changed: tuple[Path, str] | None = None
    for base in tried:
        if not (base / MODEL_FILE).is_file():
            continue
        if "base_digest" not in info:
            return base
        diff = _differences(meta, read_meta(base))
        if diff is None:
            return base
        changed = changed or (base, diff)
    if changed:
        base, diff = changed
        raise UserError(f"{ckpt} is a LoRA adapter of base checkpoint {base}, which has changed since the adapters "
                        f"were trained: {diff}; put the original base back at {base} (e.g. convert the same "
                        "source again), or train the adapters anew on this base")
    if len(tried) == 1:
        raise UserError(f"{ckpt} is a LoRA adapter of base checkpoint {tried[0]}, which is missing; put the base "
                        "back there (or export the merged model where both exist)")
    raise UserError(f"{ckpt} is a LoRA adapter of a base checkpoint found at neither {tried[0]} (where "
                    f"'{info['base_relative']}' leads from it) nor {tried[1]} (its path at training); move the base "
                    "together with the run, or put it back at either path")


def base_location(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Where the base is, as :func:`base_checkpoint` finds it, but never an error: the path recorded at training
    when the base is missing, changed or unreadable (for readers that only name the base, like PEFT export)."""
    try:
        return base_checkpoint(ckpt, meta)
    except UserError:
        return _candidates(ckpt, meta["lora"])[-1]


def adapter_meta(lora_cfg: LoraConfig, base: str | os.PathLike, adapter_params: dict[str, dict[str, Any]],
                 ckpt: str | os.PathLike | None = None, base_quant: dict[str, Any] | None = None) -> AdapterSection:
    """The ``lora`` entry of an adapter checkpoint's model.json, to pass to the writer's ``finish`` as ``lora=``.

    ``ckpt`` is the folder the adapter checkpoint ends up in (not a scratch folder renamed onto it later):
    ``base_relative`` is relative to it. Without ``ckpt`` only the absolute path is recorded. A ``base`` on a
    bucket is recorded by its URL alone, which any host reads (not by one host's copy of it).
    ``base_quant`` ({"kind", "double"}) records adapters trained on a quantized base (QLoRA): merging then adds
    them to the dequantized base, the weights they were trained beside. ``base_hub_id`` records the Hub repo
    whose model the base is (:func:`zoo.checkpoints.provenance.hub_weights`), so that a PEFT export names it even where
    the base is not at hand.
    """
    if is_remote(base):
        ref: dict[str, Any] = {"base": os.fspath(base)}
    else:
        base = Path(base).absolute()
        ref = {"base": str(base)}
    if ckpt is not None and not is_remote(base):
        try:
            ref["base_relative"] = os.path.relpath(os.path.normpath(base), os.path.normpath(Path(ckpt).absolute()))
        except ValueError:  # no relative path between them (Windows: another drive)
            pass
    base_meta = read_meta(base)
    ref["base_digest"] = base_digest(base_meta)
    repo = hub_weights(base_meta)
    if repo:  # the base is that Hub repo's model as it is: a PEFT export names the repo
        ref["base_hub_id"] = repo
    # A regex's names as the base's tower reads it (zoo.lora.params.target_modules): the record adapts those again.
    names = target_modules(lora_cfg, ModelConfig.from_dict(base_meta["config"]))
    return AdapterSection({"rank": lora_cfg.rank, "alpha": lora_cfg.alpha, "rslora": lora_cfg.rslora,
                           "target_modules": list(names), "scale": lora_scale(lora_cfg),
                           **ref, **({"base_quant": base_quant} if base_quant else {}), "params": adapter_params})


def load_adapters(ckpt: str | os.PathLike, meta: dict[str, Any], mesh: jax.sharding.Mesh | None = None
                  ) -> dict[str, Any]:
    """The adapter tree of an adapter checkpoint, sharded like their base weights on ``mesh``."""
    cfg = ModelConfig.from_dict(meta["config"])
    mesh = mesh or make_mesh()
    specs = lora_specs(cfg, lora_config(meta))
    stored = meta["lora"]["params"]
    if set(stored) != set(specs):
        raise UserError(f"{ckpt}: its adapter table does not match its LoRA settings; the checkpoint is damaged")
    abstract = {p: jax.ShapeDtypeStruct(tuple(stored[p]["shape"]), np_dtype(stored[p]["dtype"]),
                                        sharding=named_sharding(mesh, specs[p].axes, specs[p].shape))
                for p in specs}
    return orbax_v1().load(params_dir(ckpt), nest(abstract))


class MergedParamReader:
    """A base parameter with its adapter merged in, read whole or one leading-axis slice at a time
    (the :class:`zoo.checkpoints.readers.ParamReader` interface).

    ``base`` reads the parameter ``path`` of the adapter checkpoint's base (:func:`base_checkpoint`); the base
    may itself be an adapter checkpoint (DPO's adapters over an SFT run's), read merged by another of these
    (:func:`zoo.checkpoints.loading.param_reader` builds the chain).
    """

    def __init__(self, ckpt: str | os.PathLike, meta: dict[str, Any], path: str,
                 base: ParamSource):
        self.base = base
        self.shape, self.dtype = self.base.shape, self.base.dtype
        self.scale = meta["lora"]["scale"]
        self.a: np.ndarray | None = None
        self.b: np.ndarray | None = None
        if f"{path}.a" in meta["lora"]["params"]:
            # Adapters are small (rank r): read whole.
            self.a = load_param_numpy(ckpt, f"{path}.a", meta["lora"]["params"][f"{path}.a"])
            self.b = load_param_numpy(ckpt, f"{path}.b", meta["lora"]["params"][f"{path}.b"])
            self.lead = adapter_lead(ModelConfig.from_dict(meta["config"]), path)
        # QLoRA: the adapters learned beside the dequantized base, so they merge into it (zoo/model/quant.py).
        self.quant = None
        bq = meta["lora"].get("base_quant")
        if bq and not getattr(base, "dequantized", False):  # a base stored quantized reads dequantized already
            from zoo.model.quant import quantized_paths

            paths = quantized_paths(ModelConfig.from_dict(meta["config"]))
            if path in paths:
                self.quant = (bq["kind"], bool(bq.get("double")), *paths[path])

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray:
        """The merged parameter (``index=None``) or its slice ``[index]``."""
        if index is None:
            return self.read_block(0, None, None)
        w = self.base.read(index)
        if self.a is None or self.b is None:  # set together: both or neither
            return w
        idx = index if isinstance(index, tuple) else (index,)
        return self._merge(w, self.a[idx], self.b[idx], self.lead - len(idx))

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray:
        """``param[..., start:stop, ...]`` along ``axis`` (a leading, stacked axis) with the adapter merged."""
        w = self.base.read_block(axis, start, stop)
        if self.a is not None and self.b is not None:
            whole = start is None and stop is None  # the whole weight: a connector's has no stacked axis to slice
            if axis >= self.lead and not whole:
                raise ValueError("merged reads slice only the stacked leading axes")
            idx = () if whole else (slice(None),) * axis + (slice(start, stop),)
            w = self._merge(w, self.a[idx], self.b[idx], self.lead)
        return w.squeeze(axis) if squeeze else w

    def _merge(self, w: np.ndarray, a: np.ndarray, b: np.ndarray, lead: int) -> np.ndarray:
        if self.quant is not None:
            from zoo.model.quant import dequantize_now, quantize

            kind, double, _, contract = self.quant
            w = np.asarray(dequantize_now(quantize(w, lead, contract, kind, double))).astype(w.dtype)
        delta = np.asarray(lora_delta(a, b, self.scale, lead))
        return (w.astype(np.float32) + delta).astype(w.dtype)


class WholeWeightReader:
    """A weight an adapter checkpoint stores whole (a LoRA reward model's score head, :func:`zoo.lora.params.whole_weights`),
    read as the merged model has it: in the dtype of model.json's parameter table (the :class:`zoo.checkpoints.readers.
    ParamReader` interface). It is small ([hidden, num_labels]): read whole."""

    def __init__(self, ckpt: str | os.PathLike, meta: dict[str, Any], path: str):
        self.dtype = np_dtype(meta["params"][path]["dtype"])
        self.array = load_param_numpy(ckpt, path, meta["lora"]["params"][path]).astype(self.dtype)
        self.shape = self.array.shape

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray:
        """The weight (``index=None``) or its slice ``[index]``."""
        return self.array if index is None else self.array[index]

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray:
        """``weight[..., start:stop, ...]`` along ``axis``."""
        w = self.array[(slice(None),) * axis + (slice(start, stop),)]
        return w.squeeze(axis) if squeeze else w
