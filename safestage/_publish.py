"""Publishing a finished local file to its destination, atomically where the destination allows.

Three strategies, chosen per save:

- ``rename``: staging root and destination share a filesystem: chmod, fsync, ``os.replace``.
  No copy at all.
- ``replace``: copy into a hidden sibling temp file created exclusively with the final mode,
  fsync, close (checked), verify the size, then ``os.replace`` it over the final name.
  Readers see the old file or the new one, never a mix.
- ``direct``: for destinations that cannot rename (mountpoint-s3, safetensors#792): write the
  final name with O_CREAT|O_TRUNC. Object stores make the object visible only when close()
  succeeds, so it is atomic there; on a POSIX filesystem readers may see a partial file.

Every strategy writes the destination sequentially in large chunks and never calls
ftruncate, fallocate, seek, hard link or O_TMPFILE on it: those are what hostile mounts
refuse (safetensors#787 ENOSYS on HDFS FUSE, #842 EOPNOTSUPP). chmod is attempted only where
the created mode would differ from the wanted one, and its failure is ignored.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ._errors import PublishError
from ._mounts import capabilities
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

# The empty file `auto` renames once per device to learn whether the destination can rename;
# a process killed during the probe leaves it as a safestage temp that `clean` removes.
RENAME_PROBE = "safestage-rename-probe"


@dataclass(frozen=True)
class Published:
    strategy: str
    nbytes: int
    seconds: float


class _StepFailed(Exception):
    """Internal: an OSError tagged with the publishing step it came from."""

    def __init__(self, step: str, error: OSError, path: Path) -> None:
        super().__init__(step, error, path)
        self.step, self.error, self.path = step, error, path
        self.leftover: Optional[Path] = None  # our temp file, if unlinking it failed
        self.removed: Optional[bool] = None  # direct: whether a torn final file was removed


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


_umask_lock = threading.Lock()


def stat_retrying(path: Path) -> os.stat_result:
    """os.stat, retried on ESTALE: on NFS and path-based FUSE servers a concurrent rename
    over ``path`` makes a stat fail transiently (the kernel retries only once)."""
    for attempt in range(3):
        try:
            return os.stat(path)
        except OSError as exc:
            if exc.errno != errno.ESTALE or attempt == 2:
                raise
    raise AssertionError("unreachable")


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
        os.close(fd)


def write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def copy_to_new_file(
    source: Path, target: Path, *, flags: int, mode: int, fsync: bool, chunk_bytes: int = CHUNK_BYTES
) -> int:
    """Copy ``source`` into ``target`` opened with ``flags``; checked fsync, close and size.

    Sequential writes only, from one reusable buffer: memory stays at ``chunk_bytes`` whatever
    the file size. Returns the byte count. Raises _StepFailed naming the step that failed.
    """
    expected = os.stat(source).st_size
    step = "create"
    try:
        out_fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC | flags, mode)
    except OSError as exc:
        raise _StepFailed(step, exc, target) from exc
    copied = 0
    try:
        _match_mode(out_fd, mode)
        step = "write"
        with open(source, "rb", buffering=0) as src:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            buffer = bytearray(min(chunk_bytes, max(expected, 1)))
            view = memoryview(buffer)
            while True:
                count = src.readinto(buffer)
                if not count:
                    break
                write_all(out_fd, view[:count])
                copied += count
        if fsync:
            step = "fsync"
            os.fsync(out_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):  # the write/fsync error is the one to report
            os.close(out_fd)
        raise _StepFailed(step, exc, target) from exc
    step = "close"
    try:
        # safetensors 0.7 and 0.8 ignore close(); object stores upload here and report failure
        # only here, so an unchecked close is a silent data loss.
        os.close(out_fd)
    except OSError as exc:
        raise _StepFailed(step, exc, target) from exc
    step = "verify"
    try:
        size = os.stat(target).st_size
    except OSError as exc:
        raise _StepFailed(step, exc, target) from exc
    if size != expected or copied != expected:
        short = OSError(errno.EIO, f"{target} holds {size} bytes after close, expected {expected}")
        raise _StepFailed(step, short, target)
    return copied


def _match_mode(fd: int, mode: int) -> None:
    # open() applies the umask; an existing destination's mode (say 0666 under umask 022)
    # needs an explicit fchmod. Object stores refuse chmod (#792): their mode is fixed anyway.
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
    except OSError as exc:
        log.debug("could not set mode %o: %s", mode, exc)


def _rename_into_place(staged: Path, dest: Path, *, mode: int, fsync: bool) -> None:
    step = "chmod"
    try:
        os.chmod(staged, mode)
        if fsync:
            step = "fsync"
            fd = os.open(staged, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        step = "rename"
        os.replace(staged, dest)
    except OSError as exc:
        raise _StepFailed(step, exc, dest) from exc


def publish_file(
    staged: Path,
    dest: Path,
    *,
    publish: str,
    fsync: bool,
    staging_device: Optional[int],
) -> Published:
    """Publish ``staged`` to ``dest``. On failure raise PublishError; ``staged`` is kept."""
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
        try:
            _rename_into_place(staged, dest, mode=mode, fsync=fsync)
            nbytes = os.stat(dest).st_size
        except _StepFailed as failed:
            # A bind mount of the same filesystem still answers EXDEV: copy instead.
            if failed.error.errno != errno.EXDEV:
                raise _publish_error(failed, dest, staged, "rename", existed=existed) from failed.error
            strategy = "replace"  # publish="direct" never chooses rename
        else:
            if fsync:
                fsync_directory(directory)
            return Published("rename", nbytes, time.perf_counter() - started)

    if strategy == "replace":
        try:
            nbytes = _replace(staged, dest, mode=mode, fsync=fsync)
            return Published("replace", nbytes, time.perf_counter() - started)
        except _StepFailed as failed:
            cannot_rename = failed.step == "rename" and failed.error.errno in NOT_SUPPORTED
            if not (publish == "auto" and cannot_rename):
                raise _publish_error(failed, dest, staged, "replace", existed=existed) from failed.error
            _remember_direct(dest_device, directory, failed.error)

    try:
        nbytes = _direct(staged, dest, mode=mode, fsync=fsync, previous=previous)
    except _StepFailed as failed:
        raise _publish_error(failed, dest, staged, "direct", existed=existed) from failed.error
    return Published("direct", nbytes, time.perf_counter() - started)


def _choose(publish: str, directory: Path, dest_device: int, staging_device: Optional[int]) -> str:
    if publish == "direct":
        return "direct"
    if staging_device is not None and staging_device == dest_device:
        return "rename"
    if publish == "auto" and _can_rename(directory, dest_device) is False:
        return "direct"
    return "replace"


def _can_rename(directory: Path, device: int) -> Optional[bool]:
    """Whether files in ``directory`` can be renamed, probed once per device with an empty
    file, so that a mount which cannot rename (mountpoint-s3, #792) does not cost a full
    wasted copy first (measured: 1 GiB onto the kit's mountpoint took 3.25 s, 1.92 s direct).
    None when the probe itself could not run: the real publish then decides."""
    known = capabilities.strategy_for(device)
    if known is not None:
        return known != "direct"
    source = directory / temp_name(RENAME_PROBE)
    target = directory / temp_name(RENAME_PROBE)
    try:
        os.close(os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        log.debug("rename probe in %s could not create a file: %s", directory, exc)
        return None
    try:
        os.replace(source, target)
    except OSError as exc:
        _best_effort_unlink(source)
        if exc.errno not in NOT_SUPPORTED:
            return None
        _remember_direct(device, directory, exc)
        return False
    _best_effort_unlink(target)
    capabilities.remember(device, "replace")
    return True


def _remember_direct(device: int, directory: Path, error: OSError) -> None:
    if capabilities.remember(device, "direct"):
        log.warning(
            "%s cannot rename (%s); publishing to that filesystem with publish='direct' from "
            "now on (set SAFESTAGE_PUBLISH=direct to skip the probe)",
            directory,
            _errno_text(error),
        )


def _replace(staged: Path, dest: Path, *, mode: int, fsync: bool) -> int:
    temp = dest.parent / temp_name(dest.name)
    try:
        nbytes = copy_to_new_file(
            staged, temp, flags=os.O_CREAT | os.O_EXCL, mode=mode, fsync=fsync
        )
        try:
            os.replace(temp, dest)
        except OSError as exc:
            raise _StepFailed("rename", exc, dest) from exc
    except _StepFailed as failed:
        # Never leave our temp beside the destination; exclusive create means it is ours.
        if failed.step != "create":
            failed.leftover = temp if _best_effort_unlink(temp) else None
        raise
    if fsync:
        fsync_directory(dest.parent)
    return nbytes


def _direct(
    staged: Path, dest: Path, *, mode: int, fsync: bool, previous: Optional[os.stat_result]
) -> int:
    try:
        return copy_to_new_file(staged, dest, flags=os.O_CREAT | os.O_TRUNC, mode=mode, fsync=fsync)
    except _StepFailed as failed:
        if failed.step == "create":
            raise
        # An object store keeps the previous object when an upload fails; a POSIX filesystem
        # has already truncated it. Keep the final name only if it is still that old file.
        if not _unchanged(dest, previous):
            failed.removed = _best_effort_unlink(dest) is None
        raise


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


def _advice(step: str, error: OSError, strategy: str) -> str:
    code = error.errno
    if step == "rename" and code in NOT_SUPPORTED and strategy == "replace":
        return (
            "this destination cannot rename files: use publish='auto' or publish='direct' "
            "(SAFESTAGE_PUBLISH=direct)"
        )
    if code in NOT_SUPPORTED and strategy == "direct":
        return "this destination refused even a sequential write of a new file: run `safestage doctor` on it"
    if code is not None and code in _ADVICE:
        return _ADVICE[code]
    return "check the destination (`safestage doctor PATH` probes it) and save again"


def _sentence(text: str) -> str:
    return f"{text[:1].upper()}{text[1:]}."


def _publish_error(
    failed: _StepFailed, dest: Path, staged: Path, strategy: str, *, existed: bool
) -> PublishError:
    error = failed.error
    if strategy == "direct" and failed.step != "create":
        removed = failed.removed
        if removed is True:
            state = f"no incomplete file is left under {dest}"
        elif removed is False:
            state = f"{dest} may hold an incomplete file (removing it failed): do not load it"
        else:
            state = f"{dest} still holds its previous complete file"
    elif existed:
        state = f"{dest} still holds its previous file"
    else:
        state = f"nothing was written under {dest}"
    leftover = failed.leftover
    if leftover is not None:
        state += f"; a partial temp file is left at {leftover} (remove it, or run `safestage clean`)"
    kept = staged if staged.exists() else None
    where = (
        f"The complete staged copy is kept at {kept}: copy it there yourself or save again."
        if kept is not None
        else "No staged copy could be kept."
    )
    message = (
        f"safestage could not publish {dest} ({strategy}, {failed.step} of {failed.path}): "
        f"{_errno_text(error)}. {_sentence(_advice(failed.step, error, strategy))} "
        f"{_sentence(state)} {where}"
    )
    return PublishError(
        error.errno,
        message,
        str(dest),
        staged_path=str(kept) if kept is not None else None,
        step=failed.step,
    )
