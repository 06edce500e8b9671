"""KTO (``dpo.loss_type: kto``) as a task of the shared loop: unpaired thumbs-up/down rows, TRL 1.16's KTOTrainer.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization" (arXiv:2402.01306), Eq. (7),
as ``trl.KTOTrainer._compute_loss`` computes it on one micro-batch:

* ``r = pi(y|x) - ref(y|x)``, the summed log-ratio of each row's completion;
* the KL estimate ``z = clamp(mean over the micro-batch's rows of (pi(y'|x) - ref(y'|x)), min=0)``, detached,
  ``y'`` the mismatched completion of the row (prefs/unpaired.py); one value for the whole micro-batch (TRL
  gathers it over the processes: here the micro-batch spans every device);
* desirable rows ``desirable_weight * (1 - sigmoid(beta (r - z)))``, undesirable rows
  ``undesirable_weight * (1 - sigmoid(beta (z - r)))``, averaged over the micro-batch's rows; the Trainer then
  averages the micro-batches (each micro-batch's rows are its count, so the step's division does).

Metrics under TRL's names, each appended once per micro-batch and averaged as ``KTOTrainer.log`` does
(:class:`pretrain.metrics.MicroMean`, over the micro-batches that have such rows): ``kl``;
``rewards/chosen`` and ``logps/chosen`` (``beta * r`` and ``pi`` summed over the desirable rows, over their
number), ``rewards/rejected``, ``logps/rejected``; ``rewards/margins`` (their difference, in micro-batches with
both kinds); ``logits/chosen``, ``logits/rejected`` (the mean logit over the completion tokens).

The reference is DPO's (``base``, a checkpoint path or ``precomputed``: dpo/reference.py), read for both the
completion and the mismatched completion of a row in the same pass.

Rows with images (a conversational prompt with image parts and an ``images`` column) on a vision-language model
keep them in the prompt (prefs/image_pairs.py: :meth:`prefs.image_pairs.ImagePairs.tokenize_unpaired`); the
mismatched completion is another row's text after this row's prompt and images, and the policy and a live
reference read the batch's patches as DPO's do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from chat.images import image_column
from dpo.config import DPOConfig
from dpo.task import DPOTask, _images
from prefs.batch import KTOBatch
from prefs.pairs import CHOSEN, REJECTED
from prefs.unpaired import check_chunk, kto_columns, kto_documents, unpaired_rows
from pretrain.config import TrainConfig
from pretrain.metrics import LossOutput, Metric, MicroMean, Ratio
from pretrain.task import RowSource, Tokenizer
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.batching import Document
from zoo.data.files import load_dataset_rows
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.logps import batch_logps

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected")


def kto_terms(completion: jax.Array, mismatched: jax.Array, ref_completion: jax.Array, ref_mismatched: jax.Array,
              desirable: jax.Array, keep: jax.Array, beta: float, desirable_weight: float,
              undesirable_weight: float) -> dict[str, jax.Array]:
    """One micro-batch's per-row KTO losses and rewards (module docstring), [rows] each but ``kl`` (a scalar).

    ``completion``/``mismatched``: the policy's summed log-probabilities of each row's completion and of its
    mismatched completion; ``ref_*`` the reference's; ``desirable`` 1.0 or 0.0 per row; ``keep`` 1.0 for the
    rows that count (0: padding rows)."""
    sg = jax.lax.stop_gradient
    n = jnp.maximum(keep.sum(), 1.0)
    kl = jnp.maximum(sg(((mismatched - ref_mismatched) * keep).sum() / n), 0.0)
    ratio = completion - ref_completion
    up = desirable_weight * (1.0 - jax.nn.sigmoid(beta * (ratio - kl)))
    down = undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (kl - ratio)))
    return {"losses": jnp.where(desirable > 0, up, down) * keep, "rewards": beta * sg(ratio), "kl": kl}


class KTOTask(DPOTask[KTOBatch]):
    """KTO on (prompt, completion, label) rows; `dpo train` runs it for ``dpo.loss_type: kto``
    (listed before DPO in dpo/cli.py's tasks: :func:`pretrain.task.task_for`)."""

    method = "kto"
    key_metrics = ("kl", "rewards/margins")
    batch_class = KTOBatch
    unit = "rows"  # unpaired: each row is one completion

    @classmethod
    def handles(cls, cfg: TrainConfig) -> bool:
        """``dpo.loss_type: kto``."""
        return cast(DPOConfig, cfg).dpo.loss_type == "kto"

    def __init__(self, cfg: DPOConfig):
        super().__init__(cfg)
        # TRL rotates the completions within chunks of one device batch; ours is the micro-batch (all devices)
        self.chunk = cfg.batch_size // cfg.grad_accum
        check_chunk(self.chunk)
        self.files: dict[str, Any] = {}  # each data file's rows as read (their columns), by path

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """KTO and the keys it reads (its weights of desirable and undesirable rows)."""
        keys = ("dpo.loss_type", "dpo.beta", "dpo.desirable_weight", "dpo.undesirable_weight", "dpo.reference")
        return MethodCard("KTO (Kahneman-Tversky optimization, on rows labelled desirable or undesirable)", ("kto",),
                          settings(dataclasses.asdict(cfg), keys))

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path`` as unpaired (prompt, completion, label) rows, paired rows unpacked as TRL does."""
        ds, _ = load_dataset_rows(path, cfg.data.split)
        column = image_column(list(ds.column_names))
        self.files[path] = ds  # its columns: whether the rows have images (PairImageRows.image_pairs), by RowSource.path
        return RowSource(unpaired_rows(ds, kto_columns(list(ds.column_names), path), column), "kto", path)

    def row_documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                      indices: list[int] | None = None) -> tuple[dict[int, dict[str, np.ndarray]], int, set[int]]:
        """Each row's completion and its mismatched completion in the pair layout, with its label; rows with
        images on a vision-language model keep them in their prompts (prefs/image_pairs.py)."""
        images = self.image_pairs(RowSource(self.files[rows.path], "kto", rows.path), tokenizer, path)
        return kto_documents(rows.ds, indices, tokenizer, self.chat_template, path, skip_bad, self.max_len,
                             self.drop_long, self.shared_prompt, self.chunk, images)

    def trainable(self, doc: Document, seq_len: int) -> bool:
        """Whether the row, cut to fit, keeps a trained completion token and a mismatched one for the KL."""
        mask, seg = doc["loss_mask"], doc["tokens_segment_ids"]
        return bool((mask & (seg == CHOSEN)).any() and (mask & (seg == REJECTED)).any())

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> KTOBatch:
        """Pair rows with each row's label; a shared prompt's ``prefix_ids``, precomputed ``ref_logps``, a
        vision-language model's images."""
        fields = ("prefix_ids",) * self.shared_prompt + ("ref_logps",) * (self.mode == "precomputed") + ("label",)
        return KTOBatch.layout((grad_accum, micro, seq_len), fields, self.vision_layout())

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: KTOBatch, compute: Any, remat: str,
                  *, frozen_inputs: dict[str, Any] | None = None, totals: dict[str, Any] | None = None,
                  step: jax.Array | None = None) -> LossOutput:
        """A micro-batch's summed KTO losses over its row count; TRL's metrics per micro-batch (module docstring),
        from ``mb``'s rows and each row's ``label``."""
        label = mb.label
        policy = weights.cast(compute)
        arrays = mb.arrays()
        pol, mean_logit, aux = batch_logps(mcfg, policy, arrays, remat, max_segments=3, vision=_images(mcfg, mb))
        ref = self.reference_logps(mcfg, policy.base, mb, frozen_inputs, compute)
        w, seg = mb.weights, mb.segment_ids
        wy, wz = w * (seg == CHOSEN), w * (seg == REJECTED)
        keep = ((wy.sum(-1) > 0) & (wz.sum(-1) > 0)).astype(jnp.float32)
        desirable = (label.max(-1) > 0).astype(jnp.float32)
        y, z = (pol * wy).sum(-1), (pol * wz).sum(-1)
        ref_y, ref_z = (ref * wy).sum(-1), (ref * wz).sum(-1)
        at_reference = self._at_reference(policy.adapters, step)
        if at_reference is not False:  # the policy is the reference: log-ratios exactly 0 (see dpo/task.py)
            sg = jax.lax.stop_gradient
            ref_y = jnp.where(at_reference, sg(y), ref_y)
            ref_z = jnp.where(at_reference, sg(z), ref_z)
        d = self.dpo
        t = kto_terms(y, z, ref_y, ref_z, desirable, keep, d.beta, d.desirable_weight, d.undesirable_weight)
        total, n = t["losses"].sum(), keep.sum()
        extras: dict[str, Metric] = {"kl": MicroMean(t["kl"], jnp.float32(1.0))}
        means = {}
        for side, rows in (("chosen", desirable * keep), ("rejected", (1.0 - desirable) * keep)):
            count = rows.sum()
            has = (count > 0).astype(jnp.float32)
            means[side] = (t["rewards"] * rows).sum() / jnp.maximum(count, 1.0)
            extras[f"rewards/{side}"] = MicroMean(means[side] * has, has)
            extras[f"logps/{side}"] = MicroMean(jax.lax.stop_gradient(y * rows).sum() / jnp.maximum(count, 1.0) * has,
                                                has)
            tokens = wy * rows[:, None]
            ratio = Ratio((mean_logit * tokens).sum(), tokens.sum()).finish(None)
            extras[f"logits/{side}"] = MicroMean(ratio * (tokens.sum() > 0), (tokens.sum() > 0).astype(jnp.float32))
        both = ((desirable * keep).sum() > 0) & (((1.0 - desirable) * keep).sum() > 0)
        extras["rewards/margins"] = MicroMean((means["chosen"] - means["rejected"]) * both, both.astype(jnp.float32))
        objective = total + (aux["loss"] * n if aux is not None else 0.0)
        return LossOutput(objective, jax.lax.stop_gradient(total), n, extras)

