"""The hostile passthrough filesystem: an mfusepy ``Operations`` subclass over a backing directory.

This module runs only inside the FUSE server process (see ``_server.py``). It imports nothing
from ``safestage`` so the server can be started as a plain script, without importing the
package ``__init__`` (and whatever heavy libraries it may pull in).

Every I/O goes through real file descriptors on the backing files (``os.pread``/``os.pwrite``),
one per FUSE open, so per-open state (bytes written, dirty, failed) is tracked per handle.

Each mode is a :class:`Policy`: which syscalls fail, with which errno. Every refusal is counted
by :class:`FaultCounter`, which rewrites a small JSON file *before* the error is returned to the
kernel, so a test that just saw the syscall fail can read the count.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import mfusepy
from mfusepy import FuseOSError, Operations

log = logging.getLogger("safestage.testing")

# fuse_common.h (libfuse 3): the kernel passes O_TRUNC to open() instead of sending a separate
# setattr(size=0). That is how "open(O_TRUNC) works but ftruncate() fails" can be told apart.
FUSE_CAP_ATOMIC_O_TRUNC = 1 << 3
# libfuse3's receive buffer holds 256 pages (1 MiB on x86-64): ask for writes that big.
MAX_WRITE = 1 << 20
# utimensat(2) sentinels, as libfuse's high-level setattr hands them to utimens().
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
AT_FDCWD = -100
# The throttle's burst allowance, in seconds of bandwidth (10 ms: 1 MB at 100 MB/s).
_THROTTLE_CREDIT_S = 0.01

_STAT_KEYS = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_rdev", "st_blocks", "st_blksize")
# Flags that must not reach the backing open(): the kernel already applied O_APPEND when it
# computed the write offset (a backing O_APPEND fd would make pwrite ignore that offset), and
# O_DIRECT alignment rules of the backing disk are not the caller's business.
_STRIP_FLAGS = os.O_APPEND | getattr(os, "O_DIRECT", 0) | os.O_NOCTTY


@dataclass(frozen=True)
class Policy:
    """What a mode refuses, as errno values. ``None`` means: behave like a local disk."""

    truncate: Optional[int] = None  # truncate(path, n) with n > 0
    truncate_zero: Optional[int] = None  # truncate(path, 0)
    ftruncate: Optional[int] = None  # ftruncate(fd, n): FUSE setattr(size) carrying a file handle
    fallocate: Optional[int] = None
    nonsequential_write: Optional[int] = None  # a write not at the current end of the file
    rename: Optional[int] = None
    chmod: Optional[int] = None
    chown: Optional[int] = None
    link: Optional[int] = None
    symlink: Optional[int] = None
    fail_close: bool = False  # close-eio: close()/fsync() of a created or written file fail, data dropped
    object_semantics: bool = False  # mountpoint-s3: single sequential writer, visible on close
    default_mbps: Optional[float] = None

    def fault_names(self) -> tuple[str, ...]:
        """The fault counters this mode can increment (all reported, zero or not)."""
        names: list[str] = []
        for attr, name in _POLICY_FAULTS:
            if getattr(self, attr) is not None and name not in names:
                names.append(name)
        if self.object_semantics:
            names += ["open", "read", "unlink", "utimens"]
        if self.fail_close:
            names += ["flush", "fsync", "write"]
        return tuple(sorted(set(names)))


_POLICY_FAULTS = (
    ("truncate", "truncate"),
    ("truncate_zero", "truncate"),
    ("ftruncate", "ftruncate"),
    ("fallocate", "fallocate"),
    ("nonsequential_write", "write"),
    ("rename", "rename"),
    ("chmod", "chmod"),
    ("chown", "chown"),
    ("link", "link"),
    ("symlink", "symlink"),
)

POLICIES: dict[str, Policy] = {
    "passthrough": Policy(),
    "slow": Policy(default_mbps=200.0),
    # safetensors#787: HDFS FUSE (fuse_dfs) answers ENOSYS to ftruncate; truncating a path to
    # zero, which is how it implements overwrite-by-O_TRUNC, works.
    "hdfs": Policy(truncate=errno.ENOSYS, ftruncate=errno.ENOSYS, fallocate=errno.EOPNOTSUPP),
    # safetensors#842: the same failure, reported as EOPNOTSUPP (errno 95).
    "eopnotsupp": Policy(
        truncate=errno.EOPNOTSUPP, ftruncate=errno.EOPNOTSUPP, fallocate=errno.EOPNOTSUPP
    ),
    # An object-store FUSE without a local cache (e.g. rclone --vfs-cache-mode off): uploads are
    # streams, so no resizing and no writes anywhere but the end.
    "objectstore": Policy(
        truncate=errno.EPERM,
        truncate_zero=errno.EPERM,
        ftruncate=errno.EPERM,
        fallocate=errno.EOPNOTSUPP,
        nonsequential_write=errno.EPERM,
    ),
    # mountpoint-s3 (doc/SEMANTICS.md): no rename, no chmod/chown, no links, no fallocate,
    # sequential writes from offset 0 only (EINVAL), overwrite only with O_TRUNC, a new object is
    # unreadable and undeletable until closed. Real mountpoint-s3 refuses setattr(size) with
    # EPERM on committed objects; we refuse it always (a stricter, simpler model).
    "mountpoint": Policy(
        truncate=errno.EPERM,
        truncate_zero=errno.EPERM,
        ftruncate=errno.EPERM,
        fallocate=errno.EOPNOTSUPP,
        nonsequential_write=errno.EINVAL,
        rename=errno.ENOSYS,
        chmod=errno.EPERM,
        chown=errno.EPERM,
        # mountpoint-s3 leaves link/symlink unimplemented (ENOSYS); Linux >= 6.x turns ENOSYS
        # from a FUSE link into EPERM, so say EPERM for links on every kernel.
        link=errno.EPERM,
        symlink=errno.ENOSYS,
        object_semantics=True,
    ),
    # An object store whose upload fails at close: close(2) and fsync(2) say EIO and the object
    # is gone, so code that ignores close() errors loses data silently.
    "close-eio": Policy(fail_close=True),
}


class FaultCounter:
    """Counts fired faults and mirrors them to a JSON file the parent process reads."""

    def __init__(self, path: Optional[str], names: tuple[str, ...]) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {name: 0 for name in names}
        self._dump()

    def fire(self, op: str, err: int, path: Optional[str] = None) -> FuseOSError:
        """Record that ``op`` failed with ``err``; return the exception for the caller to raise."""
        with self._lock:
            self._counts[op] = self._counts.get(op, 0) + 1
            self._dump()
        log.info("fault fired: %s on %s -> %s", op, path, errno.errorcode.get(err, err))
        return FuseOSError(err)

    def _dump(self) -> None:
        # Written before the error reaches the kernel, and replaced atomically, so a reader never
        # sees a half-written file nor a count lagging behind the syscall it just watched fail.
        if self._path is None:
            return
        tmp = f"{self._path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(self._counts, handle, sort_keys=True)
        os.replace(tmp, self._path)


class Throttle:
    """Paces writes to ``mbps`` MB/s (10**6 bytes/s) by sleeping in the write handler."""

    def __init__(self, mbps: float) -> None:
        if mbps <= 0:
            raise ValueError(f"mbps must be positive, got {mbps}")
        self._rate = mbps * 1e6
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def book(self, nbytes: int) -> float:
        """Reserve transmission time for ``nbytes``; return when (monotonic) it is over.

        Writes are booked on one shared timeline, so concurrent writers share the bandwidth.
        """
        with self._lock:
            # A few ms of credit absorb the FUSE round trip between two requests, which would
            # otherwise keep the mount below ``mbps``; a longer idle time earns nothing more.
            start = max(time.monotonic() - _THROTTLE_CREDIT_S, self._next)
            self._next = start + nbytes / self._rate
            return self._next

    @staticmethod
    def wait_until(deadline: float) -> None:
        # Called after the real write, so the time the write itself took counts towards the
        # budget instead of slowing the mount below ``mbps``.
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)


@dataclass
class _Handle:
    fd: int
    path: str
    dev: int
    ino: int
    writable: bool
    written: int = 0  # end offset of the bytes written through this handle
    dirty: bool = False  # close-eio: written since open
    failed: bool = False  # close-eio: the "upload" already failed and was discarded
    uploading: bool = False  # mountpoint: this handle is the object's single, uncommitted writer
    opener: int = 0  # pid of the process that opened it (mountpoint: only its close commits)


_libc = ctypes.CDLL(None, use_errno=True)


def _caller_pid() -> int:
    """The pid of the process whose request is being served (0 where libfuse cannot say)."""
    try:
        return int(mfusepy.fuse_get_context()[2])
    except Exception:
        return 0


def _renameat2(old: str, new: str, flags: int) -> None:
    # os.rename has no flags; RENAME_NOREPLACE/RENAME_EXCHANGE must keep their meaning.
    rc = _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), ctypes.c_uint(flags))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), old)


def _pwrite_all(fd: int, data: bytes, offset: int) -> int:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _stat_dict(st: os.stat_result) -> dict[str, Any]:
    attrs: dict[str, Any] = {key: getattr(st, key) for key in _STAT_KEYS}
    attrs["st_atime"] = st.st_atime_ns
    attrs["st_mtime"] = st.st_mtime_ns
    attrs["st_ctime"] = st.st_ctime_ns
    return attrs


class HostileFS(Operations):  # type: ignore[misc]
    """Passthrough over ``backing``, refusing what ``policy`` says, counting every refusal."""

    use_ns = True  # mfusepy: times in integer nanoseconds

    def __init__(
        self,
        backing: str,
        policy: Policy,
        counter: FaultCounter,
        mbps: Optional[float] = None,
        lookup_errors: Optional[dict[str, int]] = None,
    ) -> None:
        self.root = os.path.realpath(backing)
        self.policy = policy
        # name or path (relative to the mount) -> errno: a lookup of that path, or of an entry of
        # that name in any directory, fails so (a FUSE server answering EIO or EACCES to one
        # lookup, whether or not the entry is there).
        self.lookup_errors = dict(lookup_errors or {})
        self.counter = counter
        self.throttle = Throttle(mbps) if mbps else None
        self._lock = threading.RLock()
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1
        self._uploads: dict[str, int] = {}  # mountpoint: path -> fh of its uncommitted writer

    # -- helpers ---------------------------------------------------------------------------

    def _full(self, path: Optional[str]) -> str:
        if path is None:
            # Only happens for an open-then-unlinked file (hard_remove): nothing to act on by name.
            raise FuseOSError(errno.ENOENT)
        return os.path.join(self.root, path.lstrip("/"))

    def _handle(self, fh: Optional[int]) -> _Handle:
        handle = self._handles.get(fh) if fh is not None else None
        if handle is None:
            raise FuseOSError(errno.EBADF)
        return handle

    def _register(self, fd: int, path: str, flags: int) -> int:
        st = os.fstat(fd)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        handle = _Handle(fd=fd, path=path, dev=st.st_dev, ino=st.st_ino, writable=writable, opener=_caller_pid())
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = handle
            if self.policy.object_semantics and writable:
                handle.uploading = True
                self._uploads[path] = fh
        return fh

    def _refuse(self, op: str, err: Optional[int], path: Optional[str]) -> None:
        if err is not None:
            raise self.counter.fire(op, err, path)

    # -- lifecycle ------------------------------------------------------------------------

    def init_with_config(self, conn: Any, config: Any) -> None:
        if conn is None:
            return
        if conn.capable & FUSE_CAP_ATOMIC_O_TRUNC:
            conn.want |= FUSE_CAP_ATOMIC_O_TRUNC
        else:
            # Then O_TRUNC arrives as truncate(path, 0) without a handle, which hdfs/eopnotsupp
            # still allow; objectstore/mountpoint would refuse it.
            log.warning("kernel lacks FUSE_CAP_ATOMIC_O_TRUNC: O_TRUNC arrives as truncate(path, 0)")
        conn.max_write = MAX_WRITE

    def destroy(self, path: str) -> None:
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            with contextlib.suppress(OSError):
                os.close(handle.fd)

    # -- metadata -------------------------------------------------------------------------

    def getattr(self, path: Optional[str], fh: Optional[int] = None) -> dict[str, Any]:
        handle = self._handles.get(fh) if fh else None
        if handle is not None:
            # fstat: still right for an open file that was unlinked or renamed meanwhile.
            return _stat_dict(os.fstat(handle.fd))
        if path is not None and self.lookup_errors:
            err = self.lookup_errors.get(path.lstrip("/"), self.lookup_errors.get(os.path.basename(path)))
            if err is not None:
                raise self.counter.fire("lookup", err, path)
        return _stat_dict(os.lstat(self._full(path)))

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode, follow_symlinks=False):
            raise FuseOSError(errno.EACCES)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self.root)
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail", "f_flag", "f_namemax")
        return {key: getattr(sv, key) for key in keys}

    def chmod(self, path: Optional[str], mode: int) -> int:
        self._refuse("chmod", self.policy.chmod, path)
        os.chmod(self._full(path), mode & 0o7777)
        return 0

    def chown(self, path: Optional[str], uid: int, gid: int) -> int:
        self._refuse("chown", self.policy.chown, path)
        os.chown(self._full(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path: Optional[str], times: Optional[tuple[Optional[int], Optional[int]]] = None) -> int:
        if self.policy.object_semantics and path not in self._uploads:
            # mountpoint-s3: times can be changed only on a file that is being written.
            raise self.counter.fire("utimens", errno.EPERM, path)
        full = self._full(path)
        if times is None:
            os.utime(full, follow_symlinks=False)
            return 0
        atime, mtime = times
        if atime is None or mtime is None:  # UTIME_OMIT: keep the current value
            st = os.lstat(full)
            atime = st.st_atime_ns if atime is None else atime
            mtime = st.st_mtime_ns if mtime is None else mtime
        os.utime(full, ns=(atime, mtime), follow_symlinks=False)
        return 0

    # -- namespace ------------------------------------------------------------------------

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._full(path))]

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._full(path), mode & 0o7777)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._full(path))
        return 0

    def mknod(self, path: str, mode: int, dev: int) -> int:
        os.mknod(self._full(path), mode, dev)
        return 0

    def unlink(self, path: str) -> int:
        if self.policy.object_semantics and path in self._uploads:
            # mountpoint-s3: "You cannot delete a file while it is being written."
            raise self.counter.fire("unlink", errno.EPERM, path)
        os.unlink(self._full(path))
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        self._refuse("rename", self.policy.rename, old)
        if flags:
            _renameat2(self._full(old), self._full(new), flags)
        else:
            os.replace(self._full(old), self._full(new))
        return 0

    def symlink(self, target: str, source: str) -> int:
        # mfusepy: ``target`` is the new link's path, ``source`` the text it points to.
        self._refuse("symlink", self.policy.symlink, target)
        os.symlink(source, self._full(target))
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._full(path))

    def link(self, target: str, source: str) -> int:
        # mfusepy: ``target`` is the new name, ``source`` the existing file.
        self._refuse("link", self.policy.link, target)
        os.link(self._full(source), self._full(target))
        return 0

    # -- open / close ---------------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int) -> int:
        with self._lock:
            if self.policy.object_semantics:
                self._check_object_open(path, flags | os.O_TRUNC)
            fd = os.open(self._full(path), (flags & ~_STRIP_FLAGS) | os.O_CREAT, mode & 0o7777)
            fh = self._register(fd, path, flags)
            # close-eio: creating an object is an upload too, even an empty one (a store whose
            # uploads fail refuses a 0-byte PUT as well).
            self._handles[fh].dirty = self.policy.fail_close
            return fh

    def open(self, path: str, flags: int) -> int:
        with self._lock:
            if self.policy.object_semantics:
                self._check_object_open(path, flags)
            # With FUSE_CAP_ATOMIC_O_TRUNC, O_TRUNC is in ``flags`` and is applied here: that
            # is why open(O_TRUNC) works in hdfs mode while ftruncate() does not.
            fd = os.open(self._full(path), flags & ~_STRIP_FLAGS)
            return self._register(fd, path, flags)

    def _check_object_open(self, path: str, flags: int) -> None:
        writer = self._uploads.get(path)
        if (flags & os.O_ACCMODE) == os.O_RDONLY:
            if writer is not None:
                # mountpoint-s3: a new file is not readable until its writer closes it.
                raise self.counter.fire("open", errno.EPERM, path)
            return
        if writer is not None:
            raise self.counter.fire("open", errno.EPERM, path)  # one writer at a time
        if not flags & os.O_TRUNC and os.path.lexists(self._full(path)):
            # mountpoint-s3: an existing object can be replaced only with O_TRUNC.
            raise self.counter.fire("open", errno.EPERM, path)

    def _commit(self, fh: int, handle: _Handle) -> None:
        # mountpoint-s3 completes the upload on close/fsync; from then on the object is visible.
        handle.uploading = False
        if self._uploads.get(handle.path) == fh:
            del self._uploads[handle.path]

    def _discard(self, handle: _Handle, path: Optional[str]) -> None:
        # close-eio: the "upload" failed, so the object never appears. Unlink by the name the
        # file has *now* (libfuse follows renames), but only if it is still the same inode.
        handle.failed = True
        handle.dirty = False
        if path is None:
            return
        full = self._full(path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == (handle.dev, handle.ino):
            os.unlink(full)

    def flush(self, path: Optional[str], fh: int) -> int:
        with self._lock:
            handle = self._handle(fh)
            if self.policy.fail_close and (handle.dirty or handle.failed):
                # close(2) reports FLUSH errors only (not RELEASE): this is where EIO must go.
                self._discard(handle, path)
                raise self.counter.fire("flush", errno.EIO, path)
            # mountpoint-s3 (SEMANTICS.md): close completes the upload, except for an empty
            # file or a close by another process than the opener (a forked child's copy of
            # the descriptor): then the upload completes when the last reference goes.
            if handle.uploading and handle.written > 0 and _caller_pid() in (handle.opener, 0):
                self._commit(fh, handle)
        return 0

    def fsync(self, path: Optional[str], datasync: int, fh: int) -> int:
        with self._lock:
            handle = self._handle(fh)
            if self.policy.fail_close and (handle.dirty or handle.failed):
                self._discard(handle, path)
                raise self.counter.fire("fsync", errno.EIO, path)
            if handle.uploading:
                self._commit(fh, handle)  # mountpoint-s3: fsync completes the upload
        if datasync:
            os.fdatasync(handle.fd)
        else:
            os.fsync(handle.fd)
        return 0

    def release(self, path: Optional[str], fh: int) -> int:
        with self._lock:
            handle = self._handles.pop(fh, None)
            if handle is None:
                return 0
            if handle.uploading:
                self._commit(fh, handle)
        os.close(handle.fd)
        return 0

    # -- data -----------------------------------------------------------------------------

    def read(self, path: Optional[str], size: int, offset: int, fh: int) -> bytes:
        handle = self._handle(fh)
        if handle.uploading:
            # mountpoint-s3: a handle is either a reader or a writer, never both.
            raise self.counter.fire("read", errno.EBADF, path)
        return os.pread(handle.fd, size, offset)

    def write(self, path: Optional[str], data: bytes, offset: int, fh: int) -> int:
        handle = self._handle(fh)
        with self._lock:
            self._check_write(handle, offset, path)
        deadline = self.throttle.book(len(data)) if self.throttle is not None else None
        written = _pwrite_all(handle.fd, data, offset)
        if deadline is not None:
            Throttle.wait_until(deadline)
        with self._lock:
            handle.written = max(handle.written, offset + written)
            handle.dirty = True
        return written

    def _check_write(self, handle: _Handle, offset: int, path: Optional[str]) -> None:
        policy = self.policy
        if policy.fail_close and handle.failed:
            raise self.counter.fire("write", errno.EIO, path)  # the upload already failed
        if policy.object_semantics:
            if not handle.uploading:
                raise self.counter.fire("write", errno.EBADF, path)  # committed or a reader
            if offset != handle.written:
                raise self.counter.fire("write", policy.nonsequential_write or errno.EINVAL, path)
        elif policy.nonsequential_write is not None:
            end = os.fstat(handle.fd).st_size
            if offset != end:
                # A streaming upload can only append: no seek back, no hole.
                raise self.counter.fire("write", policy.nonsequential_write, path)

    def truncate(self, path: Optional[str], length: int, fh: Optional[int] = None) -> int:
        handle = self._handles.get(fh) if fh else None
        if handle is not None:
            self._refuse("ftruncate", self.policy.ftruncate, path)
            os.ftruncate(handle.fd, length)
            return 0
        err = self.policy.truncate_zero if length == 0 else self.policy.truncate
        self._refuse("truncate", err, path)
        os.truncate(self._full(path), length)
        return 0

    def fallocate(self, path: Optional[str], mode: int, offset: int, size: int, fh: int) -> int:
        # EOPNOTSUPP, not ENOSYS: the kernel would turn ENOSYS into EOPNOTSUPP anyway, but also
        # cache it and stop asking, so later calls would never be counted.
        self._refuse("fallocate", self.policy.fallocate, path)
        if mode != 0:
            raise FuseOSError(errno.EOPNOTSUPP)
        os.posix_fallocate(self._handle(fh).fd, offset, size)
        return 0


class HostileFUSE(mfusepy.FUSE):  # type: ignore[misc]
    """mfusepy.FUSE with three libfuse3 callbacks that keep what mfusepy drops.

    - truncate: mfusepy discards the file info, so ftruncate(fd) would look like truncate(path);
      we pass the handle on, which is how hdfs mode fails ftruncate but not truncate(path, 0).
    - rename: mfusepy discards the flags; RENAME_NOREPLACE must not silently overwrite.
    - utimens: mfusepy turns UTIME_NOW/UTIME_OMIT into bogus nanosecond counts.
    """

    def _decode(self, path: Optional[bytes]) -> Optional[str]:
        return None if path is None else path.decode(self.encoding, self.errors)

    def truncate_fuse_3(self, path: Optional[bytes], length: int, fip: Any) -> int:
        fh = fip.contents.fh if fip else None
        return int(self.operations.truncate(self._decode(path), length, fh))

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return int(self.operations.rename(self._decode(old), self._decode(new), flags))

    def utimens_fuse_3(self, path: Optional[bytes], buf: Any, fip: Any) -> int:
        times: Optional[tuple[Optional[int], Optional[int]]] = None
        if buf:
            times = (_timespec_ns(buf.contents.actime), _timespec_ns(buf.contents.modtime))
        return int(self.operations.utimens(self._decode(path), times))


def _timespec_ns(ts: Any) -> Optional[int]:
    if ts.tv_nsec == UTIME_OMIT:
        return None
    if ts.tv_nsec == UTIME_NOW:
        return time.time_ns()
    return int(ts.tv_sec) * 10**9 + int(ts.tv_nsec)
