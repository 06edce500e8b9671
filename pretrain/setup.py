"""Model and tokenizer set-up of a run: a zoo checkpoint (or a random init) sharded onto the mesh."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from zoo.checkpoint import TOKENIZER_DIR, load_params, read_config
from zoo.config import ModelConfig
from zoo.errors import UserError
from zoo.lora import LoraConfig, init_lora, lora_specs
from zoo.params import init_params, nest, param_specs
from zoo.sharding import named_sharding

from pretrain.config import TrainConfig
from pretrain.dtypes import DTYPES


def load_model(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> tuple[ModelConfig, dict, Path | None, Path]:
    """(model config, sharded params, source checkpoint or None, tokenizer folder)."""
    pdt = DTYPES[cfg.dtype.params]
    if cfg.model.init == "random":
        from convert.hf_config import model_config_from_hf
        from zoo import registry

        src = Path(cfg.model.config)
        hf = json.loads(src.read_text()) if src.is_file() else registry.get(cfg.model.config).hf_config
        if hf is None:
            raise UserError(f"model.config {cfg.model.config}: no built-in config; give a config.json path")
        mcfg = model_config_from_hf(hf, f"model.config {cfg.model.config}")
        specs = param_specs(mcfg)
        shard = jax.tree.map(lambda s: named_sharding(mesh, s.axes, s.shape), nest(specs),
                             is_leaf=lambda x: isinstance(x, type(next(iter(specs.values())))))
        # No host inputs: every process builds the same global arrays, each its own shards.
        params = jax.jit(lambda: init_params(mcfg, jax.random.PRNGKey(cfg.seed), pdt), out_shardings=shard)()
        return mcfg, params, None, tokenizer_folder(cfg)
    ckpt = _resolve_checkpoint(cfg.model.path)
    return read_config(ckpt), load_params(ckpt, mesh, pdt), ckpt, tokenizer_folder(cfg)


def tokenizer_folder(cfg: TrainConfig) -> Path:
    """The run's tokenizer folder: ``model.tokenizer``, else the model checkpoint's own."""
    if cfg.model.tokenizer or cfg.model.init == "random":
        return Path(cfg.model.tokenizer or "")
    return _resolve_checkpoint(cfg.model.path) / TOKENIZER_DIR


def _resolve_checkpoint(path: str) -> Path:
    """The zoo checkpoint folder of ``model.path`` (a run folder, a missing path: a UserError saying what to give)."""
    from zoo.paths import checkpoint_dir

    return checkpoint_dir(path, "model.path")


def load_tokenizer(folder: Path):
    """The transformers tokenizer in ``folder``, or a UserError saying how to give one."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not folder.is_dir() or not any((folder / n).is_file() for n in names):
        raise UserError(f"no tokenizer in {folder}; set model.tokenizer to a tokenizer folder")
    try:
        generic = _generic_fast_tokenizer(folder)
        if generic is not None:
            return generic.from_pretrained(str(folder))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except (ValueError, OSError) as e:
        raise UserError(f"tokenizer {folder} cannot be loaded ({str(e).splitlines()[0]})") from None


def _generic_fast_tokenizer(folder: Path):
    """transformers' generic fast-tokenizer class when ``folder``'s tokenizer_config.json names it, else None.

    AutoTokenizer would resolve the name to this same class, but its module
    imports the model configurations, and with them torch wherever torch is
    installed: 0.25 GB of RSS in every training process, for nothing.
    Model-specific classes (LlamaTokenizerFast, ...) still go through AutoTokenizer.
    """
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if name not in ("TokenizersBackend", "PreTrainedTokenizerFast") or not (folder / "tokenizer.json").is_file():
        return None
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend


def lora_settings(cfg: TrainConfig, base: Path | None) -> LoraConfig | None:
    """The run's LoRA settings (None when ``lora.rank`` is 0: full fine-tuning)."""
    lo = cfg.lora
    if lo.rank == 0:
        return None
    if base is None:
        raise UserError("lora needs a pretrained base checkpoint (model.path), not model.init: random")
    targets = lo.targets
    if isinstance(targets, str) and "," in targets:  # `lora.targets=q_proj,v_proj` on the command line
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=targets, rslora=lo.rslora)


def init_adapters(mcfg: ModelConfig, lora_cfg: LoraConfig, seed: int, mesh: jax.sharding.Mesh) -> dict:
    """Fresh float32 adapters (B = 0: the model starts as the base), each sharded like its base weight."""
    specs = lora_specs(mcfg, lora_cfg)
    shard = nest({p: named_sharding(mesh, s.axes, s.shape) for p, s in specs.items()})
    # No host inputs: every process builds the same global arrays, each its own shards.
    return jax.jit(lambda: init_lora(mcfg, lora_cfg, jax.random.PRNGKey(seed + 1), "float32"), out_shardings=shard)()
