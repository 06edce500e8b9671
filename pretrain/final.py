"""The run's final model: ``output_dir/final`` as a zoo checkpoint, written by all processes together.

On the local disk (or a filesystem the hosts share) it is written into a scratch folder renamed into place. On
object storage there is no atomic rename, and the hosts may share nothing but the bucket: the old ``final`` goes
first, every process writes its own shards straight into the bucket through Orbax, then process 0 alone writes
the small files and ``model.json`` last, once every shard is committed: a reader that finds ``model.json`` finds
a whole checkpoint, and nothing of it passes through one host's disk.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import jax

from pretrain import distributed
from pretrain.config import TrainConfig
from pretrain.setup import frozen_base_quant
from zoo.checkpoints.adapter import adapter_meta
from zoo.checkpoints.format import HF_CONFIG_FILE, MODEL_FILE, TOKENIZER_DIR, WEIGHT_FILES, read_meta
from zoo.checkpoints.method_card import MethodCard, adapter_settings, settings
from zoo.checkpoints.provenance import provenance_of
from zoo.checkpoints.writer import CheckpointWriter, remove_stale_scratch, save_params
from zoo.lora.params import LoraConfig, lora_specs, whole_weights
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs
from zoo.storage import RunPath, is_remote, local, remove_tree, upload_tree

# The settings every run's card lists (config keys, in the card's order), before LoRA's and the task's own; those
# whose 0 / false means "off" are left out then, and the final learning-rate ratio where the schedule has none.
RUN_KEYS = ("optimizer.name", "optimizer.learning_rate", "optimizer.weight_decay", "optimizer.grad_clip",
            "schedule.name", "schedule.warmup_steps", "schedule.min_lr_ratio", "batch_size", "grad_accum",
            "data.seq_len", "data.chat_template", "epochs", "seed", "dtype.params", "dtype.compute")
OFF_WHEN_FALSY = ("optimizer.weight_decay", "optimizer.grad_clip", "schedule.warmup_steps", "epochs")
DECAYING_SCHEDULES = ("cosine", "linear", "wsd")


@dataclasses.dataclass
class _Final:
    """What the final checkpoint is made of: the run's config, model and trained params, its starting checkpoint
    ``src`` and tokenizer folder, the last step's record, the data report, the method and its card."""

    cfg: TrainConfig
    mcfg: ModelConfig
    params: dict[str, Any]
    src: Path | None
    tok_dir: Path
    last: dict[str, Any]
    data_report: dict[str, Any]
    method: str
    lora: LoraConfig | None
    card: MethodCard | None


def write_final(out: RunPath, cfg: TrainConfig, mcfg: ModelConfig, params: dict[str, Any], src: Path | None,
                tok_dir: Path, last: dict[str, Any], data_report: dict[str, Any], method: str = "pretrain",
                lora: LoraConfig | None = None, card: MethodCard | None = None) -> RunPath:
    """Write ``out/final`` as a zoo checkpoint, atomically; every process writes its own shards.

    With ``lora`` the params are the adapters: ``final`` is then an adapter
    checkpoint (zoo/checkpoints/adapter.py) that refers to its base ``src``.
    ``card``: what the task's model card says of its method (:meth:`pretrain.task.Task.card`), recorded in the
    training record with the run's settings (:func:`recorded_card`). On object storage (see the module
    docstring) an adapter checkpoint names its base by its absolute path (or URL) only.
    """
    f = _Final(cfg, mcfg, params, src, tok_dir, last, data_report, method, lora, card)
    return _on_bucket(out / "final", f) if is_remote(out) else _on_disk(local(out), f)


def _on_disk(out: Path, f: _Final) -> Path:
    """:func:`write_final` on a filesystem all processes share: a scratch folder, renamed onto ``out/final``."""
    final = out / "final"
    scratch = out / ".final.incomplete-run"  # one name all processes agree on
    primary = distributed.is_primary()
    if primary:
        remove_stale_scratch(final)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
    distributed.sync("lmzoo-final-scratch")
    try:
        stored = _save_arrays(scratch, f)
        if primary:
            _write_metadata(scratch, final, stored, f)
            if final.exists():
                shutil.rmtree(final)
            scratch.replace(final)
    finally:
        if primary:
            shutil.rmtree(scratch, ignore_errors=True)
    distributed.sync("lmzoo-final-done")
    return final


def _on_bucket(final: RunPath, f: _Final) -> RunPath:
    """:func:`write_final` on object storage, straight into ``final`` (see the module docstring)."""
    primary = distributed.is_primary()
    if primary:
        remove_tree(final)  # an old final's model.json goes with it: a kill from now on leaves no whole-looking final
    distributed.sync("lmzoo-final-cleared")
    stored = _save_arrays(final, f)
    try:
        if primary:
            _write_metadata(final, None, stored, f)
    except BaseException:
        if primary:  # a final that failed its check must not look whole
            (final / MODEL_FILE).unlink(missing_ok=True)
        raise
    distributed.sync("lmzoo-final-done")
    return final


def _save_arrays(folder: Path | RunPath, f: _Final) -> dict[str, dict[str, Any]]:
    """Every process writes its shards of the params into ``folder/params`` (Orbax coordinates the processes and
    commits once all are written); the params' table for model.json."""
    specs = lora_specs(f.mcfg, f.lora) if f.lora else param_specs(f.mcfg)
    stored = save_params(folder, f.params, {k: cast(tuple[str, ...], s.axes) for k, s in specs.items()})
    distributed.sync("lmzoo-final-params")
    return stored


def _write_metadata(folder: Path | RunPath, final: Path | None, stored: dict[str, dict[str, Any]], f: _Final) -> None:
    """Process 0's part: the tokenizer, the starting checkpoint's Hugging Face config, then ``model.json`` (last,
    checked against the arrays). ``final``: the local folder ``folder`` is renamed onto (an adapter checkpoint
    names its base relative to it too), or None."""
    src, lora, cfg, last = f.src, f.lora, f.cfg, f.last
    writer = CheckpointWriter(folder)
    # An adapter checkpoint describes the merged model: the base's parameter table, the adapters apart.
    writer.adopt(merged_table(f.mcfg, read_meta(cast(Path, src))["params"], stored) if lora else stored)
    if f.tok_dir.is_dir():  # its tokenizer files: model.tokenizer may name a whole model's folder
        upload_tree(f.tok_dir, folder / TOKENIZER_DIR, skip=WEIGHT_FILES)
    if src is not None and (src / HF_CONFIG_FILE).is_file():
        (folder / HF_CONFIG_FILE).write_bytes((src / HF_CONFIG_FILE).read_bytes())
    training = {"method": f.method, "data": cfg.data.path, "steps": last.get("step"),
                "final_metrics": {k: last[k] for k in ("loss", "tokens_seen") if k in last},
                **f.data_report, "processes": jax.process_count(), "devices": len(jax.devices())}
    q = frozen_base_quant(cfg, src) if lora else None
    quant = {"kind": q[0], "double": q[1]} if q else None
    # A base on a bucket is named by its URL (any host reads it), not by process 0's copy of its small files.
    base = cast(str, cfg.model.path) if is_remote(cfg.model.path or "") else cast(Path, src)
    extra = {"lora": adapter_meta(lora, base, stored, final, quant)} if lora else {}
    if f.card is not None:
        training["card"] = recorded_card(cfg, f.card, extra.get("lora")).record()
    # A run derives from its starting checkpoint: the Hub repo that came from, if any, is this run's too.
    carried = provenance_of(read_meta(src)) if src is not None else {}
    # A starting checkpoint on a bucket is named by its URL, not by process 0's local copy of it.
    source = cfg.model.path if src is not None and is_remote(cfg.model.path or "") else str(src or cfg.model.config)
    writer.finish(f.mcfg, source=source, source_format="train", training=training, **carried, **extra)


def merged_table(mcfg: ModelConfig, base: dict[str, dict[str, Any]], adapters: dict[str, dict[str, Any]]
                 ) -> dict[str, dict[str, Any]]:
    """The parameter table of the model an adapter checkpoint describes: its base's, with the weights trained
    whole (a reward model's score head) in the dtype of the base's final norm, as :func:`zoo.lora.params.merge_lora`
    merges them, and a causal base's LM head gone where the run made it a reward model."""
    whole = whole_weights(mcfg)
    if not whole:
        return base
    table = {k: v for k, v in base.items() if k != "lm_head"}
    for p in whole:
        table[p] = {**adapters[p], "dtype": base.get(p, base["final_norm"])["dtype"]}
    return table


def recorded_card(cfg: TrainConfig, card: MethodCard, lora: Mapping[str, Any] | None) -> MethodCard:
    """The task's ``card`` as the final checkpoint records it: its hyperparameters after every run's settings
    (optimizer, schedule, batch, sequence length, ...) and, for an adapter checkpoint, LoRA's (``lora``: its
    model.json entry), with the values of ``cfg`` (what the run folder's config.yaml holds)."""
    tree = dataclasses.asdict(cfg)
    keys = [k for k in RUN_KEYS if k != "schedule.min_lr_ratio" or cfg.schedule.name in DECAYING_SCHEDULES]
    run = settings(tree, keys, OFF_WHEN_FALSY)
    if lora:
        run += adapter_settings(lora) + settings(tree, ("lora.dropout", "lora.base_quant"), ("lora.dropout",))
    return dataclasses.replace(card, hyperparameters=run + card.hyperparameters)
