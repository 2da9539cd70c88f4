"""What safestage says reaches a person, once, whatever the logging setup.

A library must not configure logging, and the usual NullHandler on its logger silences
Python's last-resort handler: a script that activates in code (``with safestage.staged():``)
and never configures logging would hear nothing, not even the WARNING that its mount cannot
rename. ``LastResort`` takes the NullHandler's place on the "safestage" logger and stands in
for Python's last resort: it writes a record of WARNING or above (the level
``SAFESTAGE_LOG_LEVEL`` sets when activated from the environment) to file descriptor 2, not
through ``sys.stderr`` (which a program may have closed or replaced, or end with
``os._exit``), and only when no other handler would take the record: a program that
configured logging hears each record once, through its own handlers.

``error()`` and ``warning()`` are for what concerns data (a failed background publish, a kept
copy a killed job left behind): written to stderr even when the program silenced the logger.

In a job of many processes, what concerns the whole node or job is said once (``speaks_for_node``).
A wait that goes on for seconds says what it waits for (``wait_saying``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("safestage")

PRINTED = "safestage_printed"  # a record whose line was already written on stderr


class LastResort(logging.Handler):
    """Writes a record on stderr when no other handler of the logger's chain would take it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("safestage: %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, PRINTED, False) or _heard(record.levelno):
            return
        try:
            text = self.format(record)
        except Exception:  # a bad format argument must not break the save that logged it
            self.handleError(record)
            return
        write_stderr(f"{text}\n")


def install() -> LastResort:
    """The one LastResort of the "safestage" logger (idempotent: a module reloaded, a .pth
    run twice)."""
    for handler in log.handlers:
        if isinstance(handler, LastResort):
            return handler
    handler = LastResort()
    log.addHandler(handler)
    return handler


def error(message: str) -> None:
    _say(logging.ERROR, message)


def warning(message: str) -> None:
    """A warning a human must hear (a checkpoint left behind): logged, and on stderr even
    when the program turned the logger off."""
    _say(logging.WARNING, message)


def _say(level: int, message: str) -> None:
    log.log(level, "%s", message)
    if log.disabled or not log.isEnabledFor(level):  # no handler saw it, LastResort neither
        write_stderr(f"safestage: {logging.getLevelName(level)}: {message}\n")


def write_stderr(text: str) -> None:
    data = text.encode("utf-8", "backslashreplace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]


def _heard(level: int) -> bool:
    """Whether a record of ``level`` on our logger reaches a handler other than ours (a
    NullHandler does not count)."""
    logger: logging.Logger | None = log
    while logger is not None:
        for handler in logger.handlers:
            if not isinstance(handler, (logging.NullHandler, LastResort)) and level >= handler.level:
                return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def local_rank() -> int | None:
    """This process's rank on its node in a job its launcher started several of (torchrun:
    LOCAL_RANK; Slurm's srun: SLURM_LOCALID; Open MPI: OMPI_COMM_WORLD_LOCAL_RANK), or None."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def speaks_for_node() -> bool:
    """Whether this process says what concerns its whole node (what it finds in the staging
    root every rank of the node shares, what a mount can do): a process that is not one of
    several ranks, else local rank 0. Another rank logs the same at INFO (``level``)."""
    return local_rank() in (None, 0)


def speaks_for_job() -> bool:
    """Whether this process says what concerns the whole job (a setting every rank shares):
    a process that is not one of several ranks, else rank 0 (RANK, which torchrun sets;
    Slurm's SLURM_PROCID; Open MPI's OMPI_COMM_WORLD_RANK)."""
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value) == 0
    return True


def level(speaks: bool) -> int:
    """WARNING for the process that says a thing for the node or job, INFO for the others."""
    return logging.WARNING if speaks else logging.INFO


SAY_AFTER = 5.0  # seconds a wait goes on in silence before it says what it waits for


def wait_saying(
    condition: threading.Condition,
    predicate: Callable[[], bool],
    waiting_for: Callable[[], str],
    *,
    level: int = logging.WARNING,
) -> None:
    """``condition.wait_for(predicate)``, the caller holding ``condition``. Once it has waited
    SAY_AFTER seconds it says, once, what it waits for (``waiting_for()``, called holding the
    condition: the path and what holds it), and at its end how long it waited (INFO): a
    training loop blocked behind an upload says so, never hangs in silence."""
    if condition.wait_for(predicate, timeout=SAY_AFTER):
        return
    started = time.monotonic() - SAY_AFTER
    what = waiting_for()
    _unlocked(condition, lambda: log.log(level, "waiting for %s (%.0f s so far)", what, SAY_AFTER))
    condition.wait_for(predicate)
    _unlocked(condition, lambda: log.info("waited %.1f s for %s", time.monotonic() - started, what))


def _unlocked(condition: threading.Condition, say: Callable[[], None]) -> None:
    """Log without holding ``condition``: a handler that blocks (stderr a full pipe) must not
    stop the threads that end the work being waited for."""
    condition.release()
    try:
        say()
    finally:
        condition.acquire()
