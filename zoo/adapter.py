"""LoRA adapter checkpoints: a training run's adapters plus a reference to their base checkpoint.

Such a checkpoint's ``model.json`` is the base's (config, parameter table), with
a ``lora`` entry: the LoRA settings, the base checkpoint's path and the adapter
parameter table; ``params/`` holds only the adapters. Readers see the merged
model (``W + scale * A @ B``): :func:`zoo.checkpoint.load_params` merges on
load, and :class:`MergedParamReader` merges one layer at a time for streaming
export, so the merged model is never written or held whole.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from zoo.errors import UserError
from zoo.lora import LoraConfig, lora_scale


def lora_config(meta: dict[str, Any]) -> LoraConfig:
    """The LoraConfig recorded in an adapter checkpoint's model.json."""
    info = meta["lora"]
    return LoraConfig(rank=info["rank"], alpha=info["alpha"], targets=tuple(info["target_modules"]),
                      rslora=info["rslora"])


def base_checkpoint(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """The base checkpoint an adapter checkpoint refers to (absolute, or relative to the adapter)."""
    base = Path(meta["lora"]["base"])
    if not base.is_absolute():
        base = (Path(ckpt) / base).resolve()
    if not (base / "model.json").is_file():
        raise UserError(f"{ckpt} is a LoRA adapter of base checkpoint {base}, which is missing; put the base "
                        "back there (or export the merged model where both exist)")
    return base


def adapter_meta(lora_cfg: LoraConfig, base: Path, adapter_params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``lora`` entry of an adapter checkpoint's model.json."""
    from zoo.lora import target_modules

    return {"rank": lora_cfg.rank, "alpha": lora_cfg.alpha, "rslora": lora_cfg.rslora,
            "target_modules": list(target_modules(lora_cfg)), "scale": lora_scale(lora_cfg),
            "base": str(Path(base).absolute()), "params": adapter_params}


def load_adapters(ckpt: str | os.PathLike, meta: dict[str, Any], mesh: Any = None) -> dict[str, Any]:
    """The adapter tree of an adapter checkpoint, sharded like their base weights on ``mesh``."""
    import jax

    from zoo.checkpoint import PARAMS_DIR, _np_dtype, _orbax
    from zoo.config import ModelConfig
    from zoo.lora import lora_specs
    from zoo.params import nest
    from zoo.sharding import make_mesh, named_sharding

    cfg = ModelConfig.from_dict(meta["config"])
    mesh = mesh or make_mesh()
    specs = lora_specs(cfg, lora_config(meta))
    stored = meta["lora"]["params"]
    if set(stored) != set(specs):
        raise UserError(f"{ckpt}: its adapter table does not match its LoRA settings; the checkpoint is damaged")
    abstract = {p: jax.ShapeDtypeStruct(tuple(stored[p]["shape"]), _np_dtype(stored[p]["dtype"]),
                                        sharding=named_sharding(mesh, specs[p].axes, specs[p].shape))
                for p in specs}
    return _orbax().load(Path(ckpt).absolute() / PARAMS_DIR, nest(abstract))


class MergedParamReader:
    """A base parameter with its adapter merged in, read whole or one leading-axis slice at a time
    (the :class:`zoo.checkpoint.ParamReader` interface)."""

    def __init__(self, ckpt: str | os.PathLike, meta: dict[str, Any], path: str):
        from zoo.checkpoint import load_param_numpy, param_reader

        # The base may itself be an adapter checkpoint (DPO's adapters over an SFT run's): read it merged too.
        self.base = param_reader(base_checkpoint(ckpt, meta), path)
        self.shape, self.dtype = self.base.shape, self.base.dtype
        self.scale = meta["lora"]["scale"]
        self.a = self.b = None
        if f"{path}.a" in meta["lora"]["params"]:
            # Adapters are small (rank r): read whole.
            self.a = load_param_numpy(ckpt, f"{path}.a", meta["lora"]["params"][f"{path}.a"])
            self.b = load_param_numpy(ckpt, f"{path}.b", meta["lora"]["params"][f"{path}.b"])
            self.lead = 2 if path.split(".")[-1].startswith("expert_") else 1

    def read(self, index: int | tuple[int, ...] | None = None) -> np.ndarray:
        """The merged parameter (``index=None``) or its slice ``[index]``."""
        if index is None:
            return self.read_block(0, None, None)
        w = self.base.read(index)
        if self.a is None:
            return w
        idx = index if isinstance(index, tuple) else (index,)
        return self._merge(w, self.a[idx], self.b[idx], self.lead - len(idx))

    def read_block(self, axis: int, start: int | None, stop: int | None, squeeze: bool = False) -> np.ndarray:
        """``param[..., start:stop, ...]`` along ``axis`` (a leading, stacked axis) with the adapter merged."""
        w = self.base.read_block(axis, start, stop)
        if self.a is not None:
            if axis >= self.lead:
                raise ValueError("merged reads slice only the stacked leading axes")
            idx = (slice(None),) * axis + (slice(start, stop),)
            w = self._merge(w, self.a[idx], self.b[idx], self.lead)
        return w.squeeze(axis) if squeeze else w

    def _merge(self, w: np.ndarray, a: np.ndarray, b: np.ndarray, lead: int) -> np.ndarray:
        from zoo.lora import lora_delta

        delta = np.asarray(lora_delta(a, b, self.scale, lead))
        return (w.astype(np.float32) + delta).astype(w.dtype)
