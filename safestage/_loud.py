"""Errors nobody would hear: a failed publish must reach a human whatever the logging setup.

safestage installs a NullHandler on its logger (libraries must not configure logging), so a
program that never configured logging would hear nothing of a background publish that
failed, and the one error a block raises hides every other. ``error()`` logs as usual and,
when no real handler would take the record, also writes it to file descriptor 2 directly
(not through ``sys.stderr``, which a program may have closed or replaced). ``warning()`` does
the same for the few warnings that concern data: a kept copy a killed job left behind.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("safestage")


def error(message: str) -> None:
    log.error("%s", message)
    if not _heard(logging.ERROR):
        write_stderr(f"safestage: ERROR: {message}\n")


def warning(message: str) -> None:
    """A warning a human must hear (a checkpoint left behind): logged, and on stderr too
    when no handler would take the record."""
    log.warning("%s", message)
    if not _heard(logging.WARNING):
        write_stderr(f"safestage: WARNING: {message}\n")


def write_stderr(text: str) -> None:
    data = text.encode("utf-8", "backslashreplace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]


def _heard(level: int) -> bool:
    """Whether a record of ``level`` on our logger reaches a handler that is not a
    NullHandler (logging.lastResort does not count: NullHandler silences it)."""
    logger: logging.Logger | None = log
    while logger is not None:
        if logger.disabled or not logger.isEnabledFor(level):
            return False
        for handler in logger.handlers:
            if not isinstance(handler, logging.NullHandler) and level >= handler.level:
                return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False
