"""Data files read into rows, their problems named by file and line, tokenizers, batches and JSON-lines logs."""

from zoo import submodules

__getattr__ = submodules(__name__)
