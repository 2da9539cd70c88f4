"""Liveness that crosses PID namespaces: an owner holds a flock on what it is using.

``kill(pid, 0)`` cannot see a process in another PID namespace (two containers sharing a
scratch directory, hostNetwork pods with one host name), so a pid in a name proves nothing
there. A ``flock`` is kernel-wide: while the owner lives it holds ``LOCK_EX`` on its
private staging directory (and on the temp file it writes beside the destination, where
that filesystem supports locks); a cleaner that cannot take the lock leaves the entry alone.

The race between creating an entry and locking it is closed on both sides: a cleaner
removes only what it has locked, and holds the lock while removing; an owner that finds
its new entry locked, or no longer at its path once locked, abandons it for a fresh name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

log = logging.getLogger("safestage")

BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})


class Contended(Exception):
    """The entry just made is locked by someone else or is gone: make a fresh one."""


def claim(fd: int, path: Path) -> bool:
    """Lock ``fd`` (just created at ``path``) for its owner's lifetime.

    Returns False where the filesystem has no locks (the entry then carries only its
    name's host and pid, and other hosts remove it only with --older-than). Raises
    Contended if a cleaner holds it, or removed it before we locked it.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in BUSY:
            raise Contended(str(path)) from exc
        log.debug("no flock on %s: %s", path, exc)
        return False
    try:
        now, ours = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError as exc:
        raise Contended(str(path)) from exc
    except OSError:
        return True  # cannot tell (ESTALE on a network mount): keep it, the lock is ours
    if (now.st_dev, now.st_ino) != (ours.st_dev, ours.st_ino):
        raise Contended(str(path))
    return True


def close_quietly(fd: int) -> None:
    """Close a descriptor we only read, locked or fsync'ed: its close() says nothing about
    anyone's data, so a failure there must not fail a save (write descriptors are checked)."""
    with contextlib.suppress(OSError):
        os.close(fd)


def open_directory(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


@contextlib.contextmanager
def taken(path: Path, *, directory: bool) -> Iterator[Optional[bool]]:
    """For a cleaner: try to lock ``path``; yields True while we hold the lock (its owner is
    gone, or never locked it), False if a live owner holds it, None if this filesystem or
    entry cannot tell (no locks, or it refuses to open the entry)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | (os.O_DIRECTORY if directory else 0))
    except OSError as exc:
        log.debug("cannot open %s to check its lock: %s", path, exc)
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            yield False if exc.errno in BUSY else None
            return
        yield True
    finally:
        close_quietly(fd)
