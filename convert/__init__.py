"""Hugging Face / GGUF <-> zoo checkpoint conversion (streaming, table-driven)."""

from convert.convert import convert

__all__ = ["convert"]
