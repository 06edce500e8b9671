"""Benchmark: GRPO's sampler alone (eval/rollout.py's ``RolloutEngine.program``, what `grpo train` samples with) at
bench/grpo_step.py's shape: SmolLM2-135M-Instruct (the bundled GGUF, float32), 16 arithmetic chat prompts x G = 4
completions of at most 64 new tokens at temperature 1.0, EOS ending a completion.

Command (from a checkout's root; run it in two checkouts to compare them: each measures its own sampler)::

    python bench/grpo_sampler.py --calls 3

The first ``--warmup`` calls (compilation: the engine compiles a decoding program per batch of rows it meets, 8
to 64) are not timed; each call draws with a key of its own. Prints each call, then
one JSON line: seconds a call, completion tokens a call, completion tokens/s, and seconds per decoding step (a
call's time over its longest completion: the steps every row waits for).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3, help="timed calls (default 3)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per completion at most (default 64)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import zoo
    from convert.convert import convert
    from eval.generate import Sampler
    from eval.rollout import RolloutEngine, RolloutSpec
    from zoo.data.tokenizer import load_tokenizer
    from zoo.registry.catalogue import bundled_gguf

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "smol"
        convert(str(bundled_gguf()), str(ckpt), progress=False)
        tok = load_tokenizer(str(ckpt))
        mcfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    rng = np.random.RandomState(0)
    prompts = []
    for _ in range(16):
        a, b = rng.randint(1, 100, 2)
        text = tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}],
                                       add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    g, t = 4, args.new_tokens
    width = -(-max(map(len, prompts)) // 16) * 16 + 1  # grpo train's rows: data.seq_len + 1
    tokens = np.zeros((len(prompts) * g, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i * g:(i + 1) * g, :len(p)] = p
    spec = RolloutSpec(g, t, Sampler(1.0, 0, 1.0), (tok.eos_token_id,))
    sample = RolloutEngine(mcfg, jnp.float32, None).program(spec, lambda x: (x, x > 0))
    timed = []
    for i in range(args.calls + args.warmup):
        t0 = time.perf_counter()
        _, _, n = sample(params, jax.random.key(i), tokens)
        n = np.asarray(jax.device_get(n))
        dt = time.perf_counter() - t0
        print(f"call {i}{' (warm-up)' if i < args.warmup else ''}: {dt:.2f} s, {n.sum()} tokens, longest {n.max()}",
              flush=True)
        if i >= args.warmup:
            timed.append((dt, int(n.sum()), int(n.max())))
    seconds = sum(x[0] for x in timed)
    print(json.dumps({"s_per_call": [round(x[0], 2) for x in timed], "tokens": [x[1] for x in timed],
                      "tokens_per_s": round(sum(x[1] for x in timed) / seconds, 2),
                      "s_per_decode_step": round(seconds / sum(x[2] for x in timed), 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
