"""Benchmark: one train step of KTO (LoRA) or of a reward model (full fine-tuning or LoRA) on SmolLM2-135M: lmzoo
against TRL 1.16's KTOTrainer + peft and RewardTrainer (+ peft), side by side.

Command (from the repository root, virtualenv active, ``pip install -e '.[bench]'`` for TRL and peft)::

    python bench/pref_step.py --objective kto --rounds 2 --steps 3 --out kto_step.json
    python bench/pref_step.py --objective reward --rounds 2 --steps 3 --out rm_step.json
    python bench/pref_step.py --objective reward --lora --rounds 2 --steps 3 --out rm_lora_step.json

Options: ``--objective kto|reward --lora --seq 256 --batch 8 --steps 3 --rounds 2 --rank 16 --alpha 32 --remat
full --out FILE`` (defaults shown; ``--lora``: a reward model with LoRA). The data are bench/dpo_step.py's (``write_pairs``): ``--batch`` preference pairs
per step of random single-token words, a prompt of seq/2 tokens and two answers of seq/2 tokens (seq/2 - 1
words + EOS), so both trainers tokenize them to the same ids.

* ``--objective kto``: the pairs unpacked into 2 x batch thumbs-up/down rows (TRL's rule, both sides), ``--batch``
  rows per step, beta 0.1, LoRA rank/alpha on q, k, v, o, gate, up, down, the reference the adapters-off base
  (lmzoo ``dpo.reference: base``; TRL: peft's disabled adapters). A KTO row scores its completion and a
  mismatched one: lmzoo in one row of ``seq/2 + 2 x seq/2 + 1`` tokens (the prompt once), TRL as two sequences of
  ``seq`` tokens.
* ``--objective reward``: ``reward train`` against RewardTrainer, full fine-tuning (a fresh score head on
  SmolLM2's decoder on both sides), ``--batch`` pairs per step: lmzoo one row of ``seq/2 + 2 x seq/2 + 2`` tokens
  per pair, TRL two sequences of ``seq`` tokens. With ``--lora``: LoRA rank/alpha on the seven projections, the
  score head trained whole beside them (peft's SEQ_CLS ``modules_to_save`` on TRL's side).

Both sides: float32, AdamW (lr 1e-4 for LoRA, 1e-5 for full fine-tuning; no weight decay; constant schedule;
gradient clipping at norm 1), the same weights (lmzoo's checkpoint converted from the bundled GGUF; TRL loads its
``zoo export``), torch threads = all CPUs. Each side runs in its own child process (its own peak RSS), two
warm-up steps then ``--steps`` timed ones, the sides' order rotating every round (bench/sides.py). Reported: the
median step time, rows/s, peak RSS, and the ratios against the targets (issue 44): throughput >= 1.5 x TRL's
and peak RSS <= 0.5 x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dpo_step import write_pairs  # bench/dpo_step.py (the script's folder)
from sides import check_targets, emit, merge_rounds, run_child  # bench/sides.py

SIDES = ("lmzoo", "trl")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WARMUP = 2
BETA = 0.1


def _lr(args: argparse.Namespace) -> float:
    return 1e-4 if args.objective == "kto" or args.lora else 1e-5


def run_lmzoo(ckpt: str, pairs: str, args: argparse.Namespace) -> dict:
    """`dpo train` (kto) or `reward train` on the shared loop for 2 + steps steps; step times from metrics.jsonl."""
    from pretrain.config import load_config
    from pretrain.loop import train

    steps = WARMUP + args.steps
    p = args.seq // 2
    common = [f"model.path={ckpt}", f"data.path={pairs}", f"batch_size={args.batch}", f"max_steps={steps}",
              f"optimizer.learning_rate={_lr(args)}", "optimizer.weight_decay=0", "optimizer.b2=0.999",
              "optimizer.grad_clip=1.0", "schedule.name=constant", "schedule.warmup_steps=0", f"remat={args.remat}",
              "log_every=1", "eval_every=0", f"checkpoint.every={10 * steps}", "checkpoint.keep=1", "seed=0"]
    with tempfile.TemporaryDirectory() as out:
        if args.objective == "kto":
            from dpo.config import DPOConfig
            from dpo.kto import KTOTask

            cfg = load_config(None, [*common, f"data.seq_len={p + 2 * (args.seq - p)}", f"lora.rank={args.rank}",
                                     f"lora.alpha={args.alpha}", f"lora.targets={','.join(TARGETS)}",
                                     "dpo.loss_type=kto", f"dpo.beta={BETA}", "dpo.reference=base",
                                     f"output_dir={out}"], DPOConfig)
            task: object = KTOTask(cfg)
        else:
            from rm.config import RMConfig
            from rm.task import RewardTask

            lora = [f"lora.rank={args.rank}", f"lora.alpha={args.alpha}",
                    f"lora.targets={','.join(TARGETS)}"] if args.lora else []
            cfg = load_config(None, [*common, f"data.seq_len={p + 2 * (args.seq - p) + 1}", *lora,
                                     f"output_dir={out}"], RMConfig)
            task = RewardTask(cfg)
        train(cfg, progress=False, task=task)  # type: ignore[arg-type]
        metrics = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    times = [m["step_time"] for m in metrics]
    return {"times": times[WARMUP:], "warmup_s": times[:WARMUP], "losses": [m["loss"] for m in metrics]}


def run_trl(hf_dir: str, ckpt: str, pairs: str, args: argparse.Namespace) -> dict:
    """TRL's KTOTrainer (+ peft) or RewardTrainer on the same pairs; step times from a TrainerCallback."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / "tokenizer"))
    ds = load_dataset("json", data_files=pairs, split="train")
    times: list[float] = []
    losses: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    settings = dict(per_device_train_batch_size=args.batch, max_steps=WARMUP + args.steps, learning_rate=_lr(args),
                    lr_scheduler_type="constant", weight_decay=0.0, gradient_checkpointing=args.remat != "none",
                    use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                    dataloader_num_workers=0, max_length=args.seq + 1)
    with tempfile.TemporaryDirectory() as out:
        if args.objective == "kto":
            from peft import LoraConfig
            from transformers import AutoModelForCausalLM
            from trl import KTOConfig, KTOTrainer

            model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            peft_cfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(TARGETS), lora_dropout=0.0,
                                  task_type="CAUSAL_LM")
            trainer = KTOTrainer(model=model, args=KTOConfig(output_dir=out, beta=BETA, **settings), train_dataset=ds,
                                 processing_class=tok, peft_config=peft_cfg, callbacks=[Timer()])
        else:
            from transformers import AutoModelForSequenceClassification
            from trl import RewardConfig, RewardTrainer

            model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32, num_labels=1)
            rm_peft = None
            if args.lora:
                from peft import LoraConfig

                rm_peft = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(TARGETS),
                                     lora_dropout=0.0, task_type="SEQ_CLS")
            trainer = RewardTrainer(model=model, args=RewardConfig(output_dir=out, **settings), train_dataset=ds,
                                    processing_class=tok, peft_config=rm_peft, callbacks=[Timer()])
        trainer.train()
    return {"times": times[WARMUP:], "warmup_s": times[:WARMUP], "losses": losses,
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    """Run both sides, print the comparison and the target checks (and one JSON line)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objective", choices=("kto", "reward"), default="kto", help="what trains (default kto)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side and round, after two warm-ups")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both sides, rotating which goes first")
    ap.add_argument("--batch", type=int, default=8, help="rows per step: KTO rows, or reward pairs (default 8)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence: prompt + one answer (default 256)")
    ap.add_argument("--lora", action="store_true", help="reward: train with LoRA (the score head whole) on both sides")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank, KTO and reward --lora (default 16)")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha, KTO and reward --lora (default 32)")
    ap.add_argument("--remat", choices=("none", "full", "save_dots"), default="full",
                    help="lmzoo's `remat` (default full); TRL's gradient_checkpointing is on unless none")
    ap.add_argument("--out", type=Path, help="also write the result JSON here")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    for hidden in ("--ckpt", "--hf", "--pairs"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.seq < 4 or args.seq % 2:
        ap.error("--seq must be an even number >= 4")
    if args.child == "trl":
        print(json.dumps(run_trl(args.hf, args.ckpt, args.pairs, args)))
        return 0
    if args.child:
        print(json.dumps(run_lmzoo(args.ckpt, args.pairs, args)))
        return 0
    from convert.convert import convert
    from convert.export import export
    from zoo.data.tokenizer import load_tokenizer
    from zoo.registry.catalogue import bundled_gguf

    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, hf, pairs = f"{tmp}/smol", f"{tmp}/smol_hf", f"{tmp}/pairs.jsonl"
        convert(str(bundled_gguf()), ckpt, progress=False)
        export(ckpt, hf)
        # KTO unpacks each pair into two rows: batch / 2 pairs a step; enough for every step (no epoch boundary)
        n = args.batch * (WARMUP + args.steps) // (2 if args.objective == "kto" else 1) + 1
        write_pairs(Path(pairs), load_tokenizer(ckpt), args.batch, args.seq, n)
        for rnd in range(args.rounds):
            order = SIDES[rnd % 2:] + SIDES[:rnd % 2]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)}", file=sys.stderr, flush=True)
            for which in order:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--ckpt", ckpt, "--hf", hf,
                       "--pairs", pairs, "--objective", args.objective, "--steps", str(args.steps), "--batch",
                       str(args.batch), "--seq", str(args.seq), "--rank", str(args.rank), "--alpha", str(args.alpha),
                       "--remat", args.remat, *(["--lora"] if args.lora else [])]
                runs[which].append(run_child(cmd, which))
    res = {s: merge_rounds(runs[s]) for s in SIDES}
    for r in res.values():
        r["median_step_s"] = statistics.median(r["times"])
        r["rows_per_s"] = args.batch / r["median_step_s"]
    how = f"LoRA rank {args.rank}" if args.objective == "kto" or args.lora else "full fine-tuning"
    print(f"machine: {os.cpu_count()} CPUs; SmolLM2-135M, {args.objective}, {args.batch} "
          f"{'rows' if args.objective == 'kto' else 'pairs'} x {args.seq} tokens per step, float32, AdamW, {how}; "
          f"remat {args.remat}")
    for s in SIDES:
        r = res[s]
        print(f"{s:7} step {r['median_step_s']:.2f} s, {r['rows_per_s']:.2f} rows/s, peak RSS "
              f"{r['peak_rss_bytes'] / 2**30:.2f} GiB, loss@0 {r['losses'][0]:.4f}")
    med = lambda r: statistics.median(r["times"])  # noqa: E731
    per_round = {"throughput": [med(b) / med(a) for a, b in zip(runs["lmzoo"], runs["trl"])],
                 "rss": [a["peak_rss_bytes"] / b["peak_rss_bytes"] for a, b in zip(runs["lmzoo"], runs["trl"])]}
    lm, trl = res["lmzoo"], res["trl"]
    checks = check_targets([
        ("lmzoo / TRL throughput", trl["median_step_s"] / lm["median_step_s"], ">=", 1.5, per_round["throughput"]),
        ("lmzoo / TRL peak RSS", lm["peak_rss_bytes"] / trl["peak_rss_bytes"], "<=", 0.5, per_round["rss"])])
    emit({"benchmark": "pref_step", "objective": args.objective, "model": "SmolLM2-135M", "batch": args.batch,
          "seq": args.seq, "steps": args.steps, "rounds": args.rounds, "remat": args.remat, "lora": args.lora, "cpus": os.cpu_count(),
          "lmzoo": lm, "trl": trl, "per_round": per_round, "checks": checks,
          "all_pass": all(c["pass"] for c in checks.values())}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
