"""Benchmark: one LoRA train step of a vision-language model on the CPU, lmzoo (JAX) vs transformers + peft.

Command (from the repository root, virtualenv active; the full measurement, about 15 min on 2 CPUs)::

    python bench/vlm_lora_cpu.py --rounds 3 --steps 3 --out vlm_lora.json

Options: ``--shape smolvlm-256m --batch 2 --seq 256 --images 1 --steps 3 --warmup 2 --rounds 3 --rank 16
--alpha 32 --remat full --out FILE`` (defaults shown). A quick smoke test: ``python bench/vlm_lora_cpu.py --shape
tiny --rounds 1 --steps 1 --warmup 1 --seq 64``.

Both sides train the same model on the same batch:

- the model: ``SmolVLMForConditionalGeneration`` of SmolVLM-256M's architecture (SHAPES: a SigLIP tower 768 wide,
  12 layers, 512-pixel images in 16-pixel patches, shuffled 4 x 4 into 64 tokens an image; a Llama language model
  576 wide, 30 layers, 49,280-token vocabulary), random float32 weights drawn by transformers' own initialisation
  with a fixed seed, saved once and converted (``zoo convert``) for lmzoo, read by ``from_pretrained`` for peft;
- the batch: ``--batch`` rows of ``--seq`` tokens, each row ``--images`` images (random pixels in [-1, 1], the
  whole image real: the same ``pixel_values`` on both sides, laid out as patches for lmzoo by
  ``zoo.data.vision_layout``) whose image tokens sit as SmolVLM's processor expands an image without splitting
  (``<fake_token_around_image><global-img>`` + 64 ``<image>`` + ``<fake_token_around_image>``), random text ids
  around them; the loss over every next token but the image tokens (labels -100 there for transformers);
- LoRA: rank 16, alpha 32, dropout 0, on the language model's q, k, v, o, gate, up and down (peft:
  ``target_modules`` a pattern over ``text_model``, so the tower's q/k/v are not adapted; lmzoo's LoRA never
  adapts the tower); the tower, connector, embeddings and head frozen; AdamW (lr 1e-4) over the adapters alone;
- ``--remat`` (default full): lmzoo's ``remat`` setting, and transformers' gradient checkpointing (non-reentrant)
  unless ``none``; float32 everywhere; torch threads = all CPUs.

- ``lmzoo LoRA``: the step ``sft train`` compiles with ``lora.rank`` set (``pretrain.jit_step.make_step``; the
  base, tower included, a frozen undifferentiated argument; the images reach the forward as the batch's
  ``vision`` field, :class:`pretrain.batch.VisionBatch`);
- ``PyTorch+peft``: ``peft.get_peft_model`` over the transformers model, ``torch.optim.AdamW``, forward with
  ``pixel_values``, ``pixel_attention_mask`` and ``labels``, backward, step.

Each side runs in its own child process (``bench/sides.py``); its peak RSS is its ``VmHWM`` through loading
and the timed steps (``process_peak_rss_bytes``: the whole child's ``ru_maxrss``, the tower's timing after the
steps included), does --warmup untimed steps (JAX compiles in the first) and times --steps steps; the
order of the sides alternates every round. Reported: the median step time over all rounds, tokens/s (batch x seq
over the median step), the median step's CPU seconds (``time.process_time``: the process's threads together, less
sensitive than wall time to a shared machine), the machine's 1-minute load average before and after each side's
child (``load_average_1min``: other jobs' share of the cores), the tower and connector's forward alone (each side's own,
after the steps: where the time goes), peak RSS, trainable parameters, the step-0 loss (transformers averages over seq - 1
targets, lmzoo over seq, so they differ slightly), each round's ratios and the targets (issue 62, item 7):

- lmzoo LoRA / peft throughput >= 1.5x;
- lmzoo LoRA / peft peak RSS <= 0.6x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sides import (  # bench/sides.py (the script's folder)
    check_targets,
    emit,
    merge_rounds,
    nbytes,
    reset_peak,
    run_child,
    status_bytes,
)

SIDES = ("lora", "peft")
NAMES = {"lora": "lmzoo LoRA", "peft": "PyTorch+peft"}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WARMUP = 2  # the default of --warmup

# transformers SmolVLMConfig arguments. smolvlm-256m: HuggingFaceTB/SmolVLM-256M-Instruct's architecture (its
# config.json's text and vision fields; 256M parameters); tiny: for a smoke test in seconds.
SHAPES = {
    "smolvlm-256m": dict(
        text_config=dict(vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=False, pad_token_id=2),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16),
        scale_factor=4, image_token_id=49190),
    "tiny": dict(
        text_config=dict(vocab_size=49280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=16),
        scale_factor=2, image_token_id=49190),
}
TEXT_IDS = 49152  # random text ids below SmolVLM's added tokens (the image token among them)
AROUND, GLOBAL_IMG = 49189, 49152  # <fake_token_around_image>, <global-img> (ids of no consequence to the model)


def _tokens_per_image(shape: dict) -> int:
    v = shape["vision_config"]
    return (v["image_size"] // v["patch_size"]) ** 2 // shape["scale_factor"] ** 2


def make_model(shape: str, folder: Path) -> int:
    """Save a random SmolVLM of ``shape`` to ``folder`` (float32, transformers' initialisation, seed 0); returns its
    parameter count."""
    import torch
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    torch.manual_seed(0)
    model = SmolVLMForConditionalGeneration(SmolVLMConfig(**SHAPES[shape]))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def make_batch(shape: str, batch: int, seq: int, images: int, path: Path) -> None:
    """Write the batch both sides train on to ``path`` (npz): ``tokens`` [batch, seq + 1] int32 (each row's images'
    tokens from position 4 on, one after another) and ``pixels`` [batch * images, 3, S, S] float32."""
    s = SHAPES[shape]
    n, side = _tokens_per_image(s), s["vision_config"]["image_size"]
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, TEXT_IDS, (batch, seq + 1)).astype(np.int32)
    block = [AROUND, GLOBAL_IMG] + [s["image_token_id"]] * n + [AROUND]
    if 4 + images * len(block) > seq:
        raise SystemExit(f"--seq {seq} holds no {images} image(s) of {len(block)} tokens each")
    for k in range(images):
        tokens[:, 4 + k * len(block):4 + (k + 1) * len(block)] = block
    pixels = rng.uniform(-1, 1, (batch * images, 3, side, side)).astype(np.float32)
    np.savez(path, tokens=tokens, pixels=pixels)


def run_jax(ckpt: str, data: str, images: int, steps: int, rank: int, alpha: float, remat: str,
            warmup_steps: int = WARMUP) -> dict:
    """Time lmzoo's LoRA train step (adapters on the language model over a frozen base, tower included) on one
    CPU device, the batch's images as its ``vision`` field."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    import zoo
    from pretrain.batch import VISION_PREFIX, TokenBatch
    from pretrain.jit_step import init_state, make_step
    from pretrain.setup import adapter_init
    from zoo.data.vision_layout import image_patches, layout_rows
    from zoo.lora.params import LoraConfig
    from zoo.lora.weights import LoraRun
    from zoo.model.sharding import make_mesh

    cfg = zoo.read_config(ckpt)
    v = cfg.vision
    assert v is not None, f"{ckpt} has no vision tower"
    mesh = make_mesh(devices=jax.devices()[:1])
    jax.numpy.zeros(1).block_until_ready()
    rss0 = status_bytes("VmRSS")  # the runtime, before any weight
    frozen = zoo.load_params(ckpt, mesh, dtype=np.float32)
    tx = optax.adamw(1e-4)
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    lora_cfg = LoraConfig(rank=rank, alpha=alpha, targets=list(TARGETS))  # as pretrain.loop.train with lora.rank
    trainable = adapter_init(cfg, lora_cfg, 0, mesh)({})
    state = init_state(tx, trainable, mesh)
    step, _ = make_step(cfg, tx, jax.numpy.float32, remat, jax.tree.map(lambda x: x.sharding, state), batch_sharding,
                        None, LoraRun.of(lora_cfg), jax.tree.map(lambda x: x.sharding, frozen))
    n_trainable = sum(int(x.size) for x in jax.tree.leaves(trainable))
    arrays = np.load(data)
    t, pixels = arrays["tokens"], arrays["pixels"]
    rows, seq = t.shape[0], t.shape[1] - 1
    # as sft/vision.py lays a row's images out: each image's patches, the row's in order, flattened
    per_image = [image_patches(v, p) for p in pixels]
    laid = layout_rows(v, [per_image[r * images:(r + 1) * images] for r in range(rows)], images * v.patches_per_image)
    laid["patches"] = laid["patches"].reshape(rows, -1)
    laid["patch_valid"] = laid["patch_valid"].astype(np.int32)
    targets = t[:, 1:]
    b = {"inputs": t[:, :-1], "targets": targets, "weights": (targets != v.image_token_id).astype(np.float32),
         "segment_ids": np.ones((rows, seq), np.int32), "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
         **{VISION_PREFIX + k: x for k, x in laid.items()}}
    b = TokenBatch.of(jax.device_put({k: x[None] for k, x in b.items()}, batch_sharding))  # [grad_accum=1, ...]
    del trainable, per_image, laid  # the state holds the adapters
    weights_bytes, state_bytes = nbytes(frozen), nbytes(state)
    loaded_rss, loaded_peak = status_bytes("VmRSS"), status_bytes("VmHWM")  # the weights, adapters and optimizer state in place
    reset_peak()  # from here VmHWM is the steps' own peak (sides.run_child keeps the larger of the two)
    times, warmup, losses, cpu = [], [], [], []
    for i in range(steps + warmup_steps):  # the first step compiles; layouts are pinned, so only once
        t0, c0 = time.perf_counter(), time.process_time()
        state, m = step(state, b, frozen)
        losses.append(float(m["loss"]))  # blocks until the step is done
        (times if i >= warmup_steps else warmup).append(time.perf_counter() - t0)
        if i >= warmup_steps:
            cpu.append(time.process_time() - c0)
    step_peak = status_bytes("VmHWM")
    # Where the time goes: the tower and connector's forward alone (the step's frozen part), compiled apart.
    from zoo.model.vision import encode_images

    images = jax.jit(lambda p, x: encode_images(cfg, p, x.inputs(v)))
    mb = jax.tree.map(lambda x: x[0], b.vision)  # the one micro-batch
    images(frozen, mb).block_until_ready()
    tower = []
    for _ in range(2):
        t0 = time.perf_counter()
        images(frozen, mb).block_until_ready()
        tower.append(time.perf_counter() - t0)
    return {"times": times, "warmup_s": warmup, "losses": losses, "cpu_s": cpu, "tower_s": tower,
            "trainable_params": n_trainable,
            "runtime_rss_bytes": rss0, "weights_bytes": weights_bytes, "state_bytes": state_bytes,
            "loaded_rss_bytes": loaded_rss, "load_peak_rss_bytes": loaded_peak, "step_peak_rss_bytes": step_peak}


def run_peft(hf: str, data: str, images: int, steps: int, rank: int, alpha: float, remat: str,
             warmup_steps: int = WARMUP) -> dict:
    """Time transformers + peft LoRA (adapters on the language model) with torch.optim.AdamW over the adapters, on
    the same tokens and pixels."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import SmolVLMForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    model = SmolVLMForConditionalGeneration.from_pretrained(hf, dtype=torch.float32)
    if remat != "none":  # each layer recomputed in the backward pass, as lmzoo's remat: full
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pattern = rf".*text_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(TARGETS)})"  # the language model's alone
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=pattern, lora_dropout=0.0))
    model.train()
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    arrays = np.load(data)
    ids = torch.tensor(arrays["tokens"][:, :-1], dtype=torch.long)
    labels = ids.masked_fill(ids == model.config.image_token_id, -100)  # shifted inside; image tokens never train
    rows = len(ids)
    pixels = torch.tensor(arrays["pixels"]).reshape(rows, images, *arrays["pixels"].shape[1:])
    mask = torch.ones(rows, images, *pixels.shape[-2:], dtype=torch.bool)
    times, warmup, losses, cpu = [], [], [], []
    for i in range(steps + warmup_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=ids, pixel_values=pixels, pixel_attention_mask=mask, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss))
        (times if i >= warmup_steps else warmup).append(time.perf_counter() - t0)
        if i >= warmup_steps:
            cpu.append(time.process_time() - c0)
    peak = status_bytes("VmHWM")
    tower = []  # where the time goes: the tower and connector's forward alone (frozen: no graph either side)
    with torch.no_grad():
        for _ in range(3):
            t0 = time.perf_counter()
            model.base_model.model.model.get_image_features(pixels, mask)
            tower.append(time.perf_counter() - t0)
    return {"times": times, "warmup_s": warmup, "losses": losses, "cpu_s": cpu, "tower_s": tower[1:],
            "trainable_params": sum(q.numel() for q in trainable),
            "threads": torch.get_num_threads(), "gradient_checkpointing": remat != "none",
            "load_peak_rss_bytes": peak}  # this process's own peak, the steps' (sides.run_child: see main)


def _child(which: str, args: argparse.Namespace, ckpt: str, hf: str, data: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--ckpt", ckpt, "--hf", hf, "--data", data,
           "--images", str(args.images), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--rank", str(args.rank), "--alpha", str(args.alpha), "--remat", args.remat]
    res = run_child(cmd, NAMES[which], 13)
    # The side's peak through loading and the timed steps (lmzoo: VmHWM before and after its reset, peft: VmHWM
    # after its steps), not the process's: the tower's forward timed afterwards is a second compiled program on
    # lmzoo's side (about 0.08 GiB more), no part of the step compared.
    res["process_peak_rss_bytes"] = res["peak_rss_bytes"]
    res["peak_rss_bytes"] = max(res["load_peak_rss_bytes"], res.get("step_peak_rss_bytes", 0))
    return res


def _report(res: dict, args: argparse.Namespace, n_params: int) -> None:
    """Print the sides' table and where each lmzoo peak is."""
    v = SHAPES[args.shape]["vision_config"]
    print(f"machine: {os.cpu_count()} CPUs; SmolVLM ({args.shape}, {n_params / 1e6:,.1f}M parameters, float32), "
          f"batch {args.batch} x seq {args.seq}, {args.images} image(s) of {v['image_size']} px a row, AdamW, "
          f"lmzoo remat {args.remat}, peft gradient checkpointing {args.remat != 'none'}; LoRA rank {args.rank}, "
          f"alpha {args.alpha:g}, language model q,k,v,o,gate,up,down")
    print(f"{'':16}{'step':>10}{'CPU time':>10}{'tower fwd':>11}{'tokens/s':>10}{'peak RSS':>11}{'trainable':>14}"
          f"{'loss@0':>9}")
    gib = 2**30
    for s, r in res.items():
        print(f"{NAMES[s]:16}{r['median_step_s']:>8.2f} s{r['median_cpu_s']:>8.2f} s{r['median_tower_s']:>9.2f} s"
              f"{r['tokens_per_s']:>10.0f}"
              f"{r['peak_rss_bytes'] / gib:>7.2f} GiB{r['trainable_params']:>14,}{r['losses'][0]:>9.4f}")
    if "lora" in res:
        r = res["lora"]
        r["activations_bytes"] = r["peak_rss_bytes"] - r["runtime_rss_bytes"] - r["weights_bytes"] - r["state_bytes"]
        print(f"  lmzoo LoRA: runtime {r['runtime_rss_bytes'] / gib:.2f} GiB, weights {r['weights_bytes'] / gib:.2f} GiB, "
              f"adapters + AdamW {r['state_bytes'] / gib:.2f} GiB, the rest of the peak {r['activations_bytes'] / gib:.2f} "
              f"GiB; RSS after load {r['loaded_rss_bytes'] / gib:.2f} GiB, peak during load "
              f"{r['load_peak_rss_bytes'] / gib:.2f} GiB, during the steps {r['step_peak_rss_bytes'] / gib:.2f} GiB")


def main(argv: list[str] | None = None) -> int:
    """Run both sides in alternating rounds, print the comparison and the target checks (and one JSON line)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="smolvlm-256m",
                    help="the model's architecture (default smolvlm-256m; tiny: a smoke test)")
    ap.add_argument("--batch", type=int, default=2, help="rows (default 2)")
    ap.add_argument("--seq", type=int, default=256, help="tokens a row, image tokens included (default 256)")
    ap.add_argument("--images", type=int, default=1, help="images a row (default 1)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side and round (default 3)")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps first (default 2; the first compiles)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both sides, alternating which goes first (default 3)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (default 32)")
    ap.add_argument("--remat", choices=("none", "full", "save_dots"), default="full",
                    help="lmzoo's remat setting (default full); the peft side checkpoints its layers unless none")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides to run (default lora,peft)")
    ap.add_argument("--out", type=Path, help="also write the result JSON here")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prepare:  # the model (saved and converted) and the batch, in a child (main)
        from convert.convert import convert

        folder = Path(args.prepare)
        n_params = make_model(args.shape, folder / "hf")
        convert(str(folder / "hf"), folder / "zoo", progress=False)
        make_batch(args.shape, args.batch, args.seq, args.images, folder / "batch.npz")
        print(n_params)
        return 0
    if args.child:
        run = run_jax if args.child == "lora" else run_peft
        print(json.dumps(run(args.ckpt if args.child == "lora" else args.hf, args.data, args.images, args.steps,
                             args.rank, args.alpha, args.remat, args.warmup)))
        return 0
    sides = tuple(x for x in SIDES if x in args.sides.split(","))
    if set(args.sides.split(",")) - set(SIDES) or not sides:
        ap.error(f"--sides: choose from {', '.join(SIDES)} (got {args.sides})")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        hf, ckpt, data = Path(tmp) / "hf", Path(tmp) / "zoo", Path(tmp) / "batch.npz"
        # In a child of its own: a child's ru_maxrss starts from its parent's peak RSS at the fork (Linux copies
        # the high-water mark), so this process stays small (numpy alone) and holds no model.
        prep = subprocess.run([sys.executable, os.path.abspath(__file__), "--prepare", tmp, "--shape", args.shape,
                               "--batch", str(args.batch), "--seq", str(args.seq), "--images", str(args.images)],
                              env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE, text=True, check=True)
        n_params = int(prep.stdout.strip().splitlines()[-1])
        for rnd in range(args.rounds):
            order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(NAMES[s] for s in order)}", file=sys.stderr, flush=True)
            for which in order:
                load = os.getloadavg()[0]  # the machine's 1-minute load around each child: other jobs' share
                runs[which].append(_child(which, args, str(ckpt), str(hf), str(data)))
                runs[which][-1]["load_average_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                # each child's whole result as it comes, so a run stopped early keeps its finished rounds
                print(json.dumps({"round": rnd + 1, "side": which, **runs[which][-1]}), file=sys.stderr, flush=True)
    res = {s: merge_rounds(runs[s]) for s in sides}
    for s, r in res.items():
        for key in ("cpu_s", "tower_s", "load_average_1min"):
            r[key] = [t for rnd in runs[s] for t in rnd[key]]
        r["median_step_s"] = statistics.median(r["times"])
        r["median_cpu_s"] = statistics.median(r["cpu_s"])
        r["median_tower_s"] = statistics.median(r["tower_s"])
        r["tokens_per_s"] = args.batch * args.seq / r["median_step_s"]
    _report(res, args, n_params)
    med = lambda r: statistics.median(r["times"])  # noqa: E731
    wanted = [  # issue 62, item 7
        ("lmzoo LoRA / PyTorch+peft throughput", lambda a, b: med(b) / med(a), ">=", 1.5),
        ("lmzoo LoRA / PyTorch+peft peak RSS", lambda a, b: a["peak_rss_bytes"] / b["peak_rss_bytes"], "<=", 0.6),
    ]
    checks = [(name, fn(res["lora"], res["peft"]), op, target, [fn(a, b) for a, b in zip(runs["lora"], runs["peft"])])
              for name, fn, op, target in wanted if len(res) == 2]
    results = check_targets(checks)
    if len(res) == 2 and res["lora"]["trainable_params"] != res["peft"]["trainable_params"]:
        print(f"warning: trainable parameters differ: lmzoo LoRA {res['lora']['trainable_params']:,}, "
              f"peft {res['peft']['trainable_params']:,}")
    keys = {"lora": "lmzoo_lora", "peft": "torch_peft"}
    result = {"benchmark": "vlm_lora_cpu", "shape": args.shape, "parameters": n_params, "remat": args.remat,
              "batch": args.batch, "seq": args.seq, "images": args.images, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds, "rank": args.rank, "alpha": args.alpha, "targets": list(TARGETS),
              "cpus": os.cpu_count(), **{keys[s]: res[s] for s in sides}, "checks": results,
              "all_pass": bool(results) and all(c["pass"] for c in results.values())}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
