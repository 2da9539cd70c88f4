"""Which filesystem a path is on, and what each destination device has shown it can do.

The mount table is read from /proc/self/mountinfo (longest mount point that prefixes the
real path, as findmnt does). Verdicts of auto's rename probe ("this filesystem cannot
rename") are cached for the life of the process, so only the first save to a filesystem
probes. The key is the device *and* the mount (its id, type, source and mount point):
FUSE device numbers are reused as soon as a mount goes away (three mounts in a row all got
0:40 here), and one mount's verdict must not outlive it onto another filesystem.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Filesystems whose data lives on another machine or behind a userspace daemon: unsuitable
# as a staging root (the whole point is a local POSIX write) and the ones worth staging for.
NETWORK_FS_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "9p", "afs",
        "gpfs", "beegfs", "davfs", "ncpfs", "coda", "orangefs", "pvfs2", "virtiofs", "vboxsf",
        "panfs", "alluxio", "juicefs", "weka", "wekafs",
    }
)
LOCAL_FS_TYPES = frozenset(
    {
        "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "reiserfs", "jfs",
        "tmpfs", "ramfs", "overlay", "vfat", "exfat", "hfsplus", "apfs", "nilfs2",
    }
)


@dataclass(frozen=True)
class MountInfo:
    mount_point: str
    fs_type: str
    source: str
    options: str
    mount_id: int = -1

    @property
    def is_fuse(self) -> bool:
        return self.fs_type == "fuse" or self.fs_type.startswith(("fuse.", "fuseblk"))

    @property
    def is_network(self) -> bool:
        return self.fs_type in NETWORK_FS_TYPES

    @property
    def is_local(self) -> bool:
        return self.fs_type in LOCAL_FS_TYPES


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \040 \011 \012 \134
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match[1], 8)), field)


# The last table parsed, by file: (its text, its mounts). Every replace save looks its
# destination's mount up (filesystem_key); parsing the table took 0.35 ms of a 1 KiB save's
# 2.9 ms, reading it 0.1 ms. The text is read every time, so a mount made or gone since is
# seen at once; only an unchanged table is not parsed again.
_parsed: dict[str, tuple[str, tuple[MountInfo, ...]]] = {}


def read_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[MountInfo]:
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as table:
            text = table.read()
    except OSError:
        return []
    cached = _parsed.get(mountinfo)
    if cached is not None and cached[0] == text:
        return list(cached[1])
    mounts = _parse(text)
    _parsed[mountinfo] = (text, tuple(mounts))
    return mounts


def _parse(text: str) -> list[MountInfo]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 2:
            continue
        mounts.append(
            MountInfo(
                mount_point=_unescape(fields[4]),
                fs_type=tail[0],
                source=_unescape(tail[1]),
                options=fields[5],
                mount_id=int(fields[0]) if fields[0].isdigit() else -1,
            )
        )
    return mounts


def existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else the nearest parent that does."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_of(path: os.PathLike[str] | str) -> Optional[MountInfo]:
    """The mount holding ``path`` (or its nearest existing parent); None if unknown."""
    real = os.path.realpath(existing_ancestor(Path(path)))
    best: Optional[MountInfo] = None
    for mount in read_mounts():
        point = mount.mount_point.rstrip("/") or "/"
        holds = real == point or real.startswith(point + "/") or point == "/"
        # later lines win ties: a mount stacked on the same point hides the earlier one
        if holds and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = mount
    return best


_local_devices: dict[int, bool] = {}
_local_lock = threading.Lock()


def is_local_disk(directory: Path) -> bool:
    """Whether ``directory`` is on a local disk filesystem.

    Cached per device only for block devices (major != 0): anonymous devices (tmpfs,
    overlay, every FUSE mount) get their numbers reused as soon as a mount goes, so a
    verdict cached for one could be applied to a FUSE mount made later (skip_local_disk=True would
    then write an object store unstaged). Those are looked up each time (~0.1 ms).
    """
    device = os.stat(directory).st_dev
    if os.major(device) == 0:
        mount = mount_of(directory)
        return mount is not None and mount.is_local
    with _local_lock:
        known = _local_devices.get(device)
    if known is None:
        mount = mount_of(directory)
        known = mount is not None and mount.is_local
        with _local_lock:
            _local_devices[device] = known
    return known


def filesystem_key(directory: Path, device: int) -> Hashable:
    """What a capability verdict about ``directory``'s filesystem is cached under."""
    mount = mount_of(directory)
    if mount is None:
        return (device,)
    return (device, mount.mount_id, mount.fs_type, mount.source, mount.mount_point)


class CapabilityCache:
    """Per-filesystem verdicts of the rename probe, e.g. {filesystem_key(...): "direct"}."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._strategy: dict[Hashable, str] = {}

    def strategy_for(self, device: Hashable) -> Optional[str]:
        with self._lock:
            return self._strategy.get(device)

    def remember(self, device: Hashable, strategy: str) -> bool:
        """Record a verdict; True if it is news (so the caller warns once per device)."""
        with self._lock:
            news = self._strategy.get(device) != strategy
            self._strategy[device] = strategy
            return news

    def clear(self) -> None:
        with self._lock:
            self._strategy.clear()

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a parent thread may have held it at fork()


capabilities = CapabilityCache()


def after_fork_in_child() -> None:
    """A parent thread may have held these locks at fork() (_lifecycle)."""
    global _local_lock
    _local_lock = threading.Lock()
    capabilities.after_fork_in_child()

