"""A Bradley-Terry reward model as a task of the shared loop, equal to TRL 1.16's ``RewardTrainer``.

The model is the decoder with a scalar head ``score`` [hidden, 1] read at each sequence's last token that is
not the padding token, as transformers' ``*ForSequenceClassification`` pools (its ``pad_token_id``: TRL sets the
tokenizer's pad token, else its EOS). Started from a causal LM, the run swaps the LM head for a fresh score head
(``N(0, 0.02)``, transformers' ``initializer_range``, from the run's seed); started from a reward model (a
converted ``*ForSequenceClassification``, or a reward run's final checkpoint), it keeps its head. ``zoo export``
writes the family's ``*ForSequenceClassification`` folder. With LoRA the head trains whole beside the adapters,
as peft's ``modules_to_save`` (its SEQ_CLS task type) trains it: the adapter checkpoint stores it, the merged
model is a reward model, and ``zoo export --adapter`` writes it as peft's ``score`` module to save.

A batch row is one preference pair in DPO's layout (prefs/pairs.py): the prompt once, then prompt + chosen and
prompt + rejected as two segments reading it as a shared prefix, so a pair costs one forward pass over
``prompt + chosen + rejected + 1`` tokens, and each sequence's score reads the hidden state of its own last token.
Each row ends with one padding token so that the rejected sequence's last token is an input position.
Pairs with images on a vision-language model keep them in the prompt, as DPO's (prefs/image_pairs.py,
prefs/image_rows.py): both sequences read the row's patches.

The loss (Stiennon et al. 2020, "Learning to summarize from human feedback", arXiv:2009.01325; Ouyang et al.
2022, arXiv:2203.02155) per pair is ``-logsigmoid(r_c - r_r - margin)`` (``margin``: the pair's
``rm.margin_field`` column, Touvron et al. 2023's Llama 2 margin, else 0) plus
``rm.center_rewards_coefficient * (r_c + r_r)^2`` (Eisenstein et al. 2023, "Helping or Herding?",
arXiv:2312.09244), averaged over a micro-batch's pairs and the micro-batches (TRL: the loss / gradient
accumulation). Metrics, TRL's names and definitions, each once per micro-batch and averaged: ``min_reward``,
``mean_reward``, ``max_reward`` (over both scores of every pair), ``accuracy`` (r_c > r_r), ``margin``
(r_c - r_r).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from chat.config import chat_template_of
from chat.formats import BadRow
from prefs.batch import PairBatch
from prefs.image_rows import PairImageRows
from prefs.pairs import CHOSEN, REJECTED, load_pair_rows, pair_documents, shared_prompt_layout
from pretrain.batch import FLOAT
from pretrain.config import TrainConfig
from pretrain.metrics import LossOutput, Metric, MicroMean
from pretrain.setup import Arrays, TokenIds
from pretrain.task import Documents, RowSource, RunContext, Task, Tokenizer
from rm.config import RMConfig
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.batching import Document
from zoo.data.files import indexed_rows
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.pooling import last_positions

INIT_STD = 0.02  # transformers' initializer_range default: how a fresh score head is drawn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardBatch(PairBatch):
    """Reward-model pairs: the pair layout with each pair's ``margin`` on every token (0 without one)."""

    margin: jax.Array  # every reward row has one (0 without the column)

    @classmethod
    def dtypes(cls) -> dict[str, DTypeLike]:
        return {**PairBatch.dtypes(), "margin": FLOAT}


def pair_scores(mcfg: ModelConfig, params: dict[str, Any] | Weights, mb: PairBatch,
                remat: str = "none") -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen scores [rows], rejected scores [rows], the MoE router loss or 0) of a batch of pair rows: the score
    head on each sequence's last non-padding token (``params``: the base or :class:`zoo.lora.weights.Weights`,
    already in the compute dtype); a vision-language model reads the batch's images."""
    from zoo.model.decoder import forward

    moe = mcfg.num_experts > 0
    vision = None if mb.vision is None or mcfg.vision is None else mb.vision.inputs(mcfg.vision)
    out = forward(mcfg, params, mb.inputs, mb.segment_ids, mb.positions, return_aux=moe, remat=remat,
                  return_hidden=True, prefix_ids=mb.prefix_ids, vision=vision)
    hidden, aux = cast(tuple[jax.Array, dict[str, Any]], out) if moe else (cast(jax.Array, out), None)
    # With LoRA the head trains whole beside the adapters (zoo.lora.params.whole_weights), in the compute dtype as the
    # full model's would.
    w = Weights.wrap(params)
    trained, base = (w.adapters or {}).get("score"), w.base["score"]
    head = (base if trained is None else trained.astype(base.dtype)).astype(jnp.float32)[:, 0]
    rows = jnp.arange(hidden.shape[0])
    scores = [(hidden[rows, last_positions(mb.segment_ids, mb.inputs, seg, mcfg.pad_token_id)]
               .astype(jnp.float32) @ head) for seg in (CHOSEN, REJECTED)]
    return scores[0], scores[1], aux["loss"] if aux is not None else jnp.float32(0.0)


class RewardTask(PairImageRows, Task[RewardBatch]):
    """A Bradley-Terry reward model on (prompt, chosen, rejected) rows (module docstring)."""

    method = "reward"
    packing = "none"  # each pair is one row, laid out by prefs/pairs.py
    config_class = RMConfig
    key_metrics = ("accuracy", "margin")
    batch_class = RewardBatch

    def __init__(self, cfg: RMConfig):
        super().__init__(cfg)
        self.cfg, self.rm = cfg, cfg.rm
        self.chat_template = chat_template_of(cfg)
        self.max_len = cfg.data.seq_len  # data.seq_len + 1 tokens a row, the last a padding token (see above)
        self.drop_long = cfg.data.long_examples == "drop"
        self.shared_prompt = True
        self.init_images()  # rows with images on a vision-language model (prefs/image_rows.py)

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """Reward modelling and its centering coefficient."""
        return MethodCard("reward modelling (a sequence classifier trained on preference pairs, Bradley-Terry)",
                          ("reward-model",), settings(dataclasses.asdict(cfg), ("rm.center_rewards_coefficient",)))

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path``; a reward model learns from preference pairs: ``chosen`` and ``rejected``."""
        return load_pair_rows(path, cfg, "a reward model trains on preference pairs: rows need 'chosen' and "
                                         f"'rejected' fields (and optionally 'prompt' and '{self.rm.margin_field}')")

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """One row per usable pair, ending with a padding token, each with its margin (0 without the column);
        rows with images on a vision-language model keep them (prefs/image_pairs.py)."""
        from zoo.data.row_origin import bad_row

        docs, bad, too_long = pair_documents(indexed_rows(rows.ds, indices), tokenizer, self.chat_template, path,
                                             skip_bad, self.max_len, self.drop_long, self.shared_prompt,
                                             self.image_pairs(rows, tokenizer, path))
        has_margin = self.rm.margin_field in rows.ds.column_names
        out = {}
        for i, d in docs.items():
            margin = rows.ds[i][self.rm.margin_field] if has_margin else 0.0
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                if not skip_bad:
                    raise bad_row(path, i, BadRow(f"field '{self.rm.margin_field}' is {margin!r}, not a number"))
                bad += 1
                continue
            d = {k: np.concatenate([v, np.zeros(1, v.dtype)]) for k, v in d.items()}  # the trailing padding token
            d["margin"] = np.full(len(d["tokens"]), float(margin), np.float32)
            out[i] = d
        return Documents(out, bad, too_long)

    def trainable(self, doc: Document, seq_len: int) -> bool:
        """Whether the pair, cut to fit, still has both answers."""
        seg, mask = doc["tokens_segment_ids"], doc["loss_mask"]
        return bool((mask & (seg == CHOSEN)).any() and (mask & (seg == REJECTED)).any())

    def adapt_model(self, mcfg: ModelConfig, params: dict[str, Any], mesh: jax.sharding.Mesh, arrays: Arrays, ids: TokenIds,
                    seed: int) -> tuple[ModelConfig, dict[str, Any]]:
        """A causal LM becomes a reward model: its LM head dropped, a score head drawn (a score of the padding id,
        the tokenizer's pad token, else its EOS: TRL's rule); a reward model is kept."""
        if mcfg.num_labels:
            return mcfg, params
        from pretrain import distributed
        from zoo.model.params import param_specs
        from zoo.model.sharding import named_sharding

        pad = ids.pad if ids.pad is not None else ids.eos  # TRL's padding rule
        mcfg = dataclasses.replace(mcfg, num_labels=1, pad_token_id=pad)
        spec = param_specs(mcfg)["score"]
        dtype = params["final_norm"].dtype
        key = jax.random.fold_in(jax.random.key(seed), 0x73636F)  # its own stream
        draw = jax.jit(lambda: (INIT_STD * jax.random.normal(key, spec.shape)).astype(dtype),
                       out_shardings=named_sharding(mesh, spec.axes, spec.shape))
        if distributed.is_primary() and not arrays.abstract:
            print(f"reward model: a score head [{mcfg.hidden_size}, 1] drawn from N(0, {INIT_STD}) (seed {seed}) "
                  f"replaces the LM head; scores read each sequence's last token that is not id {pad}",
                  file=sys.stderr)
        return mcfg, {**{k: v for k, v in params.items() if k != "lm_head"}, "score": arrays.made(draw)}

    def prepare(self, ctx: RunContext) -> None:
        """The pair layout (one copy of the prompt, except for models with sliding-window layers), the tower."""
        self.shared_prompt = shared_prompt_layout(True, ctx.mcfg)
        self.vision = ctx.mcfg.vision

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> RewardBatch:
        """Pair rows with each pair's margin (and a shared prompt's ``prefix_ids``, a vision-language model's
        images)."""
        return RewardBatch.layout((grad_accum, micro, seq_len), ("prefix_ids",) * self.shared_prompt + ("margin",),
                                  self.vision_layout())

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: RewardBatch, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None) -> LossOutput:
        """A micro-batch's summed pair losses over its pair count; TRL's metrics once per micro-batch."""
        rc, rr, aux = pair_scores(mcfg, weights.cast(compute), mb, remat)
        seg = mb.segment_ids
        keep = ((seg == CHOSEN).any(-1) & (seg == REJECTED).any(-1)).astype(jnp.float32)
        margin = mb.margin[:, 0]
        per = -jax.nn.log_sigmoid(rc - rr - margin)
        if self.rm.center_rewards_coefficient is not None:
            per = per + self.rm.center_rewards_coefficient * (rc + rr) ** 2
        n = keep.sum()
        total = (per * keep).sum()
        sg = jax.lax.stop_gradient
        both = jnp.concatenate([rc, rr])
        kept = jnp.concatenate([keep, keep]) > 0
        one = jnp.float32(1.0)
        extras: dict[str, Metric] = {
            "min_reward": MicroMean(sg(jnp.min(jnp.where(kept, both, jnp.inf))), one),
            "max_reward": MicroMean(sg(jnp.max(jnp.where(kept, both, -jnp.inf))), one),
            "mean_reward": MicroMean(sg((both * kept).sum() / jnp.maximum(kept.sum(), 1.0)), one),
            "accuracy": MicroMean(sg(((rc > rr) * keep).sum() / jnp.maximum(n, 1.0)), one),
            "margin": MicroMean(sg(((rc - rr) * keep).sum() / jnp.maximum(n, 1.0)), one),
        }
        return LossOutput(total + aux * n, sg(total), n, extras)
