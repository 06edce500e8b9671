"""The ``distill:`` section of ``sft train``: GKD's keys (TRL 1.16's GKDConfig names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pretrain.config_unread import Unread, keys_unread
from zoo.errors import UserError


@dataclass
class DistillSection:
    """On-policy distillation keys; ``teacher`` None means no distillation (plain SFT). The config loader checks
    each key's type and ``range`` (pretrain/config.py), one line naming the key."""

    teacher: str | None = None  # the teacher checkpoint (same tokenizer as the student's)
    # probability that a micro-batch's completions are the student's own samples
    lmbda: float = field(default=0.5, metadata={"range": "[0, 1]"})
    beta: float = field(default=0.5, metadata={"range": "[0, 1]"})  # JSD interpolation: 0 forward KL, 1 reverse KL
    # sampling temperature of the student's (and seq_kd teacher's) completions
    temperature: float = field(default=0.9, metadata={"range": "(0, inf)"})
    max_new_tokens: int = field(default=128, metadata={"range": "[1, inf)"})  # length of sampled completions
    seq_kd: bool = False  # off-policy micro-batches use teacher-generated completions instead of the dataset's

    @property
    def samples(self) -> bool:
        """Whether a GKD run trains on sampled completions (the student's with ``lmbda`` > 0, the teacher's with
        ``seq_kd``), which makes its task an online one."""
        return bool(self.lmbda > 0 or self.seq_kd)


# The distill keys `sft train` reads only under a condition (pretrain/config_unread.py): each of them only with a
# teacher; the sampler's only when completions are sampled.
DISTILL_UNREAD: tuple[Unread, ...] = (
    *keys_unread([f"distill.{f.name}" for f in fields(DistillSection) if f.name != "teacher"],
                 lambda c: c.distill.teacher is None,
                 "is read by GKD (on-policy distillation) only, and distill.teacher is not set: set distill.teacher, "
                 "or remove it"),
    *keys_unread(("distill.temperature", "distill.max_new_tokens"), lambda c: not c.distill.samples,
                 "sets the sampled completions, and this GKD run samples none (distill.lmbda 0, distill.seq_kd "
                 "false): remove it"),
)


def check_same_tokenizer(student_vocab: dict[str, int], teacher_vocab: dict[str, int], teacher: str) -> None:
    """The teacher must share the student's vocabulary (GKD compares distributions over the same ids)."""
    if student_vocab != teacher_vocab:
        raise UserError(f"distill.teacher {teacher}: its tokenizer differs from the student's "
                        f"({len(teacher_vocab)} vs {len(student_vocab)} tokens); use a teacher with the same "
                        f"tokenizer")


def load_teacher(ctx: Any) -> tuple[Any, dict]:
    """The frozen teacher of ``distill.teacher`` (its own config: it may be deeper or wider than the student) read
    onto the run's mesh through ``ctx.arrays`` (:class:`pretrain.task.RunContext`; ``--compile-only``: its config
    read without weights, its params' layout). Returns (its model config, its params)."""
    from pretrain.dtypes import DTYPES
    from pretrain.setup import param_layout
    from zoo.checkpoints.loading import load_params

    mcfg, ckpt = ctx.arrays.checkpoint_config(str(ctx.cfg.distill.teacher), "distill.teacher")
    dtype = DTYPES[ctx.cfg.dtype.params]
    return mcfg, ctx.arrays.read(param_layout(mcfg, ctx.mesh, dtype), lambda: load_params(ckpt, ctx.mesh, dtype))


def check_teacher_tokenizer(cfg: Any, tokenizer: Any) -> None:
    """``distill.teacher``'s tokenizer must be the student's (``tokenizer``)."""
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.data.tokenizer import load_tokenizer

    teacher = str(cfg.distill.teacher)
    check_same_tokenizer(tokenizer.get_vocab(), load_tokenizer(checkpoint_dir(teacher, "distill.teacher")).get_vocab(),
                         teacher)
