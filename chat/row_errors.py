"""The error of a data row that cannot be used (chat/formats.py, chat/tool_rows.py and every chat task raise it;
the caller names the file and row: zoo.data.row_origin.bad_row)."""

from __future__ import annotations


class BadRow(ValueError):
    """One row cannot be used; the message says why (the caller names the file and row)."""
