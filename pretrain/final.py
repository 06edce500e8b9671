"""The run's final model: ``output_dir/final`` as a zoo checkpoint, written atomically by all processes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import cast

import jax

from pretrain import distributed
from pretrain.config import TrainConfig
from pretrain.setup import frozen_base_quant
from zoo.checkpoints.adapter import adapter_meta
from zoo.checkpoints.format import HF_CONFIG_FILE, TOKENIZER_DIR, WEIGHT_FILES, read_meta
from zoo.checkpoints.provenance import provenance_of
from zoo.checkpoints.writer import CheckpointWriter, remove_stale_scratch, save_params
from zoo.lora.adapters import LoraConfig, lora_specs, whole_weights
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs


def write_final(out: Path, cfg: TrainConfig, mcfg: ModelConfig, params: dict, src: Path | None, tok_dir: Path,
                last: dict, data_report: dict, method: str = "pretrain", lora: LoraConfig | None = None) -> Path:
    """Write ``out/final`` as a zoo checkpoint, atomically; every process writes its own shards.

    With ``lora`` the params are the adapters: ``final`` is then an adapter
    checkpoint (zoo/checkpoints/adapter.py) that refers to its base ``src``.
    """
    specs = lora_specs(mcfg, lora) if lora else param_specs(mcfg)
    final = out / "final"
    scratch = out / ".final.incomplete-run"  # one name all processes agree on
    primary = distributed.is_primary()
    if primary:
        remove_stale_scratch(final)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
    distributed.sync("lmzoo-final-scratch")
    try:
        stored = save_params(scratch, params, {k: cast(tuple[str, ...], s.axes) for k, s in specs.items()})
        distributed.sync("lmzoo-final-params")
        if primary:
            writer = CheckpointWriter(scratch)
            # An adapter checkpoint describes the merged model: the base's parameter table, the adapters apart.
            writer.adopt(merged_table(mcfg, read_meta(cast(Path, src))["params"], stored) if lora else stored)
            if tok_dir.is_dir():  # its tokenizer files: model.tokenizer may name a whole model's folder
                shutil.copytree(tok_dir, scratch / TOKENIZER_DIR, ignore=shutil.ignore_patterns(*WEIGHT_FILES))
            if src is not None and (src / HF_CONFIG_FILE).is_file():
                shutil.copyfile(src / HF_CONFIG_FILE, scratch / HF_CONFIG_FILE)
            training = {"method": method, "data": cfg.data.path, "steps": last.get("step"),
                        "final_metrics": {k: last[k] for k in ("loss", "tokens_seen") if k in last},
                        **data_report, "processes": jax.process_count(), "devices": len(jax.devices())}
            # The base is named relative to `final` (where the scratch folder ends up), so run and base move together.
            q = frozen_base_quant(cfg, src) if lora else None
            quant = {"kind": q[0], "double": q[1]} if q else None
            extra = {"lora": adapter_meta(lora, cast(Path, src), stored, final, quant)} if lora else {}
            # A run derives from its starting checkpoint: the Hub repo that came from, if any, is this run's too.
            carried = provenance_of(read_meta(src)) if src is not None else {}
            writer.finish(mcfg, source=str(src or cfg.model.config), source_format="train", training=training,
                          **carried, **extra)
            if final.exists():
                shutil.rmtree(final)
            scratch.replace(final)
    finally:
        if primary:
            shutil.rmtree(scratch, ignore_errors=True)
    distributed.sync("lmzoo-final-done")
    return final


def merged_table(mcfg: ModelConfig, base: dict[str, dict], adapters: dict[str, dict]) -> dict[str, dict]:
    """The parameter table of the model an adapter checkpoint describes: its base's, with the weights trained
    whole (a reward model's score head) in the dtype of the base's final norm, as :func:`zoo.lora.adapters.merge_lora`
    merges them, and a causal base's LM head gone where the run made it a reward model."""
    whole = whole_weights(mcfg)
    if not whole:
        return base
    table = {k: v for k, v in base.items() if k != "lm_head"}
    for p in whole:
        table[p] = {**adapters[p], "dtype": base.get(p, base["final_norm"])["dtype"]}
    return table
