"""Supervised fine-tuning as a task of the shared loop: chat/instruction rows -> tokens with a loss mask."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import jax

from pretrain.batch import DistillBatch, Rollout, TokenBatch
from pretrain.config import TrainConfig
from pretrain.metrics import LossOutput
from pretrain.task import Documents, LayoutContext, RowSource, RunContext, Task, Tokenizer, next_token_loss_sums
from sft.chat import ChatTemplate, parse_date
from sft.config import ChatDataSection, SFTConfig, SFTDataSection
from sft.formats import detect_format
from sft.masks import tokenize_indexed
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.files import indexed_rows, load_dataset_rows
from zoo.errors import UserError
from zoo.model.config import ModelConfig


def chat_template_of(cfg: TrainConfig) -> ChatTemplate:
    """The run's chat template: the Jinja file ``data.chat_template`` (None: the tokenizer's own), its variables
    (``data.template_kwargs``) and the fixed day its ``strftime_now`` reads (``data.template_date``)."""
    d = cast(ChatDataSection, cfg.data)  # every chat task's data section is one (sft/config.py)
    parse_date(d.template_date)  # a bad date is a config error before any row is read
    if d.chat_template is None:
        return ChatTemplate(kwargs=dict(d.template_kwargs), date=d.template_date)
    p = Path(d.chat_template).expanduser()
    if not p.is_file():
        raise UserError(f"data.chat_template {d.chat_template}: no such file (give a Jinja chat-template file)")
    return ChatTemplate(source=p.read_text(), kwargs=dict(d.template_kwargs), date=d.template_date,
                        name=f"data.chat_template {d.chat_template}")


class SFTTask(Task):
    """Completion-only / assistant-only next-token loss over SFT rows (see sft/formats.py for the formats)."""

    method = "sft"
    packing = "best_fit"  # an example is never cut across rows (its prompt would lose its answer)
    config_class = SFTConfig

    def __init__(self, cfg: SFTConfig):
        d = cfg.distill
        # GKD with sampled completions (distill/online.py) makes each step's batch itself, one example per row:
        # the config decides, so this instance overrides the class's defaults.
        self.online = d.teacher is not None and (d.lmbda > 0 or d.seq_kd)  # type: ignore[misc]
        if self.online:
            self.packing = "none"  # type: ignore[misc]
            self.batch_class = DistillBatch  # type: ignore[misc]
        super().__init__(cfg)
        self.chat_template = chat_template_of(cfg)
        self.distill = d
        self.teacher_mcfg: ModelConfig | None = None  # distill.teacher's config, once prepare loaded it
        self.sampling: Any = None  # distill.online.Sampling, once prepare set it up

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """Supervised fine-tuning; with ``distill.teacher``, knowledge distillation (GKD) and its keys."""
        teacher = cast(SFTConfig, cfg).distill.teacher
        if not teacher:
            return MethodCard("supervised fine-tuning (SFT)", ("sft",))
        keys = ("distill.teacher", "distill.lmbda", "distill.beta", "distill.temperature", "distill.max_new_tokens",
                "distill.seq_kd")
        return MethodCard("knowledge distillation (GKD: the student learns the teacher's token distributions), "
                          f"from the teacher `{teacher}`", ("distillation",),
                          settings(dataclasses.asdict(cfg), keys, ("distill.seq_kd",)))

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path`` and their format (``data.format``, or detected from the columns)."""
        ds, _ = load_dataset_rows(path, cfg.data.split)
        try:  # cfg's own data.format: each source of a mixture reads with its own (pretrain/data/mixture.py)
            fmt = detect_format(list(ds.column_names), cast(SFTDataSection, cfg.data).format)
        except UserError as e:
            raise UserError(f"data.path {path}: {e}") from None
        return RowSource(ds, fmt, path)

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """{tokens, loss_mask} of each usable row; a bad row is an error naming file and row, or skipped."""
        out, bad = tokenize_indexed(indexed_rows(rows.ds, indices), rows.field, tokenizer, self.chat_template,
                                    path, skip_bad)
        return Documents({i: {"tokens": ids, "loss_mask": mask} for i, (ids, mask) in out.items()}, bad)

    def loss_sums(self, mcfg: ModelConfig, params: dict, mb: TokenBatch, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None,
                  **forward_kwargs: Any) -> LossOutput:
        """Next-token cross-entropy over the trained (masked-in) targets only."""
        if frozen_inputs is not None:  # distill.teacher: GKD's generalized JSD against the teacher (distill/)
            from distill.losses import distill_loss_sums

            return distill_loss_sums(mcfg, params, cast(ModelConfig, self.teacher_mcfg), frozen_inputs, mb, compute,
                                     remat, self.distill.beta, **forward_kwargs)
        return next_token_loss_sums(mcfg, params, mb, compute, remat, max_segments=self.row_segments,
                                    **forward_kwargs)

    def prepare(self, ctx: RunContext) -> dict | None:
        """With ``distill.teacher``: the frozen teacher's params (the step's frozen inputs); else None."""
        if cast(SFTConfig, ctx.cfg).distill.teacher is None:
            return None
        from distill.config import load_teacher

        self.teacher_mcfg, teacher = load_teacher(ctx)
        if self.online:
            from distill.online import sampling
            from pretrain.dtypes import DTYPES
            from zoo.lora.adapters import lora_scale

            eos = tuple(sorted({ctx.tokenizer.eos_token_id} - {None}))
            if not eos:
                raise UserError("distill.lmbda/seq_kd: the tokenizer has no EOS token, so sampled completions could "
                                "never end before distill.max_new_tokens")
            self.sampling = sampling(ctx.cfg, ctx.mcfg, self.teacher_mcfg, ctx.mesh, eos,
                                     lora_scale(ctx.lora) if ctx.lora is not None else None,
                                     DTYPES[ctx.cfg.dtype.compute])
        return teacher

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> TokenBatch:
        """SFT rows; with sampled completions (GKD), rows ``distill.max_new_tokens`` longer, and the dataset's
        own target weights (:class:`DistillBatch`)."""
        if not self.online:
            return super().batch_layout(grad_accum, micro, seq_len)
        return DistillBatch.layout((grad_accum, micro, seq_len + self.distill.max_new_tokens), ("data_weights",))

    def rollout(self, params: dict, frozen: dict | None, frozen_inputs: Any, rows: dict[str, jax.Array],
                step: int, source: RowSource) -> Rollout:
        """GKD's step batch: each micro-batch the dataset's, or its prompts with the student's (probability
        ``distill.lmbda``) or, with ``distill.seq_kd``, the teacher's sampled completions (distill/online.py)."""
        return self.sampling.rollout(params, frozen, frozen_inputs, rows, step)

    def compile_layout(self, ctx: LayoutContext) -> Any:
        """For ``--compile-only``: with ``distill.teacher``, the teacher's params as ``jax.ShapeDtypeStruct`` s
        laid out as a run loads them (its config read from its checkpoint, registry name or config.json; no
        weights), and, with sampled completions, the samplers :meth:`compile_programs` lowers; else None."""
        d = cast(SFTConfig, ctx.cfg).distill
        if d.teacher is None:
            return None
        from distill.config import abstract_teacher
        from distill.online import sampling
        from pretrain.dtypes import DTYPES
        from zoo.lora.adapters import lora_scale

        self.teacher_mcfg, teacher = abstract_teacher(ctx)
        if self.online:  # the EOS id only fills a constant of the sampler: any id does
            cfg = ctx.cfg
            self.sampling = sampling(cfg, ctx.mcfg, self.teacher_mcfg, ctx.mesh, (ctx.mcfg.vocab_size - 1,),
                                     lora_scale(ctx.lora) if ctx.lora is not None else None, DTYPES[cfg.dtype.compute])
            self._abstract_teacher = teacher
        return teacher

    def compile_programs(self, trainable: Any, frozen: Any) -> dict[str, Any]:
        """The samplers lowered for ``--compile-only`` (after :meth:`compile_layout`): the student's, and with
        ``distill.seq_kd`` the teacher's, each for one micro-batch's prompts; {} without sampled completions."""
        if not self.online:
            return {}
        lora = trainable if self.sampling.lora_scale is not None else None
        base = frozen if lora is not None else trainable
        return self.sampling.lowered(base, lora, self._abstract_teacher)

    def program_kv_cache(self) -> dict[str, int]:
        """Bytes a chip holds of each sampler's KV cache (one micro-batch of prompts, ``distill.max_new_tokens``
        new tokens)."""
        return self.sampling.kv_cache_bytes() if self.online else {}
