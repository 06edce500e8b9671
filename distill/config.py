"""The ``distill:`` section of ``sft train``: GKD's keys (TRL 1.16's GKDConfig names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    from zoo.checkpoints.format import read_config
    from zoo.checkpoints.loading import load_params
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.data.tokenizer import load_tokenizer

    d: DistillSection = ctx.cfg.distill
    ckpt = checkpoint_dir(str(d.teacher), "distill.teacher")
    check_same_tokenizer(ctx.tokenizer.get_vocab(), load_tokenizer(ckpt).get_vocab(), str(d.teacher))
    return read_config(ckpt), load_params(ckpt, ctx.mesh, DTYPES[ctx.cfg.dtype.params])


def abstract_teacher(ctx: Any) -> tuple[Any, dict]:
    """For ``--compile-only``: the teacher's model config, read without weights (a zoo checkpoint, a registry
    name or a config.json), and its params as ``jax.ShapeDtypeStruct`` s sharded on the run's mesh."""
    import dataclasses

    import jax

    from pretrain.compile_only import model_config_of
    from pretrain.dtypes import DTYPES
    from zoo.model.params import nest, param_specs
    from zoo.model.sharding import named_sharding

    mcfg = dataclasses.replace(model_config_of(str(ctx.cfg.distill.teacher), "distill.teacher"),
                               attention=ctx.mcfg.attention)
    dtype = DTYPES[ctx.cfg.dtype.params]
    return mcfg, nest({k: jax.ShapeDtypeStruct(s.shape, dtype, sharding=named_sharding(ctx.mesh, s.axes, s.shape))
                       for k, s in param_specs(mcfg).items()})
