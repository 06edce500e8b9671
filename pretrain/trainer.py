"""The one training loop: config -> mesh -> data -> jitted, sharded train step -> checkpoints -> metrics.

Tasks (pretraining today; SFT and DPO later) plug in their data transform
and loss. The loss is normalized by the number of target tokens in the
whole global batch, so ``grad_accum`` and how the batch is split across
devices change nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from zoo.checkpoint import (HF_CONFIG_FILE, TOKENIZER_DIR, CheckpointWriter, load_params, read_config,
                             remove_stale_scratch, save_params)
from zoo.config import ModelConfig
from zoo.errors import UserError
from zoo.model import forward
from zoo.params import init_params, param_specs
from zoo.sharding import make_mesh, named_sharding

from pretrain import distributed
from pretrain.config import TrainConfig, to_yaml
from pretrain.data import (LaneBatches, lane_dataset, lane_rows, load_rows, packed_batches, split_rows,
                           to_model_batch, tokenize_rows)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def lr_schedule(cfg: TrainConfig, total_steps: int) -> optax.Schedule:
    """The learning-rate schedule of the config (warmup, then constant/cosine/linear/wsd)."""
    s, peak = cfg.schedule, cfg.optimizer.learning_rate
    floor = peak * s.min_lr_ratio
    decay_steps = max(1, total_steps - s.warmup_steps)
    if s.name == "constant":
        main = optax.constant_schedule(peak)
    elif s.name == "cosine":
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=s.min_lr_ratio)
    elif s.name == "linear":
        main = optax.linear_schedule(peak, floor, decay_steps)
    else:  # wsd: warmup, stable, then decay over the last 20% of steps
        stable = int(0.8 * decay_steps)
        main = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, max(1, decay_steps - stable))], [stable]
        )
    if s.warmup_steps <= 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, s.warmup_steps), main], [s.warmup_steps])


def build_optimizer(cfg: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Global-norm clipping followed by the configured optax optimizer."""
    o = cfg.optimizer
    if o.name == "adamw":
        opt = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    elif o.name == "lion":
        opt = optax.lion(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    elif o.name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(o.weight_decay), optax.sgd(schedule, momentum=o.b1))
    else:
        opt = optax.adafactor(schedule, weight_decay_rate=o.weight_decay or None)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), opt) if o.grad_clip > 0 else opt


def make_step(mcfg: ModelConfig, tx: optax.GradientTransformation, compute: Any, remat: str = "none",
              state_sharding: Any = None, batch_sharding: Any = None):
    """(train step, eval fn): gradient accumulation over the leading micro-batch axis, one optimizer update.

    With ``state_sharding`` and ``batch_sharding`` the step is compiled once for
    exactly those layouts (its outputs keep the state's layout, so the second
    call does not recompile).
    """
    moe = mcfg.num_experts > 0

    def loss_sums(params: dict, mb: dict) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        p = jax.tree.map(lambda x: x.astype(compute), params)
        out = forward(mcfg, p, mb["inputs"], mb["segment_ids"], mb["positions"], return_aux=moe, remat=remat)
        logits, aux = out if moe else (out, None)
        # logsumexp minus the target logit: the same value as -log_softmax[target], without materializing
        # (and differentiating through) a second [batch, seq, vocab] array of log-probabilities.
        target_logit = jnp.take_along_axis(logits, mb["targets"][..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
        s, n = (nll * mb["weights"]).sum(), mb["weights"].sum()
        total = s + (aux["loss"] * n if moe else 0.0)
        return total, (s, n)

    def evaluate(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
        _, (s, n) = loss_sums(params, batch)
        return s, n

    def step(state: dict, batch: dict) -> tuple[dict, dict]:
        grad_fn = jax.value_and_grad(loss_sums, has_aux=True)

        def micro(carry, mb):
            g_acc, l_acc, n_acc = carry
            (_, (s, n)), g = grad_fn(state["params"], mb)
            return (jax.tree.map(jnp.add, g_acc, g), l_acc + s, n_acc + n), None

        if jax.tree.leaves(batch)[0].shape[0] == 1:
            # No accumulation: skip the scan, whose gradient carry costs full-size copies.
            (_, (loss, n)), g = grad_fn(state["params"], jax.tree.map(lambda x: x[0], batch))
        else:
            zeros = jax.tree.map(jnp.zeros_like, state["params"])
            (g, loss, n), _ = jax.lax.scan(micro, (zeros, jnp.zeros(()), jnp.zeros(())), batch)
        n = jnp.maximum(n, 1.0)
        g = jax.tree.map(lambda x: x / n, g)
        updates, opt_state = tx.update(g, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss / n, "grad_norm": optax.tree.norm(g), "target_tokens": n}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    if state_sharding is None:
        return jax.jit(step, donate_argnums=0), jax.jit(evaluate)
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    step_jit = jax.jit(step, donate_argnums=0, in_shardings=(state_sharding, batch_sharding),
                       out_shardings=(state_sharding, replicated))
    return step_jit, jax.jit(evaluate, out_shardings=replicated)


def init_state(tx: optax.GradientTransformation, params: dict, mesh: jax.sharding.Mesh) -> dict:
    """The train state {params, opt_state, step}; optimizer moments take their parameter's sharding."""
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sharding = optax.tree_map_params(
        # Factored (adafactor) and scalar state is small: replicated.
        tx, lambda s, p: p.sharding if s.shape == p.shape else replicated, jax.eval_shape(tx.init, params), params,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state, step = jax.jit(lambda p: (tx.init(p), jnp.zeros((), jnp.int32)),
                              out_shardings=(opt_sharding, replicated))(params)
    return {"params": params, "opt_state": opt_state, "step": step}


KNOWN_PEAK_TFLOPS = {  # dense bf16 per device
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
    "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0,
}


def peak_flops(cfg: TrainConfig) -> float | None:
    """Peak FLOP/s of all devices: from ``peak_tflops``, else detected for known accelerators, else None."""
    devices = jax.devices()
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12 * len(devices)
    kind = devices[0].device_kind
    for name, tflops in KNOWN_PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops * 1e12 * len(devices)
    return None


def flops_per_token(mcfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters active per token) + causal attention scores."""
    specs = param_specs(mcfg)
    active = 0
    for path, spec in specs.items():
        if path == "embed" and not mcfg.tie_word_embeddings:
            continue  # a gather, not a matmul
        n = int(np.prod(spec.shape))
        if "expert_" in path:
            n = n * mcfg.experts_per_token // mcfg.num_experts
        active += n
    attn_width = mcfg.num_heads * (mcfg.head_dim if not mcfg.mla else mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim)
    return 6.0 * active + 6.0 * mcfg.num_layers * attn_width * seq_len  # QK^T and PV, halved for causality


def _model(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> tuple[ModelConfig, dict, Path | None, Path]:
    """(model config, sharded params, source checkpoint or None, tokenizer folder)."""
    pdt = DTYPES[cfg.dtype.params]
    if cfg.model.init == "random":
        from convert.hf_config import model_config_from_hf
        from zoo import registry

        src = Path(cfg.model.config)
        hf = json.loads(src.read_text()) if src.is_file() else registry.get(cfg.model.config).hf_config
        if hf is None:
            raise UserError(f"model.config {cfg.model.config}: no built-in config; give a config.json path")
        mcfg = model_config_from_hf(hf, f"model.config {cfg.model.config}")
        specs = param_specs(mcfg)
        shard = jax.tree.map(lambda s: named_sharding(mesh, s.axes, s.shape), _nest_specs(specs),
                             is_leaf=lambda x: isinstance(x, type(next(iter(specs.values())))))
        # No host inputs: every process builds the same global arrays, each its own shards.
        params = jax.jit(lambda: init_params(mcfg, jax.random.PRNGKey(cfg.seed), pdt), out_shardings=shard)()
        return mcfg, params, None, Path(cfg.model.tokenizer)
    ckpt = _resolve_checkpoint(cfg.model.path)
    tok = Path(cfg.model.tokenizer) if cfg.model.tokenizer else ckpt / TOKENIZER_DIR
    return read_config(ckpt), load_params(ckpt, mesh, pdt), ckpt, tok


def _nest_specs(specs: dict) -> dict:
    from zoo.params import nest

    return nest(specs)


def _resolve_checkpoint(path: str) -> Path:
    p = Path(path).expanduser()
    if (p / "model.json").is_file():
        return p
    raise UserError(f"model {path}: not a zoo checkpoint folder; create it with `zoo convert SOURCE --out {path}`")


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not folder.is_dir() or not any((folder / n).is_file() for n in names):
        raise UserError(f"no tokenizer in {folder}; set model.tokenizer to a tokenizer folder")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (ValueError, OSError) as e:
        raise UserError(f"tokenizer {folder} cannot be loaded ({str(e).splitlines()[0]})") from None


@dataclasses.dataclass
class _Data:
    """This process's view of the run's data."""

    batches: LaneBatches  # this process's rows of every global batch
    rows: list[int]  # the flat global-batch rows (lanes) this process feeds, in its local order
    eval_docs: list[np.ndarray]
    total_steps: int
    skipped: int  # bad rows skipped over the whole run (all processes)


def _owned_rows(sharding: NamedSharding, shape: tuple[int, int, int]) -> tuple[list[int], list[int]]:
    """(flat rows of the [accum, micro, seq] global batch this process holds, rows it is the first holder of)."""
    accum, micro = shape[0], shape[1]
    me = jax.process_index()
    first: dict[int, int] = {}
    mine: set[int] = set()
    for device, index in sharding.devices_indices_map(shape).items():
        for m in range(micro)[index[1]]:
            for a in range(accum)[index[0]]:
                r = a * micro + m
                first[r] = min(first.get(r, device.process_index), device.process_index)
                if device.process_index == me:
                    mine.add(r)
    return sorted(mine), sorted(r for r in mine if first[r] == me)


def _data(cfg: TrainConfig, tokenizer: Any, vocab: int, sharding: NamedSharding, micro: int) -> _Data:
    """Read, tokenize and lane-pack this process's share of the data (and the whole, small, eval set)."""
    d = cfg.data
    ds, field = load_rows(d.path, d.text_field, d.split)
    order, eval_rows = split_rows(len(ds), 0.0 if d.eval_path else d.eval_fraction, cfg.seed)
    if len(order) < cfg.batch_size:
        raise UserError(f"data.path {d.path}: {len(order)} training rows, fewer than batch_size={cfg.batch_size} "
                        "(each row of a batch reads its own share of the documents); add data or lower batch_size")
    mine, counted = _owned_rows(sharding, (cfg.grad_accum, micro, d.seq_len))
    lanes = {r: lane_rows(order, cfg.batch_size, r) for r in mine}
    failed: UserError | None = None
    docs: dict[int, np.ndarray] = {}
    try:
        docs, _ = tokenize_rows(ds, field, tokenizer, d.path, d.skip_bad_rows, [i for r in mine for i in lanes[r]])
    except UserError as e:  # a bad row in this process's share: every process must stop, not just this one
        failed = e
    if distributed.any_process(failed is not None):
        raise failed or UserError(f"{d.path}: another process found a bad row (its error names it)")
    lane_docs = {r: [docs[i] for i in lanes[r] if i in docs] for r in mine}
    empty = distributed.any_process(any(not v for v in lane_docs.values()))
    too_big = distributed.any_process(any(int(x.max()) >= vocab for x in docs.values()))
    if empty:
        raise UserError(f"data.path {d.path}: too few usable rows for batch_size={cfg.batch_size}; add data")
    if too_big:
        raise UserError(f"the tokenizer at {cfg.model.tokenizer or 'the checkpoint'} produces ids beyond the "
                        f"model's vocab_size {vocab}")
    skipped = distributed.total(sum(len(lanes[r]) - len(lane_docs[r]) for r in counted))
    if d.packing:
        tokens = distributed.total(sum(len(x) for r in counted for x in lane_docs[r]))
        per_epoch = tokens // (cfg.batch_size * (d.seq_len + 1))
    else:
        per_epoch = distributed.total(sum(len(lane_docs[r]) for r in counted)) // cfg.batch_size
    total = cfg.max_steps or max(1, per_epoch) * cfg.epochs
    batches = LaneBatches([lane_dataset(lane_docs[r], d.seq_len, cfg.seed * 1_000_003 + r, d.packing) for r in mine])
    eval_docs: list[np.ndarray] = []
    if d.eval_path:
        eds, efield = load_rows(d.eval_path, d.text_field, d.split)
        edocs, ebad = tokenize_rows(eds, efield, tokenizer, d.eval_path, d.skip_bad_rows)
        eval_docs = list(edocs.values())
        skipped += ebad
    elif len(eval_rows):
        edocs, ebad = tokenize_rows(ds, field, tokenizer, d.path, d.skip_bad_rows, list(eval_rows))
        eval_docs = [edocs[i] for i in sorted(edocs)]
        skipped += ebad
    return _Data(batches, mine, eval_docs, total, skipped)


def _global_batch(local: dict[str, np.ndarray], rows: list[int], sharding: NamedSharding,
                  shape: tuple[int, int, int]) -> dict[str, jax.Array]:
    """Global [accum, micro, seq] arrays from this process's rows (no process ever holds the whole batch)."""
    where = {r: i for i, r in enumerate(rows)}
    micro = shape[1]

    def build(x: np.ndarray) -> jax.Array:
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            a_range, m_range = range(shape[0])[index[0]], range(micro)[index[1]]
            picked = x[[where[a * micro + m] for a in a_range for m in m_range]]
            return picked.reshape(len(a_range), len(m_range), -1)[..., index[2]]

        return jax.make_array_from_callback(shape, sharding, shard)

    return {k: build(v) for k, v in local.items()}


def _replicated_batch(b: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global arrays from a batch every process holds whole (the eval set)."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in b.items()}


def _check_same_processes(data_dir: Path) -> None:
    """A checkpoint's data state is per process: resuming needs the process count that wrote it."""
    n = jax.process_count()
    written = sorted(data_dir.glob("process_*-of-*.json"))
    if written and not (data_dir / f"process_{jax.process_index()}-of-{n}.json").is_file():
        theirs = written[0].stem.rsplit("-of-", 1)[1]
        raise UserError(f"checkpoint {data_dir.parent} was written by {theirs} processes; resume it with "
                        f"{theirs} processes (this run has {n}), or use a new output_dir")


def train(cfg: TrainConfig, progress: bool | None = None) -> Path:
    """Run (or resume) training; returns the final zoo checkpoint folder ``output_dir/final``.

    In a multi-process run every process calls this with the same config; the
    processes behave as one run (process 0 writes metrics and the final model).
    """
    import grain
    import orbax.checkpoint as ocp

    devices = jax.devices()
    sizes = dataclasses.asdict(cfg.mesh)
    try:
        mesh = make_mesh(**sizes, devices=devices)
    except ValueError as e:
        raise UserError(f"mesh {sizes}: {e}") from None
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.batch_size // cfg.grad_accum
    if micro % shards:
        raise UserError(f"batch_size/grad_accum = {micro} sequences must divide over data x fsdp = {shards} devices")
    primary = distributed.is_primary()
    mcfg, params, src_ckpt, tok_dir = _model(cfg, mesh)
    tokenizer = _tokenizer(tok_dir)
    batch_shape = (cfg.grad_accum, micro, cfg.data.seq_len)
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    data = _data(cfg, tokenizer, mcfg.vocab_size, batch_sharding, micro)
    total = data.total_steps

    schedule = lr_schedule(cfg, total)
    tx = build_optimizer(cfg, schedule)
    state = init_state(tx, params, mesh)
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    step_fn, eval_fn = make_step(mcfg, tx, DTYPES[cfg.dtype.compute], cfg.remat, state_sharding, batch_sharding)
    peak = peak_flops(cfg)
    step_flops = flops_per_token(mcfg, cfg.data.seq_len) * cfg.batch_size * cfg.data.seq_len

    out = Path(cfg.output_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    manager = ocp.CheckpointManager(
        out / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, save_interval_steps=cfg.checkpoint.every),
    )

    def save(step: int, force: bool = False) -> None:
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data.batches),
            config=ocp.args.JsonSave(dataclasses.asdict(cfg))), force=force)

    start = 0
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    for saved in sorted(manager.all_steps(), reverse=True):
        _check_same_processes(out / "checkpoints" / str(saved) / "data")
        try:
            restored = manager.restore(saved, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(data.batches)))
        except UserError:
            raise
        except Exception as e:  # a damaged checkpoint fails in many ways; fall back to the one before
            print(f"warning: checkpoint {saved} in {out / 'checkpoints'} is unreadable "
                  f"({type(e).__name__}); falling back to the previous one", file=sys.stderr)
            continue
        state, start = restored["state"], saved
        break
    if primary:
        (out / "config.yaml").write_text(to_yaml(cfg))

    metrics_file = board = None
    if primary:
        from tensorboardX import SummaryWriter

        metrics_file = open(out / "metrics.jsonl", "a")
        board = SummaryWriter(str(out / "tensorboard"))
    bar = tqdm(total=total, initial=start, desc="train", unit="step",
               disable=(not primary) or (None if progress is None else not progress))
    seen = start * cfg.batch_size * cfg.data.seq_len
    last = {}
    stop = _StopOnSignal()
    try:
        for step in range(start, total):
            if distributed.any_process(stop.requested is not None):
                if manager.latest_step() != step:  # this step may already be saved
                    save(step, force=True)
                manager.wait_until_finished()
                raise UserError(f"stopped by {stop.requested or 'a signal to another process'} after step {step}; "
                                f"checkpoint saved in {out}, run the same command to resume")
            t0 = time.perf_counter()
            b = _global_batch(to_model_batch(next(data.batches)), data.rows, batch_sharding, batch_shape)
            state, m = step_fn(state, b)
            loss = float(m["loss"])
            if not np.isfinite(loss):
                raise UserError(f"loss became {loss} at step {step + 1}; the last good checkpoint is kept in {out}")
            dt = time.perf_counter() - t0
            seen += cfg.batch_size * cfg.data.seq_len
            last = {"step": step + 1, "loss": loss, "learning_rate": float(schedule(step)),
                    "grad_norm": float(m["grad_norm"]), "tokens_seen": seen,
                    "tokens_per_sec": cfg.batch_size * cfg.data.seq_len / dt, "step_time": dt,
                    "mfu": step_flops / dt / peak if peak else None}
            if data.eval_docs and cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == total):
                last["eval_loss"] = _eval_loss(eval_fn, state["params"], data.eval_docs, cfg, micro, mesh)
            if primary and ((step + 1) % cfg.log_every == 0 or step + 1 == total):
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
                for k, v in last.items():
                    if k != "step" and v is not None:
                        board.add_scalar(f"train/{k}", v, step + 1)
            save(step + 1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{last['tokens_per_sec']:.0f}")
            bar.update()
    finally:
        stop.restore()
        bar.close()
        if primary:
            metrics_file.close()
            board.close()
        manager.wait_until_finished()
    return _write_final(out, cfg, mcfg, state["params"], src_ckpt, tok_dir, last, data.skipped)


def _eval_loss(eval_fn, params: dict, docs: list, cfg: TrainConfig, micro: int, mesh: jax.sharding.Mesh,
               max_batches: int = 50) -> float:
    """Mean per-token loss over (up to ``max_batches``) packed batches of the eval documents."""
    it = packed_batches(docs, cfg.data.seq_len, micro, cfg.seed, 1, cfg.data.packing)
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    total, count = 0.0, 0.0
    for _ in range(max_batches):
        try:
            b = to_model_batch(next(it))
        except StopIteration:
            break
        s, n = eval_fn(params, _replicated_batch(b, sharding))
        total, count = total + float(s), count + float(n)
    if count == 0:
        raise UserError("the eval data is shorter than one batch of seq_len tokens; add data or lower data.seq_len")
    return total / count


class _StopOnSignal:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop at the next step boundary."""

    def __init__(self) -> None:
        import signal
        import threading

        self.requested: str | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        import signal

        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        """Put the previous handlers back."""
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)


def _write_final(out: Path, cfg: TrainConfig, mcfg: ModelConfig, params: dict, src: Path | None, tok_dir: Path,
                 last: dict, skipped: int) -> Path:
    """Write ``out/final`` as a zoo checkpoint, atomically; every process writes its own shards."""
    specs = param_specs(mcfg)
    final = out / "final"
    scratch = out / ".final.incomplete-run"  # one name all processes agree on
    primary = distributed.is_primary()
    if primary:
        remove_stale_scratch(final)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
    distributed.sync("lmzoo-final-scratch")
    try:
        stored = save_params(scratch, params, {k: s.axes for k, s in specs.items()})
        distributed.sync("lmzoo-final-params")
        if primary:
            writer = CheckpointWriter(scratch)
            writer.adopt(stored)
            if tok_dir.is_dir():
                shutil.copytree(tok_dir, scratch / TOKENIZER_DIR)
            if src is not None and (src / HF_CONFIG_FILE).is_file():
                shutil.copyfile(src / HF_CONFIG_FILE, scratch / HF_CONFIG_FILE)
            training = {"method": "pretrain", "data": cfg.data.path, "steps": last.get("step"),
                        "final_metrics": {k: last[k] for k in ("loss", "tokens_seen") if k in last},
                        "skipped_rows": skipped, "processes": jax.process_count(), "devices": len(jax.devices())}
            writer.finish(mcfg, source=str(src or cfg.model.config), source_format="train", training=training)
            if final.exists():
                shutil.rmtree(final)
            scratch.replace(final)
    finally:
        if primary:
            shutil.rmtree(scratch, ignore_errors=True)
    distributed.sync("lmzoo-final-done")
    return final
