"""Model and tokenizer set-up of a run: a zoo checkpoint (or a random init) sharded onto the mesh."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import jax

from pretrain.config import TrainConfig
from pretrain.dtypes import DTYPES
from zoo.checkpoints.format import read_config
from zoo.checkpoints.loading import load_params
from zoo.data.tokenizer import holds_tokenizer, tokenizer_dir
from zoo.errors import UserError
from zoo.lora.adapters import LoraConfig, init_lora, lora_specs, whole_weights
from zoo.model.config import ModelConfig
from zoo.model.params import flatten, init_params, nest, param_specs
from zoo.model.sharding import named_sharding


def load_model(cfg: TrainConfig, mesh: jax.sharding.Mesh
               ) -> tuple[ModelConfig, dict[str, Any], Path | None, Path]:
    """(model config, sharded params, source checkpoint or None, tokenizer folder)."""
    pdt = DTYPES[cfg.dtype.params]
    if cfg.model.init == "random":
        from zoo.model.from_hf import model_config_from_hf
        from zoo.registry import catalogue as registry

        name = cast(str, cfg.model.config)  # model.init: random needs it (TrainConfig checks)
        mcfg = model_config_from_hf(registry.hf_config_of(name, "model.config"), f"model.config {name}")
        specs = param_specs(mcfg)
        shard = jax.tree.map(lambda s: named_sharding(mesh, s.axes, s.shape), nest(specs),
                             is_leaf=lambda x: isinstance(x, type(next(iter(specs.values())))))
        # No host inputs: every process builds the same global arrays, each its own shards.
        params = jax.jit(lambda: init_params(mcfg, jax.random.PRNGKey(cfg.seed), pdt), out_shardings=shard)()
        return mcfg, params, None, tokenizer_folder(cfg)
    ckpt = _resolve_checkpoint(cast(str, cfg.model.path))
    mcfg = read_config(ckpt)
    if frozen_base_quant(cfg, ckpt):  # QLoRA: the projections come next, one at a time (quantize_frozen_base)
        from zoo.model.quant import quantized_paths

        skip = quantized_paths(mcfg)
        return mcfg, load_params(ckpt, mesh, pdt, paths=[p for p in param_specs(mcfg) if p not in skip]), ckpt, \
            tokenizer_folder(cfg)
    return mcfg, load_params(ckpt, mesh, pdt), ckpt, tokenizer_folder(cfg)


def tokenizer_folder(cfg: TrainConfig) -> Path:
    """The run's tokenizer folder: ``model.tokenizer``, else the model checkpoint's own.

    A folder without tokenizer files is a UserError here, naming the setting
    that gives one (zoo.data.tokenizer.load_tokenizer reads the folder afterwards).
    """
    if cfg.model.tokenizer or cfg.model.init == "random":
        folder = Path(cfg.model.tokenizer or "")
    else:
        folder = tokenizer_dir(_resolve_checkpoint(cast(str, cfg.model.path)))
    if not holds_tokenizer(folder):
        raise UserError(f"no tokenizer in {folder}; set model.tokenizer to a tokenizer folder")
    return folder


def _resolve_checkpoint(path: str) -> Path:
    """The zoo checkpoint folder of ``model.path`` (a run folder, a missing path: a UserError saying what to give)."""
    from zoo.checkpoints.paths import checkpoint_dir

    return checkpoint_dir(path, "model.path")


def lora_settings(cfg: TrainConfig, base: Path | None) -> LoraConfig | None:
    """The run's LoRA settings (None when ``lora.rank`` is 0: full fine-tuning)."""
    if cfg.lora.rank and base is None:
        raise UserError("lora needs a pretrained base checkpoint (model.path), not model.init: random")
    return lora_config(cfg)


def lora_config(cfg: TrainConfig) -> LoraConfig | None:
    """The config's LoRA settings as a :class:`zoo.lora.adapters.LoraConfig` (None when ``lora.rank`` is 0)."""
    lo = cfg.lora
    if lo.rank == 0:
        return None
    targets = lo.targets
    if isinstance(targets, str) and "," in targets:  # `lora.targets=q_proj,v_proj` on the command line
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=targets, rslora=lo.rslora)


def frozen_base_quant(cfg: TrainConfig, ckpt: Path | None) -> tuple[str, bool] | None:
    """How the run's frozen base is quantized, (kind, double) or None: ``lora.base_quant``, or for a LoRA run on
    a checkpoint stored quantized (``zoo quantize``), the checkpoint's own quantization (a different
    ``lora.base_quant`` is an error: the float weights are not there to quantize otherwise)."""
    from zoo.checkpoints import quantized as quant_checkpoint
    from zoo.checkpoints.format import read_meta

    check_base_quant(cfg)
    lo = cfg.lora
    asked = (lo.base_quant, lo.base_quant_double) if lo.base_quant else None
    stored = quant_checkpoint.settings(read_meta(ckpt)) if ckpt is not None else None
    if stored is None or lo.rank <= 0:  # full fine-tuning reads a quantized checkpoint dequantized
        return asked
    if asked is not None and asked != stored:
        raise UserError(f"model.path {cfg.model.path} is stored quantized ({quant_checkpoint.describe(*stored)}); "
                        f"lora.base_quant {lo.base_quant} (base_quant_double {str(lo.base_quant_double).lower()}) "
                        "asks for another: leave lora.base_quant unset, or start from the float checkpoint")
    return stored


def quantize_frozen_base(cfg: TrainConfig, mcfg: ModelConfig, params: dict[str, Any], mesh: jax.sharding.Mesh,
                         ckpt: Path | None) -> dict[str, Any]:
    """QLoRA (:func:`frozen_base_quant`): ``params`` (loaded by :func:`load_model` without the projections) plus
    each projection of ``ckpt`` loaded, quantized (zoo/model/quant.py) and placed one at a time, so the float base is
    never whole in memory; the quantized fields are split over ``fsdp`` (:func:`zoo.model.quant.place`). A checkpoint
    stored quantized gives its fields as they are."""
    from zoo.checkpoints.loading import quantized_param
    from zoo.model import quant

    q = frozen_base_quant(cfg, ckpt)
    if q is None:
        return params
    flat = flatten(params)
    del params
    pdt = DTYPES[cfg.dtype.params]
    for path in quant.quantized_paths(mcfg):
        flat[path] = quant.place(quantized_param(cast(Path, ckpt), path, *q, dtype=pdt), mesh)
    return nest(flat)


def check_base_quant(cfg: TrainConfig) -> None:
    """The QLoRA settings make sense (before anything is loaded or written)."""
    from zoo.model import quant

    lo = cfg.lora
    if lo.base_quant is None:
        if lo.base_quant_double:
            raise UserError("lora.base_quant_double needs lora.base_quant: nf4")
        return
    if lo.base_quant not in quant.KINDS:
        raise UserError(f"lora.base_quant {lo.base_quant!r}: choose one of {', '.join(quant.KINDS)} (or leave it unset)")
    if lo.base_quant_double and lo.base_quant != "nf4":
        raise UserError("lora.base_quant_double applies to lora.base_quant: nf4 only")
    if lo.rank <= 0:
        raise UserError("lora.base_quant quantizes the frozen base of a LoRA run: set lora.rank too")
    if cfg.model.init == "random":
        raise UserError("lora.base_quant needs a pretrained base checkpoint (model.path), not model.init: random")


def init_adapters(mcfg: ModelConfig, lora_cfg: LoraConfig, seed: int, mesh: jax.sharding.Mesh,
                  params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fresh float32 adapters (B = 0: the model starts as the base), each sharded like its base weight; the
    weights trained whole (a reward model's score head, :func:`zoo.lora.adapters.whole_weights`) start as ``params``'."""
    specs = lora_specs(mcfg, lora_cfg)
    shard = nest({p: named_sharding(mesh, s.axes, s.shape) for p, s in specs.items()})
    whole = {p: v for p, v in flatten(params or {}).items() if p in whole_weights(mcfg)}
    # No host inputs: every process builds the same global arrays, each its own shards.
    adapters: dict[str, Any] = jax.jit(lambda w: init_lora(mcfg, lora_cfg, jax.random.PRNGKey(seed + 1), "float32",
                                                           nest(w)), out_shardings=shard)(whole)
    return adapters
