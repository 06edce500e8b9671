"""Named models: the zoo's catalogue (data, not code)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from zoo.errors import UserError


@dataclass(frozen=True)
class ZooEntry:
    """One named model: its family, Hub repository and size."""

    name: str
    family: str
    hf_repo: str
    params: float  # parameter count, for display
    description: str = ""


_ENTRIES = [
    ZooEntry("llama2-7b", "llama", "meta-llama/Llama-2-7b-hf", 6.74e9, "Llama 2, multi-head attention"),
    ZooEntry("llama3-8b", "llama", "meta-llama/Meta-Llama-3-8B", 8.03e9, "Llama 3, GQA"),
    ZooEntry("llama3-8b-instruct", "llama", "meta-llama/Meta-Llama-3-8B-Instruct", 8.03e9, "Llama 3 chat"),
    ZooEntry("llama3.1-8b", "llama", "meta-llama/Llama-3.1-8B", 8.03e9, "Llama 3.1, llama3 RoPE scaling"),
    ZooEntry("llama3.1-8b-instruct", "llama", "meta-llama/Llama-3.1-8B-Instruct", 8.03e9, "Llama 3.1 chat"),
    ZooEntry("llama3.1-70b", "llama", "meta-llama/Llama-3.1-70B", 70.55e9, "Llama 3.1 70B"),
    ZooEntry("llama3.2-1b", "llama", "meta-llama/Llama-3.2-1B", 1.24e9, "Llama 3.2, tied embeddings"),
    ZooEntry("llama3.2-1b-instruct", "llama", "meta-llama/Llama-3.2-1B-Instruct", 1.24e9, "Llama 3.2 chat"),
    ZooEntry("llama3.2-3b", "llama", "meta-llama/Llama-3.2-3B", 3.21e9, "Llama 3.2 3B"),
    ZooEntry("llama3.2-3b-instruct", "llama", "meta-llama/Llama-3.2-3B-Instruct", 3.21e9, "Llama 3.2 3B chat"),
    ZooEntry("smollm2-135m-instruct", "llama", "HuggingFaceTB/SmolLM2-135M-Instruct", 134.5e6, "SmolLM2 chat (Llama architecture)"),
    ZooEntry("smollm2-1.7b-instruct", "llama", "HuggingFaceTB/SmolLM2-1.7B-Instruct", 1.71e9, "SmolLM2 chat (Llama architecture)"),
]

REGISTRY: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def get(name: str) -> ZooEntry:
    """The entry called ``name``; an unknown name is a UserError naming the nearest ones."""
    if name in REGISTRY:
        return REGISTRY[name]
    close = difflib.get_close_matches(name, list(REGISTRY), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"unknown model name '{name}'{hint} (`zoo list` shows them all)")


def looks_like_name(source: str) -> bool:
    """True when ``source`` is a bare name (no slash, no file suffix): a registry lookup."""
    return "/" not in source and "\\" not in source and not source.endswith(".gguf")


def human_count(n: float) -> str:
    """1.24e9 -> '1.24B'."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))
