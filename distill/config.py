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
    # the teacher's tokenizer (a tokenizer folder or zoo checkpoint), checked against the student's; null: the
    # teacher's own tokenizer/, else the student's is used for both, as TRL's GKDTrainer does
    teacher_tokenizer: str | None = None
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
    """The teacher must share the student's vocabulary (GKD compares distributions over the same ids); ``teacher``
    names where its tokenizer came from (``distill.teacher PATH``)."""
    if student_vocab != teacher_vocab:
        raise UserError(f"{teacher}: its tokenizer differs from the student's "
                        f"({len(teacher_vocab)} vs {len(student_vocab)} tokens); use a teacher with the same "
                        f"tokenizer")


def check_vocab_size(student: int, teacher: int, path: str) -> None:
    """The teacher's vocabulary size must be the student's, as TRL's GKDTrainer checks (its logits are compared
    id by id); the one check on a teacher that carries no tokenizer."""
    if student != teacher:
        raise UserError(f"distill.teacher {path}: its vocab_size is {teacher}, the student's {student}; GKD compares "
                        f"the teacher's whole next-token distribution, so use a teacher with the student's vocabulary")


def load_teacher(ctx: Any) -> tuple[Any, dict]:
    """The frozen teacher of ``distill.teacher`` (its own config: it may be deeper or wider than the student) read
    onto the run's mesh through ``ctx.arrays`` (:class:`pretrain.task.RunContext`; ``--compile-only``: its config
    read without weights, its params' layout), its vocabulary size checked against the student's (``ctx.mcfg``).
    Returns (its model config, its params)."""
    from pretrain.dtypes import DTYPES
    from pretrain.setup import param_layout
    from zoo.checkpoints.loading import load_params
    from zoo.model.context import check_context

    mcfg, ckpt = ctx.arrays.checkpoint_config(str(ctx.cfg.distill.teacher), "distill.teacher")
    check_vocab_size(ctx.mcfg.vocab_size, mcfg.vocab_size, str(ctx.cfg.distill.teacher))
    try:  # set-up checks the student's layers against mesh.context; the teacher runs on the same mesh
        check_context(mcfg, ctx.cfg.mesh.context)
    except UserError as e:
        raise UserError(f"distill.teacher {ctx.cfg.distill.teacher}: {e}") from None
    dtype = DTYPES[ctx.cfg.dtype.params]
    return mcfg, ctx.arrays.read(param_layout(mcfg, ctx.mesh, dtype), lambda: load_params(ckpt, ctx.mesh, dtype))


def check_teacher_tokenizer(cfg: Any, tokenizer: Any) -> None:
    """The teacher's tokenizer must be the student's (``tokenizer``): ``distill.teacher_tokenizer``, else the teacher
    checkpoint's own ``tokenizer/``. A teacher with neither is read with the student's tokenizer, as TRL's
    GKDTrainer reads every teacher (its vocabulary size checked by :func:`check_vocab_size`)."""
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.data.tokenizer import TOKENIZER_FILES, holds_tokenizer, load_tokenizer, tokenizer_dir

    d = cfg.distill
    if d.teacher_tokenizer is not None:
        label, path = f"distill.teacher_tokenizer {d.teacher_tokenizer}", str(d.teacher_tokenizer)
        if not holds_tokenizer(tokenizer_dir(path)):
            raise UserError(f"{label}: no tokenizer there; give a tokenizer folder (with any of "
                            f"{', '.join(TOKENIZER_FILES)}) or a zoo checkpoint with a tokenizer/ folder")
    else:
        path = str(checkpoint_dir(str(d.teacher), "distill.teacher"))
        if not holds_tokenizer(tokenizer_dir(path)):
            return
        label = f"distill.teacher {d.teacher}"
    try:
        teacher_vocab = load_tokenizer(path).get_vocab()
    except UserError as e:  # files there that transformers cannot read
        raise UserError(f"{label}: {e}; set distill.teacher_tokenizer to the teacher's tokenizer") from None
    check_same_tokenizer(tokenizer.get_vocab(), teacher_vocab, label)


def check_teacher_vision(student: Any, teacher: Any, path: str) -> None:
    """A teacher of rows with images reads the student's patches: its tower must take the same input (patch
    layout and image tokens; its width and depth may differ), else one line naming it."""
    def reads(v: Any) -> tuple:
        return (v.tower, v.patch_size, v.image_size, v.num_channels, v.scale_factor, v.image_token_id,
                v.patch_dim, v.patches_per_image, v.tokens_per_image)

    if teacher is None:
        raise UserError(f"distill.teacher {path}: the rows have images and the teacher has no vision tower; use a "
                        "vision-language teacher of the student's image processing, or rows without images")
    if reads(teacher) != reads(student):
        raise UserError(f"distill.teacher {path}: its vision tower reads images differently from the student's "
                        f"(tower, patch size, image size, image tokens: {reads(teacher)} vs {reads(student)}); "
                        "use a teacher with the student's image processing")
