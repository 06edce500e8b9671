"""The one training loop: state init/restore, data, a generator of training steps, and hooks.

A task (pretrain/task.py; pretraining is the simplest) plugs in how rows become
documents and how a micro-batch's loss is computed; the loop never learns
which one it runs. :func:`train` composes the run: the model and the task's
:meth:`~pretrain.task.Task.prepare` (one :class:`~pretrain.task.RunContext`),
the run's data (pretrain/data/run.py ``read_run_data``), the jitted step
(pretrain/jit_step.py), the train state (restored by the checkpointing hook), then
the steps (pretrain/steps.py, each a :class:`~pretrain.hooks.StepInfo`)
and after each the hooks (:class:`~pretrain.hooks.Hooks`, each added with its
period), in order: evaluation, the caller's (``train(hooks=...)``: the
training commands' scored ``eval.tasks``), the task's own (GRPO's completions
log), metrics (pretrain/runlog.py) and checkpoints. Each hook owns its files
and trims them to the step a resumed run starts from. The loss is
normalized by the number of target tokens in the whole global batch, so
``grad_accum`` and how the batch is split across devices change nothing.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import types
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from pretrain import distributed, preflight, runfolder, runlog
from pretrain.checkpoints import Checkpoints
from pretrain.config import TrainConfig, to_yaml
from pretrain.data.mixture import describe as describe_mixture
from pretrain.data.run import RunData, data_reads, read_run_data
from pretrain.dtypes import DTYPES
from pretrain.evaluation import Evaluation
from pretrain.final import write_final
from pretrain.flops import flops_per_token, peak_flops
from pretrain.hooks import Hooks, RunModel
from pretrain.jit_step import init_state, make_step
from pretrain.optim import build_optimizer, lr_schedule
from pretrain.setup import init_adapters, load_model, lora_settings, quantize_frozen_base
from pretrain.steps import Training
from pretrain.task import PretrainTask, RunContext, Task
from zoo.console import is_terminal
from zoo.data.tokenizer import load_tokenizer
from zoo.errors import UserError
from zoo.kernels.choice import check_platform, check_rows, kernel_for
from zoo.lora.adapters import LoraConfig, lora_scale
from zoo.model.config import ModelConfig
from zoo.model.sharding import make_mesh


@dataclasses.dataclass
class _Run:
    """What :func:`train` sets up before the first step: the model and the task's frozen inputs on the mesh, the
    data, the optimizer's schedule, the jitted step and the train state."""

    mesh: jax.sharding.Mesh
    micro: int
    mcfg: ModelConfig
    params: dict[str, Any]
    src_ckpt: Path | None
    tok_dir: Path
    tokenizer: Any
    lora_cfg: LoraConfig | None
    frozen_inputs: Any
    batch_sharding: NamedSharding
    data: RunData
    schedule: Any = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    step_fn: Any = None
    eval_fn: Any = None

    @property
    def frozen(self) -> dict[str, Any] | None:
        """With LoRA only the adapters are trained (``state["params"]``); the base is a frozen, undifferentiated
        input of the step."""
        return self.params if self.lora_cfg else None


def train(cfg: TrainConfig, progress: bool | None = None, task: Task[Any] | None = None, fresh: bool = False,
          resume_with_changes: Sequence[str] | str = (), hooks: Hooks | None = None) -> Path:
    """Run (or resume) training of ``task`` (default: pretraining); returns ``output_dir/final``.

    In a multi-process run every process calls this with the same config; the
    processes behave as one run (process 0 writes metrics and the final model).
    ``progress``: a bar (True) or one plain line every ``log_every`` steps
    (False); None picks the bar on a terminal. A rerun in a folder that holds a
    run continues it, if its config changes only what ``runfolder.MAY_CHANGE``
    allows or ``resume_with_changes`` names; ``fresh`` moves an old run aside
    and starts over. ``hooks``: the caller's step hooks (:meth:`pretrain.hooks.Hooks.add`), run after the
    evaluation and before the task's own, the metrics log and the checkpoints (what they add to a step's record is
    logged and saved).
    """
    out = Path(cfg.output_dir).absolute()
    primary = distributed.is_primary()
    check_platform(cfg.model.attention, cfg.dtype.compute)  # before anything is written
    task = task or PretrainTask(cfg)
    check_rows(cfg.model.attention, task.batch_layout(1, 1, cfg.data.seq_len).inputs.shape[-1],  # GRPO's are longer
               task.row_segments if task.packing != "none" else 1)  # DPO's shared prefixes: said when traced
    done = runfolder.open_run(out, cfg, fresh, runfolder.parse_changes(resume_with_changes, type(cfg)))
    if done is not None:
        return done
    run = _set_up(cfg, task, primary)
    _build_step(cfg, task, run)
    # A fresh run whose first step fails on the user's inputs (an online task's reward function, say) leaves
    # nothing behind: what it wrote into a folder that held nothing before is removed.
    held_before = out.exists() and any(out.iterdir())
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpoints(out, cfg, run.data.batches)
    run.state, start, restored_from = checkpoints.restore(run.state)
    total = run.data.total_steps
    if start > total:
        raise UserError(f"{out} holds a run at step {start}, past this config's {total} steps (max_steps, epochs); "
                        f"raise max_steps, or start over with --fresh")
    if primary and restored_from is not None:
        print(f"Resuming from step {start} (checkpoint {restored_from})", flush=True)
    if primary:
        (out / runfolder.CONFIG_FILE).write_text(to_yaml(cfg))
    bar_wanted = is_terminal(sys.stdout) if progress is None else progress
    log = runlog.RunLog(out, total, not bar_wanted, list(task.key_metrics) or None, summary_writer(),
                        cfg.log_every) if primary else None
    run_hooks = _run_hooks(cfg, task, run, out, primary, hooks or Hooks(), log, checkpoints)
    training = Training(cfg, task, run.step_fn, run.data, run.batch_sharding,
                        (cfg.grad_accum, run.micro, cfg.data.seq_len), run.frozen, run.frozen_inputs, run.schedule,
                        run.state, flops_per_token(run.mcfg, cfg.data.seq_len, frozen_base=run.lora_cfg is not None)
                        * cfg.batch_size * cfg.data.seq_len, peak_flops(cfg))
    try:
        last = _take_steps(training, run_hooks, checkpoints, start, total, log, primary and bar_wanted, out)
    finally:
        if training.failed_first_step and not held_before and primary:
            shutil.rmtree(out, ignore_errors=True)
    return write_final(out, cfg, run.mcfg, training.state["params"], run.src_ckpt, run.tok_dir, last,
                       _data_report(cfg, run.data, primary), task.method, run.lora_cfg, task.card(cfg))


def _set_up(cfg: TrainConfig, task: Task[Any], primary: bool) -> _Run:
    """The mesh, the model the task trains (QLoRA's quantized base; a reward model's score head), the task's
    frozen inputs and the run's data, each checked before anything is written."""
    mesh = _mesh(cfg)
    micro = cfg.batch_size // cfg.grad_accum
    mcfg, params, src_ckpt, tok_dir = load_model(cfg, mesh)
    mcfg = dataclasses.replace(mcfg, attention=cfg.model.attention)  # a run's choice, never saved (zoo.kernels.choice)
    kernel_for(mcfg, DTYPES[cfg.dtype.compute])  # model.attention: cudnn on a model it cannot run: said now
    params = quantize_frozen_base(cfg, mcfg, params, mesh, src_ckpt)  # QLoRA; unchanged without lora.base_quant
    tokenizer = load_tokenizer(tok_dir)
    mcfg, params = task.adapt_model(mcfg, params, mesh, tokenizer, cfg.seed)  # a reward model: its score head
    lora_cfg = lora_settings(cfg, src_ckpt)
    # A task may need inputs of its own beside the trained weights (a reference model), or a pass with the
    # starting weights before training (reference log-probabilities computed once): before any documents.
    frozen_inputs = task.prepare(RunContext(cfg, mcfg, mesh, tokenizer, lora_cfg, params, data_reads(cfg), src_ckpt))
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    data = read_run_data(cfg, task, tokenizer, mcfg.vocab_size, batch_sharding, micro)
    _check_data(cfg, task, data, micro, primary)
    return _Run(mesh, micro, mcfg, params, src_ckpt, tok_dir, tokenizer, lora_cfg, frozen_inputs, batch_sharding,
                data)


def _build_step(cfg: TrainConfig, task: Task[Any], run: _Run) -> None:
    """The optimizer's schedule, the train state (adapters or the whole model) and the jitted train and eval
    steps, set on ``run``."""
    # The schedule counts optimizer updates: an online task may make several per step (its batch reused).
    run.schedule = lr_schedule(cfg, run.data.total_steps * task.updates_per_step)
    tx = build_optimizer(cfg, run.schedule)
    lora_cfg = run.lora_cfg
    trained = init_adapters(run.mcfg, lora_cfg, cfg.seed, run.mesh, run.params) if lora_cfg else run.params
    run.state = init_state(tx, trained, run.mesh)
    run.step_fn, run.eval_fn = make_step(
        run.mcfg, tx, DTYPES[cfg.dtype.compute], cfg.remat, jax.tree.map(lambda x: x.sharding, run.state),
        run.batch_sharding, task, lora_scale(lora_cfg) if lora_cfg else None,
        jax.tree.map(lambda x: x.sharding, run.frozen), lora_dropout=lora_cfg.dropout if lora_cfg else 0.0,
        seed=cfg.seed, frozen_inputs_sharding=jax.tree.map(lambda x: x.sharding, run.frozen_inputs))


def _run_hooks(cfg: TrainConfig, task: Task[Any], run: _Run, out: Path, primary: bool, caller: Hooks,
               log: runlog.RunLog | None, checkpoints: Checkpoints) -> Hooks:
    """The run's hooks in order: evaluation, the caller's, the task's own, the metrics log and checkpoints; each
    set up with the run's model."""
    hooks = Hooks()
    hooks.add(Evaluation(cfg, run.data, run.micro, run.mesh,
                         partial(run.eval_fn, frozen=run.frozen, frozen_inputs=run.frozen_inputs), task.batch,
                         run.frozen, primary, task.eval_metrics), every=cfg.eval_every)
    hooks.extend(caller)
    for hook in task.hooks(out, primary):
        hooks.add(hook)
    if log:
        hooks.add(log)
    hooks.add(checkpoints)  # every step: its manager keeps checkpoint.every (and saves on a preemption notice)
    hooks.setup(RunModel(run.mcfg, run.tokenizer, run.lora_cfg, run.frozen))
    return hooks


def _take_steps(training: Training, hooks: Hooks, checkpoints: Checkpoints, start: int, total: int,
                log: runlog.RunLog | None, bar_wanted: bool, out: Path) -> dict[str, Any]:
    """Steps ``start`` .. ``total``, the hooks after each, a signal stopping the run at a step boundary (its
    checkpoint saved); returns the last step's metrics record (the log's last if no step is left to run)."""
    bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not bar_wanted)
    stop = _StopOnSignal()

    def before(step: int) -> None:
        if distributed.any_process(stop.requested is not None):
            checkpoints.save_now(step, training.state)  # this step may already be saved
            raise UserError(f"stopped by {stop.requested or 'a signal to another process'} after step {step}; "
                            f"checkpoint saved in {out}, run the same command to resume")

    try:
        hooks.start(start)
        last = dict(log.last) if log else {}  # what `final` records if no step is left to run (killed before it)
        for info in training.steps(start, total, before):
            hooks.on_step(info)
            last = info.record
            bar.set_postfix(loss=f"{info.loss:.4f}", tok_s=f"{last['tokens_per_sec']:.0f}",
                            pad=f"{last['padding_fraction']:.2f}")
            bar.update()
    finally:
        stop.restore()
        bar.close()
        hooks.close()
    return last


def _mesh(cfg: TrainConfig) -> jax.sharding.Mesh:
    """The run's device mesh (``cfg.mesh``), checked against the batch it splits."""
    sizes = dataclasses.asdict(cfg.mesh)
    try:
        mesh = make_mesh(**sizes, devices=jax.devices())
    except ValueError as e:
        raise UserError(f"mesh {sizes}: {e}") from None
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.batch_size // cfg.grad_accum
    if micro % shards:
        raise UserError(f"batch_size/grad_accum = {micro} sequences must divide over data x fsdp = {shards} devices")
    return mesh


def _check_data(cfg: TrainConfig, task: Task[Any], data: RunData, micro: int, primary: bool) -> None:
    """Report what was cut; before anything is written, a run that cannot train is an error, not 0-loss steps
    and a `final` model."""
    if primary and data.too_long:
        what = "left out" if cfg.data.long_examples == "drop" else "truncated"
        print(f"{data.too_long} training examples are longer than data.seq_len + 1 = {cfg.data.seq_len + 1} tokens: "
              f"{what} (data.long_examples)", file=sys.stderr)
    if not task.online:  # an online task's rows are prompts: it makes what trains itself
        preflight.check_first_batch(data.batches, cfg)
    if data.eval_docs and cfg.eval_every and not task.online:  # an online task's held-out rows are prompts too
        preflight.check_eval(data.eval_docs, cfg, micro, data.packing)


def _data_report(cfg: TrainConfig, data: RunData, primary: bool) -> dict[str, Any]:
    """What the run's data was, for ``final``'s training record (every process: a mixture's counts are summed)."""
    cut = f"{'dropped' if cfg.data.long_examples == 'drop' else 'truncated'}_long_examples"
    report: dict[str, Any] = {"skipped_rows": data.skipped, "packing": data.packing, cut: data.too_long}
    mixture = data.mixture_report()
    if mixture:
        report["mixture"] = mixture
        if primary:
            print(describe_mixture(mixture), file=sys.stderr)
    return report


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

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
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

        writer: type = SummaryWriter  # tensorboardX ships no types
        return writer
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    writer = SummaryWriter
    return writer
