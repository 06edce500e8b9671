"""The one training loop: state init/restore, data, a generator of training steps, and hooks.

A task (pretrain/task.py; pretraining is the simplest) plugs in how rows become
documents and how a micro-batch's loss is computed; the loop never learns
which one it runs. :func:`train` composes the run: the set-up it shares with
``--compile-only`` (pretrain/setup.py: the model, the task's
:meth:`~pretrain.task.Task.adapt_model` and :meth:`~pretrain.task.Task.prepare`),
then what a run alone reads (the task's :meth:`~pretrain.task.Task.read_inputs`,
the run's data: pretrain/data/run.py ``read_run_data``), the jitted step and the
train state (pretrain/setup.py ``build_step``; restored by the checkpointing hook), then
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
import sys
import types
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from pretrain import distributed, preflight, runfolder, runlog, trackers
from pretrain.checkpoints import Checkpoints
from pretrain.config import TrainConfig, to_yaml
from pretrain.data.mixture import describe as describe_mixture
from pretrain.data.run import RunData, data_reads, read_run_data
from pretrain.dtypes import DTYPES
from pretrain.evaluation import Evaluation
from pretrain.final import write_final
from pretrain.flops import flops_per_token, image_flops_per_step, peak_flops
from pretrain.hooks import Hooks, RunModel
from pretrain.jit_step import init_state, make_step, state_layout
from pretrain.optim import build_optimizer, lr_schedule
from pretrain.setup import (
    RUN,
    Arrays,
    Model,
    TokenIds,
    adapter_init,
    layout_of,
    run_mesh,
    set_up_model,
    tokenizer_folder,
    whole_of,
)
from pretrain.steps import Training
from pretrain.task import PretrainTask, ReadContext, RunContext, Task
from zoo.console import is_terminal
from zoo.data.tokenizer import load_tokenizer
from zoo.errors import Interrupted, UserError
from zoo.kernels.choice import check_platform, check_rows, kernel_for
from zoo.lora.weights import LoraRun
from zoo.storage import RunPath, remove_tree, run_path


@dataclasses.dataclass
class _Run:
    """What :func:`train` sets up before the first step: the model the task trains and its frozen inputs on the
    mesh (:mod:`pretrain.setup`, as ``--compile-only`` sets them up), the tokenizer and the data."""

    model: Model
    tok_dir: Path
    tokenizer: Any
    frozen_inputs: Any
    data: RunData
    micro: int


def train(cfg: TrainConfig, progress: bool | None = None, task: Task[Any] | None = None, fresh: bool = False,
          resume_with_changes: Sequence[str] | str = (), hooks: Hooks | None = None) -> RunPath:
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
    out = run_path(cfg.output_dir)
    primary = distributed.is_primary()
    check_platform(cfg.model.attention, cfg.dtype.compute)  # before anything is written
    trackers.check_installed(cfg.report_to)
    task = task or PretrainTask(cfg)
    check_rows(cfg.model.attention, task.batch_layout(1, 1, cfg.data.seq_len).inputs.shape[-1],  # GRPO's are longer
               task.row_segments if task.packing != "none" else 1)  # DPO's shared prefixes: said when traced
    preflight.check_data_files(cfg)  # the config's own faults first, then the files, before the model loads
    done = runfolder.open_run(out, cfg, fresh, runfolder.parse_changes(resume_with_changes, type(cfg)))
    if done is not None:
        return done
    # A fresh run that stops before its first step is taken (a tracker that cannot start; a first step that fails
    # on the user's inputs, as an online task's reward function may) leaves nothing behind: what it wrote into a
    # folder that held nothing before is removed. Set-up may write there already (DPO's cached reference scores).
    held_before = out.exists() and any(out.iterdir())
    run = _set_up(cfg, task, primary)
    tracking = _start_trackers(out, cfg, primary, held_before)  # before the run's own files
    # The schedule counts optimizer updates: an online task may make several per step (its batch reused).
    step = build_step(cfg, task, run.model, run.frozen_inputs, RUN, run.data.total_steps * task.updates_per_step)
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpoints(out, cfg, run.data.batches)
    model = run.model
    step.state, start, restored_from = checkpoints.restore(step.state)
    total = run.data.total_steps
    if start > total:
        raise UserError(f"{out} holds a run at step {start}, past this config's {total} steps (max_steps, epochs); "
                        f"raise max_steps, or start over with --fresh")
    if primary and restored_from is not None:
        print(f"Resuming from step {start} (checkpoint {restored_from})", flush=True)
    if primary:
        (out / runfolder.CONFIG_FILE).write_text(to_yaml(cfg))
    bar_wanted = is_terminal(sys.stdout) if progress is None else progress
    log = runlog.RunLog(out, total, not bar_wanted, list(task.key_metrics) or None,
                        summary_writer() if "tensorboard" in trackers.chosen(cfg.report_to) else trackers.NoBoard,
                        cfg.log_every) if primary else None
    run_hooks = _run_hooks(cfg, task, run, step, out, primary, hooks or Hooks(), log, tracking, checkpoints)
    training = Training(cfg, task, step.train, run.data, step.batch_sharding,
                        (cfg.grad_accum, run.micro, cfg.data.seq_len), model.frozen, model.weights, run.frozen_inputs,
                        step.schedule, step.state,
                        flops_per_token(model.mcfg, cfg.data.seq_len, frozen_base=model.lora is not None)
                        * cfg.batch_size * cfg.data.seq_len
                        + image_flops_per_step(model.mcfg, task.batch_layout(cfg.grad_accum, run.micro,
                                                                             cfg.data.seq_len),
                                               model.lora is not None, cfg.model.freeze), peak_flops(cfg))
    try:
        last = _take_steps(training, run_hooks, checkpoints, start, total, log, primary and bar_wanted, out)
    finally:
        if training.failed_first_step and not held_before and primary:
            remove_tree(out)
    return write_final(out, cfg, model.mcfg, training.state["params"], model.source, run.tok_dir, last,
                       _data_report(cfg, run.data, primary), task.method, model.lora, task.card(cfg))


def _set_up(cfg: TrainConfig, task: Task[Any], primary: bool) -> _Run:
    """The mesh, the model the task trains (QLoRA's quantized base; a reward model's score head) and the task's
    frozen inputs (:mod:`pretrain.setup`, as ``--compile-only`` sets them up), then what a run alone reads: the
    task's inputs from the tokenizer and the data (:meth:`~pretrain.task.Task.read_inputs`) and the run's data,
    each checked before anything is written."""
    devices = jax.devices()
    mesh = run_mesh(cfg, *task.train_devices(devices))
    tok_dir = tokenizer_folder(cfg)
    model = set_up_model(cfg, mesh, RUN)
    kernel_for(model.mcfg, DTYPES[cfg.dtype.compute])  # model.attention: cudnn on a model it cannot run: said now
    tokenizer = load_tokenizer(tok_dir)
    # A task may need inputs of its own beside the trained weights (a reference model), or a pass with the
    # starting weights before training (reference log-probabilities computed once): before any documents.
    model, ctx, frozen_inputs = prepare_task(cfg, task, model, RUN, TokenIds.of(tokenizer))
    task.read_inputs(ReadContext(ctx, tokenizer, data_reads(cfg), frozen_inputs))
    micro = cfg.batch_size // cfg.grad_accum
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    data = read_run_data(cfg, task, tokenizer, model.mcfg.vocab_size, batch_sharding, micro)
    _check_data(cfg, task, data, micro, primary)
    return _Run(model, tok_dir, tokenizer, frozen_inputs, data, micro)


@dataclasses.dataclass
class Step:
    """The train state (the adapters, or the whole model, and the optimizer's state), its jitted train and eval
    steps (:func:`pretrain.jit_step.make_step`), the batch's sharding and the learning-rate schedule."""

    state: dict[str, Any]
    train: Any
    evaluate: Any
    batch_sharding: NamedSharding
    schedule: Any


def prepare_task(cfg: TrainConfig, task: Task[Any], model: Model, arrays: Arrays,
                 ids: TokenIds) -> tuple[Model, RunContext, Any]:
    """(the model the task trains, the task's :class:`~pretrain.task.RunContext`, the step's frozen inputs): the
    task's change to the model
    (:meth:`~pretrain.task.Task.adapt_model`: a reward model's score head) and its set-up
    (:meth:`~pretrain.task.Task.prepare`), the same for a run and ``--compile-only``."""
    mcfg, params = task.adapt_model(model.mcfg, model.params, model.mesh, arrays, ids, cfg.seed)
    model = dataclasses.replace(model, mcfg=mcfg, params=params)
    ctx = RunContext(cfg, mcfg, model.mesh, model.lora, params, arrays, ids, model.source)
    return model, ctx, task.prepare(ctx)


def build_step(cfg: TrainConfig, task: Task[Any], model: Model, frozen_inputs: Any, arrays: Arrays,
               updates: int) -> Step:
    """The optimizer (its schedule over ``updates`` optimizer updates), the train state (fresh adapters with LoRA,
    else the model's params) and the jitted train and eval steps, sharded on the model's mesh."""
    schedule = lr_schedule(cfg, updates)
    tx = build_optimizer(cfg, schedule)
    lora, mesh = model.lora, model.mesh
    trained = arrays.made(adapter_init(model.mcfg, lora, cfg.seed, mesh), whole_of(model.mcfg, model.params)) \
        if lora else model.params
    state = arrays.read(state_layout(tx, layout_of(trained), mesh), lambda: init_state(tx, trained, mesh))
    batch_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    shardings = partial(jax.tree.map, lambda x: x.sharding)
    train, evaluate = make_step(model.mcfg, tx, DTYPES[cfg.dtype.compute], cfg.remat, shardings(state),
                                batch_sharding, task, LoraRun.of(lora, cfg.seed), shardings(model.frozen),
                                frozen_inputs_sharding=shardings(frozen_inputs), freeze=frozenset(cfg.model.freeze))
    return Step(state, train, evaluate, batch_sharding, schedule)


def _run_hooks(cfg: TrainConfig, task: Task[Any], run: _Run, step: Step, out: RunPath, primary: bool, caller: Hooks,
               log: runlog.RunLog | None, tracking: trackers.TrackerHook | None, checkpoints: Checkpoints) -> Hooks:
    """The run's hooks in order: evaluation, the caller's, the task's own, the metrics log and checkpoints; each
    set up with the run's model."""
    hooks = Hooks()
    model = run.model
    hooks.add(Evaluation(cfg, run.data, run.micro, model.mesh,
                         partial(step.evaluate, frozen=model.frozen, frozen_inputs=run.frozen_inputs), task.batch,
                         model.weights, primary, task.eval_metrics, task.finish_rows, task.row_budgets()),
              every=cfg.eval_every)
    hooks.extend(caller)
    for hook in task.hooks(out, primary):
        hooks.add(hook)
    if log:
        hooks.add(log)
    if tracking:
        hooks.add(tracking)  # after the log: its floats
    hooks.add(checkpoints)  # every step: its manager keeps checkpoint.every (and saves on a preemption notice)
    hooks.setup(RunModel(model.mcfg, run.tokenizer, model.lora, model.frozen))
    return hooks


def _start_trackers(out: RunPath, cfg: TrainConfig, primary: bool, held_before: bool) -> trackers.TrackerHook | None:
    """Process 0's trackers, their runs started (or resumed) before the run writes its own files: one that cannot
    start (no server, no credentials) is one line, and a folder that held nothing before holds nothing after (what
    set-up wrote there is removed). Every process learns of it (the others would wait for process 0 at the first
    checkpoint)."""
    hook = trackers.TrackerHook(out, trackers.chosen(cfg.report_to), cfg, cfg.log_every) if primary else None
    failed: UserError | None = None
    try:
        if hook:
            hook.open()
    except UserError as e:
        failed = e
    if distributed.any_process(failed is not None):
        if primary and not held_before:
            remove_tree(out)
        raise failed or UserError("report_to: process 0's trackers could not start (its output says why)")
    return hook


def _take_steps(training: Training, hooks: Hooks, checkpoints: Checkpoints, start: int, total: int,
                log: runlog.RunLog | None, bar_wanted: bool, out: RunPath) -> dict[str, Any]:
    """Steps ``start`` .. ``total``, the hooks after each, a signal stopping the run at a step boundary (its
    checkpoint saved); returns the last step's metrics record (the log's last if no step is left to run)."""
    bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not bar_wanted)
    stop = _StopOnSignal()

    def before(step: int) -> None:
        if stop.reached(step - start):
            checkpoints.save_now(step, training.state)  # this step may already be saved (Orbax's own notice)
            # Not an error (exit 2): a shell's 128 + the signal's number, 130 for Ctrl-C.
            raise Interrupted(f"interrupted by {stop.requested or stop.NOTICE}: checkpoint saved at step {step} in "
                              f"{out}; run the same command to resume", 128 + stop.signum)

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
        preflight.check_eval(data.eval_docs, cfg, micro, data.packing, task.row_budgets())


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
    """SIGTERM/SIGINT ask the loop to checkpoint and stop at a step boundary, the same one on every process.

    One process: Python's handlers note the signal and the loop stops at the next boundary. Several processes:
    the signal reaches one host (a preempted VM), yet every host must save the same step. JAX's preemption
    service (started by ``jax.distributed.initialize``, SIGTERM its notice) catches SIGTERM itself, tells the
    other processes through its coordination service and agrees on a step in the background; :meth:`reached`
    asks it at each boundary (``reached_preemption_sync_point``: 0.1 µs, where an all-gather of a "stop" flag,
    a collective across hosts at every step, measured 6 ms over gloo on CPU). A Python
    SIGTERM handler would replace JAX's, so only SIGINT gets one, which passes Ctrl-C on to JAX as a SIGTERM.
    With JAX's preemption service turned off (``jax_enable_preemption_service``) the processes all-gather the
    flag at every step instead."""

    NOTICE = "a signal to one of the run's processes (a preemption notice)"

    def __init__(self) -> None:
        import signal
        import threading

        self.requested: str | None = None  # the name of a signal this process's handler saw
        self.signum = signal.SIGTERM.value  # its number; a preemption notice's, SIGTERM, until one comes
        # JAX's flags are attributes of jax.config (their documented reading), which its stubs do not list; getattr
        # types the same with and without jax installed (CI's lint environment has none).
        service = bool(getattr(jax.config, "jax_enable_preemption_service", False))
        self.notice = jax.process_count() > 1 and service
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT,) if self.notice else (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        import signal

        self.requested, self.signum = signal.Signals(signum).name, signum
        if self.notice:  # JAX's own SIGTERM handler, installed in C, tells every process
            signal.raise_signal(signal.SIGTERM)

    def reached(self, taken: int) -> bool:
        """Whether the run stops at this boundary, ``taken`` steps after this run (or rerun) started; every process
        gets the same answer at the same step."""
        if self.notice:
            from jax.experimental import multihost_utils

            # JAX's service counts from its own start: a notice that comes before the first boundary is agreed for
            # id 1. Counting the run's global step instead, a resumed run (first id its checkpoint's step) would
            # pass that id and never stop; every process resumes at the same step, so this count agrees too.
            return bool(multihost_utils.reached_preemption_sync_point(taken))
        return distributed.any_process(self.requested is not None)

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
