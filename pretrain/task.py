"""What a training run trains for: a task turns dataset rows into token documents and computes loss sums.

The loop (pretrain/trainer.py) never learns which task it runs. :class:`Task`
is the seam: two required methods (rows -> documents, (params, batch) -> loss
sums) and optional hooks with no-op defaults. Pretraining is the simplest task:
every token of a text document is a target. A task also names its config
schema (``config_class``: :class:`pretrain.config.TrainConfig` or a subclass
with its own section and data keys), so the config system composes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax

from pretrain.config import TrainConfig
from pretrain.data import tokenize_rows
from pretrain.metrics import LossOutput
from pretrain.preflight import keeps_a_target
from zoo.batching import Document
from zoo.config import ModelConfig
from zoo.datafiles import load_rows
from zoo.loss import next_token_nll_sum
from zoo.model import forward, stored_head
from zoo.quant import cast_params


@dataclass
class RowSource:
    """A dataset's rows and the column(s) a task reads from them."""

    ds: Any
    field: str

    def __len__(self) -> int:
        return len(self.ds)


class Task:
    """The seams of the shared loop; subclasses implement :meth:`load`, :meth:`documents` and :meth:`loss_sums`.

    The optional hooks have no-op defaults, so the loop calls them on every task:

    * :meth:`prepare`, called once after the model loads, returns the task's
      *frozen inputs* (a reference model's params, say): the train and eval
      steps pass them to :meth:`loss_sums` as the keyword ``frozen_inputs``,
      never differentiated;
    * :meth:`batch_totals` gives counts over the whole global batch, passed to
      each micro-batch's :meth:`loss_sums` as ``totals``;
    * :meth:`trainable` says whether a document (cut to a row) trains anything;
    * ``too_long`` collects the row indices the task cut or dropped to fit its
      own rows (reported like ``data.long_examples``);
    * ``reads_step``: the train step passes its optimizer step as ``step``;
    * ``key_metrics``: the task's metrics a plain log line shows beside the loss;
    * ``group_size``: how many consecutive rows of a batch read the same document (1: each its own);
    * an *online* task (``online``) makes each step's batch itself: :meth:`rollout` turns the global batch of
      data rows (documents padded to ``data.seq_len + 1``, every feature) into the model batch the step
      trains on, ``updates_per_step`` times, and :meth:`step_metrics` reports what it measured.
    """

    method: ClassVar[str] = "pretrain"  # recorded in the final checkpoint's training provenance
    packing: ClassVar[str] = "concat"  # how documents become rows with data.packing on: "concat" or "best_fit"
    config_class: ClassVar[type[TrainConfig]] = TrainConfig  # the config schema the task reads
    reads_step: ClassVar[bool] = False
    key_metrics: ClassVar[tuple[str, ...]] = ()
    online: ClassVar[bool] = False

    def __init__(self, cfg: TrainConfig | None = None):
        self.too_long: set[int] = set()
        self.group_size = 1
        self.updates_per_step = 1

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of a local file/folder or Hub dataset."""
        raise NotImplementedError

    def documents(self, rows: RowSource, tokenizer: Any, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> tuple[dict[int, Document], int]:
        """(documents by row index, number of bad rows skipped) for the rows at ``indices`` (default all)."""
        raise NotImplementedError

    def loss_sums(self, mcfg: ModelConfig, params: dict, mb: dict, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None,
                  **forward_kwargs: Any) -> LossOutput:
        """One micro-batch's :class:`LossOutput`: the objective to differentiate, the loss sum and its count,
        and the task's metrics, each declaring its reduction (:mod:`pretrain.metrics`).

        ``forward_kwargs`` (LoRA adapters, scale, dropout rate and key) go to
        the model's forward pass. The metrics are combined over micro-batches
        and logged finished (eval: with an ``eval_`` prefix).
        """
        raise NotImplementedError

    def prepare(self, cfg: TrainConfig, mcfg: ModelConfig, params: dict, mesh: jax.sharding.Mesh,
                tokenizer: Any) -> Any:
        """Set up before training (``params``: the starting weights, the base with LoRA); returns the frozen
        inputs the step passes to :meth:`loss_sums`, or None (the default: nothing)."""
        return None

    def batch_totals(self, batch: dict) -> Any:
        """Counts over the whole global batch (any leading axes) that one micro-batch cannot see; None by default."""
        return None

    def trainable(self, doc: Document, seq_len: int) -> bool:
        """Whether ``doc``, cut to a row of ``seq_len + 1`` tokens, trains anything (default: keeps a target)."""
        return keeps_a_target(doc, seq_len)

    def rollout(self, params: Any, frozen: Any, frozen_inputs: Any, rows: dict[str, jax.Array],
                step: int) -> dict[str, jax.Array]:
        """An online task's model batch for loop step ``step`` (0-based) from the global data rows ``rows``
        ([accum, micro, seq_len + 1] each), made with the current weights (``params``, the trained ones; the
        frozen base with LoRA). Only called when ``online``."""
        raise NotImplementedError

    def step_metrics(self, step_time: float) -> dict[str, float]:
        """What the task measured in the step just taken (``step_time`` seconds in all), logged with its
        metrics; none by default."""
        return {}


def next_token_loss_sums(mcfg: ModelConfig, params: dict, mb: dict, compute: Any, remat: str,
                         **forward_kwargs: Any) -> LossOutput:
    """Weighted next-token cross-entropy sums (plus MoE router losses) of a micro-batch.

    Sums, not means: the step divides by the target count of the whole global
    batch, so splitting it over devices or accumulation steps changes nothing.
    """
    moe = mcfg.num_experts > 0
    p = cast_params(params, compute)
    out = forward(mcfg, p, mb["inputs"], mb["segment_ids"], mb["positions"], return_aux=moe, remat=remat,
                  return_hidden=True, **forward_kwargs)
    hidden, aux = out if moe else (out, None)
    # Fused head + loss in chunks (zoo.loss): the [batch, seq, vocab] logits are never stored. With LoRA
    # adapters the head is frozen, so its gradient is not even computed.
    head, vocab_major = stored_head(mcfg, p)
    s = next_token_nll_sum(hidden, head, mb["targets"], mb["weights"], mcfg.final_softcap,
                           head_grad=forward_kwargs.get("lora") is None, vocab_major=vocab_major)
    n = mb["weights"].sum()
    total = s + (aux["loss"] * n if moe else 0.0)
    return LossOutput(total, s, n)


class PretrainTask(Task):
    """Continued pretraining: plain text, every token a target."""

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path`` and its text column (``data.text_field``)."""
        ds, field = load_rows(path, cfg.data.text_field, cfg.data.split)
        return RowSource(ds, field)

    def documents(self, rows: RowSource, tokenizer: Any, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> tuple[dict[int, Document], int]:
        """Token ids (+ EOS) of each text row."""
        return tokenize_rows(rows.ds, rows.field, tokenizer, path, skip_bad, indices)

    def loss_sums(self, mcfg: ModelConfig, params: dict, mb: dict, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None,
                  **forward_kwargs: Any) -> LossOutput:
        """Next-token cross-entropy over every target."""
        return next_token_loss_sums(mcfg, params, mb, compute, remat, **forward_kwargs)
