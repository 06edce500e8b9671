"""The ``distill:`` section of ``sft train``: GKD's keys (TRL 1.16's GKDConfig names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo.errors import UserError


@dataclass
class DistillSection:
    """On-policy distillation keys; ``teacher`` None means no distillation (plain SFT)."""

    teacher: str | None = None  # the teacher checkpoint (same tokenizer as the student's)
    lmbda: float = 0.5  # probability that a micro-batch's completions are the student's own samples
    beta: float = 0.5  # JSD interpolation: 0 forward KL, 1 reverse KL
    temperature: float = 0.9  # sampling temperature of the student's (and seq_kd teacher's) completions
    max_new_tokens: int = 128  # completion length of sampled completions
    seq_kd: bool = False  # off-policy micro-batches use teacher-generated completions instead of the dataset's

    def check(self) -> None:
        """Each key in its range, one line naming the key and the fix."""
        if self.teacher is not None and not str(self.teacher):
            raise UserError("distill.teacher must be a checkpoint path (or leave it out for plain SFT)")
        for key in ("lmbda", "beta"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
                raise UserError(f"distill.{key} must be a number in [0, 1], got {v!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not float(t) > 0.0:
            raise UserError(f"distill.temperature must be a number > 0, got {t!r}")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"distill.max_new_tokens must be an integer >= 1, got {n!r}")
        if not isinstance(self.seq_kd, bool):
            raise UserError(f"distill.seq_kd must be true or false, got {self.seq_kd!r}")


def check_same_tokenizer(student_vocab: dict[str, int], teacher_vocab: dict[str, int], teacher: str) -> None:
    """The teacher must share the student's vocabulary (GKD compares distributions over the same ids)."""
    if student_vocab != teacher_vocab:
        raise UserError(f"distill.teacher {teacher}: its tokenizer differs from the student's "
                        f"({len(teacher_vocab)} vs {len(student_vocab)} tokens); use a teacher with the same "
                        f"tokenizer")


def load_teacher(ctx: Any) -> tuple[Any, dict]:
    """The frozen teacher of ``distill.teacher`` (its own config: it may be deeper or wider than the student),
    loaded on the run's mesh; its tokenizer must be the student's. Returns (its model config, its params)."""
    from pretrain.dtypes import DTYPES
    from zoo.checkpoint import read_config
    from zoo.loading import load_params
    from zoo.paths import checkpoint_dir
    from zoo.tokenizer import load_tokenizer

    d: DistillSection = ctx.cfg.distill
    if d.lmbda > 0 or d.seq_kd:
        raise UserError(f"distill.lmbda {d.lmbda} / distill.seq_kd {d.seq_kd}: sampled completions are not "
                        "supported yet; set distill.lmbda: 0 and distill.seq_kd: false (the dataset's completions)")
    ckpt = checkpoint_dir(str(d.teacher), "distill.teacher")
    check_same_tokenizer(ctx.tokenizer.get_vocab(), load_tokenizer(ckpt).get_vocab(), str(d.teacher))
    return read_config(ckpt), load_params(ckpt, ctx.mesh, DTYPES[ctx.cfg.dtype.params])
