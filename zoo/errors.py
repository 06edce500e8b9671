"""User-facing errors: one clear line, exit code 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user gave us (a path, a config, a checkpoint).

    The command-line entry points print ``error: <message>`` and exit with
    code 2; the message must name the offending thing and how to fix it.
    """

    exit_code = 2
