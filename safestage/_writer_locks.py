"""One direct writer of a destination file at a time, across the processes of this host.

``direct`` writes the final name itself (no temp, no rename: mountpoint-s3, #792). Two
processes writing one file that way at once (two ranks saving the same shard, a retried job
and its straggler) interleave their bytes under one name, and both report success (review
7; following a new file keeps its name open for the whole serialization). So every direct
publish holds an exclusive flock on a lock file of its own for the whole write: one per
destination path, in a private directory of this user (``/dev/shm/safestage-locks-<uid>``;
if someone else owns that name, ``$XDG_RUNTIME_DIR/safestage-locks``, then the temp
directory's ``safestage-locks-<uid>``).

The destination itself is never opened for this (review 8): opening it would wake a
writer blocked on a FIFO there, hold a reader handle beside our writer (mountpoint-s3
refuses a writer while a reader is open: EPERM), and take anyone's ``flock`` on it for a
writer's. A lock file is unlinked by its holder before it lets go; a waiter left holding a
lock on an unlinked file sees its name is another inode now and tries again. A process
killed while holding one leaves the file, unlocked (the next writer of that path takes it
as is): ``safestage clean`` removes lock files nobody holds. A child forked meanwhile closes its
copies at once (_fork_fds): the parent's lock stays, since a flock belongs to the open file
description, which the parent still holds.

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
from typing import Callable, Optional

from ._fork_fds import closed_in_children
from ._interrupts import deferred
from ._locks import BUSY, close_quietly

log = logging.getLogger("safestage")

_POLL_S = 0.05
_WARN_AFTER_S = 30.0
_warned_squatted: set[str] = set()


@contextlib.contextmanager
def sole_writer(dest: Path, still_wanted: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold the host-wide lock of ``dest`` for a direct write. ``still_wanted()`` is called
    while waiting and raises to give up (a cancelled commit, a followed writer that failed:
    a Ctrl-C in the saving thread must not wait for another process's write, review 9). Best
    effort: no lock directory, or no flock there, and the write goes ahead unlocked."""
    directory = lock_directory()
    if directory is None:
        yield
        return
    path = directory / (hashlib.sha256(os.fsencode(str(dest))).hexdigest()[:40] + ".lock")
    with closed_in_children(path, writes_only=False):
        fd = _acquire(path, dest, still_wanted)
        try:
            yield
        finally:
            if fd is not None:
                with deferred():  # a Ctrl-C now is raised once the lock is let go
                    try:
                        with contextlib.suppress(OSError):
                            os.unlink(path)  # before letting go: a waiter then sees a stale inode
                    finally:
                        close_quietly(fd)


def lock_directory(*, create: bool = True) -> Optional[Path]:
    """This user's private lock directory (created 0700 unless ``create`` is False), by its
    real path (what /proc/self/fd shows, for _fork_fds), or None if none can be had."""
    uid = os.geteuid()
    candidates = [Path("/dev/shm") / f"safestage-locks-{uid}"]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        candidates.append(Path(runtime) / "safestage-locks")
    candidates.append(Path(tempfile.gettempdir()) / f"safestage-locks-{uid}")
    for directory in candidates:
        if not directory.parent.is_dir():
            continue
        directory = Path(os.path.realpath(directory.parent)) / directory.name
        if create:
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                log.debug("no direct-writer lock directory %s: %s", directory, exc)
                continue
        try:
            info = os.lstat(directory)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & 0o077:
            return directory
        if str(directory) not in _warned_squatted:  # another user made it first (/dev/shm is
            _warned_squatted.add(str(directory))   # everyone's): never use it (review 9)
            log.warning(
                "%s is not a private directory of uid %d (owner uid %d, mode %o): direct "
                "writers do not take turns through it; trying the next place",
                directory, uid, info.st_uid, stat.S_IMODE(info.st_mode),
            )  # fmt: skip
    return None


def _acquire(path: Path, dest: Path, still_wanted: Callable[[], None]) -> Optional[int]:
    started = time.monotonic()
    said = 0  # 0: nothing logged yet, 1: INFO, 2: WARNING
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("cannot open the direct-writer lock %s of %s: %s", path, dest, exc)
            return None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in BUSY:
                        log.debug("no flock for the direct-writer lock of %s: %s", dest, exc)
                        close_quietly(fd)
                        return None
                # Not given up when its name goes while we wait: whoever removed it (a wipe of
                # /dev/shm, logind's RemoveIPC) does not make its holder stop writing (review
                # 10). Only a lock we hold is checked for staleness, below.
                still_wanted()
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
            if not _stale(path, fd):
                return fd
        except BaseException:
            close_quietly(fd)
            raise
        close_quietly(fd)


def _stale(path: Path, fd: int) -> bool:
    """Whether ``path`` no longer names the lock file ``fd`` is open on (its holder removed
    it before letting go: the lock to take is the file there now)."""
    try:
        return not os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
    except FileNotFoundError:
        return True
    except OSError:
        return False


def sweep() -> int:
    """Remove lock files nobody holds (their holder was killed); the number removed."""
    directory = lock_directory(create=False)  # no direct write yet: nothing to sweep
    if directory is None:
        return 0
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.endswith(".lock"):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _stale(path, fd):
                os.unlink(path)  # under the lock, as its holders do
                removed += 1
        except OSError:
            pass  # held: a live writer
        finally:
            close_quietly(fd)
    return removed
