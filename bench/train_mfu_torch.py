"""Benchmark peer (accelerator): the same Llama-shaped LoRA and full fine-tuning steps in PyTorch + transformers
(+ peft for LoRA), for side-by-side rows with bench/train_mfu_gpu.py.

Random weights of the shapes of bench/train_mfu_gpu.py's SHAPES, bf16 weights, SDPA attention (flash attention
on an NVIDIA GPU), AdamW (torch's fused one), no gradient checkpointing (remat none), one optimizer step per
batch. MFU uses the same model FLOPs as lmzoo's rows (pretrain.flops.flops_per_token: 6 x active matmul
parameters per token for full fine-tuning, 4 x for a frozen base, plus causal attention). torch, transformers and
peft are peers here, never lmzoo's run-time needs.

Usage (on a GPU machine)::

    python bench/train_mfu_torch.py --model 8b --lora 16 --batch 4
    python bench/train_mfu_torch.py --model 8b --batch 2
    python bench/train_mfu_torch.py --model 1b --layers 1 --seq 128 --batch 1 --steps 1 --peak-tflops 1  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.train_mfu_gpu import add_step_flags, hf_config  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    """Build the model on the first device and time the step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrain.flops import KNOWN_PEAK_TFLOPS, flops_per_token
    from zoo.model.from_hf import model_config_from_hf

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raw = hf_config(args.model, args.layers)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear"))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # float32 adapters, as lmzoo's
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=dev.type == "cuda")
    b, t = args.batch, args.seq
    tokens = torch.randint(0, config.vocab_size, (b, t + 1), device=dev)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()

    def step() -> float:
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    times, first = [], 0.0
    for i in range(args.steps + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i == 0:
            first = time.perf_counter() - t0
        if i >= 2:
            times.append(time.perf_counter() - t0)
    kind = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in KNOWN_PEAK_TFLOPS.items() if k.lower() in kind.lower()), None)
    med = statistics.median(times)
    flops = flops_per_token(model_config_from_hf(raw, args.model), t, frozen_base=bool(args.lora)) * b * t
    return {"side": "torch+peft" if args.lora else "torch", "model": args.model, "layers": config.num_hidden_layers,
            "device": kind, "mode": f"lora r{args.lora}" if args.lora else "full", "attention": "sdpa",
            "batch": b, "seq": t, "remat": "none", "first_step_s": first, "median_step_s": med, "step_s": times,
            "tokens_per_s": b * t / med, "model_tflops_per_step": flops / 1e12,
            "mfu": flops / med / (peak * 1e12) if peak else None,
            "peak_bytes_in_use": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None}


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print a line and the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_flags(ap, model="8b", steps=3)
    r = run(ap.parse_args(argv))
    mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a"
    print(f"{r['side']} {r['model']} ({r['layers']} layers, {r['mode']}) on {r['device']}: batch {r['batch']} x seq "
          f"{r['seq']}, step {r['median_step_s']:.3f} s, {r['tokens_per_s']:.0f} tokens/s, MFU {mfu}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
