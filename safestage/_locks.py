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

from ._names import Owner

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
    fd, locked = try_lock(path, directory=directory)
    try:
        yield locked
    finally:
        if fd is not None:
            close_quietly(fd)


def try_lock(path: Path, *, directory: bool) -> tuple[Optional[int], Optional[bool]]:
    """For a cleaner that goes on holding what it locked (recover): (fd, True) while we hold
    ``path``'s lock (the caller closes fd), (None, False) if a live owner holds it, (None,
    None) if this filesystem or entry cannot tell."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | (os.O_DIRECTORY if directory else 0))
    except OSError as exc:
        log.debug("cannot open %s to check its lock: %s", path, exc)
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        close_quietly(fd)
        return None, False if exc.errno in BUSY else None
    return fd, True


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (ourselves included). A zombie is not alive: a
    killed rank stays one until its launcher reaps it."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except (OverflowError, ValueError):
        return False  # no process can have that pid
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: kill() said it exists
    return state not in (b"Z", b"X")


def owner_gone(
    owner: Owner,
    locked: Optional[bool],
    *,
    local: bool,
    mtime: float = 0.0,
    older_than: Optional[float] = None,
    now: float = 0.0,
) -> tuple[bool, str]:
    """The one answer to "is the owner of this entry gone?": (gone, why). ``locked``: True we
    hold the entry's lock, False a live owner holds it, None the lock cannot tell. ``local``:
    the entry is on a local filesystem (a staging root), whose locks are kernel-wide whatever
    the host name; beside a destination a lock counts only for this host's entries, and where
    the lock cannot tell, only ``older_than`` (an mtime older than that) removes an entry."""
    if locked is False:
        return False, "in use: its owner holds its lock (it may run in another PID namespace)"
    this_host = owner.is_this_host()
    if this_host and process_alive(owner.pid):
        return False, f"its owner, pid {owner.pid}, is running"
    if locked and (this_host or local):
        return True, (
            f"its owner, pid {owner.pid}, is gone (nobody holds its lock)"
            if this_host
            else f"made on host {owner.host}; nobody holds its lock"
        )
    why = (
        f"made on host {owner.host}: pid {owner.pid} cannot be checked from here"
        if not this_host
        else "this filesystem cannot tell whether its owner lives (no locks)"
    )
    age = now - mtime
    if older_than is None:
        return False, f"{why} (pass --older-than SECONDS to remove old ones)"
    if age <= older_than:
        return False, f"{why}; modified {age:.0f} s ago (not older than {older_than:g} s)"
    return True, f"{why}; untouched for {age:.0f} s (older than {older_than:g} s)"
