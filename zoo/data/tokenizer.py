"""The one tokenizer loader of lmzoo: a zoo checkpoint's tokenizer, or the one in a tokenizer folder.

``zoo generate``, ``zoo eval``, training runs (``model.tokenizer`` or the
checkpoint's own), the demo and the benchmarks all load through
:func:`load_tokenizer`, so they agree on where a tokenizer is, how it is read
and what a missing or broken one says.

An adapter checkpoint (a LoRA run's ``final``) holds a copy of its run's
tokenizer (pretrain/final.py copies it in), so it loads like any other checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zoo.checkpoints.format import MODEL_FILE, TOKENIZER_DIR
from zoo.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one makes a tokenizer folder


def holds_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` is a folder with tokenizer files in it (not whether they load)."""
    folder = Path(folder)
    return folder.is_dir() and any((folder / n).is_file() for n in TOKENIZER_FILES)


def tokenizer_dir(path: str | Path) -> Path:
    """The tokenizer folder of ``path``: its ``tokenizer/`` folder when it is a zoo checkpoint, else ``path`` itself."""
    path = Path(path)
    return path / TOKENIZER_DIR if (path / MODEL_FILE).is_file() else path


def load_tokenizer(path: str | Path) -> Any:
    """The transformers tokenizer of a zoo checkpoint (its ``tokenizer/`` folder) or in a tokenizer folder.

    A UserError says what is missing: a checkpoint without its tokenizer
    folder, a folder without tokenizer files, or files transformers cannot read.
    """
    folder = tokenizer_dir(path)
    if not holds_tokenizer(folder):
        if folder == Path(path):
            raise UserError(f"no tokenizer in {path}; give a zoo checkpoint or a folder with tokenizer files "
                            f"(any of {', '.join(TOKENIZER_FILES)})")
        if not folder.is_dir():
            raise UserError(f"{path} has no {TOKENIZER_DIR}/ folder; convert it from a source with tokenizer files")
        raise UserError(f"no tokenizer in {folder}; convert {path} again from a source with tokenizer files")
    try:
        generic = _generic_fast_tokenizer(folder)
        if generic is not None:
            return generic.from_pretrained(str(folder))
        from transformers import AutoTokenizer  # here, not at the top: importing transformers takes seconds

        return AutoTokenizer.from_pretrained(str(folder))
    except (ValueError, OSError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]  # transformers' messages run to many lines
        raise UserError(f"tokenizer {folder} cannot be loaded ({first})") from None


def _generic_fast_tokenizer(folder: Path) -> Any:
    """transformers' generic fast-tokenizer class when ``folder``'s tokenizer_config.json names it, else None.

    AutoTokenizer would resolve the name to this same class, but its module
    imports the model configurations, and with them torch wherever torch is
    installed: 0.25 GB of RSS in every training process, for nothing.
    Model-specific classes (LlamaTokenizerFast, ...) still go through AutoTokenizer.
    """
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if name not in ("TokenizersBackend", "PreTrainedTokenizerFast") or not (folder / "tokenizer.json").is_file():
        return None
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend
