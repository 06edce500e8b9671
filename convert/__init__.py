"""Hugging Face / GGUF <-> zoo checkpoint conversion (streaming, table-driven): :func:`convert.convert.convert`.

Nothing is imported here: `zoo` builds its parser from convert/cli.py, which must not load the converter or JAX.
"""
