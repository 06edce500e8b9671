"""What a training run trains for: the seam between the loop (pretrain/loop.py) and a task.

The loop never learns which task it runs. :class:`Task` is the seam, called in
one fixed order: :meth:`Task.load` (rows of a data path) and
:meth:`Task.prepare` (once, with the :class:`RunContext`, after the model
loads and before any documents are made; it returns the step's frozen
inputs; ``--compile-only`` runs the same on abstract params) and
:meth:`Task.read_inputs` (a run's alone: the tokenizer and the data), then :meth:`Task.documents` (rows -> token documents, a
:class:`Documents`), then each step :meth:`Task.loss_sums` ((params, batch) ->
a :class:`pretrain.metrics.LossOutput` whose metrics declare their own
reduction), and for an online task :meth:`Task.rollout` (data rows -> the
:class:`Rollout` the step trains on) first. Pretraining is the simplest task:
every token of a text document is a target. A task also names its config
schema (``config_class``: :class:`pretrain.config.TrainConfig` or a subclass
with its own section and data keys), so the config system composes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeAlias, cast

import jax
from jax.typing import DTypeLike

from pretrain.batch import B, Rollout, TokenBatch
from pretrain.config import TrainConfig
from pretrain.data.pipeline import tokenize_rows
from pretrain.hooks import Hook
from pretrain.metrics import LossOutput
from pretrain.preflight import keeps_a_target
from pretrain.setup import Arrays, TokenIds
from zoo.checkpoints.method_card import MethodCard
from zoo.data.batching import Document
from zoo.data.files import load_rows
from zoo.errors import UserError
from zoo.lora.params import LoraConfig
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward, stored_head
from zoo.model.loss import next_token_nll_sum
from zoo.storage import RunPath

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    Tokenizer: TypeAlias = PreTrainedTokenizerBase
else:
    Tokenizer = Any

# A task's frozen inputs (what :meth:`Task.prepare` returns for the step: a reference model's params, say), or None.
FrozenInputs: TypeAlias = dict[str, Any] | None
# Counts over a whole global batch (:meth:`Task.batch_totals`) by name, or None.
Totals: TypeAlias = dict[str, jax.Array] | None


@dataclass
class RowSource:
    """A dataset's rows, the column(s) a task reads from them, and the path they were read from."""

    ds: Any  # a datasets.Dataset (or anything indexable by row with column_names)
    field: str
    path: str = ""

    def __len__(self) -> int:
        return len(self.ds)


@dataclass
class Documents:
    """What :meth:`Task.documents` made of some rows: documents by row index, the bad rows it skipped, and the
    row indices it cut or dropped to fit its own rows (reported like ``data.long_examples``)."""

    docs: Mapping[int, Document]
    bad: int = 0
    too_long: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class DataRead:
    """One data file a run reads: its path, the config it is read with (a mixture source's own data keys) and
    whether it is training data (else eval data)."""

    path: str
    cfg: TrainConfig
    training: bool


@dataclass
class RunContext:
    """What :meth:`Task.prepare` may read of the run, under training and ``--compile-only`` alike: its config,
    the model's, the mesh, the LoRA settings (None: full fine-tuning), the starting params (the frozen base with
    LoRA), how arrays are got (``arrays``: made and read for a run, their layouts alone for ``--compile-only``,
    whose params are ``jax.ShapeDtypeStruct`` s), the tokenizer's ids and the checkpoint the params came from
    (None: model.init random)."""

    cfg: TrainConfig
    mcfg: ModelConfig
    mesh: jax.sharding.Mesh
    lora: LoraConfig | None
    params: dict[str, Any]
    arrays: Arrays
    ids: TokenIds
    source: Path | None = None


@dataclass
class ReadContext:
    """What :meth:`Task.read_inputs` may read, a run's alone: the :class:`RunContext` (its params real arrays),
    the tokenizer, the data files the run reads (:func:`pretrain.data.run.data_reads`) and the frozen inputs
    :meth:`Task.prepare` returned."""

    run: RunContext
    tokenizer: Tokenizer
    reads: list[DataRead]
    frozen_inputs: Any = None


class Task(Generic[B]):
    """The seam of the shared loop; subclasses implement :meth:`load`, :meth:`documents` and :meth:`loss_sums`.
    Generic in its model batch class ``B`` (:attr:`batch_class`): ``class GRPOTask(Task[RolloutBatch])``, whose
    :meth:`loss_sums` reads a ``RolloutBatch`` and whose :meth:`rollout` makes a ``Rollout[RolloutBatch]``.

    The loop calls, in this order: :meth:`load` for each data path, :meth:`adapt_model` and :meth:`prepare`
    once (after the model loads; ``--compile-only`` calls these two on abstract params), :meth:`read_inputs`,
    :meth:`documents` for the rows it reads, then the step (:meth:`batch_totals`, :meth:`loss_sums`;
    :meth:`rollout` first for an online task). A task keeps what ``prepare`` set up for ``documents`` and the
    step; the loop never sets a task's attributes. The optional methods have no-op defaults:

    * :meth:`prepare` returns the task's *frozen inputs* (a reference model's params, say): the train and eval
      steps pass them to :meth:`loss_sums` as the keyword ``frozen_inputs``, never differentiated;
    * :meth:`batch_totals` gives counts over the whole global batch, passed to each micro-batch's
      :meth:`loss_sums` as ``totals``;
    * :meth:`trainable` says whether a document (cut to a row) trains anything;
    * :meth:`hooks` gives the task's own step hooks (a log file of its own, say);
    * ``reads_step``: the train step passes its optimizer step as ``step``;
    * ``key_metrics``: the task's metrics a plain log line shows beside the loss;
    * ``group_size``: how many consecutive rows of a batch read the same document (1: each its own);
    * an *online* task (``online``) makes each step's batch itself: :meth:`rollout` turns the global batch of
      data rows (documents padded to ``data.seq_len + 1``, every feature) into the :class:`Rollout` the step
      trains on, ``updates_per_step`` times; one that ``draws_rows`` takes its rows itself, ahead of the steps
      (:meth:`start_steps`; GRPO's asynchronous rollouts), and is given none.
    """

    method: ClassVar[str] = "pretrain"  # recorded in the final checkpoint's training provenance
    packing: ClassVar[str] = "concat"  # how documents become rows with data.packing on: "concat" or "best_fit"
    config_class: ClassVar[type[TrainConfig]] = TrainConfig  # the config schema the task reads
    reads_step: ClassVar[bool] = False
    key_metrics: ClassVar[tuple[str, ...]] = ()
    online: ClassVar[bool] = False
    # The model batch the step reads: ``B`` itself (a class variable cannot name a type variable, so it is
    # declared as any batch class; each task sets its own).
    batch_class: ClassVar[type[TokenBatch]] = TokenBatch

    def __init__(self, cfg: TrainConfig | None = None):
        self.group_size = 1
        self.updates_per_step = 1
        # The most documents a packed batch row holds (None: no bound, or rows the task lays out itself), for
        # kernels that take documents rather than segment ids (zoo.kernels.choice.cudnn_attention): one without
        # packing, data.max_segments with best-fit packing.
        self.row_segments: int | None = None
        if cfg is not None and self.packing != "none":
            d = cfg.data
            if d.max_segments is not None and self.packing != "best_fit":
                raise UserError(f"data.max_segments: {self.method} concatenates documents into rows with no bound "
                                "on their number; remove it (it bounds best-fit packing, as sft train's)")
            self.row_segments = 1 if not d.packing else d.max_segments if self.packing == "best_fit" else None

    @classmethod
    def handles(cls, cfg: TrainConfig) -> bool:
        """Whether this task runs ``cfg`` (:func:`task_for`): True by default; a variant of a task (KTO of DPO's)
        says which configs are its own, and its command lists it before the task it varies."""
        return True

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """What the model card of ``cfg``'s run says of its method: its name, Hub tags and the task's own key
        hyperparameters (the final checkpoint records it, pretrain/final.py, with every run's settings).
        Pretraining's: next-token prediction, no keys of its own."""
        init = ", from a random initialization" if cfg.model.init == "random" else ""
        return MethodCard(f"pretraining (next-token prediction){init}", ("pretraining",))

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of a local file/folder or Hub dataset."""
        raise NotImplementedError

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """The :class:`Documents` of the rows at ``indices`` (default all)."""
        raise NotImplementedError

    def finish_rows(self, rows: dict[str, Any]) -> dict[str, Any]:
        """This process's packed data rows (numpy, [rows, seq_len + 1] each) as the model batch is made from them:
        unchanged by default; SFT with images replaces its rows' document tags by their images (chat/image_documents.py)."""
        return rows

    def row_budgets(self) -> dict[str, int]:
        """The document features that are not per token, each with how many entries a packed row holds of it (after
        :meth:`documents`): none by default; SFT with images, its documents' patches (chat/image_documents.py)."""
        return {}

    def batch(self, arrays: dict[str, jax.Array]) -> B:
        """The typed model batch of a model-batch dict (zoo.data.batching.to_model_batch's)."""
        return cast(B, self.batch_class.of(arrays))  # batch_class is B (see there)

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> TokenBatch:
        """The step's global batch ([grad_accum, micro, seq_len] rows) as ``jax.ShapeDtypeStruct`` s, so the step
        can be lowered and compiled without data (call after :meth:`prepare` where that decides the layout)."""
        return self.batch_class.layout((grad_accum, micro, seq_len))

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: B, compute: DTypeLike, remat: str, *,
                  frozen_inputs: FrozenInputs = None, totals: Totals = None, step: jax.Array | None = None) -> LossOutput:
        """One micro-batch's :class:`LossOutput` (``mb``: a :attr:`batch_class`): the objective to differentiate,
        the loss sum and its count, and the task's metrics, each declaring its reduction (:mod:`pretrain.metrics`).

        ``weights`` (:class:`zoo.lora.weights.Weights`: the base, LoRA's
        adapters, their scale and dropout) go to the model's forward pass; only
        the trained ones (:attr:`Weights.trained`) are differentiated. The
        metrics are combined over micro-batches and logged finished (eval:
        with an ``eval_`` prefix).
        """
        raise NotImplementedError

    def adapt_model(self, mcfg: ModelConfig, params: dict[str, Any], mesh: jax.sharding.Mesh, arrays: Arrays, ids: TokenIds,
                    seed: int) -> tuple[ModelConfig, dict[str, Any]]:
        """The model the task trains, from the one loaded (``params`` sharded on ``mesh``; under ``--compile-only``
        their layouts, so arrays are got through ``arrays``): unchanged by default; a reward model (rm/) swaps the
        LM head for its score head. Called before :meth:`prepare`."""
        return mcfg, params

    def eval_metrics(self, weights: Weights, docs: list[Document], source: RowSource | None,
                     step: int) -> dict[str, float] | None:
        """The task's own metrics of the held-out documents ``docs`` every ``eval_every`` steps (``weights``: the
        current ones, no dropout; ``source``: the training rows), or None (the default): the eval loss instead.
        GRPO's are the held-out prompts' rewards (grpo/held_out.py)."""
        return None

    def prepare(self, ctx: RunContext) -> Any:
        """Set up the step (``ctx.params``: the starting weights, the base with LoRA), for a run and for
        ``--compile-only`` alike, so written once: arrays come through ``ctx.arrays``, and nothing reads the
        tokenizer or the data (that is :meth:`read_inputs`'). Returns the frozen inputs the step passes to
        :meth:`loss_sums`, or None (the default: nothing)."""
        return None

    def read_inputs(self, ctx: ReadContext) -> None:
        """A run's set-up beyond the step's (after :meth:`prepare`, before any documents are made): what needs the
        tokenizer, the data or the weights' values (a reference's log-probabilities over the dataset, reward
        models). ``--compile-only`` never calls it. Nothing by default."""

    def compile_programs(self, weights: Weights, frozen_inputs: Any) -> dict[str, Any]:
        """For ``--compile-only``, after :meth:`prepare`: the task's other device programs (an online task's
        sampler, say), lowered from the abstract weights (no dropout) and frozen inputs, by name; {} by default."""
        return {}

    def program_kv_cache(self) -> dict[str, int]:
        """For ``--compile-only``, after :meth:`compile_programs`: bytes a chip holds of each program's KV cache
        (a sampler's), by program name; {} by default."""
        return {}

    def batch_totals(self, batch: Any) -> Any:
        """Counts over the whole global batch (any leading axes) that one micro-batch cannot see; None by default."""
        return None

    def trainable(self, doc: Document, seq_len: int) -> bool:
        """Whether ``doc``, cut to a row of ``seq_len + 1`` tokens, trains anything (default: keeps a target)."""
        return keeps_a_target(doc, seq_len)

    def rollout(self, weights: Weights, frozen_inputs: FrozenInputs, rows: dict[str, jax.Array] | None, step: int,
                source: RowSource) -> Rollout[B]:
        """An online task's :class:`Rollout` for loop step ``step`` (0-based) from the global data rows ``rows``
        ([accum, micro, seq_len + 1] each; ``source``: the rows they were read from), made with the current
        ``weights`` (no dropout). Only called when ``online``."""
        raise NotImplementedError

    def train_devices(self, devices: list[Any]) -> tuple[list[Any], str]:
        """The devices the run's mesh trains on, of ``devices`` (every process's), and how mesh errors name them:
        all of them by default (GRPO's asynchronous rollouts keep some for sampling)."""
        return devices, "devices"

    @property
    def draws_rows(self) -> bool:
        """Whether an online task takes its data rows itself (with :meth:`start_steps`' ``next_rows``), so
        :meth:`rollout` is given none."""
        return False

    def start_steps(self, start: int, total: int, next_rows: Callable[[], dict[str, jax.Array]],
                    source: RowSource) -> None:
        """Before an online task's first step: the steps ``start`` .. ``total`` - 1 come, ``next_rows()`` is the
        next global batch of data rows (as :meth:`rollout` is given them), read from ``source``. Nothing by
        default."""

    def end_steps(self) -> None:
        """After an online task's last step, or once the steps stop on an error: what :meth:`start_steps` started
        ends. Nothing by default."""

    def hooks(self, out: RunPath, primary: bool) -> list[Hook]:
        """The task's own step hooks (:class:`pretrain.hooks.Hook`) for the run folder ``out``; none by default."""
        return []


def next_token_loss_sums(mcfg: ModelConfig, weights: Weights, mb: TokenBatch, compute: DTypeLike, remat: str,
                         max_segments: int | None = None) -> LossOutput:
    """Weighted next-token cross-entropy sums (plus MoE router losses) of a micro-batch.

    Sums, not means: the step divides by the target count of the whole global
    batch, so splitting it over devices or accumulation steps changes nothing.
    """
    moe = mcfg.num_experts > 0
    w = weights.cast(compute)
    vision = None if mb.vision is None or mcfg.vision is None else mb.vision.inputs(mcfg.vision)
    out = forward(mcfg, w, mb.inputs, mb.segment_ids, mb.positions, return_aux=moe, remat=remat,
                  return_hidden=True, max_segments=max_segments, vision=vision)
    hidden, aux = cast(tuple[jax.Array, dict[str, Any]], out) if moe else (cast(jax.Array, out), None)
    # Fused head + loss in chunks (zoo.model.loss): the [batch, seq, vocab] logits are never stored. With LoRA
    # adapters the head is frozen, so its gradient is not even computed.
    head, vocab_major = stored_head(mcfg, w.base)
    s = next_token_nll_sum(hidden, head, mb.targets, mb.weights, mcfg.final_softcap,
                           head_grad=w.adapters is None, vocab_major=vocab_major)
    n = mb.weights.sum()
    total = s + (aux["loss"] * n if aux is not None else 0.0)
    return LossOutput(total, s, n)


def task_for(cfg: TrainConfig, classes: Sequence[type[Task[Any]]]) -> Task[Any]:
    """The task that runs ``cfg``: made from the first of ``classes`` (the ones a command can run, each variant
    before the task it varies: ``dpo train``'s KTO before DPO) whose :meth:`Task.handles` is true."""
    for cls in classes:
        if cls.handles(cfg):
            return cls(cfg)
    raise TypeError(f"none of {[c.__name__ for c in classes]} runs this config")  # a command's list: a bug


class PretrainTask(Task[TokenBatch]):
    """Continued pretraining: plain text, every token a target."""

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path`` and its text column (``data.text_field``)."""
        ds, field = load_rows(path, cfg.data.text_field, cfg.data.split)
        return RowSource(ds, field, path)

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """Token ids (+ EOS) of each text row."""
        return Documents(*tokenize_rows(rows.ds, rows.field, tokenizer, path, skip_bad, indices))

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: TokenBatch, compute: DTypeLike, remat: str, *,
                  frozen_inputs: FrozenInputs = None, totals: Totals = None, step: jax.Array | None = None) -> LossOutput:
        """Next-token cross-entropy over every target."""
        return next_token_loss_sums(mcfg, weights, mb, compute, remat, max_segments=self.row_segments)
