"""Publishing a finished local file to its destination, atomically where the destination allows.

Three strategies, chosen per save:

- ``rename``: staging root and destination share a filesystem: chmod, fsync, ``os.replace``.
  No copy at all.
- ``replace``: copy into a hidden sibling temp file created exclusively with the final mode,
  fsync, close (checked), verify the size, then ``os.replace`` it over the final name.
  Readers see the old file or the new one, never a mix.
- ``direct``: for destinations that cannot rename (mountpoint-s3, safetensors#792): write the
  final name with O_CREAT|O_TRUNC, once the writer has finished. Object stores make the
  object visible only when close() succeeds, so it is atomic there; on a POSIX filesystem
  readers may see a partial file.

Concurrency under ``direct``: within one process, direct writes of one path take turns (a
per-path lock). Across processes, one writer per destination file is the caller's contract,
as every object store requires (mountpoint-s3 refuses a second writer itself): two processes
writing one file with ``direct`` at once may leave a mix of both under the final name.
A child forked while we write a destination closes its copy of our descriptor at once
(_fork_fds): a DataLoader worker must not keep an upload open.

Every strategy writes the destination sequentially in large chunks and never calls
ftruncate, fallocate, seek, hard link or O_TMPFILE on it: those are what hostile mounts
refuse (safetensors#787 ENOSYS on HDFS FUSE, #842 EOPNOTSUPP). chmod is attempted only where
the created mode would differ from the wanted one, and its failure is ignored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import io
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Union

from . import _loud, _object_store
from ._destination import Destination, ObjectURL, is_store
from ._errors import PublishError
from ._follow import Follower, Reader
from ._fork_fds import closed_in_children
from ._interrupts import deferred
from ._locks import Contended, claim, close_quietly
from ._mounts import capabilities, filesystem_key
from ._names import temp_name

log = logging.getLogger("safestage")

# Measured (benchmarks/copy_methods.py): a read/write loop into FUSE ran 928 MB/s at 4 MiB,
# 867 at 8 and 734 at 32; sendfile was 25-35% slower into FUSE, copy_file_range refused (EXDEV).
CHUNK_BYTES = 4 << 20

# What a destination answers when it cannot do an operation at all, as opposed to failing it.
# safetensors#787: HDFS FUSE answers ENOSYS; #842: other FUSE mounts EOPNOTSUPP; #792:
# mountpoint-s3 refuses rename and chmod (EPERM on some versions). A same-directory rename can
# only be EXDEV when the filesystem does not implement rename (gcsfuse, some 9p servers).
NOT_SUPPORTED = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM, errno.EXDEV})
# The same without EPERM, which is also a permission answer about one file (a colleague's
# file in a sticky directory): only a probe of the device may read it as "cannot rename".
RENAME_UNSUPPORTED = NOT_SUPPORTED - {errno.EPERM}
# An owner keeps losing its fresh temp to a concurrent cleaner at most this often in a row.
_TEMP_ATTEMPTS = 5

# The file `auto` renames once per device to learn whether the destination can rename;
# a process killed during the probe leaves it as a safestage temp that `clean` removes.
RENAME_PROBE = "safestage-rename-probe"


class Digest(Protocol):
    """What ``publish_file(digest=...)`` feeds the published bytes to (hashlib objects fit).

    ``update`` may raise to abort the copy (a directory commit cancels its other files this
    way): the target is then cleaned up as after any other error."""

    def update(self, data: memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class Published:
    strategy: str
    nbytes: int
    seconds: float
    digest: Optional[str] = None  # hexdigest of the published bytes, if asked for
    etag: Optional[str] = None  # an object store's ETag (or generation) of what was published


class _StepFailed(Exception):
    """Internal: an OSError tagged with the publishing step it came from."""

    def __init__(self, step: str, error: OSError, path: Path) -> None:
        super().__init__(step, error, path)
        self.step, self.error, self.path = step, error, path
        self.leftover: Optional[Path] = None  # our temp file, if unlinking it failed
        self.removed: Optional[bool] = None  # direct: whether a torn final file was removed
        self.advice: Optional[str] = None  # what to do, when the step knows better than errno
        self.unlinked_previous = False  # direct: the old file was unlinked before writing
        # A read of the staged copy that failed after the target was opened (and, under direct,
        # truncated): the destination is touched although the failing side is the staging one.
        self.after_create = False


_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it (os.umask is racy across threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def stat_retrying(path: Path) -> os.stat_result:
    """os.stat, retried on ESTALE: on NFS and path-based FUSE servers a concurrent rename
    over ``path`` makes a stat fail transiently (the kernel retries only once)."""
    for _ in range(2):
        try:
            return os.stat(path)
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
    return os.stat(path)


def wanted_mode(dest: Path) -> tuple[int, Optional[os.stat_result]]:
    """(mode, previous stat or None): an existing file keeps its mode; a new one gets
    0o666 & ~umask.

    safetensors 0.8 leaves every file 0600 (safetensors#782); 0.7 and every other file in a
    checkpoint folder get 0o666 & ~umask, so that is what a new file gets here.
    """
    try:
        previous = stat_retrying(dest)
    except FileNotFoundError:
        return 0o666 & ~current_umask(), None
    return stat.S_IMODE(previous.st_mode), previous


def _best_effort_unlink(path: Path) -> Optional[OSError]:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:  # some mounts refuse unlink too: report, don't crash
        log.warning("could not remove %s: %s", path, exc)
        return exc
    return None


def fsync_directory(directory: Path) -> None:
    """Make a rename durable. Best effort: many FUSE and network filesystems refuse it."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        log.debug("cannot open %s to fsync it: %s", directory, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        log.debug("directory fsync of %s refused: %s", directory, exc)
    finally:
        close_quietly(fd)


def write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def copy_to_new_file(
    source: Path,
    target: Path,
    *,
    flags: int,
    mode: int,
    fsync: bool,
    prepare: Optional[Callable[[int], None]] = None,
    before_create: Optional[Callable[[], None]] = None,
    digest: Optional[Digest] = None,
    follow: Optional[Follower] = None,
) -> int:
    """Copy ``source`` into ``target`` opened with ``flags``; checked fsync, close and size.
    With ``follow``, read ``source`` while its writer is still writing it (see _follow): only
    into our own hidden temp (``replace``), never into a final name.

    Sequential writes only, from one reusable buffer: memory stays at CHUNK_BYTES whatever
    the file size. ``prepare(fd)`` runs right after the open. ``digest``, if given, is updated
    with every chunk as it is written (the bytes are read once). Returns the byte count. Raises
    _StepFailed naming the step that failed. Whatever is raised (KeyboardInterrupt too), the
    target's descriptor is closed before it propagates; removing the target is the caller's.
    """
    src = _open_source(source, follow)
    with contextlib.closing(src):
        expected = -1 if isinstance(src, Reader) else _size_of(src, source)
        if before_create is not None:
            before_create()
        # A child forked while we write the target closes its copy at once (_fork_fds).
        with closed_in_children(target):
            copied = _copy_into(src, source, expected, target, flags=flags, mode=mode, fsync=fsync,
                                prepare=prepare, digest=digest)  # fmt: skip
    if isinstance(src, Reader):  # a followed file (_follow) is sized only at its end
        expected = src.expected
    try:
        size = os.stat(target).st_size
    except OSError as exc:
        raise _StepFailed("verify", exc, target) from exc
    if size != expected or copied != expected:
        short = OSError(errno.EIO, f"{target} holds {size} bytes after close, expected {expected}")
        raise _StepFailed("verify", short, target)
    return copied


def _open_source(source: Path, follow: Optional[Follower]) -> Union[io.FileIO, Reader]:
    """The staged file, opened before the target is created: once a publish has begun, a tmp
    cleaner emptying the staging root cannot take the data from under it (the open file
    outlives the unlink). With ``follow``, a reader behind the still-running writer."""
    if follow is not None:
        return follow.open()
    try:
        return open(source, "rb", buffering=0)
    except OSError as exc:
        raise _StepFailed("read", exc, source) from exc


def _size_of(src: io.FileIO, source: Path) -> int:
    try:
        return os.fstat(src.fileno()).st_size
    except OSError as exc:
        raise _StepFailed("read", exc, source) from exc


def _copy_into(
    src: Union[io.FileIO, Reader],
    source: Path,
    expected: int,
    target: Path,
    *,
    flags: int,
    mode: int,
    fsync: bool,
    prepare: Optional[Callable[[int], None]],
    digest: Optional[Digest],
) -> int:
    # expected < 0: a followed file (_follow), whose size is known only at its end.
    buffer = bytearray(CHUNK_BYTES if expected < 0 else min(CHUNK_BYTES, max(expected, 1)))
    step = "create"
    try:
        out_fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC | flags, mode)
    except OSError as exc:
        raise _StepFailed(step, exc, target) from exc
    unclosed: Optional[int] = out_fd
    copied = 0
    step = "prepare"  # from here on the target exists (and O_TRUNC has emptied it)
    try:
        if prepare is not None:
            prepare(out_fd)
        _match_mode(out_fd, mode)
        step = "write"
        if hasattr(os, "posix_fadvise") and isinstance(src, io.FileIO):
            os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        view = memoryview(buffer)
        try:
            while count := _read_chunk(src, buffer, source):  # a followed read blocks on the writer
                if digest is not None:
                    digest.update(view[:count])
                write_all(out_fd, view[:count])
                copied += count
        except _StepFailed as failed:
            failed.after_create = True
            raise
        if fsync:
            step = "fsync"
            os.fsync(out_fd)
        # safetensors 0.7 and 0.8 ignore close(); object stores upload here and report failure
        # only here, so an unchecked close is a silent data loss. Linux releases the fd even
        # when close() fails: never close it twice.
        step, unclosed = "close", None
        os.close(out_fd)
    except OSError as exc:
        raise _StepFailed(step, exc, target) from exc
    finally:
        if unclosed is not None:
            with deferred(), contextlib.suppress(OSError):  # the error in flight is the one to report
                os.close(unclosed)
    return copied


def _read_chunk(src: Union[io.FileIO, Reader], buffer: bytearray, source: Path) -> int:
    try:
        return src.readinto(buffer) or 0
    except OSError as exc:  # the staging side failed, not the destination
        raise _StepFailed("read", exc, source) from exc


def _match_mode(fd: int, mode: int) -> None:
    # open() applies the umask; an existing destination's mode (say 0666 under umask 022)
    # needs an explicit fchmod. Object stores refuse chmod (#792): their mode is fixed anyway.
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
    except OSError as exc:
        log.debug("could not set mode %o: %s", mode, exc)


def _rename_into_place(staged: Path, dest: Path, *, mode: int, fsync: bool) -> int:
    """chmod, fsync, os.replace; the byte count is taken before: after the rename the save
    is done, and nothing may fail it any more."""
    step = "inspect"
    try:
        nbytes = os.stat(staged).st_size
        if fsync:  # before the chmod: the final mode may not let us open it (0200)
            step = "fsync"
            fd = os.open(staged, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                close_quietly(fd)
        step = "chmod"
        os.chmod(staged, mode)
        step = "rename"
        os.replace(staged, dest)
    except OSError as exc:
        raise _StepFailed(step, exc, dest) from exc
    return nbytes


def _link_into_place(staged: Path, dest: Path, *, mode: int, fsync: bool) -> int:
    """A rename that keeps its source: fsync, chmod, a hard link under a hidden sibling name,
    os.replace over ``dest``. The staged file stays whole under its own name (a commit kept
    after a failure still holds every file of its checkpoint); our temp never outlives the
    call."""
    step = "inspect"
    temp = dest.parent / temp_name(dest.name)
    linked = False
    try:
        nbytes = os.stat(staged).st_size
        if fsync:
            step = "fsync"
            fd = os.open(staged, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                close_quietly(fd)
        step = "chmod"
        os.chmod(staged, mode)
        step = "link"
        os.link(staged, temp)
        linked = True
        step = "rename"
        os.replace(temp, dest)
        linked = False
    except OSError as exc:
        raise _StepFailed(step, exc, dest) from exc
    finally:
        if linked:
            with deferred():
                _best_effort_unlink(temp)
    return nbytes


# What a link answers where hard links are not to be had: copy instead.
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def publish_file(
    staged: Path,
    dest: Destination,
    *,
    publish: str,
    fsync: bool,
    staging_device: Optional[int],
    sync_directory: bool = True,
    digest: Optional[Callable[[], Digest]] = None,
    follow: Optional[Follower] = None,
    keep_source: bool = False,
) -> Published:
    """Publish ``staged`` to ``dest``. On failure raise PublishError; ``staged`` is kept.

    With ``fsync``, the directory of a renamed file is fsync'ed too, unless the caller
    passes ``sync_directory=False`` to do that itself once it has counted the publish as
    done (a Ctrl-C during that fsync must not make a published save look unpublished).

    ``digest``: a factory of Digest objects (``hashlib.sha256``); the result's ``digest`` is
    then the hexdigest of exactly the bytes published, computed while copying them (a fresh
    object per copy attempt). ``rename`` copies nothing, so it reads the staged file once.

    ``follow``: ``staged`` is still being written; a ``replace`` copy reads behind its writer
    into its hidden temp (_follow). A ``direct`` publish waits for the writer to finish first.
    Never with rename (``staging_device`` must be None): a rename needs the whole file.

    ``keep_source``: where a rename would do, link instead (``link``): ``staged`` stays whole
    (a commit's files: its copy, kept after a failure, must hold every file). Copies where no
    hard link can be made.
    """
    if follow is not None and staging_device is not None:
        raise ValueError("publish_file(follow=...) copies: pass staging_device=None")
    if isinstance(dest, ObjectURL):
        return _upload(staged, dest, digest)
    started = time.perf_counter()
    directory = dest.parent
    try:
        mode, previous = wanted_mode(dest)
        dest_device = os.stat(directory).st_dev
    except OSError as exc:  # the directory vanished, or went stale: still a PublishError
        failed = _StepFailed("inspect", exc, directory)
        raise _publish_error(failed, dest, staged, "inspect", existed=False) from exc
    existed = previous is not None
    strategy = _choose(publish, directory, dest_device, staging_device)

    if strategy == "rename":
        place, strategy = (_link_into_place, "link") if keep_source else (_rename_into_place, "rename")
        try:
            hexdigest = _digest_file(staged, digest()) if digest is not None else None
            nbytes = place(staged, dest, mode=mode, fsync=fsync)
        except _StepFailed as failed:
            # A bind mount of the same filesystem still answers EXDEV, and some filesystems
            # have no hard links: copy instead.
            if not (failed.error.errno == errno.EXDEV or (keep_source and failed.step == "link"
                                                          and failed.error.errno in _NO_LINK)):  # fmt: skip
                raise _publish_error(failed, dest, staged, strategy, existed=existed) from failed.error
            strategy = "replace"  # publish="direct" never chooses rename
        else:
            if fsync and sync_directory:
                fsync_directory(directory)
            return Published(strategy, nbytes, time.perf_counter() - started, hexdigest)

    if strategy == "replace":
        try:
            nbytes, hexdigest = _replace(staged, dest, mode=mode, fsync=fsync, digest=digest, follow=follow)
            if fsync and sync_directory:
                fsync_directory(directory)
            return Published("replace", nbytes, time.perf_counter() - started, hexdigest)
        except _StepFailed as failed:
            # Only a probe of the device decides that it cannot rename: a refused rename of
            # this one file is this save's error. Without a verdict (the probe could not
            # run), an answer that can only mean "no rename here" sends this one file direct.
            unsupported = failed.step == "rename" and failed.error.errno in RENAME_UNSUPPORTED
            undecided = capabilities.strategy_for(filesystem_key(directory, dest_device)) is None
            if not (publish == "auto" and unsupported and undecided):
                raise _publish_error(failed, dest, staged, "replace", existed=existed) from failed.error
            log.warning(
                "%s: rename refused (%s); published with publish='direct' (not atomic)",
                dest, _errno_text(failed.error),
            )  # fmt: skip

    if follow is not None:
        follow.written()  # `direct` publishes after the writer: it never writes a final name early
    try:
        nbytes, hexdigest = _direct(staged, dest, mode=mode, fsync=fsync, previous=previous, digest=digest)
    except _StepFailed as failed:
        raise _publish_error(failed, dest, staged, "direct", existed=existed) from failed.error
    return Published("direct", nbytes, time.perf_counter() - started, hexdigest)


def _digest_file(path: Path, digest: Digest) -> str:
    """The hexdigest of ``path``, read once in chunks (for ``rename``, which copies nothing)."""
    try:
        with open(path, "rb", buffering=0) as source:
            buffer = bytearray(CHUNK_BYTES)
            view = memoryview(buffer)
            while count := source.readinto(buffer):
                digest.update(view[:count])
    except OSError as exc:
        raise _StepFailed("read", exc, path) from exc
    return digest.hexdigest()


def _upload(staged: Path, dest: ObjectURL, digest: Optional[Callable[[], Digest]]) -> Published:
    """``upload``, the one strategy of an object store: the staged file streamed to its key,
    which shows the new object only once all of it has arrived (an object PUT is atomic).
    Nothing of a failed upload is published; the staged copy stays for the caller to keep."""
    try:
        done = _object_store.upload(staged, dest, digest() if digest is not None else None)
    except _object_store.StoreError as exc:
        raise PublishError(
            exc.errno, f"{exc.message} Nothing was published to {dest}. {kept_copy_text(staged)}",
            str(dest), staged_path=str(staged), step="upload",
        ) from exc
    return Published("upload", done.nbytes, done.seconds, done.digest, done.etag)


def planned_strategy(publish: str, dest: Destination, staging_device: Optional[int]) -> Optional[str]:
    """The strategy publish_file would choose for ``dest`` now (None: cannot tell, the
    directory is not there); the rename probe runs here if it has not yet."""
    if is_store(dest):
        return "upload"
    assert isinstance(dest, Path)
    try:
        dest_device = os.stat(dest.parent).st_dev
    except OSError:
        return None
    return _choose(publish, dest.parent, dest_device, staging_device)


def _choose(publish: str, directory: Path, dest_device: int, staging_device: Optional[int]) -> str:
    if publish == "direct":
        return "direct"
    if staging_device is not None and staging_device == dest_device:
        return "rename"
    if publish == "auto" and _can_rename(directory, dest_device) is False:
        return "direct"
    return "replace"


def _can_rename(directory: Path, device: int) -> Optional[bool]:
    """Whether files in ``directory`` can be renamed, probed once per filesystem, so that a
    mount which cannot rename (mountpoint-s3, #792) does not cost a full wasted copy first
    (measured: 1 GiB onto the kit's mountpoint took 3.25 s, 1.92 s direct). None when the
    probe itself could not run: the real publish then decides.

    The probe leaves nothing, on every path: it writes one byte before its checked close,
    because rclone (--vfs-cache-mode off, 1.60) uploads a file nobody wrote to only at
    release, after close() has returned, so a rename and unlink right after close miss it
    and the "removed" file reappears (229 of 300 empty probes on rclone-s3 did; 0 of 200
    one-byte ones). Its close may fail (close-eio): both names are removed in any case.
    """
    key = filesystem_key(directory, device)
    known = capabilities.strategy_for(key)
    if known is not None:
        return known != "direct"
    source = directory / temp_name(RENAME_PROBE)
    target = directory / temp_name(RENAME_PROBE)
    try:
        try:
            fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("rename probe in %s could not create a file: %s", directory, exc)
            return None
        try:
            try:
                _lock_temp(source, fd)  # cleaners leave a live probe alone, as any temp of ours
                os.write(fd, b"\0")
            finally:
                os.close(fd)
            os.replace(source, target)
        except Contended:
            return None  # a cleaner took it: no verdict this time
        except OSError as exc:
            if exc.errno not in NOT_SUPPORTED:
                log.debug("rename probe in %s failed: %s", directory, exc)
                return None
            if capabilities.remember(key, "direct"):
                # Each rank of a node probes its mounts: local rank 0 says it (_loud).
                log.log(
                    _loud.level(_loud.speaks_for_node()),
                    "the filesystem of %s cannot rename files (a probe's rename answered %s); "
                    "publishing to it with publish='direct' from now on (set "
                    "SAFESTAGE_PUBLISH=direct to skip the probe)",
                    directory, _errno_text(exc),
                )  # fmt: skip
            return False
        capabilities.remember(key, "replace")
        return True
    finally:
        with deferred():  # a Ctrl-C now is raised once both names are gone
            _best_effort_unlink(source)  # a refusal is logged at WARNING with the path
            _best_effort_unlink(target)


def _replace(
    staged: Path,
    dest: Path,
    *,
    mode: int,
    fsync: bool,
    digest: Optional[Callable[[], Digest]],
    follow: Optional[Follower] = None,
) -> tuple[int, Optional[str]]:
    """Copy into a fresh hidden sibling, then os.replace it over ``dest``. Our temp never
    outlives the call, whatever is raised (a KeyboardInterrupt mid-copy included).

    While it is written the temp is locked (its writing descriptor holds a flock, so cleaners
    in any PID namespace of this host leave it alone). Between its checked close and the
    rename it is not, and a cleaner that cannot see our pid (another PID namespace) may take
    it then: the size check or the rename finds it gone, and since the staged copy is still
    here, we simply copy again under a fresh name.
    """
    for _ in range(_TEMP_ATTEMPTS):
        temp = dest.parent / temp_name(dest.name)
        hasher = digest() if digest is not None else None  # a fresh one per attempt
        try:
            nbytes = copy_to_new_file(
                staged, temp, flags=os.O_CREAT | os.O_EXCL, mode=mode, fsync=fsync,
                prepare=functools.partial(_lock_temp, temp), digest=hasher, follow=follow,
            )  # fmt: skip
            try:
                os.replace(temp, dest)
            except OSError as exc:
                if isinstance(exc, FileNotFoundError) and dest.parent.is_dir():
                    continue  # taken between its close and the rename (see above)
                raise _StepFailed("rename", exc, dest) from exc
        except Contended:
            with deferred():
                _best_effort_unlink(temp)  # a concurrent `safestage clean` took it: a fresh name
            continue
        except _StepFailed as failed:
            if failed.step == "verify" and failed.error.errno == errno.ENOENT and dest.parent.is_dir():
                continue  # taken between its close and the size check (see above)
            # Exclusive create means the temp is ours: never leave it beside the destination.
            if failed.step != "create":
                with deferred():
                    failed.leftover = temp if _best_effort_unlink(temp) else None
            raise
        except BaseException:
            with deferred():
                _best_effort_unlink(temp)
            raise
        return nbytes, hasher.hexdigest() if hasher is not None else None
    error = OSError(errno.EBUSY, "another process keeps removing safestage's temp files here")
    exhausted = _StepFailed("create", error, dest.parent)
    exhausted.advice = (
        f"something removes new files in {dest.parent} as soon as they appear (a cleaner "
        "running in a loop?): stop it and save again"
    )
    raise exhausted


def _lock_temp(temp: Path, write_fd: int) -> None:
    """Lock the temp through its own writing descriptor: no second open (rclone 1.60 stalls
    5 s opening a reader of a file being written, then answers ENOENT). Raises Contended if
    a cleaner got to it first; a filesystem without locks leaves it unlocked (its name's host
    and pid then speak for it)."""
    claim(write_fd, temp)


_direct_locks: dict[str, threading.Lock] = {}
_direct_locks_guard = threading.Lock()


def _direct_lock(dest: Path) -> threading.Lock:
    """The in-process lock of direct writes of ``dest`` (never removed: one per path written)."""
    with _direct_locks_guard:
        return _direct_locks.setdefault(str(dest), threading.Lock())


def _direct(
    staged: Path,
    dest: Path,
    *,
    mode: int,
    fsync: bool,
    previous: Optional[os.stat_result],
    digest: Optional[Callable[[], Digest]],
) -> tuple[int, Optional[str]]:
    """Write the final name itself: for destinations that cannot rename (#792). One direct
    publish of a given file at a time in this process: two would interleave their bytes.
    Other processes are not serialized: one writer per file is the caller's contract."""
    hasher = digest() if digest is not None else None
    with _direct_lock(dest):
        nbytes = _direct_locked(staged, dest, mode=mode, fsync=fsync, previous=previous, digest=hasher)
        return nbytes, hasher.hexdigest() if hasher is not None else None


def _direct_locked(
    staged: Path,
    dest: Path,
    *,
    mode: int,
    fsync: bool,
    previous: Optional[os.stat_result],
    digest: Optional[Digest],
) -> int:
    is_link = os.path.islink(dest)
    if previous is not None and not is_link:
        _refuse_special_file(dest, previous)
    flags = os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO put there meanwhile
    aside = _Aside(dest, is_link=is_link, mapped=not is_link and previous is not None and _mapped_here(previous))
    if aside.needed:
        flags = os.O_CREAT | os.O_EXCL
    try:
        nbytes = copy_to_new_file(
            staged, dest, flags=flags, mode=mode, fsync=fsync, prepare=_regular_and_blocking,
            before_create=aside.clear_the_name, digest=digest,
        )  # fmt: skip
    except BaseException as exc:
        with deferred():
            if isinstance(exc, _StepFailed) and exc.step in ("create", "read", "unlink") and not exc.after_create:
                restored = aside.restore()
                exc.unlinked_previous = aside.lost_previous and not restored
                raise
            # An object store keeps the previous object when an upload fails; a POSIX
            # filesystem has already truncated it. Keep the final name only if it is still
            # that old file, and put back a file moved aside.
            unchanged = not aside.cleared and _unchanged(dest, previous)
            removed = None if unchanged else _remove_torn(dest)
            restored = aside.restore() if removed else False
            if isinstance(exc, _StepFailed):
                exc.removed = None if restored else removed
                exc.unlinked_previous = aside.lost_previous and not restored
        raise
    aside.discard()
    return nbytes


_UNLINK_PATIENCE_S = 1.0


def _remove_torn(dest: Path) -> bool:
    """Remove the torn file a direct publish wrote under the final name; True if none is left.
    A refusal is retried for a moment: a child forked during the copy holds our descriptor
    until its fork handler closes it (_fork_fds), and until then mountpoint refuses to unlink
    a file being written (EPERM)."""
    deadline = time.monotonic() + _UNLINK_PATIENCE_S
    while True:
        try:
            os.unlink(dest)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            log.warning("could not remove %s: %s", dest, exc)
            return False
        return True


class _Aside:
    """Clears the final name before a direct write when the old file must keep its inode:
    a symlink there (a plain save replaces the link; writing through it would overwrite its
    target: latest.safetensors -> step-1000.safetensors), or a file this process has mapped
    (safetensors#762: O_TRUNC rewrites the inode under the tensors loaded from it, changing
    their values, and a shorter file kills the process with SIGBUS). Where the filesystem
    can rename, the old file is moved to a hidden sibling and put back if the new one cannot
    be written; where it cannot (object stores), it is unlinked, and an error says it is gone.
    """

    def __init__(self, dest: Path, *, is_link: bool, mapped: bool) -> None:
        self.dest = dest
        self.needed = is_link or mapped
        self._is_link = is_link
        self.cleared = False
        self.moved: Optional[Path] = None
        self.lost_previous = False  # the old file was unlinked (not a mere symlink)

    def clear_the_name(self) -> None:  # the source is open by now: a read error cannot follow
        if not self.needed:
            return
        why = "a symlink" if self._is_link else "mapped by this process"
        log.debug("%s is %s: clearing the name before writing a new file", self.dest, why)
        if not self._is_link:
            moved = self.dest.parent / temp_name(self.dest.name)
            try:
                os.replace(self.dest, moved)
            except OSError as exc:
                log.debug("cannot move %s aside (%s): unlinking it", self.dest, exc)
            else:
                self.moved, self.cleared = moved, True
                return
        try:
            os.unlink(self.dest)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _StepFailed("unlink", exc, self.dest) from exc
        self.cleared = True
        self.lost_previous = not self._is_link

    def restore(self) -> bool:
        """Put the moved-aside old file back under its name (the new one is not there)."""
        if self.moved is None:
            return False
        try:
            os.replace(self.moved, self.dest)
        except OSError as exc:
            log.warning("could not put %s back from %s: %s", self.dest, self.moved, exc)
            return False
        self.moved = None
        return True

    def discard(self) -> None:
        if self.moved is not None:
            _best_effort_unlink(self.moved)
            self.moved = None


_FILE_TYPES = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def _refuse_special_file(dest: Path, previous: os.stat_result) -> None:
    for is_kind, kind in _FILE_TYPES:
        if is_kind(previous.st_mode):
            error = OSError(errno.EINVAL, f"{dest} is {kind}")
            failed = _StepFailed("inspect", error, dest)
            failed.advice = (
                f"{dest} is {kind}, not a regular file: publish='direct' writes the final name "
                "in place and will not write into it. Remove it or save under another name "
                "(a plain safetensors save and publish='replace' replace it with a regular file)"
            )
            raise failed


def _regular_and_blocking(fd: int) -> None:
    """After the open: refuse what is not a regular file (it appeared after our check),
    then drop the O_NONBLOCK that kept a FIFO from blocking the open."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        _refuse_special_file(Path(os.readlink(f"/proc/self/fd/{fd}")), info)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)


def _mapped_here(info: os.stat_result) -> bool:
    """Whether this process has the file ``info`` describes mapped (/proc/self/maps)."""
    wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x} {info.st_ino} "
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            return any(_maps_identity(line) == wanted for line in maps)
    except OSError:
        return True  # cannot tell: the new inode is the safe choice


def _maps_identity(line: str) -> str:
    # "start-end perms offset dev inode path": dev and inode are fields 4 and 5
    fields = line.split(maxsplit=5)
    return f"{fields[3]} {fields[4]} " if len(fields) >= 5 else ""


def _unchanged(path: Path, previous: Optional[os.stat_result]) -> bool:
    if previous is None:
        return False
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_size, now.st_mtime_ns) == (previous.st_size, previous.st_mtime_ns)


def _errno_text(error: OSError) -> str:
    code = error.errno
    name = errno.errorcode.get(code, "?") if code else "?"
    return f"[Errno {code}] {name}: {error.strerror or error}"


_ADVICE = {
    errno.ENOSPC: "the destination is full: free space there (or choose another destination) and save again",
    errno.EDQUOT: "the destination quota is exhausted: free space there and save again",
    errno.EIO: (
        "the destination failed to store the data (an object-store upload that fails at close "
        "looks like this): check the mount's health, credentials and logs, then save again"
    ),
    errno.EROFS: "the destination is mounted read-only: remount it read-write or save elsewhere",
    errno.EACCES: "this process may not write in the destination directory: fix its permissions",
    errno.ENOENT: "the destination directory vanished during the save: recreate it and save again",
}


def _advice(failed: _StepFailed, strategy: str, dest: Path) -> str:
    step, error = failed.step, failed.error
    code = error.errno
    if failed.advice is not None:
        return failed.advice
    if step == "read":
        return (
            "the staged copy could not be read back from the staging root (its disk failed, "
            "or something removed it): check the staging root and save again"
        )
    if step == "rename" and code in NOT_SUPPORTED and strategy == "replace":
        if code == errno.EPERM:
            return (
                f"the rename over {dest.name} was refused: in a sticky directory (mode 1777) "
                "only the owner of a file may replace it, and some mounts cannot rename at all "
                "(then use publish='auto' or publish='direct')"
            )
        return (
            "this destination cannot rename files: use publish='auto' or publish='direct' "
            "(SAFESTAGE_PUBLISH=direct)"
        )
    if strategy == "direct" and step == "create" and code in (errno.EPERM, errno.EBUSY, errno.ETXTBSY):
        return (
            f"the destination refused to open {dest.name} for writing: on an object-store "
            "mount (one writer per object) another process may be writing it right now; "
            "wait for it and save again, or check that this user may write there"
        )
    if code in NOT_SUPPORTED and strategy == "direct":
        return "this destination refused even a sequential write of a new file: run `safestage doctor` on it"
    if code == errno.ENOENT and step in ("write", "fsync", "close", "verify", "rename") and dest.parent.is_dir():
        return (
            f"a file of this save vanished from {dest.parent} while it was being written "
            "(another process removing files there, e.g. a cleaner?): save again"
        )
    if code is not None and code in _ADVICE:
        return _ADVICE[code]
    return "check the destination (`safestage doctor PATH` probes it) and save again"


def _sentence(text: str) -> str:
    return f"{text[:1].upper()}{text[1:]}."


def _publish_error(
    failed: _StepFailed, dest: Path, staged: Path, strategy: str, *, existed: bool
) -> PublishError:
    error = failed.error
    # nothing written yet
    untouched = failed.step in ("create", "inspect", "unlink", "read") and not failed.after_create
    if failed.unlinked_previous:
        state = (
            f"{dest} is gone: this process had it mapped (loaded), so it was unlinked to write "
            "a new file, and the new file could not be written"
        )
    elif strategy == "direct" and not untouched:
        if failed.removed is True:
            state = f"no incomplete file is left under {dest}"
        elif failed.removed is False:
            state = f"{dest} may hold an incomplete file (removing it failed): do not load it"
        else:
            state = f"{dest} still holds its previous complete file"
    elif existed:
        state = f"{dest} still holds its previous file" + (" (untouched)" if untouched else "")
    else:
        state = f"nothing was written under {dest}"
    leftover = failed.leftover
    if leftover is not None:
        state += f"; a partial temp file is left at {leftover} (remove it, or run `safestage clean`)"
    kept = staged if staged.exists() else None
    where = kept_copy_text(kept)
    message = (
        f"safestage could not publish {dest} ({strategy}, {failed.step} of {failed.path}): "
        f"{_errno_text(error)}. {_sentence(_advice(failed, strategy, dest))} "
        f"{_sentence(state)} {where}"
    )
    return PublishError(
        error.errno,
        message,
        str(dest),
        staged_path=str(kept) if kept is not None else None,
        step=failed.step,
    )


def kept_copy_text(kept: Optional[Path]) -> str:
    """The sentence of a PublishError that says where the complete staged copy is (what can be
    done with it is said where its record is written: _stage.keep_unpublished)."""
    if kept is None:
        return "No staged copy could be kept."
    return f"The complete staged copy is kept at {kept}."


def after_fork_in_child() -> None:
    """Locks a thread of the parent held at fork() would never be released here (_lifecycle)."""
    global _direct_locks_guard, _umask_lock
    _direct_locks.clear()
    _direct_locks_guard = threading.Lock()
    _umask_lock = threading.Lock()
