"""One direct writer of a destination file at a time, across the processes of this host.

``direct`` writes the final name itself (no temp, no rename: mountpoint-s3, #792). Two
processes writing one file that way at once (two ranks saving the same shard, a retried job
and its straggler) interleave their bytes under one name, and both report success (review
7; following a new file keeps its name open for the whole serialization). So every direct
publish holds an exclusive flock on a lock file of its own for the whole write: one per
destination path, in a private per-user directory of this host
(``/dev/shm/safestage-locks-<uid>``, else the temp directory).

The destination itself is never opened for this (review 8): opening it would wake a
writer blocked on a FIFO there, hold a reader handle beside our writer (mountpoint-s3
refuses a writer while a reader is open: EPERM), and take anyone's ``flock`` on it for a
writer's. A lock file is unlinked by its holder before it lets go, so none accumulate; a
waiter left holding a lock on an unlinked file sees its name is another inode now and
tries again. A child forked meanwhile closes its copies at once (the parent's lock stays:
a flock belongs to the open file description, which the parent still holds).

Scope: processes of one host and one user that see the same lock directory, naming the
file by the same resolved path. Other hosts and users are not serialized, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from ._locks import BUSY, close_quietly

log = logging.getLogger("safestage")

_POLL_S = 0.05
_WARN_AFTER_S = 30.0
# Lock descriptors this process holds: a forked child closes its copies (see above).
_held: set[int] = set()


@contextlib.contextmanager
def sole_writer(dest: Path) -> Iterator[None]:
    """Hold the host-wide lock of ``dest`` for a direct write; best effort (no lock
    directory, or a filesystem without flock: the write goes ahead unlocked, as before)."""
    held = _acquire(dest)
    try:
        yield
    finally:
        if held is not None:
            _release(*held)


def _lock_directory() -> Optional[Path]:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    directory = base / f"safestage-locks-{os.geteuid()}"
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.debug("no direct-writer lock directory %s: %s", directory, exc)
        return None
    try:
        info = os.lstat(directory)
    except OSError as exc:
        log.debug("no direct-writer lock directory %s: %s", directory, exc)
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        log.debug("%s is not a private directory of this user: direct writes are not locked", directory)
        return None
    return directory


def _acquire(dest: Path) -> Optional[tuple[int, Path]]:
    directory = _lock_directory()
    if directory is None:
        return None
    path = directory / (hashlib.sha256(os.fsencode(str(dest))).hexdigest()[:40] + ".lock")
    started = time.monotonic()
    said = 0  # 0: nothing logged yet, 1: INFO, 2: WARNING
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("cannot open the direct-writer lock %s of %s: %s", path, dest, exc)
            return None
        _held.add(fd)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in BUSY:
                        log.debug("no flock for the direct-writer lock of %s: %s", dest, exc)
                        _drop(fd)
                        return None
                waited = time.monotonic() - started
                if said == 0:
                    log.info("%s: waiting for another process's direct write of it to end", dest)
                    said = 1
                elif said == 1 and waited > _WARN_AFTER_S:
                    log.warning(
                        "%s: still waiting after %.0f s for another process of this host writing "
                        "it with publish='direct' (lock %s)", dest, waited, path,
                    )  # fmt: skip
                    said = 2
                time.sleep(_POLL_S)
            try:
                current = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                current = None
        except BaseException:
            _drop(fd)
            raise
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            return fd, path
        _drop(fd)  # its holder removed it while we waited: take the one there now


def _release(fd: int, path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)  # before letting go: a waiter then sees a stale inode and retries
    _drop(fd)


def _drop(fd: int) -> None:
    _held.discard(fd)
    close_quietly(fd)


def _after_fork_in_child() -> None:
    for fd in list(_held):
        close_quietly(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
