"""GKD (on-policy distillation, distill/) as variants of the SFT task, chosen by the config (``distill:``) as
dpo's KTO is by ``dpo.loss_type``: `sft train` lists them before SFTTask (sft/cli.py ``sft_tasks``) and
:func:`pretrain.task.task_for` picks the first that :meth:`~pretrain.task.Task.handles` the config.

- :class:`GKDTask`: ``distill.teacher`` with no sampled completions (``lmbda`` 0, no ``seq_kd``): SFT's rows,
  packed as SFT packs them, trained on the teacher's token distributions (the generalized JSD,
  distill/losses.py); rows with images on a vision-language student and teacher (reading the same patches) give
  both models the rows' images;
- :class:`OnlineGKDTask`: with sampled completions: an online task that makes each step's batch itself, one
  example per row, from the dataset's rows and the student's (or the teacher's) samples (distill/online.py); its
  samplers take no images yet (rows with images are one line).
"""

from __future__ import annotations

from typing import Any, cast

import jax

from chat.images import image_column
from distill.batch import DistillBatch
from distill.config import check_teacher_tokenizer, check_teacher_vision, load_teacher
from distill.losses import distill_loss_sums
from distill.online import Sampling, sampling
from pretrain.batch import Rollout, TokenBatch
from pretrain.config import TrainConfig
from pretrain.dtypes import DTYPES
from pretrain.metrics import LossOutput
from pretrain.task import Documents, ReadContext, RowSource, RunContext, Tokenizer
from sft.config import SFTConfig
from sft.task import SFTTask
from zoo.errors import UserError
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig


class GKDTask(SFTTask):
    """SFT rows trained on ``distill.teacher``'s token distributions (module docstring)."""


    @classmethod
    def handles(cls, cfg: TrainConfig) -> bool:
        """``distill.teacher`` set, no sampled completions."""
        d = cast(SFTConfig, cfg).distill
        return d.teacher is not None and not d.samples

    def __init__(self, cfg: SFTConfig):
        super().__init__(cfg)
        self.distill = cfg.distill
        self.teacher_mcfg: ModelConfig | None = None  # distill.teacher's config, once prepare read it

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: TokenBatch, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None) -> LossOutput:
        """GKD's generalized JSD against the teacher (``frozen_inputs``: its params), summed over the trained
        targets (distill/losses.py)."""
        return distill_loss_sums(mcfg, weights, cast(ModelConfig, self.teacher_mcfg), frozen_inputs, mb, compute,
                                 remat, self.distill.beta)

    def prepare(self, ctx: RunContext) -> dict[str, Any]:
        """The frozen teacher's params (the step's frozen inputs), read onto the run's mesh (``--compile-only``:
        their layout, the teacher's config read without weights)."""
        super().prepare(ctx)  # the student's tower
        self.teacher_mcfg, teacher = load_teacher(ctx)
        return teacher

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """SFT's documents; rows with images need a teacher that reads the student's patches (same tower input)."""
        if image_column(list(rows.ds.column_names)) is not None and self.vision is not None:
            check_teacher_vision(self.vision, cast(ModelConfig, self.teacher_mcfg).vision,
                                 str(self.distill.teacher))
        return super().documents(rows, tokenizer, path, skip_bad, indices)

    def read_inputs(self, ctx: ReadContext) -> None:
        """The teacher's tokenizer must be the student's."""
        check_teacher_tokenizer(ctx.run.cfg, ctx.tokenizer)


class OnlineGKDTask(GKDTask):
    """GKD with sampled completions (module docstring): each micro-batch the dataset's, or its prompts with the
    student's (probability ``distill.lmbda``) or, with ``distill.seq_kd``, the teacher's completions."""

    online = True
    reads_images = False  # the samplers take no images yet
    images_refused_by = ("GKD with sampled completions (distill.lmbda, distill.seq_kd)",
                         "set distill.lmbda: 0 and distill.seq_kd: false")
    packing = "none"  # one example per row: a row's prompt is completed in place
    batch_class = DistillBatch

    @classmethod
    def handles(cls, cfg: TrainConfig) -> bool:
        """``distill.teacher`` set, with sampled completions."""
        d = cast(SFTConfig, cfg).distill
        return d.teacher is not None and d.samples

    def __init__(self, cfg: SFTConfig):
        super().__init__(cfg)
        self.sampling: Sampling | None = None  # set up by prepare

    def prepare(self, ctx: RunContext) -> dict[str, Any]:
        """The teacher's params, and the samplers set up."""
        teacher = super().prepare(ctx)
        if ctx.ids.eos is None:
            raise UserError("distill.lmbda/seq_kd: the tokenizer has no EOS token, so sampled completions could "
                            "never end before distill.max_new_tokens")
        self.sampling = sampling(ctx.cfg, ctx.mcfg, cast(ModelConfig, self.teacher_mcfg), ctx.mesh, (ctx.ids.eos,),
                                 DTYPES[ctx.cfg.dtype.compute])
        return teacher

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> DistillBatch:
        """Rows ``distill.max_new_tokens`` longer than SFT's, and the dataset's own target weights."""
        return DistillBatch.layout((grad_accum, micro, seq_len + self.distill.max_new_tokens), ("data_weights",))

    def rollout(self, weights: Weights, frozen_inputs: Any, rows: dict[str, jax.Array] | None, step: int,
                source: RowSource) -> Rollout[DistillBatch]:
        """GKD's step batch: each micro-batch the dataset's, or its prompts with sampled completions
        (distill/online.py)."""
        assert self.sampling is not None and rows is not None, "prepare first; GKD is given its rows"
        return self.sampling.rollout(weights, frozen_inputs, rows, step)

    def compile_programs(self, weights: Weights, frozen_inputs: Any) -> dict[str, Any]:
        """The samplers lowered for ``--compile-only`` (after :meth:`prepare`): the student's, and with
        ``distill.seq_kd`` the teacher's (``frozen_inputs``), each for one micro-batch's prompts."""
        assert self.sampling is not None, "prepare first"
        return self.sampling.lowered(weights, frozen_inputs)

    def program_kv_cache(self) -> dict[str, int]:
        """Bytes a chip holds of each sampler's KV cache (one micro-batch of prompts, ``distill.max_new_tokens``
        new tokens)."""
        assert self.sampling is not None, "prepare first"
        return self.sampling.kv_cache_bytes()
