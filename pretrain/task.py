"""What a training run trains for: a task turns dataset rows into token documents and computes loss sums.

The loop (pretrain/trainer.py) never learns which task it runs. Pretraining is
the simplest task: every token of a text document is a target. SFT (loss masks)
and DPO (pair losses) plug in the same two seams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from zoo.config import ModelConfig
from zoo.loss import next_token_nll_sum
from zoo.model import forward, stored_head

from pretrain.config import TrainConfig
from pretrain.data import load_rows, tokenize_rows

# A document: int32 token ids, or {"tokens": ids, "loss_mask": bool per token} when only some are targets.
Document = np.ndarray | dict[str, np.ndarray]


@dataclass
class RowSource:
    """A dataset's rows and the column(s) a task reads from them."""

    ds: Any
    field: str

    def __len__(self) -> int:
        return len(self.ds)


class Task(Protocol):
    """The two seams of the shared loop (rows -> documents, (params, batch) -> loss sums).

    Optional extras a task may have (DPO uses them; pretraining and SFT do not):

    * ``prepare(cfg, mcfg, params, mesh, tokenizer)``, called once after the model
      loads (``params``: the starting weights, the base with LoRA), returns
      params the step passes to ``loss_sums`` as the keyword ``reference``
      (never differentiated), or None;
    * ``loss_sums`` returning ``(objective, (loss sum, count, {name: sum}))``:
      the named sums are accumulated like the loss and logged divided by the
      count (eval: with an ``eval_`` prefix); a ``(sum, count)`` pair in place of
      a sum is logged as its own ratio (e.g. a mean over tokens, not pairs);
    * ``batch_totals(batch)``: counts over the whole global batch (any leading
      axes; every micro-batch and device), passed to each micro-batch's
      ``loss_sums`` as the keyword ``totals`` (DPO: the chosen-answer tokens
      its RPO term's token mean divides by);
    * ``too_long``: the row indices the task cut or dropped to fit its own rows
      (reported like ``data.long_examples``).
    """

    method: str  # recorded in the final checkpoint's training provenance
    packing: str  # how documents become rows when data.packing is on: "concat" or "best_fit" (pretrain.data)

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of a local file/folder or Hub dataset."""
        ...

    def documents(self, rows: RowSource, tokenizer: Any, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> tuple[dict[int, Document], int]:
        """(documents by row index, number of bad rows skipped) for the rows at ``indices`` (default all)."""
        ...

    def loss_sums(self, mcfg: ModelConfig, params: dict, mb: dict, compute: Any, remat: str,
                  **forward_kwargs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """(objective to differentiate, (loss sum, target count)) of one micro-batch; ``forward_kwargs``
        (LoRA adapters, scale, dropout rate and key) go to the model's forward pass."""
        ...


def next_token_loss_sums(mcfg: ModelConfig, params: dict, mb: dict, compute: Any, remat: str,
                         **forward_kwargs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Weighted next-token cross-entropy sums (plus MoE router losses) of a micro-batch.

    Sums, not means: the step divides by the target count of the whole global
    batch, so splitting it over devices or accumulation steps changes nothing.
    """
    moe = mcfg.num_experts > 0
    p = jax.tree.map(lambda x: x.astype(compute), params)
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
    return total, (s, n)


class PretrainTask:
    """Continued pretraining: plain text, every token a target."""

    method = "pretrain"
    packing = "concat"  # documents may be cut across rows: no padding at all

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path`` and its text column (``data.text_field``)."""
        ds, field = load_rows(path, cfg.data.text_field, cfg.data.split)
        return RowSource(ds, field)

    def documents(self, rows: RowSource, tokenizer: Any, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> tuple[dict[int, Document], int]:
        """Token ids (+ EOS) of each text row."""
        return tokenize_rows(rows.ds, rows.field, tokenizer, path, skip_bad, indices)

    def loss_sums(self, mcfg: ModelConfig, params: dict, mb: dict, compute: Any, remat: str,
                  **forward_kwargs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Next-token cross-entropy over every target."""
        return next_token_loss_sums(mcfg, params, mb, compute, remat, **forward_kwargs)
