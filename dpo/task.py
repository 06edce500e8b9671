"""Preference optimization (DPO and its variants) as a task of the shared training loop.

A batch row is one pair (prefs/pairs.py): its prompt once, then the chosen
answer as segment 1 and the rejected one as segment 2, both reading the
prompt as a shared prefix, in one forward pass. The loss sums of a
micro-batch are the per-pair losses (dpo/losses.py) summed over its pairs,
with the pair count as the count, so the step's division gives the mean over
the pairs of the whole global batch, whatever ``grad_accum`` and the mesh.
``dpo.sft_weight``'s NLL term is one token mean over every chosen answer token
of the global batch (TRL's ``"sft"`` term): each micro-batch adds its NLL sum
scaled by the global pairs / chosen tokens (:meth:`DPOTask.batch_totals`,
which the step computes on the whole batch), so the same division yields it.
The reference (dpo/reference.py) is the frozen base run without adapters,
a checkpoint passed in as the step's ``frozen_inputs`` argument, or per-token
log-probabilities cached before training and read from the batch.

Where the policy is still the reference (the reference is the starting model,
and the policy has not moved from it: LoRA adapters that add nothing, or full
fine-tuning's step 1), the log-ratios are the policy's own log-probabilities
minus themselves, so the rewards are exactly 0. The reference's separately
computed log-probabilities would differ in the last bits: XLA compiles the
differentiated policy pass and the plain reference pass differently (other
fusions, e.g. another ``exp`` kernel in the attention softmax), whatever the code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from chat.config import chat_template_of
from chat.image_documents import text_document
from dpo.config import DPOConfig
from dpo.losses import preference_loss, rpo_nll_scale
from dpo.reference import cached_reference_logps, compute_reference_logps, load_reference, resolve_checkpoint
from prefs.batch import PairBatch
from prefs.image_rows import PairImageRows
from prefs.pairs import CHOSEN, PROMPT, REJECTED, load_pair_rows, pair_documents, shared_prompt_layout
from pretrain.config import TrainConfig
from pretrain.dtypes import DTYPES
from pretrain.metrics import LossOutput, Mean, Metric, MicroMean, Ratio
from pretrain.preflight import check_untrainable, untrainable
from pretrain.task import Documents, ReadContext, RowSource, RunContext, Task, Tokenizer
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.batching import Document
from zoo.data.files import indexed_rows
from zoo.errors import UserError
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.logps import batch_logps
from zoo.model.params import flatten
from zoo.model.quant import cast_params
from zoo.model.vision import VisionInputs
from zoo.storage import run_path

# The metrics each step logs (TRL's names), besides `loss`: means over the global batch's pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected")


# What each dpo.loss_type is, as a model card names it (dpo/losses.py; kto: dpo/kto.py's KTOTask).
LOSS_NAMES = {
    "sigmoid": "DPO, sigmoid loss", "ipo": "IPO", "hinge": "DPO, hinge loss (SLiC)", "robust": "robust DPO",
    "simpo": "SimPO (reference-free)", "orpo": "ORPO (odds-ratio preference optimization, reference-free)",
    "cpo": "CPO (contrastive preference optimization, reference-free)",
}


# The task's batch class: DPO's PairBatch, or a variant's subclass of it (KTO's KTOBatch: dpo/kto.py).
P = TypeVar("P", bound=PairBatch)


class DPOTask(PairImageRows, Task[P]):
    """Direct preference optimization and its variants on (prompt, chosen, rejected) rows; generic in its batch
    class ``P`` for its variants (``DPOTask[PairBatch]`` is DPO's, ``KTOTask`` a ``DPOTask[KTOBatch]``)."""

    method = "dpo"
    packing = "none"  # each pair is one row, its two sequences laid out by the task (prefs/pairs.py)
    config_class = DPOConfig
    reads_step = True  # the train step passes its optimizer step to loss_sums (pretrain/jit_step.py)
    key_metrics = ("rewards/accuracies", "rewards/margins")  # what a plain log line shows besides the loss
    batch_class: ClassVar[type[PairBatch]] = PairBatch  # declared: KTOTask narrows it to KTOBatch
    unit = "pairs"  # what one example of its data is, as messages count them

    def __init__(self, cfg: DPOConfig):
        if cfg.dpo.loss_type == "kto" and type(self) is DPOTask:  # a caller's bug: the command picks KTOTask
            raise ValueError("dpo.loss_type kto is dpo.kto.KTOTask's (`dpo train` picks it: pretrain.task.task_for)")
        super().__init__(cfg)
        self.cfg, self.dpo = cfg, cfg.dpo
        self.chat_template = chat_template_of(cfg)
        self.max_len = cfg.data.seq_len + 1
        self.drop_long = cfg.data.long_examples == "drop"
        self.mode = cfg.dpo.reference_mode  # none, base, precomputed or path
        self.ref_logps: dict[str, dict[int, np.ndarray]] = {}
        # One copy of each pair's prompt, shared by its answers (prefs/pairs.py), unless dpo.share_prompt is off;
        # prepare() turns it off for models with sliding-window layers.
        self.shared_prompt = cfg.dpo.share_prompt
        # Whether the reference is the policy's starting model (prepare() finds out): then the policy is
        # the reference until it moves (see loss_sums).
        self.reference_is_start = False
        # A vision-language model's tower (prepare), and the images of rows that have them (prefs/image_pairs.py).
        self.init_images()  # (prefs/image_rows.py)

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """The loss named (tagged too, unless DPO's own sigmoid) and the keys it reads."""
        loss = cast(DPOConfig, cfg).dpo.loss_type
        keys = ("dpo.loss_type", "dpo.beta", "dpo.label_smoothing", *(("dpo.simpo_gamma",) if loss == "simpo" else ()),
                *(("dpo.cpo_alpha",) if loss == "cpo" else ()), "dpo.sft_weight", "dpo.reference")
        return MethodCard(f"{LOSS_NAMES.get(loss, loss)}: preference optimization (`dpo.loss_type: {loss}`)",
                          ("dpo", *((loss,) if loss != "sigmoid" else ())),
                          settings(dataclasses.asdict(cfg), keys, ("dpo.label_smoothing", "dpo.sft_weight")))

    # ---- rows -> documents ------------------------------------------------------------------------------

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path``; they need ``chosen`` and ``rejected`` columns (``prompt`` is optional)."""
        return load_pair_rows(path, cfg, "preference rows need 'chosen' and 'rejected' fields (and optionally "
                                         "'prompt')")

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """One row document per usable pair (with its cached reference log-probabilities when precomputed).

        Reads what :meth:`prepare` set up (the layout, the cached log-probabilities), as the loop's order
        (:class:`pretrain.task.Task`) has it; before ``prepare`` it lays pairs out as ``dpo.share_prompt`` says
        and cannot attach precomputed log-probabilities."""
        docs, bad, too_long = self.row_documents(rows, tokenizer, path, skip_bad, indices)
        if self.mode == "precomputed":
            cached = self.ref_logps[path]
            for i, d in docs.items():
                d["ref_logps"] = cached[i]
        return Documents(docs, bad, too_long)

    def row_documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                      indices: list[int] | None = None) -> tuple[dict[int, dict[str, np.ndarray]], int, set[int]]:
        """(pair documents by row index, bad rows skipped, rows too long) of the rows at ``indices`` (default all),
        laid out as :meth:`prepare` decided: what :meth:`documents` returns and the precomputed reference scores.
        Rows with images (an ``images`` column) on a vision-language model keep them (prefs/image_pairs.py)."""
        images = self.image_pairs(rows, tokenizer, path)
        docs, bad, too_long = pair_documents(indexed_rows(rows.ds, indices), tokenizer, self.chat_template, path,
                                             skip_bad, self.max_len, self.drop_long, self.shared_prompt, images)
        if images is None and self.vision is not None:  # they may mix with pairs that have images (a mixture)
            docs = {i: text_document(x, packed=False) for i, x in docs.items()}
        return docs, bad, too_long

    def rows_keyed_by_index(self) -> bool:
        """KTO's unpaired rows tag their images by row index alone (one file); DPO's pairs by their file's range."""
        return self.dpo.loss_type == "kto"

    # ---- the reference ----------------------------------------------------------------------------------

    def prepare(self, ctx: RunContext) -> dict[str, Any] | None:
        """Set up the reference and the pair layout before any documents are made (for ``--compile-only`` too:
        on layouts); returns the reference params the step needs (``dpo.reference`` a path, read like the
        policy), else None (``precomputed`` scores come in the batch, ``base`` is LoRA's frozen base).

        ``ctx.params`` are the starting weights (LoRA: the frozen base).
        """
        from pretrain.setup import param_layout

        cfg, mcfg, mesh = ctx.cfg, ctx.mcfg, ctx.mesh
        self.vision = mcfg.vision
        self.shared_prompt = shared_prompt_layout(self.dpo.share_prompt, mcfg)
        if self.mode == "base" and ctx.lora is None:
            raise UserError("full fine-tuning (lora.rank: 0) needs a reference model besides the trained one: set "
                            "dpo.reference to a zoo checkpoint path (e.g. the model you start from) or to "
                            "precomputed; dpo.reference: base is the LoRA base with its adapters off")
        # Whether the reference is the policy's starting model: the base is where LoRA starts; precomputed scores
        # are the params' own unless dpo.reference_model names another; a path's weights are compared once read.
        self.reference_is_start = self.mode == "base" or (self.mode == "precomputed" and not self.dpo.reference_model)
        if self.mode != "path":
            return None
        dtype = DTYPES[cfg.dtype.params]
        return ctx.arrays.read(param_layout(mcfg, mesh, dtype),
                               lambda: load_reference(str(self.dpo.reference), mcfg, mesh, dtype))

    def read_inputs(self, ctx: ReadContext) -> None:
        """A run's reference scores: a path's weights compared with the starting ones (equal, the policy starts as
        the reference), or every pair scored (``precomputed``, cached)."""
        if self.mode == "path":
            self.reference_is_start = _equal_weights(ctx.frozen_inputs, ctx.run.params)
        elif self.mode == "precomputed":
            self._precompute(ctx)

    def _precompute(self, ctx: ReadContext) -> None:
        """Score every pair of the run's data (``ctx.reads``) with the reference, or read the cached scores."""

        from pretrain import distributed

        cfg, mcfg, params, mesh = ctx.run.cfg, ctx.run.mcfg, ctx.run.params, ctx.run.mesh
        source = self.dpo.reference_model or cfg.model.path
        if cfg.model.init == "random" and not self.dpo.reference_model:
            raise UserError("dpo.reference: precomputed with model.init: random needs dpo.reference_model "
                            "(a zoo checkpoint to score the pairs with)")
        weights = resolve_checkpoint(str(source))
        d = cfg.data
        docs = {}
        for read in ctx.reads:
            rows = self.load(read.path, read.cfg)
            docs[read.path] = self.row_documents(rows, ctx.tokenizer, read.path, d.skip_bad_rows)[0]
            if read.training:  # the loop checks this too, but only after the cache below is written into output_dir
                check_untrainable(*untrainable(docs[read.path].values(), d.seq_len, self.trainable), cfg,
                                  f"data.path {read.path}")
        compute = DTYPES[cfg.dtype.compute]

        def score(documents: list[Any]) -> list[Any]:
            # Only on a cache miss: a separate reference is loaded for this pass alone, then released.
            ref = load_reference(self.dpo.reference_model, mcfg, mesh, DTYPES[cfg.dtype.params]) \
                if self.dpo.reference_model else params
            rows_per_batch = cfg.batch_size // cfg.grad_accum
            try:
                return compute_reference_logps(mcfg, ref, documents, d.seq_len, rows_per_batch, mesh, compute,
                                               self.finish_rows)
            finally:
                if ref is not params:
                    for x in jax.tree.leaves(ref):
                        x.delete()

        self.ref_logps = cached_reference_logps(run_path(cfg.output_dir), docs, weights, cfg.dtype.compute,
                                                score, distributed.is_primary(), cfg.dtype.params,
                                                self.chat_template.identity(), unit=self.unit,
                                                images=None if self.images is None else self.images.digest())

    def trainable(self, doc: Document, seq_len: int) -> bool:
        """Whether a pair document (already cut to fit) still compares two answers: each keeps a trained token
        (a pair cut to less than half its prompt or an answer keeps none: prefs.pairs.keeps_meaning), and what is
        kept of them differs (identical kept answers prefer nothing)."""
        mask, seg, tokens = doc["loss_mask"], doc["tokens_segment_ids"], doc["tokens"]
        chosen, rejected = tokens[mask & (seg == CHOSEN)], tokens[mask & (seg == REJECTED)]
        return len(chosen) > 0 and len(rejected) > 0 and not np.array_equal(chosen, rejected)

    # ---- (params, batch) -> loss sums -------------------------------------------------------------------

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> PairBatch:
        """Pair rows: a shared prompt's ``prefix_ids`` (as :meth:`prepare` decided), precomputed ``ref_logps``, and a
        vision-language model's images (:meth:`vision_layout`)."""
        fields = ("prefix_ids",) * self.shared_prompt + ("ref_logps",) * (self.mode == "precomputed")
        return PairBatch.layout((grad_accum, micro, seq_len), fields, self.vision_layout())

    def batch_totals(self, batch: PairBatch) -> dict[str, jax.Array]:
        """{pairs, chosen_tokens} of a whole batch (any leading axes: the step's global batch, every
        micro-batch and device): the counts RPO's token-mean NLL divides by (:func:`rpo_nll_scale`)."""
        wc, _, keep = _answer_masks(batch)
        return {"pairs": keep.sum(), "chosen_tokens": (wc.sum(-1) * keep).sum()}

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: P, compute: Any, remat: str,
                  *, frozen_inputs: dict[str, Any] | None = None, totals: dict[str, Any] | None = None,
                  step: jax.Array | None = None) -> LossOutput:
        """A micro-batch's sum of per-pair losses over its pair count, each metric a :class:`Mean` over pairs
        (TRL's ``logits/*`` a token mean per micro-batch, a :class:`MicroMean` over micro-batches).

        ``totals`` (:meth:`batch_totals` of the global batch, passed by the step) weigh the
        ``dpo.sft_weight`` NLL term; without them the micro-batch is taken as the whole batch.
        ``step`` (the optimizer step the update starts from, passed by the train step) tells
        full fine-tuning's step 1, where the policy is still its starting weights.
        """
        policy = weights.cast(compute)
        arrays = mb.arrays()
        rows = 3  # documents in a pair's row: its two answers, and the prompt they share as a prefix (prefs/pairs.py)
        pol, mean_logit, aux = batch_logps(mcfg, policy, arrays, remat, max_segments=rows, vision=_images(mcfg, mb))
        ref = (self.reference_logps(mcfg, policy.base, mb, frozen_inputs, compute) if self.mode != "none"
               else jnp.zeros_like(pol))
        wc, wr, keep = _answer_masks(mb)
        chosen, rejected = (pol * wc).sum(-1), (pol * wr).sum(-1)
        ref_c, ref_r = (ref * wc).sum(-1), (ref * wr).sum(-1)
        terms = preference_loss(self.dpo.loss_type, chosen, rejected, ref_c, ref_r, wc.sum(-1), wr.sum(-1),
                                self.dpo.beta, self.dpo.label_smoothing, self.dpo.simpo_gamma,
                                self._at_reference(policy.adapters, step))
        n = keep.sum()
        total = (terms.losses * keep).sum()
        if self.dpo.sft_weight:
            # TRL's "sft" term: -mean log p over every chosen token of the batch, added once to the mean
            # preference loss. The step divides these sums by the global pair count, so this micro-batch's
            # NLL sum enters times (global pairs / global chosen tokens): their sum over micro-batches and
            # devices, divided by the pairs, is the global token mean, however the batch is split.
            g = totals if totals is not None else self.batch_totals(mb)
            nll_sum = -(pol * wc * keep[:, None]).sum()
            total = total + self.dpo.sft_weight * nll_sum * rpo_nll_scale(g["pairs"], g["chosen_tokens"])
        sg = jax.lax.stop_gradient
        rw_c, rw_r = terms.chosen_rewards, terms.rejected_rewards
        per_pair = {
            "rewards/chosen": rw_c, "rewards/rejected": rw_r,
            "rewards/accuracies": (rw_c > rw_r).astype(jnp.float32), "rewards/margins": rw_c - rw_r,
            "logps/chosen": terms.chosen_logps, "logps/rejected": terms.rejected_logps,
        }
        extras: dict[str, Metric] = {k: Mean((v * keep).sum()) for k, v in per_pair.items()}
        # TRL's logits/*: the mean logit over the vocabulary, averaged over every chosen (rejected) answer
        # token of the micro-batch (all devices), so longer answers weigh more; TRL appends one such value per
        # micro-batch and logs their plain mean, so micro-batches with fewer answer tokens weigh as much.
        for name, wa in (("logits/chosen", wc), ("logits/rejected", wr)):
            wk = wa * keep[:, None]
            extras[name] = MicroMean(Ratio((mean_logit * wk).sum(), wk.sum()).finish(None), jnp.float32(1.0))
        if self.dpo.loss_type in ("orpo", "cpo"):
            total = total + self._own_nll(pol, mb, wc, keep, n, extras)
        if terms.log_odds is not None:  # ORPO's log odds ratio, and the mean of its logsigmoid
            extras["log_odds_chosen"] = Mean((terms.log_odds * keep).sum())
            extras["log_odds_ratio"] = Mean((jax.nn.log_sigmoid(terms.log_odds) * keep).sum())
        objective = total + (aux["loss"] * n if aux is not None else 0.0)
        return LossOutput(objective, sg(total), n, extras)

    def _own_nll(self, pol: jax.Array, mb: PairBatch, wc: jax.Array, keep: jax.Array, n: jax.Array,
                 extras: dict[str, Metric]) -> jax.Array:
        """ORPO's and CPO's NLL term of a micro-batch, weighted for the step's division by the global pair count;
        logs it as ``nll_loss``.

        TRL's trainers take a token mean over the micro-batch (``CrossEntropyLoss`` on the chosen rows: ORPO over
        the whole chosen sequence, prompt and answer; CPO over the chosen answer) and average the micro-batches'
        losses. Each micro-batch's mean enters times its pair count, so the step's division by the global pair
        count gives that average wherever the micro-batches hold equal pair counts (TRL's batches always do)."""
        if self.dpo.loss_type == "orpo":
            seg = mb.segment_ids
            after = jnp.concatenate([seg[:, 1:], jnp.zeros_like(seg[:, :1])], axis=1)
            # every target of prompt + chosen: the prompt segment's (its last predicts the chosen segment's first
            # token, the prompt's last) and the chosen segment's own (prefs/pairs.py's layout, shared prompt or not)
            mask = ((seg == PROMPT) | ((seg == CHOSEN) & (after == CHOSEN))).astype(jnp.float32)
            weight = 1.0
        else:
            mask, weight = wc, self.dpo.cpo_alpha
        mask = mask * keep[:, None]
        nll = -(pol * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        extras["nll_loss"] = MicroMean(jax.lax.stop_gradient(nll) * (weight > 0), jnp.float32(1.0))
        return weight * nll * n if weight > 0 else jnp.float32(0.0)

    def reference_logps(self, mcfg: ModelConfig, p: dict[str, Any], mb: PairBatch, frozen_inputs: Any, compute: Any
                        ) -> jax.Array:
        """The reference's per-token log-probabilities of a micro-batch's rows, not differentiated: read from the
        batch (precomputed), the base with the adapters off (``p``: the cast base), or the checkpoint passed as
        the step's frozen inputs."""
        if self.mode == "precomputed":  # the batch carries them (batch_layout)
            return cast(jax.Array, mb.ref_logps).astype(jnp.float32)
        weights = p if self.mode == "base" else cast_params(frozen_inputs, compute)  # base: no second copy
        # each row holds three documents: two answers and the prompt they share (prefs/pairs.py); its images too
        return jax.lax.stop_gradient(batch_logps(mcfg, weights, mb.arrays(), max_segments=3,
                                                 vision=_images(mcfg, mb))[0])

    def _at_reference(self, lora: dict[str, Any] | None, step: jax.Array | None) -> jax.Array | bool:
        """Whether the policy is the reference itself (a traced bool), or False where it cannot be known:
        the reference is the starting model, and the policy is too (LoRA: every adapter adds nothing;
        full fine-tuning: no update yet)."""
        if not self.reference_is_start:
            return False
        if lora is not None:
            return _adapters_off(lora)
        return False if step is None else step == 0


def _images(mcfg: ModelConfig, mb: PairBatch) -> VisionInputs | None:
    """The model's view of a micro-batch's images (None: a text batch): what the policy and a live reference read."""
    return None if mb.vision is None or mcfg.vision is None else mb.vision.inputs(mcfg.vision)


def _adapters_off(lora: dict[str, Any]) -> jax.Array:
    """True where every LoRA adapter adds nothing (its A or its B all zero, so ``scale * x @ A @ B`` is 0):
    the policy is then its base model, e.g. before the first update (fresh adapters have B = 0)."""
    flat = flatten(lora)
    pairs = {path.rpartition(".")[0] for path in flat}
    return jnp.all(jnp.stack([jnp.all(flat[f"{p}.a"] == 0) | jnp.all(flat[f"{p}.b"] == 0) for p in sorted(pairs)]))


def _equal_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two parameter trees (the same model's, laid out alike) hold equal weights, leaf by leaf."""
    if str(jax.tree.structure(a)) != str(jax.tree.structure(b)):
        return False
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(la, lb)):
        return False
    same = jax.jit(lambda xs, ys: jnp.all(jnp.stack([jnp.array_equal(x, y) for x, y in zip(xs, ys)])))(la, lb)
    return bool(np.asarray(jax.device_get(same)))


def _answer_masks(batch: PairBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen-answer token weights, rejected-answer token weights, 1.0 for each row holding a whole pair)
    of a batch's rows (rows without both answers, e.g. padding rows, count for nothing)."""
    w, seg = batch.weights, batch.segment_ids
    wc, wr = w * (seg == CHOSEN), w * (seg == REJECTED)
    keep = (wc.sum(-1) > 0) & (wr.sum(-1) > 0)
    return wc, wr, keep.astype(jnp.float32)

