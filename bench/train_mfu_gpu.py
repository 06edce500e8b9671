"""Benchmark (accelerator): MFU of lmzoo's train step on Llama-3.2-1B- and Llama-3.1-8B-shaped models.

Random weights (the shapes are what matter), bf16 compute, AdamW, the same jitted, sharded step `pretrain train`
and `sft train` run (pretrain.jit_step.make_step) over all local devices (FSDP): full fine-tuning, or LoRA (``--lora
RANK``) on every attention and MLP projection of a frozen base. Prints step time, tokens/s and MFU against the
device's dense bf16 peak (or --peak-tflops), with the model FLOPs the step needs (pretrain.flops: 6 x the active
matmul parameters per token for full fine-tuning, 4 x for a frozen base, plus causal attention), never XLA's
estimate. An 8B model's fp32 weights + Adam moments need 128 GB: on one device use ``--params bfloat16`` (weights
and Adam's moments in bf16) or trim the depth with --layers (MFU per layer is what the trim preserves).

Usage (on a GPU/TPU machine)::

    python bench/train_mfu_gpu.py --model 8b --lora 16 --params bfloat16 --batch 4 --remat save_dots
    python bench/train_mfu_gpu.py --model 8b --params bfloat16 --batch 2 --remat save_dots
    python bench/train_mfu_gpu.py --model 1b --seq 256 --layers 1 --batch 1 --steps 1 --peak-tflops 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
}


def hf_config(model: str, layers: int | None) -> dict:
    """A Llama 3 HF config dict of the given shape."""
    shape = dict(SHAPES[model])
    if layers:
        shape["num_hidden_layers"] = layers
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, **shape}


def run(args: argparse.Namespace) -> dict:
    """Build the model on a (fsdp = all devices) mesh and time the train step (full fine-tuning, or LoRA on
    every attention and MLP projection of a frozen base with ``--lora``)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from pretrain.batch import TokenBatch
    from pretrain.flops import KNOWN_PEAK_TFLOPS, flops_per_token
    from pretrain.jit_step import init_state, make_step
    from zoo.kernels.choice import kernel_for
    from zoo.lora.params import LoraConfig, init_lora, lora_specs
    from zoo.lora.weights import LoraRun
    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import init_params, nest, param_specs
    from zoo.model.sharding import make_mesh, named_sharding

    cfg = model_config_from_hf(hf_config(args.model, args.layers), args.model)
    cfg = dataclasses.replace(cfg, attention=args.attention)
    mesh = make_mesh(devices=jax.devices())
    pdt = jnp.dtype(args.params)
    specs = param_specs(cfg)
    shard = nest({k: named_sharding(mesh, s.axes, s.shape) for k, s in specs.items()})
    params = jax.jit(lambda: init_params(cfg, jax.random.PRNGKey(0), pdt), out_shardings=shard)()
    tx = optax.adamw(1e-4)
    lora = LoraConfig(rank=args.lora, alpha=2.0 * args.lora) if args.lora else None
    frozen = frozen_sharding = None
    if lora:
        lspecs = lora_specs(cfg, lora)
        lshard = nest({k: named_sharding(mesh, s.axes, s.shape) for k, s in lspecs.items()})
        frozen, frozen_sharding = params, jax.tree.map(lambda x: x.sharding, params)
        params = jax.jit(lambda: init_lora(cfg, lora, jax.random.PRNGKey(1), "float32"), out_shardings=lshard)()
    state = init_state(tx, params, mesh)
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    step, _ = make_step(cfg, tx, jnp.bfloat16, args.remat, jax.tree.map(lambda x: x.sharding, state), batch_sharding,
                        lora=LoraRun.of(lora), frozen_sharding=frozen_sharding)
    b, t = args.batch * len(jax.devices()), args.seq
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, b, t + 1)).astype(np.int32)
    batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "weights": np.ones((1, b, t), np.float32),
             "segment_ids": np.ones((1, b, t), np.int32),
             "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (1, b, t)).copy()}
    batch = TokenBatch.of(jax.device_put(batch, batch_sharding))
    times, compile_s = [], 0.0
    dtypes_before = [x.dtype for x in jax.tree.leaves(state)]
    for i in range(args.steps + 2):  # two warm-up steps (the first compiles; the second must not)
        t0 = time.perf_counter()
        state, m = step(state, batch, frozen)
        float(m["loss"])
        if i == 0:
            compile_s = time.perf_counter() - t0
        if i >= 2:
            times.append(time.perf_counter() - t0)
    kind = jax.devices()[0].device_kind
    peak = args.peak_tflops or next((v for k, v in KNOWN_PEAK_TFLOPS.items() if k.lower() in kind.lower()), None)
    med = statistics.median(times)
    flops = flops_per_token(cfg, t, frozen_base=lora is not None) * b * t
    mem = jax.devices()[0].memory_stats() or {}
    return {"model": args.model, "layers": cfg.num_layers, "device": kind, "devices": len(jax.devices()),
            "mode": f"lora r{args.lora}" if lora else "full", "params": args.params,
            "attention": kernel_for(cfg, jnp.bfloat16), "batch": b, "seq": t, "remat": args.remat,
            "first_step_s": compile_s, "median_step_s": med, "step_s": times, "tokens_per_s": b * t / med,
            "model_tflops_per_step": flops / 1e12,
            "mfu": flops / med / (peak * 1e12 * len(jax.devices())) if peak else None,
            "state_dtypes_kept": dtypes_before == [x.dtype for x in jax.tree.leaves(state)],
            "peak_bytes_in_use": mem.get("peak_bytes_in_use")}


def add_step_flags(ap: argparse.ArgumentParser, model: str = "1b", steps: int = 5) -> None:
    """The flags both sides of the benchmark share (this file's and bench/train_mfu_torch.py's): the model's
    shape, the batch, the timed steps, LoRA's rank and the peak."""
    ap.add_argument("--model", choices=sorted(SHAPES), default=model, help=f"model shape (default {model})")
    ap.add_argument("--layers", type=int, help="trim the depth to this many layers (to fit memory)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per device (default 4)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--steps", type=int, default=steps, help=f"timed steps after two warm-ups (default {steps})")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on every attention and MLP projection of a "
                    "frozen base (default 0: full fine-tuning)")
    ap.add_argument("--peak-tflops", type=float, help="per-device peak; default: detected for known accelerators")


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print a line per result and the JSON."""
    from zoo.model.config import ATTENTION_KERNELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_flags(ap)
    ap.add_argument("--remat", choices=["none", "full", "save_dots"], default="save_dots",
                    help="activation rematerialization (default save_dots)")
    ap.add_argument("--params", choices=["float32", "bfloat16"], default="float32",
                    help="parameter (master weight) dtype (default float32); compute is bfloat16")
    ap.add_argument("--attention", choices=ATTENTION_KERNELS, default="auto",
                    help="the attention kernel (model.attention; default auto: cuDNN on NVIDIA GPUs)")
    args = ap.parse_args(argv)
    r = run(args)
    mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a (unknown peak)"
    print(f"{r['model']} ({r['layers']} layers, {r['mode']}, {r['attention']} attention, remat {r['remat']}) on "
          f"{r['devices']}x {r['device']}: batch {r['batch']} x seq {r['seq']}, step {r['median_step_s']:.3f} s, "
          f"{r['tokens_per_s']:.0f} tokens/s, MFU {mfu}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
