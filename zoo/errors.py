"""User-facing errors: one clear line, exit code 2, no traceback; and a run's stop on a signal, which is none."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user gave us (a path, a config, a checkpoint).

    The command-line entry points print ``error: <message>`` and exit with
    code 2; the message must name the offending thing and how to fix it.
    """

    exit_code = 2


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal (Ctrl-C's SIGINT, or SIGTERM) at a step boundary, its checkpoint saved: not an
    error. The command-line entry points print the message as it is (no ``error:``) and exit with
    ``exit_code``, a shell's 128 + the signal's number (130 for Ctrl-C). A KeyboardInterrupt, so that a caller
    of ``train()`` (a notebook) sees what Ctrl-C raises anywhere else."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code
