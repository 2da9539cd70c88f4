"""The staging root (StagingRoot), which makes one save directory per save (``_kept.SaveDir``),
and the steps of a save that _save plans and runs: write a local copy (LocalCopy), follow it,
publish it.

Each save is serialized by the *original* writer into a fresh 0700 save directory under a
local POSIX staging root, then handed to _publish. The save directory is what makes a shared,
world-writable root safe: nobody else can plant a file or symlink inside it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ._config import Settings
from ._destination import Destination
from ._errors import PublishError, StagingError
from ._follow import FOLLOW_MIN_BYTES, Follower, FollowMismatch, WriterFailed
from ._interrupts import deferred
from ._kept import Record, SaveDir, recover_command, remove_tree, sweep
from ._lifecycle import start_worker
from ._locks import Contended, claim, close_quietly, open_directory
from ._mounts import mount_of
from ._names import local_name, save_dir_name
from ._paths import real_directory
from ._publish import (
    Published,
    fsync_directory,
    kept_copy_text,
    planned_strategy,
    publish_file,
    wanted_mode,
)

log = logging.getLogger("safestage")

_OS_ERROR_IN_MESSAGE = re.compile(r"\(os error (\d+)\)")


@dataclass(frozen=True)
class PublishRecord:
    """One published file: where it went, how big, how, and how long each half took."""

    destination: Destination
    bytes: int
    # "rename" (same filesystem, no copy), "link" (a commit's, which keeps its local copy whole),
    # "replace", "direct", or "unstaged" (skip_local_disk)
    publish: str
    seconds: float  # serialize + publish, as the caller of save_file waited
    serialize_seconds: float
    publish_seconds: float


def _is_host_root() -> bool:
    """Whether this process is uid 0 of the initial user namespace, whose uid_map is the
    whole identity map (any other map is a user namespace, even one mapping 0 to 0)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map", encoding="ascii") as table:
            first = table.read().split()
    except OSError:
        return True  # no user namespaces here
    return first == ["0", "0", "4294967295"]


class StagingRoot:
    """The staging root, checked (local, POSIX, writable, not planted) and swept of dead
    processes' save directories when constructed. _save keeps one per process and root."""

    def __init__(self, root: Path, *, is_default: bool, warn_kept: bool = True) -> None:
        if is_default:
            _ensure_private_default(root)
        _check_root(root)
        self.path = real_directory(root) or root  # the kernel's path: no text games (issue 9)
        try:
            info = os.stat(self.path)
        except OSError as exc:
            raise _root_error(self.path, exc, "inspect") from exc
        self.device = info.st_dev
        self._identity = _identity(info)
        _sweep_dead(self.path, warn_kept=warn_kept)

    def unchanged(self) -> bool:
        """Whether the checked directory is still there, as itself, with the owner and mode it
        was checked with (one stat): a root removed, replaced, chowned or loosened since is
        checked again (the default root is tightened back to 0700), so its errors and fixes
        stay the activation's."""
        try:
            info = os.stat(self.path)
        except OSError:
            return False
        return _identity(info) == self._identity and stat.S_ISDIR(info.st_mode)

    def check_room(self, nbytes: Optional[int], dest: Destination) -> None:
        """Refuse a save of about ``nbytes`` that cannot fit in the root, before anything is
        written: serializing a 5 GB shard into a root with 2 GB free only to fail at the end
        wastes minutes. Best effort: no size, or no statvfs, and the write itself decides
        (a real ENOSPC then gives the same error)."""
        if not nbytes:
            return
        try:
            info = os.statvfs(self.path)
        except OSError:
            return
        if info.f_blocks == 0:  # ramfs, tmpfs size=0: no size limit, not "full" (review 5)
            return
        # Only the host's root may use the blocks ext4 reserves; root in a user namespace
        # (rootless podman, Kubernetes hostUsers: false) counts as everyone else.
        blocks = info.f_bfree if _is_host_root() else info.f_bavail
        free = blocks * info.f_frsize
        if nbytes <= free:
            return
        raise StagingError(
            errno.ENOSPC,
            f"safestage could not stage {dest}: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: "
            f"it needs {nbytes} bytes in the staging root {self.path}, which has {free} free. The "
            "staging root is full: point staged(root) or SAFESTAGE_DIR at a local disk with room "
            "for the largest shard. Nothing was written; the destination was not touched.",
            str(self.path),
        )

    def new_save_dir(self) -> SaveDir:
        for _ in range(100):
            candidate = self.path / save_dir_name()
            try:
                os.mkdir(candidate, 0o700)
            except FileExistsError:
                continue
            except OSError as exc:
                raise _root_error(self.path, exc, "create a private staging directory in") from exc
            fd: Optional[int] = None
            try:
                fd = open_directory(candidate)
                claim(fd, candidate)
            except (FileNotFoundError, Contended):
                # A sweeper got to it before we locked it: one in another PID namespace
                # removes it, but one that sees our pid alive (another thread's activation
                # sweeping) keeps it and lets go. Either way a fresh name for us, and the
                # empty directory we made goes (CI of stop 16 found it left behind).
                with deferred():
                    _drop_abandoned(candidate, fd)
                continue
            except BaseException as exc:
                with deferred():
                    if fd is not None:
                        close_quietly(fd)
                    remove_tree(candidate)
                if isinstance(exc, OSError):
                    raise _root_error(
                        self.path, exc, "lock a private staging directory in"
                    ) from exc
                raise
            return SaveDir(candidate, fd)
        raise StagingError(
            errno.EEXIST,
            f"safestage could not find a free staging name under {self.path}",
            str(self.path),
        )


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_uid, stat.S_IMODE(info.st_mode))


def _drop_abandoned(candidate: Path, fd: Optional[int]) -> None:
    """Remove the empty private directory we made and could not lock, if it is still ours
    (the same inode); rmdir never removes anything a save put there."""
    try:
        if fd is not None and os.path.samestat(os.fstat(fd), os.lstat(candidate)):
            os.rmdir(candidate)
    except OSError as exc:
        log.debug("could not remove the abandoned staging directory %s: %s", candidate, exc)
    finally:
        if fd is not None:
            close_quietly(fd)


def _sweep_dead(root: Path, *, warn_kept: bool = True) -> None:
    """Remove the save directories that processes on this host left when they died and that
    hold nothing worth keeping (``_kept.sweep``, the rules of `safestage clean`), and name the
    kept copies, on stderr once per process whatever the logging setup (``warn_kept``; not for
    `safestage recover` itself). A kept copy is never published from here: the job may have
    written newer checkpoints since, and an activation must not start uploads nobody asked
    for; `safestage recover` does it when asked."""
    try:
        swept = sweep(root, warn_kept=warn_kept)
    except OSError as exc:
        log.debug("could not sweep %s: %s", root, exc)
        return
    for item in swept:
        if item.action in ("removed", "kept"):
            log.info("%s/%s %s: %s", root, item.found.path.name, item.action, item.reason)


def _ensure_private_default(root: Path) -> None:
    """Create $TMPDIR/safestage-<uid> 0700, and refuse one someone else planted."""
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _root_error(root, exc, "create the default staging root") from exc
    info = _refuse_planted(root)
    if info.st_mode & 0o077:
        os.chmod(root, 0o700)


def _refuse_planted(root: Path) -> os.stat_result:
    info = os.lstat(root)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise StagingError(
            errno.EPERM,
            f"safestage refuses the default staging root {root}: it is not a directory owned by "
            f"uid {os.getuid()} (someone may have planted it). Remove it, or set SAFESTAGE_DIR "
            "to a private local directory.",
            str(root),
        )
    return info


def check_root(root: Path, *, is_default: bool) -> None:
    """What activation checks, without creating the root or sweeping it (for `status` and
    `run`): raise the StagingError an activation would raise."""
    if is_default:
        if not os.path.lexists(root):
            _check_root(root.parent)  # the first activation makes it 0700 there
            return
        _refuse_planted(root)
    _check_root(root)


def _check_root(root: Path) -> None:
    try:
        info = os.stat(root)
    except FileNotFoundError as exc:
        raise StagingError(
            errno.ENOENT,
            f"safestage staging root {root} does not exist: create it (mkdir -p) or choose an "
            "existing local directory (staged(root) or SAFESTAGE_DIR).",
            str(root),
        ) from exc
    except OSError as exc:
        raise _root_error(root, exc, "inspect") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise StagingError(
            errno.ENOTDIR,
            f"safestage staging root {root} is not a directory: name a local directory.",
            str(root),
        )
    mount = mount_of(root)
    if mount is not None and (mount.is_fuse or mount.is_network):
        raise StagingError(
            None,
            f"safestage staging root {root} is on a {mount.fs_type} mount ({mount.source} at "
            f"{mount.mount_point}): staging needs a local POSIX filesystem (local disk, NVMe "
            "scratch or /dev/shm) so the writer's ftruncate and rename work there.",
            str(root),
        )
    # A real write probe: os.access() says yes to root even on a read-only mount. Locked
    # like every private directory, so no sweeper takes it for a dead one meanwhile.
    probe = root / save_dir_name()
    try:
        os.mkdir(probe, 0o700)
    except OSError as exc:
        raise _root_error(root, exc, "write in") from exc
    fd: Optional[int] = None
    try:
        fd = open_directory(probe)
        claim(fd, probe)
    except (OSError, Contended):
        pass  # a sweeper got there first: the root is writable, which is all we ask here
    finally:
        with deferred():
            try:
                os.rmdir(probe)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _root_error(root, exc, "remove its own probe directory from") from exc
            finally:
                if fd is not None:
                    close_quietly(fd)


def _root_error(root: Path, exc: OSError, doing: str) -> StagingError:
    advice = {
        errno.EACCES: "make it writable by this user or choose another directory",
        errno.EPERM: "make it writable by this user or choose another directory",
        errno.EROFS: "it is on a read-only filesystem: choose another directory",
        errno.ENOSPC: "its filesystem is full: free space or choose another directory",
        errno.ENOENT: "it no longer exists: recreate it or choose another directory",
    }.get(exc.errno or 0, "choose another local directory")
    return StagingError(
        exc.errno,
        f"safestage could not {doing} staging root {root}: [Errno {exc.errno}] {exc.strerror}. "
        f"Set staged(root) or SAFESTAGE_DIR: {advice}.",
        str(root),
    )


@dataclass(frozen=True)
class LocalCopy:
    """A file written locally, complete in its save directory, waiting to be published."""

    save_dir: SaveDir
    path: Path
    dest: Destination
    started: float  # perf_counter when the save began
    serialize_seconds: float
    wall_started: float = field(
        default_factory=time.time
    )  # when, by the clock (a kept copy's record)

    @property
    def nbytes(self) -> int:
        return os.stat(self.path).st_size


def _write_checked(write: Callable[[str], None], staged: Path, dest: Destination) -> None:
    """Run the writer into ``staged``; a writer that returns without leaving a file there
    is an error, never an empty publish."""
    write(str(staged))
    if not staged.is_file():
        raise StagingError(
            errno.ENOENT,
            f"safestage: the writer returned but left no file at {staged}; nothing was published to {dest}.",
            str(staged),
        )


def write_local(
    write: Callable[[str], None],
    dest: Destination,
    staging: StagingRoot,
    *,
    needs: Optional[int] = None,
    private: Optional[SaveDir] = None,
) -> LocalCopy:
    """Run ``write(local_path)`` into a fresh private directory; clean up if it fails.

    ``needs``: the file's size if known (StagingRoot.check_room). An I/O failure inside the
    staging root (full, removed) becomes a StagingError; any other error of the writer (bad
    tensors) reaches the caller unchanged.
    """
    started = time.perf_counter()
    staging.check_room(needs, dest)
    private = staging.new_save_dir() if private is None else private  # made by the caller
    staged = private / local_name(dest.name)
    try:
        _write_checked(write, staged, dest)
    except BaseException as exc:
        private.remove()
        translated = staging_failure(exc, staged, staging.path)
        if translated is not None:
            raise translated from exc
        raise
    return LocalCopy(private, staged, dest, started, time.perf_counter() - started)


def follow_strategy(
    settings: Settings, dest: Destination, staging: StagingRoot, needs: Optional[int] = None
) -> Optional[str]:
    """The strategy a followed save of ``dest`` would publish with, or None where following
    does not apply. Only ``replace``: its temp is ours alone (O_EXCL), so a writer failing
    mid-file costs nothing but that temp. ``direct`` publishes after the writer (never
    followed), and a rename needs the whole file. A save known to be smaller than
    FOLLOW_MIN_BYTES is not followed: there is nothing to overlap. A save of unknown size
    (torch.save) only with follow=True; the default (None, "auto") follows only what it
    knows to be big."""
    if settings.follow is False:
        return None
    if needs is None:
        if settings.follow is None:
            return None
    elif needs < FOLLOW_MIN_BYTES:
        return None
    strategy = planned_strategy(settings.publish, dest, staging.device)
    return strategy if strategy == "replace" else None


def write_following(
    write: Callable[[str], None],
    dest: Path,
    staging: StagingRoot,
    settings: Settings,
    *,
    needs: Optional[int] = None,
) -> PublishRecord:
    """Serialize into a private directory as write_local does, while a thread publishes the
    file behind the writer (_follow). If the followed copy cannot be proved equal to the
    staged file, or fails, the complete staged file is published again the ordinary way.
    A writer's error removes the partial copy (and the staged file) and reaches the caller."""
    started = time.perf_counter()
    staging.check_room(needs, dest)
    private = staging.new_save_dir()
    staged = private / local_name(dest.name)
    follower = Follower(private.path, staged)
    outcome: list[object] = []

    def publish() -> None:
        try:
            outcome.append(publish_file(
                staged, dest, publish=settings.publish, fsync=settings.fsync, staging_device=None,
                sync_directory=False, follow=follower,
            ))  # fmt: skip
        except BaseException as exc:  # handed to the saving thread
            outcome.append(exc)
        finally:
            follower.reader_gone()  # a failed publish never asks for the read-back

    try:
        publisher = start_worker(publish, name="safestage-follow", daemon=True)
    except RuntimeError as exc:
        # No thread to be had (a container at its pids limit, RLIMIT_NPROC, interpreter
        # shutdown on 3.12+): the save needs none, so it is staged, then published (review 6).
        log.debug("%s: cannot follow the writer (%s); staging, then publishing", dest, exc)
        private.remove()
        return publish_local(write_local(write, dest, staging), settings, staging)  # room checked
    item: Optional[LocalCopy] = None
    try:
        _write_checked(write, staged, dest)
        item = LocalCopy(private, staged, dest, started, time.perf_counter() - started)
        follower.finish()
        follower.check_final()  # the read-back CRC, while the publisher copies the tail
        publisher.wait()
    except BaseException as exc:
        # Every way out stops and joins the publisher first: no thread may go on copying
        # (or hold the destination's lock) after this save has returned.
        with deferred():
            follower.fail()
            publisher.wait()  # the publisher removes its partial copy
        if item is None:  # the writer failed, or was interrupted: nothing to keep
            with deferred():
                private.remove()
            translated = staging_failure(exc, staged, staging.path)
            if translated is not None:
                raise translated from exc
            raise
        if outcome and isinstance(outcome[0], Published):
            # Interrupted after the copy had committed: the save is published; nothing kept.
            with deferred():
                item.save_dir.remove()
            raise
        keep_unpublished(item, exc)  # Ctrl-C mid-copy: the complete file stays, named
        raise
    result = outcome[0] if outcome else None
    if isinstance(result, PublishError) and _destination_failed(result):
        # The destination itself failed (EIO at close, ENOSPC, ...): the same failure as an
        # ordinary publish would meet, not a reason to copy everything again.
        named = _naming_the_kept_copy(result, item)
        keep_unpublished(item, named)
        raise named
    if not isinstance(result, Published):
        log.warning(
            "%s: the copy made while serializing could not be used (%s: %s); publishing the "
            "complete staged file", dest, type(result).__name__, result,
        )  # fmt: skip
        return publish_local(item, settings, staging, copy=True)
    item.save_dir.remove()
    if settings.fsync and result.strategy == "replace":
        fsync_directory(dest.parent)
    done = time.perf_counter()
    record = PublishRecord(
        destination=dest,
        bytes=result.nbytes,
        publish=result.strategy,
        seconds=done - started,
        serialize_seconds=item.serialize_seconds,
        publish_seconds=done - started - item.serialize_seconds,
    )
    log.debug(
        "%s: %d bytes, serialize %.3fs, %s followed (%d bytes while writing), %.3fs more",
        dest, record.bytes, record.serialize_seconds, record.publish,
        follower.bytes_while_writing, record.publish_seconds,
    )  # fmt: skip
    return record


def _naming_the_kept_copy(error: PublishError, item: LocalCopy) -> PublishError:
    """A followed publish that failed while the writer was still writing built its error
    before the staged file existed under its name ("No staged copy could be kept."); the
    writer has since returned and the complete copy is kept: the error must say where
    (review 6)."""
    if error.staged_path is not None or not item.path.exists():
        return error
    message = error.message.replace(kept_copy_text(None), kept_copy_text(item.path))
    if message == error.message:  # the sentence was not there to swap: say it anyway
        message = f"{message} {kept_copy_text(item.path)}"
    named = PublishError(
        error.errno, message, error.filename, staged_path=str(item.path), step=error.step
    )
    named.__cause__ = error.__cause__
    return named


def _destination_failed(error: PublishError) -> bool:
    """Whether a followed publish failed at the destination, not in following the writer
    (a mismatch, a writer that failed, a read of the staging file: those fall back)."""
    cause = error.__cause__
    return getattr(error, "step", None) != "read" and not isinstance(
        cause, (FollowMismatch, WriterFailed)
    )


def publish_local(
    item: LocalCopy, settings: Settings, staging: StagingRoot, *, copy: bool = False
) -> PublishRecord:
    """Publish a staged file and remove its private directory; return the record.
    ``copy``: never move the staged file itself (rename), copy its bytes.

    On failure the private directory and its complete file are kept, and the PublishError
    says where.
    """
    publish_started = time.perf_counter()
    try:
        if not item.path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(item.path))
        published = publish_file(
            item.path,
            item.dest,
            publish=settings.publish,
            fsync=settings.fsync,
            staging_device=None if copy else staging.device,
            sync_directory=False,
        )
    except BaseException as exc:
        if not item.path.exists():
            item.save_dir.remove()
            if isinstance(exc, OSError) and not isinstance(exc, StagingError):
                raise _staged_copy_vanished(item, staging.path) from exc
            raise
        keep_unpublished(item, exc)
        raise
    item.save_dir.remove()  # published: from here on there is nothing to keep
    if settings.fsync and published.strategy in ("rename", "replace") and isinstance(item.dest, Path):
        fsync_directory(item.dest.parent)  # makes the rename durable
    done = time.perf_counter()
    record = PublishRecord(
        destination=item.dest,
        bytes=published.nbytes,
        publish=published.strategy,
        seconds=done - item.started,
        serialize_seconds=item.serialize_seconds,
        publish_seconds=done - publish_started,
    )
    log.debug(
        "%s: %d bytes, serialize %.3fs, %s %.3fs",
        item.dest,
        record.bytes,
        record.serialize_seconds,
        record.publish,
        record.publish_seconds,
    )
    return record


def keep_unpublished(item: LocalCopy, exc: BaseException) -> None:
    """The publish of ``item`` did not happen: its complete copy stays where it is (never
    swept, see _clean), recording its destination; an error says where itself, an interrupt
    gets a note that does."""
    if item.path.exists():
        item.save_dir.keep(Record(
            destination=item.dest, local=item.path.name, kind="file", left=(item.path.name,),
            started=item.wall_started, error=str(exc),
        ))  # fmt: skip
        if isinstance(exc, PublishError) and exc.staged_path == str(item.path):
            exc.message = f"{exc.message} {_publishes_it(item)}"
    item.save_dir.release()
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
        _note_kept_copy(exc, item)


def _publishes_it(item: LocalCopy) -> str:
    """What to do with a kept single file: its record names its destination, so recover
    publishes it as a save does (a temp file and replace, or direct), with its checks."""
    command = recover_command(item.save_dir.path.parent, item.dest)
    return f"{command} publishes it once this process has ended (or save again)."


def _note_kept_copy(exc: BaseException, item: LocalCopy) -> None:
    text = (  # the path last: a note read by a script ends with it, as before
        f"safestage: interrupted while publishing {item.dest}; {_publishes_it(item)[:-1]}; the "
        f"complete staged copy is kept at {item.path}"
    )
    log.warning("%s", text)
    if hasattr(exc, "add_note"):  # Python 3.11+: shown under the traceback
        exc.add_note(text)


def _staged_copy_vanished(item: LocalCopy, root: Path) -> StagingError:
    return StagingError(
        errno.ENOENT,
        f"safestage: the staged copy {item.path} vanished before it was published to "
        f"{item.dest}: the staging root {root} was removed or cleaned during the save. "
        f"{item.dest} was not replaced. Save again, with staged(root) or SAFESTAGE_DIR on a "
        "directory that no tmp cleaner empties.",
        str(root),
    )


def write_unstaged(write: Callable[[str], None], dest: Path, settings: Settings) -> PublishRecord:
    """when="auto" on a local disk: the original writer straight to ``dest``, no staging.

    Then the mode safetensors 0.8 gets wrong (0600 whatever the umask, safetensors#782) is
    set to what a staged save would give, and the file is fsync'ed if asked.
    """
    started = time.perf_counter()
    mode, _previous = wanted_mode(dest)
    write(str(dest))
    os.chmod(dest, mode)
    if settings.fsync:
        fd = os.open(dest, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            close_quietly(fd)
        fsync_directory(dest.parent)
    seconds = time.perf_counter() - started
    return PublishRecord(dest, os.stat(dest).st_size, "unstaged", seconds, seconds, 0.0)


def errno_of(exc: BaseException) -> Optional[int]:
    """The errno of an OSError, or of a SafetensorError (whose text ends "(os error N)")."""
    if isinstance(exc, OSError):
        return exc.errno
    if type(exc).__name__ == "SafetensorError":
        match = _OS_ERROR_IN_MESSAGE.search(str(exc))
        return int(match[1]) if match else None
    return None


def staging_failure(exc: BaseException, staged: Path, root: Path) -> Optional[StagingError]:
    """An I/O failure of the writer inside the staging root is a staging problem, not the
    caller's tensors: say so, with the errno. Tensor errors pass through unchanged."""
    code = errno_of(exc)
    if code is None:
        return None
    advice = {
        errno.ENOSPC: "the staging root is full: point staged(root) or SAFESTAGE_DIR at a local disk with room for the largest shard",
        errno.EDQUOT: "the staging root's quota is exhausted: choose another staging root",
        errno.ENOENT: "the staging root was removed during the save: recreate it or choose another",
    }.get(code, "check the staging root or choose another")
    return StagingError(
        code,
        f"safestage could not serialize into staging file {staged}: [Errno {code}] "
        f"{os.strerror(code)} ({exc}). {advice[:1].upper()}{advice[1:]}. The destination was not touched.",
        str(staged),
    )
