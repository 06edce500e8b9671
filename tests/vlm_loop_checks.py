"""Shared steps of the vision-language loop tests: a DPO batch of pairs with images laid out as `dpo train` lays
it out (its task, its documents, the policy's log-probabilities), and one `zoo eval` run of a multiple-choice
task with images and its logged samples. The oracle side stays in each test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tests.run_files import write_jsonl


def dpo_image_pair_logps(ckpt: Path, tok: Any, folder: Path, rows: list[dict], image_files: list[Path],
                         seq_len: int) -> tuple[dict, Any, np.ndarray]:
    """(the documents by row, the batch, the per-token log-probabilities [rows, t]) of ``rows`` (TRL's vision preference rows, written
    to ``folder``/pairs.jsonl beside copies of ``image_files``) as `dpo train`'s task lays them out, each answer
    with its own copy of the prompt (as prepare() sets it for sliding-window models), under the model ``ckpt``."""
    import jax

    import zoo
    from dpo.config import DPOConfig
    from dpo.task import DPOTask
    from pretrain.config import load_config
    from zoo.data.batching import batch_vision, stacked
    from zoo.model.logps import batch_logps

    write_jsonl(folder / "pairs.jsonl", rows)
    for p in image_files:  # image paths are relative to the data file
        (folder / p.name).write_bytes(p.read_bytes())
    path = str(folder / "pairs.jsonl")
    cfg = load_config(None, [f"model.path={ckpt}", f"data.path={path}", f"data.seq_len={seq_len}", "batch_size=2",
                             "max_steps=1", "lora.rank=4", f"output_dir={folder / 'out'}"], DPOConfig)
    task = DPOTask(cfg)
    mcfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    task.vision, task.shared_prompt = mcfg.vision, False  # what prepare() sets from the model (sliding layers)
    docs = task.documents(task.load(path, cfg), tok, path, False).docs
    batch = stacked([docs[i] for i in range(len(rows))], cfg.data.seq_len + 1, len(rows), task.finish_rows)
    logp = np.asarray(jax.jit(lambda p, b: batch_logps(mcfg, p, b, max_segments=3,
                                                       vision=batch_vision(mcfg, b))[0])(params, batch))
    return docs, batch, logp


def eval_multiple_choice(root: Path, ckpt: Path, rows: list[dict], batch_size: int) -> list[dict]:
    """`zoo eval` of a multiple-choice task over ``rows`` (question, choices, answer, images), written to
    ``root``; returns its logged samples, one a row, in order."""
    from zoo.cli import main as zoo_main

    write_jsonl(root / "mc.jsonl", rows)
    (root / "mc.yaml").write_text(yaml.safe_dump({"name": "mc", "data": "mc.jsonl", "kind": "multiple_choice",
                                                  "context": "{question}", "choices": "choices", "gold": "answer"}))
    out = root / "results.json"
    assert zoo_main(["eval", str(ckpt), "--tasks", str(root / "mc.yaml"), "--out", str(out), "--log-samples",
                     "--batch-size", str(batch_size)]) == 0
    return [json.loads(line) for line in out.with_name("results.samples.jsonl").read_text().splitlines()]
