"""Model batches as typed pytrees: :class:`TokenBatch` (what every task's rows hold; each task's batch class, a
subclass, lives with its task) and an online task's :class:`Rollout` (the batch it made, with what it measured).

A batch's arrays are [..., rows, length]: the step's global batch is
[grad_accum, micro, seq_len], one micro-batch [micro, seq_len]. A field a
batch may lack (a shared prompt's ``prefix_ids``, say) is None there. Each
class knows its layout (:meth:`TokenBatch.layout`: the batch as
``jax.ShapeDtypeStruct`` s in its arrays' places), so a step can be lowered and compiled without data.

A vision-language model's batch also carries its rows' images (:class:`VisionBatch`, the ``vision`` field): per row
``max_patches`` patches, each field [..., rows, width] like the token fields (the patches flattened to
``max_patches * patch_dim``), so the loop's sharding and micro-batch slicing treat them alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from zoo.model.vision import VisionInputs
from zoo.model.vision_config import VisionConfig

B = TypeVar("B", bound="TokenBatch")  # a batch class (a task's: pretrain.task.Task is generic in it)
B_co = TypeVar("B_co", bound="TokenBatch", covariant=True)  # a Rollout's batch class (read-only there)

INT, FLOAT = jnp.int32, jnp.float32


# The host batch's keys of a VisionBatch's fields (zoo.data.batching.to_model_batch passes them through whole).
VISION_PREFIX = "vision_"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionBatch(VisionInputs):
    """The rows' images as patches: :class:`zoo.model.vision.VisionInputs`' fields in the batch's layout
    (:mod:`zoo.data.vision_layout` lays them out): ``patches`` [..., rows, max_patches * patch_dim] float32 (flat,
    as every batch field is [..., rows, width]), the others [..., rows, max_patches] int32 (``patch_valid`` 0/1).
    :meth:`inputs` gives the model's layout of one micro-batch."""

    def inputs(self, v: VisionConfig) -> VisionInputs:
        """The model's :class:`VisionInputs` of one micro-batch ([rows, ...] arrays): the patches unflattened."""
        rows, width = self.patches.shape[-2:]
        return VisionInputs(self.patches.reshape(rows, width // v.patch_dim, v.patch_dim), self.patch_image,
                            self.patch_valid.astype(bool), self.patch_pos, self.patch_group, self.patch_slot)

    @classmethod
    def layout(cls, rows: tuple[int, ...], max_patches: int, patch_dim: int) -> VisionBatch:
        """The images of ``rows`` ([grad_accum, micro], say) rows of ``max_patches`` patches as
        ``jax.ShapeDtypeStruct`` s."""
        ints: Any = jax.ShapeDtypeStruct((*rows, max_patches), INT)  # in the arrays' places, as TokenBatch.layout's
        return cls(cast(Any, jax.ShapeDtypeStruct((*rows, max_patches * patch_dim), FLOAT)), ints, ints, ints, ints, ints)

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> VisionBatch | None:
        """The images of a model-batch dict (its ``vision_*`` keys), or None when it has none."""
        if VISION_PREFIX + "patches" not in arrays:
            return None
        return cls(**{f.name: arrays[VISION_PREFIX + f.name] for f in dataclasses.fields(cls)})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """Rows of tokens: each position's input and target token, the target's loss weight, the position's
    segment (0: padding) and its position in the segment; ``prefix_ids``: a shared prefix's ids, aligned with the
    inputs (zoo.model.decoder.forward), or None; ``vision``: a vision-language model's images (:class:`VisionBatch`),
    or None."""

    inputs: jax.Array
    targets: jax.Array
    weights: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    prefix_ids: jax.Array | None = None
    vision: VisionBatch | None = None

    @classmethod
    def of(cls: type[B], arrays: Mapping[str, Any]) -> B:
        """The batch of the model-batch dict ``arrays`` (zoo.data.batching.to_model_batch's): its fields by name,
        None where absent; other keys are left out."""
        present: dict[str, Any] = {f.name: arrays.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**{**present, "vision": VisionBatch.of(arrays)})

    def arrays(self) -> dict[str, jax.Array]:
        """The token fields that are there, as the dict zoo's model functions read (``vision`` is left out: the
        forward takes it as its own argument)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "vision" and getattr(self, f.name) is not None}

    @classmethod
    def dtypes(cls) -> dict[str, DTypeLike]:
        """Each field's dtype (for :meth:`layout`)."""
        return {"inputs": INT, "targets": INT, "weights": FLOAT, "segment_ids": INT, "positions": INT,
                "prefix_ids": INT}

    @classmethod
    def layout(cls: type[B], shape: tuple[int, ...], fields: tuple[str, ...] = (),
               vision: tuple[int, int] | None = None) -> B:
        """The batch of ``shape`` ([grad_accum, micro, seq_len], say) as ``jax.ShapeDtypeStruct`` s: every
        required field, the optional ones named in ``fields``, and with ``vision`` = (max_patches, patch_dim)
        the rows' images (:meth:`VisionBatch.layout`)."""
        kinds = cls.dtypes()
        # ShapeDtypeStructs in the arrays' places: jax reads the layout as the batch's pytree, abstract.
        out: dict[str, Any] = {f.name: jax.ShapeDtypeStruct(shape, kinds[f.name])
                               for f in dataclasses.fields(cls)
                               if f.name != "vision" and (f.default is dataclasses.MISSING or f.name in fields)}
        if vision is not None:
            out["vision"] = VisionBatch.layout(shape[:-1], *vision)
        return cls(**out)


@dataclass(frozen=True)
class Rollout(Generic[B_co]):
    """What an online task's :meth:`Task.rollout` made for one step: the model batch the step trains on (a
    ``B_co``: the task's batch class), the metrics it measured (logged with the step's), and how its time and
    tokens went, from which :meth:`timing` reports the step's split between making the batch and training on it.
    Frozen: read-only, so a rollout of a subclass's batch is a rollout of its base class's (covariant)."""

    batch: B_co
    metrics: dict[str, float]
    generation_s: float = 0.0  # seconds spent generating
    rollout_s: float = 0.0  # seconds spent making the batch in all
    tokens: int = 0  # the tokens the step's updates train on (every update's)
    log: list[dict[str, Any]] = field(default_factory=list)  # records for the task's own step log (its hooks)

    def timing(self, step_time: float) -> dict[str, float]:
        """The share of the step spent generating, and tokens per second of training and of the whole step
        (the loop's own count, batch_size x data.seq_len, would measure data rows, not the tokens trained)."""
        return {"generation_share": self.generation_s / step_time if step_time > 0 else 0.0,
                "train_tokens_per_sec": self.tokens / max(step_time - self.rollout_s, 1e-9),
                "tokens_per_sec": self.tokens / max(step_time, 1e-9)}
