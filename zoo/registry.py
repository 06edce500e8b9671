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
    ZooEntry("mistral-7b-v0.3", "mistral", "mistralai/Mistral-7B-v0.3", 7.25e9, "Mistral 7B"),
    ZooEntry("mistral-7b-instruct-v0.3", "mistral", "mistralai/Mistral-7B-Instruct-v0.3", 7.25e9, "Mistral 7B chat"),
    ZooEntry("gemma-2b", "gemma", "google/gemma-2b", 2.51e9, "Gemma 1"),
    ZooEntry("gemma-2b-it", "gemma", "google/gemma-2b-it", 2.51e9, "Gemma 1 chat"),
    ZooEntry("gemma-7b", "gemma", "google/gemma-7b", 8.54e9, "Gemma 1"),
    ZooEntry("gemma-7b-it", "gemma", "google/gemma-7b-it", 8.54e9, "Gemma 1 chat"),
    ZooEntry("gemma2-2b", "gemma2", "google/gemma-2-2b", 2.61e9, "Gemma 2, soft-capping, local/global"),
    ZooEntry("gemma2-2b-it", "gemma2", "google/gemma-2-2b-it", 2.61e9, "Gemma 2 chat"),
    ZooEntry("gemma2-9b", "gemma2", "google/gemma-2-9b", 9.24e9, "Gemma 2"),
    ZooEntry("gemma2-9b-it", "gemma2", "google/gemma-2-9b-it", 9.24e9, "Gemma 2 chat"),
    ZooEntry("gemma2-27b", "gemma2", "google/gemma-2-27b", 27.2e9, "Gemma 2"),
    ZooEntry("gemma2-27b-it", "gemma2", "google/gemma-2-27b-it", 27.2e9, "Gemma 2 chat"),
    ZooEntry("gemma3-270m", "gemma3", "google/gemma-3-270m", 268e6, "Gemma 3 text"),
    ZooEntry("gemma3-270m-it", "gemma3", "google/gemma-3-270m-it", 268e6, "Gemma 3 text chat"),
    ZooEntry("gemma3-1b", "gemma3", "google/gemma-3-1b-pt", 1.0e9, "Gemma 3 text"),
    ZooEntry("gemma3-1b-it", "gemma3", "google/gemma-3-1b-it", 1.0e9, "Gemma 3 text chat"),
    ZooEntry("gemma3-4b", "gemma3", "google/gemma-3-4b-pt", 3.88e9, "Gemma 3: text weights of the multimodal checkpoint"),
    ZooEntry("gemma3-4b-it", "gemma3", "google/gemma-3-4b-it", 3.88e9, "Gemma 3 chat: text weights of the multimodal checkpoint"),
    ZooEntry("gemma3-12b", "gemma3", "google/gemma-3-12b-pt", 11.8e9, "Gemma 3: text weights of the multimodal checkpoint"),
    ZooEntry("gemma3-12b-it", "gemma3", "google/gemma-3-12b-it", 11.8e9, "Gemma 3 chat: text weights of the multimodal checkpoint"),
    ZooEntry("gemma3-27b", "gemma3", "google/gemma-3-27b-pt", 27.0e9, "Gemma 3: text weights of the multimodal checkpoint"),
    ZooEntry("gemma3-27b-it", "gemma3", "google/gemma-3-27b-it", 27.0e9, "Gemma 3 chat: text weights of the multimodal checkpoint"),
    ZooEntry("qwen2.5-0.5b", "qwen2", "Qwen/Qwen2.5-0.5B", 494e6, "Qwen 2.5, q/k/v bias"),
    ZooEntry("qwen2.5-0.5b-instruct", "qwen2", "Qwen/Qwen2.5-0.5B-Instruct", 494e6, "Qwen 2.5 chat"),
    ZooEntry("qwen2.5-7b", "qwen2", "Qwen/Qwen2.5-7B", 7.62e9, "Qwen 2.5"),
    ZooEntry("qwen2.5-7b-instruct", "qwen2", "Qwen/Qwen2.5-7B-Instruct", 7.62e9, "Qwen 2.5 chat"),
    ZooEntry("qwen3-0.6b", "qwen3", "Qwen/Qwen3-0.6B-Base", 596e6, "Qwen 3 base, q/k norm"),
    ZooEntry("qwen3-0.6b-instruct", "qwen3", "Qwen/Qwen3-0.6B", 596e6, "Qwen 3 post-trained (chat/thinking)"),
    ZooEntry("qwen3-8b", "qwen3", "Qwen/Qwen3-8B-Base", 8.19e9, "Qwen 3 base"),
    ZooEntry("qwen3-8b-instruct", "qwen3", "Qwen/Qwen3-8B", 8.19e9, "Qwen 3 post-trained (chat/thinking)"),
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
