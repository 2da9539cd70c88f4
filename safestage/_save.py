"""One save, planned and run: every way in goes through here.

``staged()``/``activate()`` saves (the serialize_file and torch.save wrappers, _writers),
``staged_file``, the Lightning plugin, and, for their staging directory, ``staged_dir`` and
``commit_in_place``. A save is planned (``plan``) as one of:

- ``unstaged``: the original writer straight to the destination (skip_local_disk on a local
  disk, or a path inside a staged_file/staged_dir local directory, which is staging already);
- ``followed``: serialized locally while a thread publishes behind the writer (_follow);
- ``staged``: serialized locally, then published before the save returns;
- ``background``: serialized locally, published by the one background publisher
  (_work), which owns the publish and its error. A writer that can copy its state
  (``snapshot``: safetensors and torch.save) returns once the copy is taken (_snapshot), and
  the serialization runs on the worker too;
- ``deferred``: into a background ``staged_dir``'s local directory (its ``Deferred`` takes
  the save): the state copied, then serialized on a worker, as a background save's, but into
  the directory itself, which the block's commit publishes once its saves are written.

and then run (``run``). The staging root is checked and swept once per process and root
(``staging_root``), not per save: a Lightning run saving a checkpoint every few minutes
probes and sweeps its root once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Literal, Optional

from . import _patch, _work
from ._config import BACKGROUND_ON, PathArg, Settings
from ._destination import Destination, file_url
from ._errors import PublishError, StagingError
from ._kept import SaveDir
from ._mounts import is_local_disk
from ._names import local_name
from ._paths import absolute, resolve_destination
from ._snapshot import Held
from ._stage import (
    LocalCopy,
    PublishRecord,
    StagingRoot,
    follow_strategy,
    keep_unpublished,
    publish_local,
    staging_failure,
    write_following,
    write_local,
    write_unstaged,
)

log = logging.getLogger("safestage")

Way = Literal["unstaged", "followed", "staged", "background", "deferred"]
Record = Callable[[PublishRecord], None]
AsError = Callable[[BaseException], BaseException]
# Copy the writer's state within the budget (bytes): the writer of the copy and what holds
# it, or None when it cannot be copied (the save then serializes before it returns).
Snapshot = Callable[[int], Optional[tuple[Callable[[str], None], Held]]]


def _as_is(exc: BaseException) -> BaseException:
    return exc


# -- the staging root: checked and swept once per process and root ------------------------------

_roots: dict[tuple[int, Path, bool], StagingRoot] = {}
_roots_lock = threading.Lock()


def staging_root(settings: Settings, *, opening: bool = False) -> StagingRoot:
    """The checked staging root of ``settings``: built (checked, swept) on first use in this
    process, then reused while the directory is still there as itself. ``opening`` (an
    activation, a plugin made): a root removed since is checked again, so that the
    activation fails as on first use."""
    path = settings.staging_root()
    is_default = settings.root is None
    key = (os.getpid(), path, is_default)
    with _roots_lock:
        root = _roots.get(key)
        if root is not None and not (is_default or opening) and not os.path.lexists(root.path):
            return root  # removed since: its next save says so ("it no longer exists")
        if root is None or not root.unchanged():  # the default root is made again
            root = StagingRoot(path, is_default=is_default)
            _roots[key] = root
        return root


def save_dir(settings: Settings) -> tuple[StagingRoot, SaveDir]:
    """A fresh private save directory under the checked staging root (a commit's)."""
    root = staging_root(settings)
    return root, root.new_save_dir()


def checked_roots() -> list[Path]:
    """The staging roots this process has checked (retention looks there for live commits)."""
    with _roots_lock:
        return [path for (pid, path, _) in _roots if pid == os.getpid()]


def after_fork_in_child() -> None:  # registered by _lifecycle
    # The parent's threads (a root being checked) do not exist here.
    global _roots_lock
    _roots_lock = threading.Lock()
    _roots.clear()
    _writing.clear()


# -- plan and run --------------------------------------------------------------------------------


def plan(
    settings: Settings, dest: Destination, root: StagingRoot, *, needs: Optional[int], owner: object
) -> Way:
    """How one save of ``dest`` runs (see the module docstring)."""
    if _patch.in_unstaged_dir(dest):
        # Into staged_dir's local directory or staged_file's path: staging already, and its
        # owner publishes it (staging it again would publish after the owner had committed).
        # A background staged_dir's block returns without waiting for its saves.
        return "deferred" if isinstance(owner, Deferred) else "unstaged"
    if settings.skip_local_disk and isinstance(dest, Path) and is_local_disk(dest.parent):
        return "unstaged"
    if settings.background and _work.may_defer(owner):
        return "background"
    if follow_strategy(settings, dest, root, needs) is not None:
        return "followed"
    return "staged"


def run(
    write: Callable[[str], None],
    dest: Destination,
    settings: Settings,
    *,
    owner: object,
    record: Record,
    needs: Optional[int] = None,
    as_error: AsError = _as_is,
    job: Optional[_work.Job] = None,
    snapshot: Optional[Snapshot] = None,
) -> None:
    """One save: ``write(path)`` writes the file, planned and published as ``plan`` says;
    ``record`` receives its PublishRecord (on a worker thread for a background publish).
    ``snapshot``: how to copy the writer's state, for a background save to return after the
    copy.

    ``owner`` is whoever waits for its background publish (``_work.wait(owner)``); ``job``,
    the save's job if the caller started it (``_patch``, under its lock), else one is started;
    ``as_error`` gives safestage's errors the class that writer's callers catch
    (SafetensorError for safetensors, RuntimeError for torch.save); ``needs``, the file's
    size if known, lets a staging root that cannot hold it refuse before anything is written.
    Raises what a staged save raises (StagingError, PublishError with the complete copy
    kept); a writer's own error removes the local copy and reaches the caller unchanged."""
    with _work.running("file", dest, owner, job=job) as job:
        root = staging_root(settings)
        way = plan(settings, dest, root, needs=needs, owner=owner)
        # plan: only a local directory's save is written in place or followed; an object is
        # always staged, then uploaded.
        if way == "unstaged":
            assert isinstance(dest, Path), dest
            record(write_unstaged(write, dest, settings))
            return
        if way == "followed":
            assert isinstance(dest, Path), dest
            _work.settle(dest)  # an earlier background publish of it lands first
            try:
                following = write_following(write, dest, root, settings, needs=needs)
            except (PublishError, StagingError) as exc:
                as_error(exc)
                raise
            record(following)
            return
        if way == "deferred":
            # Not in a process that may not leave work behind (a forked child: its commit is
            # its parent's): written before the call returns, as when it cannot be copied.
            taken = snapshot(settings.snapshot_bytes()) if snapshot is not None and _work.may_defer(owner) else None
            if taken is None:
                write(str(dest))
                return
            _serialize_later(*taken, dest, settings, None, job, record, as_error, needs=needs)
            return
        if way == "background":
            _make_room(root, needs, dest, owner)  # checked here: write_local need not again
            taken = snapshot(settings.snapshot_bytes()) if snapshot is not None else None
            if taken is not None:
                _serialize_later(*taken, dest, settings, root, job, record, as_error, needs=needs)
                return
            needs = None
        copy = write_local(write, dest, root, needs=needs)
        publish(copy, settings, root, job=job if way == "background" else None,
                record=record, as_error=as_error)  # fmt: skip


def publish(
    copy: LocalCopy,
    settings: Settings,
    root: StagingRoot,
    *,
    job: Optional[_work.Job] = None,
    record: Record,
    as_error: AsError = _as_is,
    copy_bytes: bool = False,
) -> None:
    """Publish a local copy: now (``job`` None), after any pending background publish of the
    same destination, or, handing ``job`` off, on a worker. ``copy_bytes``: never move the
    local file itself (rename), copy its bytes."""

    def work() -> PublishRecord:
        try:
            published = publish_local(copy, settings, root, copy=copy_bytes)
        except (PublishError, StagingError) as exc:
            as_error(exc)
            raise
        record(published)
        return published

    if job is None:
        _work.settle(copy.dest)  # an earlier background publish of it lands first
        work()
        return
    _work.hand_off(  # a Ctrl-C while waiting for a slot keeps and names the copy
        job, work, limit=settings.background, kept=copy.path, not_started=functools.partial(keep_unpublished, copy),
    )  # fmt: skip


def _serialize_later(
    write: Callable[[str], None],
    held: Held,
    dest: Destination,
    settings: Settings,
    root: Optional[StagingRoot],
    job: _work.Job,
    record: Record,
    as_error: AsError,
    *,
    needs: Optional[int],
) -> None:
    """A background save whose state is copied (``held``): serialized from the copy and
    published on a worker; the copy is released once the local file is written (or not).
    Its private directory is made here, so that a staging root that is gone (a tmp cleaner)
    is said at the call, as for a save that serializes now. ``root`` None (deferred): written
    into ``dest`` itself, a background staged_dir's local directory, and not published."""
    try:
        private = root.new_save_dir() if root is not None else None
    except BaseException:
        held.release()
        raise

    def work() -> Optional[PublishRecord]:
        try:
            try:
                if root is None or private is None:  # deferred: into a local directory
                    assert isinstance(dest, Path), dest
                    _write_in_place(write, dest, settings)
                    return None
                # Room was checked at the call, before the copies of earlier saves were
                # written: a root full of them now has room once they are published. One
                # write at a time per root, so that the check sees every copy written.
                with _local_writes(root.path):
                    try:
                        root.check_room(needs, dest)
                    except StagingError:
                        if not _work.settle_copies(job.owner, but=job):
                            private.remove()
                            raise
                    copy = write_local(write, dest, root, needs=needs, private=private)
            finally:
                held.release()
            job.kept = copy.path  # named if exit is cut short while it publishes
            published = publish_local(copy, settings, root)
        except (PublishError, StagingError) as exc:
            as_error(exc)
            raise
        record(published)
        return published

    def not_started(exc: BaseException) -> None:  # nothing was written; the save raises
        held.release()
        if private is not None:
            private.remove()

    # A staged_dir's settings need not ask for background publishes: its block's saves go on
    # on a worker all the same.
    limit = settings.background if private is not None else max(settings.background, BACKGROUND_ON)
    _work.hand_off(job, work, limit=limit, not_started=not_started)


def _write_in_place(write: Callable[[str], None], dest: Path, settings: Settings) -> None:
    """A deferred save, on its worker: into the staged_dir's local directory, where a full or
    removed staging root is a staging problem, said so with the errno (as write_local does)."""
    try:
        write(str(dest))
    except BaseException as exc:
        translated = staging_failure(exc, dest, settings.staging_root())
        if translated is not None:
            raise translated from exc
        raise


_writing: dict[Path, threading.Lock] = {}


def _local_writes(root: Path) -> threading.Lock:
    """The lock of the deferred writes into ``root`` (one at a time)."""
    with _roots_lock:
        return _writing.setdefault(root, threading.Lock())


def _make_room(root: StagingRoot, needs: Optional[int], dest: Destination, owner: object) -> None:
    """background: a root too full for this file now may hold it once the owner's pending
    publishes have landed and their local copies are gone; wait for those before refusing
    (review 5). Their failures are raised where they always are (close, teardown)."""
    try:
        root.check_room(needs, dest)
    except StagingError:
        pending = _work.running_count(owner)
        if not pending:
            raise
        log.info(
            "%s: the staging root is full until %d pending publish(es) land; waiting", dest, pending
        )
        _work.settle(owner=owner)
        root.check_room(needs, dest)


# -- a background staged_dir: its saves serialized later, from a copy -----------------------------


class Deferred:
    """The saves into one background ``staged_dir``'s local directory (``_patch.begin_save``
    gives them to it): each planned ``deferred`` (copied, serialized on a worker), so that the
    block returns without waiting for them; its commit waits for them (``wait``) before its
    checks."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._jobs: list[_work.Job] = []

    @property
    def jobs(self) -> list[_work.Job]:
        """Its saves handed to a worker (one that ran in its caller raised there)."""
        return [job for job in self._jobs if job.background]

    def _begin_save(self, dest: Destination) -> _work.Job:
        """Called under the activation lock, as a Stage's: the save is this block's job."""
        job = _work.start("file", dest, self)
        self._jobs.append(job)
        return job

    def _save(
        self,
        serialize: Callable[[str], None],
        dest: Path,
        *,
        as_error: AsError = _as_is,
        needs: Optional[int] = None,
        job: Optional[_work.Job] = None,
        snapshot: Optional[Snapshot] = None,
    ) -> None:
        """One save of the block, through the one pipeline (``run``), as a Stage's."""
        run(serialize, dest, self.settings, owner=self, record=lambda _: None, needs=needs, as_error=as_error,
            job=job, snapshot=snapshot)  # fmt: skip

    def wait(self) -> None:
        """Until every save has been written; the first failure raised, whether or not
        somebody saw it already (``safestage.wait()`` in the block)."""
        errors = []
        for job in self.jobs:
            try:
                job.wait()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def settle(self) -> None:
        """Until every save has been written or has failed (their failures are the block's)."""
        _work.failures(self)

    def __repr__(self) -> str:
        return f"<safestage deferred saves: {len(self.jobs)}>"


# -- staged_file: the writer is the caller's block ----------------------------------------------


@contextlib.contextmanager
def local_file(dest: Destination, settings: Settings) -> Iterator[Path]:
    """A local path in a fresh save directory for any writer (the caller's block); published
    to ``dest`` when the block succeeds, removed when it raises."""
    with _work.running("file", dest, None):
        root = staging_root(settings)
        started = time.perf_counter()
        copy: Optional[LocalCopy] = None
        private = root.new_save_dir()
        _patch.add_unstaged_dir(private.path)  # a safetensors save into it is not staged again
        try:
            local = private / local_name(dest.name)
            try:
                yield local
            except BaseException:
                private.remove()
                raise
            finally:
                _patch.remove_unstaged_dir(private.path)
            copy = LocalCopy(private, local, dest, started, time.perf_counter() - started)
            _check_written(copy)
        finally:
            if copy is None:
                private.release()
        # A symlink left by the writer (a cache's file): publish its bytes, never the link,
        # and never touch its target (a rename would move the link and chmod the target).
        publish(
            copy,
            settings,
            root,
            record=lambda _: None,
            copy_bytes=stat.S_ISLNK(os.lstat(local).st_mode),
        )


def _check_written(copy: LocalCopy) -> None:
    """The writer must have left one regular file (or a symlink to one) at the local path;
    anything else is an error, and whatever it wrote is kept and named, never deleted."""
    local = copy.path
    try:
        info = os.lstat(local)
    except FileNotFoundError:
        copy.save_dir.remove()
        raise StagingError(
            errno.ENOENT,
            f"safestage.staged_file: nothing was written to {local}, so nothing was published to {copy.dest}.",
            str(local),
        ) from None
    if stat.S_ISREG(info.st_mode) or (stat.S_ISLNK(info.st_mode) and local.is_file()):
        return
    kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
    copy.save_dir.release()  # kept: it may hold hours of work (a save_state, a DCP save)
    raise StagingError(
        errno.EISDIR if stat.S_ISDIR(info.st_mode) else errno.EINVAL,
        f"safestage.staged_file: the writer made {kind} at {local} where a file was expected, "
        f"so nothing was published to {copy.dest}. What it wrote is kept at {local}; for a "
        "whole directory use safestage.staged_dir().",
        str(local),
    )


# -- the destination -----------------------------------------------------------------------------


def destination(dest: PathArg) -> Destination:
    """The kernel's path of ``dest`` (see _paths), or the error a plain open would give; or the
    object an object-store URL names (_destination)."""
    url = file_url(dest)
    if url is not None:
        return url
    text = os.fsdecode(dest)  # a bytes path, as open() and staged_dir take (undecodable bytes too)
    target = resolve_destination(text)
    if target is not None:
        return target
    shown = absolute(text)
    if text.endswith("/") or os.path.basename(text) in ("", ".", ".."):
        raise PublishError(
            errno.EISDIR,
            f"safestage: {text!r} names a directory (trailing slash, '.' or '..'): name a file.",
            str(shown),
        )
    if os.path.isdir(text):
        raise PublishError(
            errno.EISDIR, f"safestage: {shown} is a directory: name a file inside it.", str(shown)
        )
    code = _open_error(os.path.dirname(text) or ".")
    if code == errno.ENOTDIR:
        advice = "a component of its directory is not a directory"
    elif code == errno.EACCES:
        advice = "this user may not search its directory: fix the permissions"
    else:
        advice = "its directory does not exist: create it before saving"
    raise PublishError(
        code,
        f"safestage: cannot save to {shown}: [Errno {code}] {os.strerror(code)}: {advice}.",
        str(shown),
    )


def _open_error(directory: str) -> int:
    """The errno the kernel gives for ``directory`` (ENOENT if it gives none)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno or errno.ENOENT
    os.close(fd)
    return errno.ENOENT
