"""A checkpoint's provenance: the Hugging Face Hub repo its model comes from (model.json's ``hub_id``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# A Hub repo id as a source names it: a registry description ends in "(owner/repo)"; a Hub source is the bare id.
_REPO_ID = r"[\w.-]+/[\w.-]+"
HUB_ID = "hub_id"  # model.json: the Hub repo the checkpoint's model comes from (`zoo convert` records it)


def hub_repo_of(source: str) -> str | None:
    """The Hub repo id a checkpoint's ``source`` names, or None (a local folder or GGUF file)."""
    m = re.search(rf"\(({_REPO_ID})\)$", source)
    if m:
        return m.group(1)
    # A relative local folder can look like owner/repo too; `zoo convert` prefers an existing folder, so do we.
    if re.fullmatch(_REPO_ID, source) and not source.startswith(".") and not Path(source).exists():
        return source
    return None


def hub_id(meta: dict[str, Any]) -> str | None:
    """The Hub repo a checkpoint's model comes from: converted from it, maybe quantized or trained since.

    ``zoo convert`` records it (model.json's ``hub_id``), and ``zoo quantize`` and training runs copy it from
    the checkpoint they start from. A checkpoint converted before the field existed has it read from its
    ``source``. None: a local folder, a GGUF file, a random init, or a run started from one.
    """
    if meta.get(HUB_ID):
        return str(meta[HUB_ID])
    if str(meta.get("source_format", "")).startswith("hf"):
        return hub_repo_of(str(meta.get("source", "")))
    return None


def hub_weights(meta: dict[str, Any]) -> str | None:
    """The Hub repo whose model a checkpoint *is*, tensor for tensor as ``zoo export`` writes it; else None.

    Only a direct conversion qualifies: not a quantized or trained checkpoint (other weights), nor the language
    model of a multimodal repo (other module names: ``source_format`` ``hf-gemma3-multimodal``).
    """
    return hub_id(meta) if meta.get("source_format") == "hf" else None


def provenance_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``hub_id`` entry a checkpoint derived from ``meta``'s checkpoint carries (empty when none is known):
    pass it to :meth:`zoo.checkpoints.writer.CheckpointWriter.finish`."""
    repo = hub_id(meta)
    return {HUB_ID: repo} if repo else {}
