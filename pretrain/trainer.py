"""The one training loop: config -> mesh -> data -> jitted, sharded train step -> checkpoints -> metrics.

A task (pretrain/task.py; pretraining is the simplest) plugs in how rows become
documents and how a micro-batch's loss sums are computed; the loop never
learns which one it runs. The loss is normalized by the number of target
tokens in the whole global batch, so ``grad_accum`` and how the batch is
split across devices change nothing. Set-up, the step, the cross-process data
plumbing and the final checkpoint live in files of their own.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from pretrain import distributed, preflight, runfolder, runlog
from pretrain.config import TrainConfig, to_yaml
from pretrain.data import packed_batches
from pretrain.dtypes import DTYPES
from pretrain.eval_tasks import TrainingEval
from pretrain.final import write_final
from pretrain.flops import flops_per_token, peak_flops
from pretrain.lanes import check_same_processes, global_batch, run_data
from pretrain.metrics import LossOutput
from pretrain.optim import build_optimizer, lr_schedule
from pretrain.setup import init_adapters, load_model, lora_settings, quantize_frozen_base
from pretrain.sources import describe as describe_mixture
from pretrain.step import init_state, make_step
from pretrain.task import PretrainTask, Task
from zoo.batching import replicated_batch, to_model_batch
from zoo.console import is_terminal
from zoo.errors import UserError
from zoo.lora import lora_scale
from zoo.sharding import make_mesh
from zoo.tokenizer import load_tokenizer


def train(cfg: TrainConfig, progress: bool | None = None, task: Task | None = None, fresh: bool = False,
          resume_with_changes: Sequence[str] | str = ()) -> Path:
    """Run (or resume) training of ``task`` (default: pretraining); returns ``output_dir/final``.

    In a multi-process run every process calls this with the same config; the
    processes behave as one run (process 0 writes metrics and the final model).
    ``progress``: a bar (True) or one plain line every ``log_every`` steps
    (False); None picks the bar on a terminal. A rerun in a folder that holds a
    run continues it, if its config changes only what ``runfolder.MAY_CHANGE``
    allows or ``resume_with_changes`` names; ``fresh`` moves an old run aside
    and starts over.
    """
    import grain
    import orbax.checkpoint as ocp

    out = Path(cfg.output_dir).absolute()
    primary = distributed.is_primary()
    allowed = runfolder.parse_changes(resume_with_changes, type(cfg))
    if fresh:
        moved = runfolder.move_aside(out) if primary else None
        distributed.sync("lmzoo-fresh")
        if moved:
            print(f"--fresh: moved the old run in {out} to {moved}", file=sys.stderr)
    else:
        changes = runfolder.config_changes(out, cfg, allowed)
        done = runfolder.finished_run(out, cfg)
        if done is not None:
            if primary:
                steps = runfolder.checkpoint_steps(out)[-1]
                print(f"{out}: the run is complete (step {steps} of {steps}; final model {done}); nothing to train "
                      f"(raise max_steps to train on, or pass --fresh to start over)")
            return done
        if changes and primary:
            print("continuing with changes: " + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes),
                  file=sys.stderr)
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
    task = task or PretrainTask(cfg)
    mcfg, params, src_ckpt, tok_dir = load_model(cfg, mesh)
    params = quantize_frozen_base(cfg, mcfg, params, mesh, src_ckpt)  # QLoRA; unchanged without lora.base_quant
    tokenizer = load_tokenizer(tok_dir)
    # A task may need inputs of its own beside the trained weights (a reference model), or a pass with the
    # starting weights before training (reference log-probabilities computed once).
    frozen_inputs = task.prepare(cfg, mcfg, params, mesh, tokenizer)
    batch_shape = (cfg.grad_accum, micro, cfg.data.seq_len)
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    data = run_data(cfg, task, tokenizer, mcfg.vocab_size, batch_sharding, micro)
    if primary and data.too_long:
        what = "left out" if cfg.data.long_examples == "drop" else "truncated"
        print(f"{data.too_long} training examples are longer than data.seq_len + 1 = {cfg.data.seq_len + 1} tokens: "
              f"{what} (data.long_examples)", file=sys.stderr)
    total = data.total_steps
    # Before anything is written: a run that cannot train is an error, not 0-loss steps and a `final` model.
    if not task.online:  # an online task's rows are prompts: it makes what trains itself
        preflight.check_first_batch(data.batches, cfg)
    if data.eval_docs and cfg.eval_every:
        preflight.check_eval(data.eval_docs, cfg, micro, data.packing)
    # A mixture's eval loss per source too (`eval_loss/NAME`), for each source eval set that fills a batch.
    eval_sets = {}
    for name, docs in (data.eval_sets if len(data.eval_sets) > 1 and cfg.eval_every else {}).items():
        if preflight.fills_batch(docs, cfg, micro, data.packing):
            eval_sets[name] = docs
        elif primary:
            print(f"warning: the eval set of source {name} ({len(docs)} examples) cannot fill one eval batch of "
                  f"{micro} rows: it counts in eval_loss, but gets no eval_loss/{name} of its own", file=sys.stderr)

    # The schedule counts optimizer updates: an online task may make several per step (its batch reused).
    updates = task.updates_per_step
    schedule = lr_schedule(cfg, total * updates)
    tx = build_optimizer(cfg, schedule)
    lora_cfg = lora_settings(cfg, src_ckpt)
    # With LoRA only the adapters are trained (state["params"]); the base is a frozen, undifferentiated input.
    frozen = params if lora_cfg else None
    trainable = init_adapters(mcfg, lora_cfg, cfg.seed, mesh) if lora_cfg else params
    state = init_state(tx, trainable, mesh)
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    step_fn, eval_fn = make_step(mcfg, tx, DTYPES[cfg.dtype.compute], cfg.remat, state_sharding, batch_sharding,
                                 task, lora_scale(lora_cfg) if lora_cfg else None,
                                 jax.tree.map(lambda x: x.sharding, frozen),
                                 lora_dropout=lora_cfg.dropout if lora_cfg else 0.0, seed=cfg.seed,
                                 frozen_inputs_sharding=jax.tree.map(lambda x: x.sharding, frozen_inputs))
    scored = TrainingEval(cfg, mcfg, tokenizer, lora_cfg)
    peak = peak_flops(cfg)
    step_flops = flops_per_token(mcfg, cfg.data.seq_len) * cfg.batch_size * cfg.data.seq_len

    # A fresh run whose first step fails on the user's inputs (an online task's reward function, say) leaves
    # nothing behind: what it wrote into a folder that held nothing before is removed.
    held_before = out.exists() and any(out.iterdir())
    out.mkdir(parents=True, exist_ok=True)
    manager = ocp.CheckpointManager(
        out / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, save_interval_steps=cfg.checkpoint.every),
    )

    def save(step: int, force: bool = False) -> None:
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data.batches),
            config=ocp.args.JsonSave(dataclasses.asdict(cfg))), force=force)

    start, restored_from = 0, None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    for saved in sorted(manager.all_steps(), reverse=True):
        check_same_processes(out / "checkpoints" / str(saved) / "data")
        try:
            restored = manager.restore(saved, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(data.batches)))
        except UserError:
            raise
        except Exception as e:  # a damaged checkpoint fails in many ways; fall back to the one before
            print(f"warning: checkpoint {saved} in {out / 'checkpoints'} is unreadable "
                  f"({type(e).__name__}); falling back to the previous one", file=sys.stderr)
            continue
        state, start, restored_from = restored["state"], saved, out / "checkpoints" / str(saved)
        break
    if start > total:
        raise UserError(f"{out} holds a run at step {start}, past this config's {total} steps (max_steps, epochs); "
                        f"raise max_steps, or start over with --fresh")
    if primary and restored_from is not None:
        print(f"Resuming from step {start} (checkpoint {restored_from})", flush=True)
    if primary:
        (out / runfolder.CONFIG_FILE).write_text(to_yaml(cfg))

    bar_wanted = is_terminal(sys.stdout) if progress is None else progress
    log = runlog.RunLog(out, start, total, not bar_wanted, list(task.key_metrics) or None,
                        summary_writer()) if primary else None
    bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not (primary and bar_wanted))
    seen = start * cfg.batch_size * cfg.data.seq_len
    last = dict(log.last) if log else {}  # what `final` records if no step is left to run (killed before it)
    stop = _StopOnSignal()
    discard = False
    try:
        for step in range(start, total):
            if distributed.any_process(stop.requested is not None):
                if manager.latest_step() != step:  # this step may already be saved
                    save(step, force=True)
                manager.wait_until_finished()
                raise UserError(f"stopped by {stop.requested or 'a signal to another process'} after step {step}; "
                                f"checkpoint saved in {out}, run the same command to resume")
            t0 = time.perf_counter()
            try:
                if task.online:  # the task makes the batch (GRPO: samples completions and scores them)
                    rows = global_batch(next(data.batches), data.rows, batch_sharding, batch_shape)
                    b = task.rollout(state["params"], frozen, frozen_inputs, rows, step)
                else:
                    b = global_batch(to_model_batch(next(data.batches)), data.rows, batch_sharding, batch_shape)
                m = None
                for _ in range(updates):
                    state, one = step_fn(state, b, frozen, frozen_inputs=frozen_inputs)
                    m = one if m is None else jax.tree.map(jnp.add, m, one)
            except UserError:
                discard = step == 0 and not held_before and primary
                raise
            if updates > 1:  # each update's metrics, averaged
                m = jax.tree.map(lambda x: x / updates, m)
            loss = float(m["loss"])
            if not np.isfinite(loss):
                raise UserError(f"loss became {loss} at step {step + 1}; the last good checkpoint is kept in {out}")
            dt = time.perf_counter() - t0
            seen += cfg.batch_size * cfg.data.seq_len
            last = {"step": step + 1, "loss": loss, "learning_rate": float(schedule(step * updates)),
                    "grad_norm": float(m["grad_norm"]), "tokens_seen": seen,
                    "tokens_per_sec": cfg.batch_size * cfg.data.seq_len / dt, "step_time": dt,
                    "mfu": step_flops / dt / peak if peak else None, "padding_fraction": float(m["padding"]),
                    **{k: float(v) for k, v in m["task"].items()}, **task.step_metrics(dt)}
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == total):
                if data.eval_docs:
                    score = partial(eval_fn, frozen=frozen, frozen_inputs=frozen_inputs)
                    last.update(_eval_loss(score, state["params"], data.eval_docs, cfg, micro, mesh, data.packing))
                    for name, docs in eval_sets.items():
                        one = _eval_loss(score, state["params"], docs, cfg, micro, mesh, data.packing)
                        last[f"eval_loss/{name}"] = one["eval_loss"]
                if scored:
                    last.update(scored(state["params"], frozen))
            if primary and ((step + 1) % cfg.log_every == 0 or step + 1 == total):
                log.record(last)
            # The last step is always checkpointed: a rerun of the finished run then has nothing to redo.
            save(step + 1, force=step + 1 == total)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{last['tokens_per_sec']:.0f}", pad=f"{last['padding_fraction']:.2f}")
            bar.update()
    finally:
        stop.restore()
        bar.close()
        if primary:
            log.close()
        manager.wait_until_finished()
        if discard:
            shutil.rmtree(out, ignore_errors=True)
    data_report = {"skipped_rows": data.skipped, "packing": data.packing,
                   f"{'dropped' if cfg.data.long_examples == 'drop' else 'truncated'}_long_examples": data.too_long}
    mixture = data.mixture_report()  # every process: it sums their counts
    if mixture:
        data_report["mixture"] = mixture
        if primary:
            print(describe_mixture(mixture), file=sys.stderr)
    return write_final(out, cfg, mcfg, state["params"], src_ckpt, tok_dir, last, data_report, task.method, lora_cfg)


def _eval_loss(eval_fn, params: dict, docs: list, cfg: TrainConfig, micro: int, mesh: jax.sharding.Mesh, packing: str,
               max_batches: int = 50) -> dict[str, float]:
    """{eval_loss: mean per-target loss, eval_<name>: the task's other metrics} over (up to ``max_batches``)
    packed batches of the eval documents."""
    it = packed_batches(docs, cfg.data.seq_len, micro, cfg.seed, 1, packing)
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    total: LossOutput | None = None
    for _ in range(max_batches):
        try:
            b = to_model_batch(next(it))
        except StopIteration:
            break
        one = jax.tree.map(float, eval_fn(params, replicated_batch(b, sharding)))
        total = one if total is None else total.combine(one)
    if total is None or total.count == 0:
        raise UserError("the eval data is shorter than one batch of seq_len tokens; add data or lower data.seq_len")
    return {"eval_loss": total.loss / total.count, **{f"eval_{k}": float(v) for k, v in total.means().items()}}


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


def summary_writer() -> type:
    """tensorboardX's SummaryWriter class, imported without importing torch.

    tensorboardX imports torch whenever it is installed, only to recognise
    torch tensors, which this loop never logs: 0.25 GB of RSS in every
    training process of an environment that has torch (a benchmark's, a test
    run's). While it imports, ``torch`` is marked absent.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter
