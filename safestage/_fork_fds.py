"""Destination write descriptors a forked child must not keep.

A child forked while a publish writes (a DataLoader worker, a multiprocessing Pool started
during a background publish) gets a copy of every descriptor. On mountpoint-s3 a write
descriptor still open in another process keeps the upload open, so the publish can neither
finish nor remove its file. The child closes its copies at once.

Tracked by path, registered *before* the open and forgotten *after* the close, then found in
the child by scanning /proc/self/fd: a set of descriptor numbers would miss a fork that lands
between an open returning and its number being recorded, or close a number reused by then.
Only descriptors opened for writing match: a reader the program has open on the same file
is not ours to close.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator

_paths: Counter[str] = Counter()  # path -> how many of our writes of it are in flight
_guard = threading.Lock()


@contextlib.contextmanager
def closed_in_children(path: os.PathLike[str] | str) -> Iterator[None]:
    """Around the open and close of ``path`` for writing: a child forked meanwhile closes it."""
    key = os.fspath(path)
    with _guard:
        _paths[key] += 1
    try:
        yield
    finally:
        with _guard:
            _paths[key] -= 1
            if _paths[key] <= 0:
                del _paths[key]


def after_fork_in_child() -> None:
    """Close the child's copies of our write descriptors (registered by _lifecycle)."""
    global _guard
    _guard = threading.Lock()  # a parent thread may have held it at fork()
    wanted = set(_paths)
    _paths.clear()
    if not wanted:
        return
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") not in wanted:
                continue
        except OSError:
            continue
        if _opened_for_writing(int(name)):
            with contextlib.suppress(OSError):
                os.close(int(name))


def _opened_for_writing(fd: int) -> bool:
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE != os.O_RDONLY
    except (OSError, ValueError):
        pass
    return False
