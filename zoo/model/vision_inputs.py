"""A batch's images as the towers take them: patches with per-patch metadata (:mod:`zoo.data.vision_layout` lays
them out on the host). Its own module so that every tower (zoo.model.vision, vision_gemma4) reads it and
zoo.model.vision can dispatch to the others without an import cycle."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax


@partial(jax.tree_util.register_dataclass,
         data_fields=("patches", "patch_image", "patch_valid", "patch_pos", "patch_group", "patch_slot"),
         meta_fields=())
@dataclass(frozen=True)
class VisionInputs:
    """A batch's images as patches, [rows, max_patches, ...] each (:mod:`zoo.data.vision_layout` has the meaning
    of every field): ``patches`` [b, n, patch_dim] float, ``patch_image`` [b, n] int (0: no image),
    ``patch_valid`` [b, n] bool, ``patch_pos`` [b, n] int, ``patch_group`` [b, n] int (-1: no token),
    ``patch_slot`` [b, n] int."""

    patches: jax.Array
    patch_image: jax.Array
    patch_valid: jax.Array
    patch_pos: jax.Array
    patch_group: jax.Array
    patch_slot: jax.Array
