"""Descriptors a forked child must not keep: our destination writes and writer locks.

A child forked while a publish runs (a DataLoader worker, a multiprocessing Pool) gets a
copy of every descriptor. On mountpoint-s3 a write descriptor still open in another process
keeps the upload open, so the publish can neither finish nor remove its file (review 7); a
copied writer-lock descriptor keeps the lock held, or held on a lock file its owner has
already removed, so another process's direct save of that file waits as long as the child
lives (review 9). The child closes them at once.

Tracked by path, registered *before* the open and forgotten *after* the close, then found in
the child by scanning /proc/self/fd: a set of descriptor numbers would miss a fork that lands
between an open returning and its number being recorded, or between forgetting it and its
close (review 9 saw 1 in 30 children keep one). Only descriptors opened for writing match a
destination path: a reader the program has open on the same file is not ours to close.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator

_paths: Counter[str] = Counter()  # path -> how many of our opens of it are in flight
_writes_only: dict[str, bool] = {}  # path -> match only descriptors opened for writing
_guard = threading.Lock()


@contextlib.contextmanager
def closed_in_children(path: os.PathLike[str] | str, *, writes_only: bool) -> Iterator[None]:
    """Around the open and close of ``path``: a child forked meanwhile closes it."""
    key = os.fspath(path)
    with _guard:
        _paths[key] += 1
        _writes_only[key] = writes_only
    try:
        yield
    finally:
        with _guard:
            _paths[key] -= 1
            if _paths[key] <= 0:
                del _paths[key]
                _writes_only.pop(key, None)


def _after_fork_in_child() -> None:
    global _guard
    _guard = threading.Lock()  # a parent thread may have held it at fork()
    wanted = dict(_writes_only)
    _paths.clear()
    _writes_only.clear()
    if not wanted:
        return
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        path = link
        if path not in wanted:  # a removed file's link reads "<path> (deleted)"; a live file
            path = link.removesuffix(" (deleted)")  # may be named so itself (review 10)
            if path not in wanted:
                continue
        fd = int(name)
        if wanted[path] and not _opened_for_writing(fd):
            continue
        with contextlib.suppress(OSError):
            os.close(fd)


def _opened_for_writing(fd: int) -> bool:
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE != os.O_RDONLY
    except (OSError, ValueError):
        pass
    return False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
