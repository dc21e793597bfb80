"""Errors the command line turns into a one-paragraph message and an exit code (no traceback)."""

from __future__ import annotations


class HarnessError(Exception):
    """An error a person can fix; its message says what is wrong and how to fix it."""

    exit_code = 2


class UsageError(HarnessError):
    """Bad input: an unknown pair, a missing or malformed repro, a plugin that fails to import."""

    exit_code = 2


class CannotEvaluate(HarnessError):
    """A repro that cannot be evaluated here (its pair is missing, a plugin does not import).

    `harness replay` exits 2 for it, or 125 during a `git bisect run` so bisect skips the commit.
    """

    exit_code = 2
