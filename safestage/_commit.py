"""``safestage.staged_dir``: a whole checkpoint directory, committed by a file written last.

A training checkpoint is a directory (shards, index, config and tokenizer JSON, torch.save
pickles, DCP's .metadata). A job killed while writing one in place leaves a directory that
looks complete and is not, and no destination we serve can fix that with a directory rename
(mountpoint-s3 has none, gcsfuse's is not atomic). So:

1. the block writes the checkpoint into a fresh local directory (in a save directory
   under the staging root, locked, 0700, from ``_save``); saves into it are not staged
   a second time;
2. on success, pending background publishes of files under the destination land first;
   everything that can refuse the commit is found before the destination is touched (what
   the block left, what is in the way at the destination); only then is the destination's
   commit file removed, so that a commit killed half-way can never leave an old commit
   file vouching for a mix of old and new files, and the temp files killed commits left
   there (subdirectories too) go;
3. every file is published by ``_publish.publish_file`` (rename / replace / direct, size
   verified, modes as for every save), two files at once, its CRC-32
   computed while it is copied;
4. the commit file (``_manifest``) is published last, atomically where the destination can
   rename (replace), direct where it cannot (an object store shows it only once complete).

A refusal (step 2) removes the local copy: refused as it is, it would be refused again. A
failure keeps the local copy, with a record of what it is for (``_stage.record_kept``), and
says which files landed; the commit file is never written then, so ``verify`` and
``latest_complete`` see an incomplete checkpoint.

The local directory's life, as sweeps and `safestage clean` see it (``_names``): it carries
``safestage-disposable`` while the block writes (a process killed then leaves nothing worth
keeping), loses it when the block returns (from then on it may hold the only complete copy:
kept), and gets it back once the commit file has landed, just before it is removed.
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
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, NoReturn, Optional, Union

from . import _background, _config, _inflight, _patch, _prune, _save
from ._clean import remove_dead_temps
from ._config import BACKGROUND_ON, PathArg, Publish, Settings
from ._errors import ConfigError, PublishError
from ._interrupts import deferred
from ._lifecycle import start_worker
from ._manifest import COMMIT_NAME, Crc32, FileEntry, Manifest, new_manifest, unsafe_path
from ._names import DISPOSABLE_MARKER, KEPT_RECORD, is_writer_temp, parse_temp_name
from ._paths import real_directory
from ._peers import DEFAULT_TIMEOUT
from ._publish import Digest, Published, fsync_directory, publish_file
from ._stage import PublishRecord, SaveDir, StagingRoot, record_kept, remove_tree

log = logging.getLogger("safestage")

# The commit file as staged, beside (never inside) the directory the block writes.
_STAGED_COMMIT = "safestage-commit.json"


class _Cancelled(Exception):
    """Raised from inside a copy to stop it: the commit was interrupted."""


class _CancellableCrc32(Crc32):
    """The digest of one copy, which also stops that copy at its next chunk once the commit
    is interrupted (publish_file then removes what it had started: its Digest contract)."""

    def __init__(self, cancel: threading.Event) -> None:
        super().__init__()
        self._cancel = cancel

    def update(self, data: memoryview, /) -> None:
        if self._cancel.is_set():
            raise _Cancelled("the checkpoint commit was interrupted")
        super().update(data)


def _digest_factory(cancel: threading.Event) -> Callable[[], Digest]:
    # A module-level seam: benchmarks/checkpoint.py swaps in a no-op digest to measure its cost.
    return lambda: _CancellableCrc32(cancel)


@dataclass
class _Tree:
    """What the block left in the local directory (relative '/'-separated paths)."""

    files: list[tuple[str, int]] = field(default_factory=list)  # (path, size)
    directories: list[str] = field(default_factory=list)  # every directory, parents first
    empty: list[str] = field(default_factory=list)  # those with nothing inside


class StagedDir:
    """The context manager ``safestage.staged_dir()`` returns. ``with`` yields the local
    directory to write the checkpoint into; after a successful block, ``records`` lists the
    published files (the commit file last) and ``manifest`` is what the commit file says."""

    def __init__(
        self,
        dest: PathArg,
        settings: Settings,
        *,
        group: Any = None,
        timeout: float = 0.0,
        in_flight: int = 0,
        retention: Optional[_prune.Retention] = None,
    ) -> None:
        self.settings = settings
        self._retention = retention  # keep=N: pruned after the commit landed (_prune)
        self._dest_argument = dest
        self._group, self._timeout = group, timeout  # a collective commit (_group_commit)
        self.dest: Optional[Path] = None  # the kernel's path of the destination, once entered
        self.local: Optional[Path] = None
        self.records: list[PublishRecord] = []
        self.manifest: Optional[Manifest] = None
        self._staging: Optional[StagingRoot] = None
        self._private: Optional[SaveDir] = None
        self._state = "new"
        self._removed_commit = False  # the destination's previous commit file is gone
        self._distributed: Optional[dict[str, int]] = None  # {"rank", "world_size"} of a collective commit
        self._peers: Any = None  # its _peers.Peers, once entered
        self._in_flight = in_flight  # a background commit: at most this many at once (0: not one)
        self._error: Optional[BaseException] = None  # why a background commit failed

    def __enter__(self) -> Path:
        if self._state != "new":
            raise RuntimeError("this staged_dir was already used; call safestage.staged_dir() again")
        self._state = "open"
        _background.adopt(self)  # its commit may run in the background in this process only
        if self._in_flight or self._group is not None:
            # Never more local copies than commits allowed in flight; a collective commit
            # waits for every earlier one, whose exchanges share its gloo group.
            _background.make_room("commit", 1 if self._group is not None else self._in_flight)
        _raise_failed_commits()  # of those finished by now
        if self._group is not None:
            from ._group_commit import enter

            return enter(self)
        dest = destination_directory(self._dest_argument)
        staging, private = _save.save_dir(self.settings)
        local = private / _local_name(dest.name)
        try:
            _mark_disposable(private)  # until the block returns: an unfinished checkpoint
            os.mkdir(local)
        except BaseException:
            with deferred():
                _discard(private, local)
            raise
        self.dest, self.local, self._staging, self._private = dest, local, staging, private
        _patch.add_unstaged_dir(local)
        return local

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        private, local = self._private, self.local
        assert private is not None and local is not None, "__exit__ without __enter__"
        self._state = "closed"
        _patch.remove_unstaged_dir(local)
        try:
            if self._group is not None:
                from ._group_commit import leave

                leave(self, exc)
                return
            if exc is not None:  # nothing is published; the block's exception propagates
                with deferred():
                    _discard(private, local)
                return
            self._commit(private, local)
        except BaseException as failed:
            self._error = self._error or failed  # wait() raises it too
            raise

    def __repr__(self) -> str:
        return f"<safestage.StagedDir {self._state} dest={str(self.dest or self._dest_argument)!r}>"

    # -- the commit ---------------------------------------------------------------------------

    def _commit(self, private: SaveDir, local: Path) -> None:
        assert self.dest is not None
        _background.settle(self.dest)  # an earlier background commit of it lands first
        tree = self._check(private, local)
        if self._in_flight and _background.may_defer(self):
            self._hand_off(private, local, tree)
            with _started_lock:
                _started.append(self)
            _background.publisher().submit(
                functools.partial(self._land_or_record, private, local, tree), self.dest,
                max_pending=self._in_flight, owner=self, kept=local, kind="commit",
                not_started=lambda exc: self._keep(private, local, tree, {}, exc),
            )  # fmt: skip
            return
        self._land(private, local, tree)

    def _check(self, private: SaveDir, local: Path) -> _Tree:
        """Everything that refuses the commit, before the destination is touched."""
        dest = self.dest
        assert dest is not None
        tree: Optional[_Tree] = None
        try:
            tree = _scan(local, dest)
            _check_destination(dest, tree)
        except PublishError:
            self._refused(private, local)
            raise
        except BaseException as exc:  # Ctrl-C while checking: nothing published, the copy kept
            self._keep(private, local, tree, {}, exc)
            raise
        return tree

    def _hand_off(self, private: SaveDir, local: Path, tree: _Tree) -> None:
        """From here on the local copy may be the only complete one: recorded, never swept."""
        assert self.dest is not None
        try:
            files = [path for path, _ in tree.files]
            record_kept(private.path, self.dest, local, left=files, landed=[], commit_file=True,
                        distributed=self._distributed)  # fmt: skip
            with contextlib.suppress(FileNotFoundError):
                os.unlink(private / DISPOSABLE_MARKER)
        except BaseException as exc:
            self._keep(private, local, tree, {}, exc)
            raise

    def _land_or_record(self, private: SaveDir, local: Path, tree: _Tree) -> None:
        """A background commit, on the publisher's thread: its error is the handle's."""
        try:
            self._land(private, local, tree, handed=True)
        except BaseException as exc:
            self._error = exc
            raise

    @_inflight.registered  # from here until it lands or fails, retention never removes dest
    def _land(self, private: SaveDir, local: Path, tree: _Tree, *, handed: bool = False) -> None:
        dest, staging = self.dest, self._staging
        assert dest is not None and staging is not None
        started = time.perf_counter()
        published: dict[str, Published] = {}
        manifest: Optional[Manifest] = None
        try:
            if not handed:
                self._hand_off(private, local, tree)
            # An older background save of a file in it lands now, never after the commit file.
            _background.settle_under(dest)
            created, self._removed_commit = _prepare_destination(dest, tree, local, self.settings.fsync)
            self._publish_files(tree, local, published, created)
            manifest = new_manifest(
                [FileEntry(path, published[path].nbytes, published[path].digest or "")
                 for path, _ in tree.files],
                tree.empty,
                _version(),
            )  # fmt: skip
            self._publish_commit_file(manifest, private, local, tree, created)
        except BaseException as exc:
            if manifest is not None and not isinstance(exc, Exception) and _landed(dest, manifest):
                # Interrupted after the commit file landed: the checkpoint is complete.
                self._finish(private, local, manifest)
                _note(exc, f"safestage: interrupted after {dest} was committed (it is complete)")
                raise
            self._keep(private, local, tree, published, exc)
            raise
        self._finish(private, local, manifest)
        log.debug(
            "%s: committed %d files, %d bytes in %.3fs",
            dest, len(manifest.files), manifest.total_bytes, time.perf_counter() - started,
        )  # fmt: skip
        if self._retention is not None:  # only now that the commit file has landed
            self._retention.after_commit(dest, staging.path)

    # -- the handle of a commit ----------------------------------------------------------------

    def wait(self) -> Manifest:
        """The manifest of the landed commit, once it has landed (a background commit: wait
        for it); raises its PublishError if it failed (every time wait() is called)."""
        if self._state != "closed":
            raise RuntimeError("StagedDir.wait() is for after the block: the commit starts when it returns")
        with contextlib.suppress(Exception):  # a Ctrl-C while waiting propagates
            _background.wait(self)  # observed here: exit does not report it again
        _forget_started(self)
        if self._error is not None:
            raise self._error
        if self.manifest is None:
            raise RuntimeError(f"{self.dest}: the block raised, so nothing was committed")
        return self.manifest

    def done(self) -> bool:
        """Whether the commit has finished (landed or failed); False before the block returned."""
        return self._state == "closed" and _background.running(self) == 0

    def _refused(self, private: SaveDir, local: Path) -> None:
        with deferred():  # refused as it is, it would be refused again: not kept
            _discard(private, local)

    def _keep(
        self,
        private: SaveDir,
        local: Path,
        tree: Optional[_Tree],
        published: dict[str, Published],
        exc: BaseException,
    ) -> None:
        """The local copy stays, saying what is left, and is never swept (no disposable
        marker): it may be the only complete copy of the checkpoint."""
        assert self.dest is not None
        with deferred():
            every = [path for path, _ in tree.files] if tree is not None else []
            left = [path for path in every if path not in published]
            record_kept(private.path, self.dest, local, left=left, landed=list(published),
                        commit_file=True, error=exc, distributed=self._distributed)  # fmt: skip
            with contextlib.suppress(FileNotFoundError):
                os.unlink(private / DISPOSABLE_MARKER)
            private.release()
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
            _note(exc, _kept_text(self.dest, local, published))

    def _finish(self, private: SaveDir, local: Path, manifest: Manifest) -> None:
        self.manifest = manifest

        with deferred():
            with contextlib.suppress(OSError):  # landed: a kill during the removal leaves junk
                _mark_disposable(private)
            _discard(private, local)

    def _publish_files(
        self,
        tree: _Tree,
        local: Path,
        published: dict[str, Published],
        created: set[Path],
        wait: Optional[Callable[[_Work], Optional[BaseException]]] = None,
    ) -> None:
        """Publish every file, largest first, on ``settings.background`` threads (at least one). After a failure no
        new file starts and those in flight finish; after an interrupt those in flight stop
        too (at their next chunk), and no worker takes another file: nothing is copied once
        this has returned or raised.

        Workers (_lifecycle) taking paths from a shared iterator, not an executor: an interrupt can
        land inside ``Thread.start()``, and an executor would by then have queued work that
        the half-started thread runs after we raised; here it finds the work stopped."""
        dest = self.dest
        assert dest is not None
        order = [path for path, _ in sorted(tree.files, key=lambda item: (-item[1], item[0]))]
        work = _Work(order, _digest_factory)
        interrupt: Optional[BaseException] = None
        try:
            for index in range(min(max(self.settings.background, 1), len(order))):
                start_worker(
                    functools.partial(work.run, self._publish_one, local, created),
                    name=f"safestage-commit-{index}",
                )
        except BaseException as exc:  # KeyboardInterrupt: stop the copies in flight
            interrupt = exc
            work.stop(cancel=True)
        absorbed = work.wait() if wait is None else wait(work)  # a collective commit's heartbeat
        interrupt = interrupt or absorbed
        for path in order:
            if path in work.published:
                published[path] = work.published[path]
                self._record(dest / path, work.published[path])
        if interrupt is not None:
            raise interrupt
        failures = [(path, work.errors[path]) for path in order if path in work.errors]
        if failures:
            raise _partial_error(dest, local, order, published, failures, self._removed_commit) from failures[0][1]

    def _publish_one(
        self, local: Path, created: set[Path], path: str, digest: Callable[[], Digest]
    ) -> Published:
        dest = self.dest
        assert dest is not None and self._staging is not None
        return publish_file(  # what was in the way was refused before (_check_destination)
            local / path,
            dest / path,
            publish=self.settings.publish,
            fsync=self.settings.fsync,
            staging_device=self._staging.device,
            digest=digest,
        )

    def _publish_commit_file(
        self, manifest: Manifest, private: SaveDir, local: Path, tree: _Tree, created: set[Path]
    ) -> None:
        dest = self.dest
        assert dest is not None and self._staging is not None
        target = dest / COMMIT_NAME
        try:
            result = publish_manifest(manifest, private, dest, self.settings, self._staging.device)
        except OSError as exc:
            landed = tuple(sorted(path for path, _ in tree.files))
            raise PublishError(
                exc.errno,
                f"safestage could not commit {dest}: all {len(landed)} files landed, but the "
                f"commit file {COMMIT_NAME} could not be written ({exc}). {dest} is therefore "
                f"not complete{_previous(self._removed_commit, ' (the previous commit file was removed first)')} "
                f"(verify and latest_complete say so). Commit again; the local copy is kept at {local}.",
                str(target),
                staged_path=str(local),
                step="commit",
                landed=landed,
                not_landed=(),
            ) from exc
        self._record(target, result)

    def _record(self, target: Path, result: Published) -> None:
        self.records.append(
            PublishRecord(
                destination=target,
                bytes=result.nbytes,
                publish=result.strategy,
                seconds=result.seconds,
                serialize_seconds=0.0,
                publish_seconds=result.seconds,
            )
        )


# Background commits started in this process whose failure nobody has seen yet.
_started: list[StagedDir] = []
_started_lock = threading.Lock()


def _raise_failed_commits() -> None:
    """Raise, at the next staged_dir, the error of a background commit that failed since
    (once; wait() on its handle raises it again)."""
    with _started_lock:
        finished = [stage for stage in _started if stage.done()]
        for stage in finished:
            _started.remove(stage)
    for stage in finished:
        try:  # raises the error only if nobody has seen it yet (safestage.wait(), say)
            _background.wait(stage, finished_only=True)
        except BaseException as error:
            if hasattr(error, "add_note"):
                error.add_note(f"safestage: raised here, at the next staged_dir: the background commit of {stage.dest} failed")
            raise


def _forget_started(stage: StagedDir) -> None:
    with _started_lock:
        if stage in _started:
            _started.remove(stage)


def after_fork_in_child() -> None:  # registered by _lifecycle
    global _started_lock
    _started.clear()  # the parent's commits: neither run nor fail here
    _started_lock = threading.Lock()


def _commits_in_flight(background: object) -> int:
    """staged_dir's ``background``: False (or 0) synchronous, True one commit in flight, N at
    most N (its own meaning: not files at once, and never from SAFESTAGE_BACKGROUND)."""
    if isinstance(background, bool):
        return int(background)
    if isinstance(background, int) and 0 <= background <= _config.MAX_BACKGROUND:
        return background
    raise ConfigError(
        f"safestage.staged_dir: background={background!r} is not a boolean or a whole number from 0 to "
        f"{_config.MAX_BACKGROUND}: use False (commit before the block's end returns), True (one "
        "commit in the background at a time) or N (at most N)"
    )


def _write_new_file(path: Path, payload: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        data = memoryview(payload)
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


class _Work:
    """The files of one commit, handed out to worker threads one at a time.

    Completion is counted here, not with Thread.join(): on CPython 3.11 a join() that a
    KeyboardInterrupt cuts short can mark a live thread as stopped (the bpo-45274 handling
    releases the thread's own state lock), and a later join() then returns at once."""

    def __init__(self, order: list[str], digest: Callable[[threading.Event], Callable[[], Digest]]) -> None:
        self._paths = iter(order)
        self._exhausted = not order
        self._running = 0  # workers publishing a file right now
        self._done = threading.Condition()
        self._failed = threading.Event()  # set: no worker takes another file
        self._cancel = threading.Event()  # set: the copies in flight stop at their next chunk
        self._digest = digest(self._cancel)
        self.published: dict[str, Published] = {}
        self.errors: dict[str, BaseException] = {}

    def stop(self, *, cancel: bool) -> None:
        with self._done:
            self._failed.set()
            if cancel:
                self._cancel.set()
            self._done.notify_all()

    def run(
        self,
        publish: Callable[[Path, set[Path], str, Callable[[], Digest]], Published],
        local: Path,
        created: set[Path],
    ) -> None:
        while True:
            with self._done:
                path = None if self._failed.is_set() else next(self._paths, None)
                if path is None:
                    self._exhausted = True
                    self._done.notify_all()
                    return
                self._running += 1
            try:
                result = publish(local, created, path, self._digest)
            except BaseException as exc:  # recorded for the main thread, which raises it
                with self._done:
                    self.errors[path] = exc
                self.stop(cancel=False)
            else:
                with self._done:
                    self.published[path] = result
            finally:
                with self._done:
                    self._running -= 1
                    self._done.notify_all()

    def finished(self, timeout: float) -> bool:
        """Whether no file is in flight and none will start, waiting at most ``timeout``."""
        with self._done:
            return self._done.wait_for(
                lambda: self._running == 0 and (self._exhausted or self._failed.is_set()), timeout
            )

    def wait(self) -> Optional[BaseException]:
        """Until no file is in flight and none will start. An interrupt while waiting cancels
        the copies in flight and the wait goes on; the first interrupt is returned."""
        interrupt: Optional[BaseException] = None
        while True:
            try:
                with self._done:
                    self._done.wait_for(
                        lambda: self._running == 0 and (self._exhausted or self._failed.is_set())
                    )
                return interrupt
            except BaseException as exc:
                self.stop(cancel=True)
                interrupt = interrupt or exc


def staged_dir(
    dest: PathArg,
    root: Optional[PathArg] = None,
    *,
    publish: Optional[Publish] = None,
    fsync: bool = True,
    background: Union[bool, int] = False,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT,
    keep: Optional[int] = None,
    **removed: NoReturn,
) -> StagedDir:
    """Write a whole checkpoint directory locally; commit it to ``dest`` when the block succeeds.

        with safestage.staged_dir("/mnt/s3/run42/checkpoint-1000") as local:
            model.save_pretrained(local)
            torch.save(optimizer.state_dict(), local / "optimizer.pt")

    ``local`` is a fresh directory under the staging root ``root`` (default SAFESTAGE_DIR,
    else $TMPDIR/safestage-<uid>); write anything into it, subdirectories too. When the
    block returns, ``dest``'s commit file is removed, every file is published (``publish``,
    ``fsync`` as for every save; two files at once), then the commit file
    ``_SAFESTAGE_COMMIT.json`` is written last.

    ``background=True``: the commit goes on on safestage's threads once the block has
    returned, and the object ``staged_dir()`` returned is its handle (``wait()``: the
    manifest, or the PublishError; ``done()``). At most one commit is in flight (``N``: at
    most N): the next ``staged_dir`` waits before its block. A failed background commit is
    raised by ``wait()``, by the next ``staged_dir`` and, if nobody saw it, at exit (status 1). ``dest`` is created if missing (its parent
    must exist). If the block raises, nothing is published and ``local`` is removed. If a
    publish fails, PublishError says which files landed; no commit file is written and the
    local copy is kept. ``keep=N``: once the commit file has landed, prune ``dest``'s parent
    of the checkpoints named like it (its name with the trailing step number as ``*``) beyond
    the N newest complete ones, as ``safestage.prune`` does; a failure there is a WARNING, never
    an error of the landed commit. Options are checked here (ConfigError), ``dest`` and the
    staging root when the block starts.

    ``group``, a torch.distributed process group (``torch.distributed.group.WORLD``), makes it
    a collective: every rank of the group enters with the same ``dest`` and writes its own
    files under its own staging root; they land in one directory with one commit file,
    listing every file and its rank, and every rank returns once it has landed or raises
    (``_group_commit``). ``timeout`` is how many seconds a rank waits for one that neither
    answers nor dies (a rank that dies is noticed at once).
    """
    _config.reject_removed(removed, "safestage.staged_dir")
    # Two files publishing at once (benchmarks/README.md); not from SAFESTAGE_BACKGROUND, which
    # is for the saves staging intercepts, as is the choice of a background commit.
    settings = _config.resolve(root=root, publish=publish, fsync=fsync, background=BACKGROUND_ON)
    in_flight = _commits_in_flight(background)
    if group is not None and in_flight > 1:
        raise ConfigError(
            f"safestage.staged_dir(group=..., background={background!r}): a collective commit runs "
            "one at a time (its exchanges share one gloo group): use background=True"
        )
    if group is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ConfigError(f"safestage.staged_dir: timeout must be a number of seconds > 0, not {timeout!r}")
    return StagedDir(dest, settings, group=group, timeout=float(timeout), in_flight=in_flight,
                     retention=_prune.retention_for(dest, keep))


# -- committing files already at the destination ------------------------------------------------

# A JSON file of a checkpoint larger than this is read for its digest but not parsed.


def destination_directory(dest: PathArg) -> Path:
    """The kernel's path of the checkpoint directory ``dest`` (symlinks followed, as any
    writer into it would), which may not exist yet; its parent must. Raised before the block
    runs, so that a typo costs nothing: PublishError ENOTDIR (a file is there), ENOENT (the
    parent is missing: staged_dir creates the checkpoint directory, never its parents, which
    on an unmounted mount point would quietly fill the local disk)."""
    text = os.fspath(dest)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text or "\x00" in text:
        raise PublishError(errno.EINVAL, f"safestage.staged_dir: {text!r} is not a directory path", text)
    stripped = text.rstrip("/") or "/"
    existing = real_directory(stripped)
    if existing is not None:
        return existing
    head, name = os.path.split(stripped)
    if os.path.lexists(stripped) or name in ("", ".", ".."):
        raise PublishError(
            errno.ENOTDIR,
            f"safestage.staged_dir: {text} exists and is not a directory (or is a dangling "
            "symlink): name a directory for the checkpoint.",
            text,
        )
    parent = real_directory(head or ".")
    if parent is None:
        raise PublishError(
            errno.ENOENT,
            f"safestage.staged_dir: the parent directory of {text} does not exist (or is not a "
            "directory): create it first. staged_dir creates the checkpoint directory itself, "
            "never its parents (on a mount point that is not mounted they would land on the "
            "local disk).",
            text,
        )
    return parent / name


def _check_destination(dest: Path, tree: _Tree) -> None:
    """Refuse, before the previous commit is touched, what is in the way at ``dest``: where
    the checkpoint has a directory, anything but a directory; where it has a file, anything
    but a regular file (a directory cannot be replaced; a symlink could make ``direct``
    write outside the checkpoint, and the rule does not depend on the mount); a directory
    where the commit file goes. One listing per directory that exists there already."""
    wanted: dict[str, dict[str, str]] = {"": {COMMIT_NAME: "commit"}}
    for directory in tree.directories:
        parent, _, name = directory.rpartition("/")
        wanted.setdefault(parent, {})[name] = "directory"
    for path, _ in tree.files:
        parent, _, name = path.rpartition("/")
        wanted.setdefault(parent, {})[name] = "file"
    queue = [""]
    while queue:
        relative = queue.pop()
        here = dest / relative if relative else dest
        try:
            with os.scandir(here) as listing:
                present = {entry.name: entry for entry in listing if entry.name in wanted.get(relative, {})}
        except OSError:
            continue  # missing (made by this commit), or unreadable: the publish itself decides
        for name, entry in sorted(present.items()):
            want = wanted[relative][name]
            path = f"{relative}/{name}" if relative else name
            if entry.is_symlink():
                have = "a symlink"
            elif entry.is_dir(follow_symlinks=False):
                have = "a directory"
            elif entry.is_file(follow_symlinks=False):
                have = "a file"
            else:
                have = "a FIFO, socket or device"
            if want == "directory" and have == "a directory":
                queue.append(path)
            elif want == "commit" and have != "a directory":
                pass  # a file, or anything the invalidation's unlink removes
            elif want == "file" and have == "a file":
                pass
            else:
                where = {"directory": "a directory", "file": "a file"}.get(want, "its commit file")
                raise _refusal(
                    dest, tree, dest / path, f"is {have} where the checkpoint has {where}"
                    + (" (staged_dir never writes through a symlink: it could point outside the "
                       "checkpoint)" if have == "a symlink" else "")
                    + ". Remove it from the destination", errno.ENOTDIR if want == "directory"
                    else errno.EISDIR if have == "a directory" else errno.EINVAL, step="inspect",
                )  # fmt: skip


def _prepare_destination(dest: Path, tree: _Tree, local: Path, fsync: bool) -> tuple[set[Path], bool]:
    """Create ``dest`` and its subdirectories. Before anything is written there, remove its
    commit file and the temp files of killed commits (at any depth). Returns the directories
    this call created and whether a previous commit file was removed."""
    step = "mkdir"
    created: set[Path] = set()
    removed = False
    try:
        if _make_directory(dest):
            created.add(dest)
        else:
            step = "invalidate"
            removed = invalidate(dest, fsync=fsync)
            step = "mkdir"
            remove_dead_temps(dest)  # a re-commit: what killed commits left goes now
        for directory in tree.directories:
            if _make_directory(dest / directory):
                created.add(dest / directory)
    except OSError as exc:
        if step == "invalidate":
            what = f"could not remove the previous commit file {dest / COMMIT_NAME}"
            state = "Nothing was published; the previous commit is untouched."
        else:
            what = f"could not create directory {exc.filename or dest}"
            state = "Nothing was published" + _previous(
                removed, f", but the previous commit file was removed first: {dest} is not complete "
                "until a commit succeeds (verify and latest_complete say so)"
            ) + "."
        raise PublishError(
            exc.errno,
            f"safestage could not commit {dest}: {what}: [Errno {exc.errno}] {exc.strerror}. "
            f"{state} The checkpoint is kept at {local}.",
            str(dest),
            staged_path=str(local),
            step=step,
            landed=(),
            not_landed=tuple(sorted(path for path, _ in tree.files)),
        ) from exc
    return created, removed


def invalidate(dest: Path, *, fsync: bool) -> bool:
    """Remove ``dest``'s commit file, if any, before anything of a new commit is written
    there: a commit killed half-way then leaves no commit file at all, never an old one
    vouching for a mix of old and new files. True if there was one."""
    try:
        os.unlink(dest / COMMIT_NAME)
    except FileNotFoundError:
        return False
    if fsync:
        fsync_directory(dest)  # the removal first, on disk too, before any new file
    return True


def publish_manifest(
    manifest: Manifest, private: SaveDir, dest: Path, settings: Settings, staging_device: int
) -> Published:
    """Write ``manifest`` into ``private`` and publish it as ``dest``'s commit file: the last
    file of a commit, atomically (replace) where the destination can rename, direct where it
    cannot (an object store shows it only once complete). Raises what publish_file raises."""
    staged = private / _STAGED_COMMIT
    try:
        _write_new_file(staged, manifest.encode())
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(staged)  # a torn local commit file helps nobody (a full staging root)
        raise
    return publish_file(
        staged,
        dest / COMMIT_NAME,
        publish=settings.publish,
        fsync=settings.fsync,
        staging_device=staging_device,
    )


def _make_directory(path: Path) -> bool:
    """mkdir ``path``: True if this made it, False if a real directory was there already."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):  # appeared since _check_destination looked
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise NotADirectoryError(errno.ENOTDIR, f"it is {kind}, where the checkpoint has a directory", str(path))
    return False


def _refusal(dest: Path, tree: Optional[_Tree], path: Path, problem: str, code: int, *, step: str) -> PublishError:
    """A commit refused before the destination was touched. The local copy is removed (the
    caller does): refused as it is, it would be refused again, and kept copies that nobody
    can commit would pile up in the staging root."""
    return PublishError(
        code,
        f"safestage will not commit {dest}: {path} {problem}. Nothing was published; the "
        f"previous commit, if any, is untouched. The local copy was removed: fix this and "
        f"save the checkpoint again.",
        str(path),
        step=step,
        landed=(),
        not_landed=None if tree is None else tuple(sorted(p for p, _ in tree.files)),
    )


def _previous(removed: bool, text: str = " and the previous commit file was removed first") -> str:
    """What an error after the invalidation says about the previous commit, if there was one."""
    return text if removed else ""


# -- the local directory ------------------------------------------------------------------------


def _local_name(name: str) -> str:
    """The local directory is named like the destination, for people reading a PublishError
    (the destination "/" has no name)."""
    # Never a name a sweep could take for safetensors' torn temp (.tmpXXXXXX), as local_name.
    if name in ("", DISPOSABLE_MARKER, KEPT_RECORD, _STAGED_COMMIT) or is_writer_temp(name):
        return f"{name}.dir"
    return name


def _discard(private: SaveDir, local: Path) -> None:
    """Remove the local directory, then the private one: the disposable marker goes last, so
    that an interrupted removal still leaves a directory that sweeps know to remove."""
    remove_tree(local)
    private.remove()


def _mark_disposable(private: SaveDir) -> None:
    fd = os.open(private / DISPOSABLE_MARKER, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.close(fd)


def _scan(local: Path, dest: Path) -> _Tree:
    """Every file and directory the block left, without following anything. Refused, before
    anything is published: symlinks (they could point anywhere, and object stores cannot
    hold one), FIFOs, sockets and devices, an entry at the top named like the commit file,
    names of safestage's temp files (a re-commit would remove them), and a ``.safetensors``
    file that is not one (``verify --deep`` would reject the fresh checkpoint: the rule
    ``commit_in_place`` follows)."""
    try:
        tree = _walk(local, dest)
        for path, size in tree.files:
            if path.endswith(".safetensors"):
                problem = _not_safetensors(local / path, size)
                if problem is not None:
                    raise _refusal(dest, tree, local / path, f"is not a complete safetensors file: {problem}",
                                   errno.EBADMSG, step="scan")  # fmt: skip
        return tree
    except PublishError:
        raise
    except OSError as exc:  # a directory the block left unreadable, say
        raise _refusal(
            dest, None, Path(os.fsdecode(exc.filename)) if exc.filename else local,
            f"cannot be read: [Errno {exc.errno}] {exc.strerror}", exc.errno or errno.EIO, step="scan",
        ) from exc  # fmt: skip


def _not_safetensors(path: Path, size: int) -> Optional[str]:
    from ._verify import safetensors_problem

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        return safetensors_problem(fd, size)
    finally:
        os.close(fd)


def _walk(local: Path, dest: Path) -> _Tree:
    tree = _Tree()
    stack = [("", local)]
    while stack:
        relative, directory = stack.pop()
        with os.scandir(directory) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
        if relative and not entries:
            tree.empty.append(relative)
        for entry in entries:
            path = f"{relative}/{entry.name}" if relative else entry.name
            info = entry.stat(follow_symlinks=False)
            problem = unsafe_path(path)
            if problem is not None:
                problem = f"{problem}: that name is safestage's commit file, choose another"
            elif parse_temp_name(entry.name) is not None and stat.S_ISREG(info.st_mode):
                problem = "is named like a safestage temp file (a re-commit would remove it): choose another name"
            if stat.S_ISLNK(info.st_mode):
                problem = "is a symlink: copy the file it points to instead"
            elif stat.S_ISDIR(info.st_mode) and problem is None:
                tree.directories.append(path)
                stack.append((path, Path(entry.path)))
                continue
            elif not stat.S_ISDIR(info.st_mode) and not stat.S_ISREG(info.st_mode):
                problem = "is not a regular file or directory (a FIFO, socket or device)"
            if problem is not None:
                raise _refusal(dest, None, Path(entry.path), problem, errno.EINVAL, step="scan")
            tree.files.append((path, info.st_size))
    tree.directories.sort(key=lambda path: (path.count("/"), path))
    return tree


# -- what a failure says ------------------------------------------------------------------------


def _partial_error(
    dest: Path,
    local: Path,
    order: list[str],
    published: dict[str, Published],
    failures: list[tuple[str, BaseException]],
    removed_commit: bool,
) -> BaseException:
    path, first = failures[0]
    if not isinstance(first, OSError):
        return first  # not an I/O failure (a bug, MemoryError): as it is
    landed = tuple(sorted(published))
    missing = tuple(sorted(p for p in order if p not in published))
    return PublishError(
        first.errno,
        f"safestage could not commit {dest}: {len(landed)} of {len(order)} files landed "
        f"({_some(landed)}), {len(missing)} did not ({_some(missing)}). No commit file was "
        f"written{_previous(removed_commit)}: {dest} is not complete (verify and latest_complete "
        f"say so). Every file "
        f"that did not land is kept in {local}; commit again. First error, for {path}: {first}",
        str(dest),
        staged_path=str(local),
        step=getattr(first, "step", None),
        landed=landed,
        not_landed=missing,
    )


def _some(paths: tuple[str, ...], limit: int = 5) -> str:
    if not paths:
        return "none"
    shown = ", ".join(paths[:limit])
    return shown if len(paths) <= limit else f"{shown} and {len(paths) - limit} more"


def _kept_text(dest: Path, local: Path, published: dict[str, Published]) -> str:
    landed = f"; {len(published)} files had landed ({_some(tuple(sorted(published)))})" if published else ""
    return (
        f"safestage: interrupted while committing {dest}; no commit file was written{landed}. "
        f"The checkpoint is kept at {local}."
    )


def _note(exc: BaseException, text: str) -> None:
    log.warning("%s", text)
    if hasattr(exc, "add_note"):  # Python 3.11+: shown under the traceback
        exc.add_note(text)


def _landed(dest: Path, manifest: Manifest) -> bool:
    """Whether ``dest`` holds exactly this commit file (after an interrupt: did it land?)."""
    try:
        with open(dest / COMMIT_NAME, "rb") as handle:
            return handle.read() == manifest.encode()
    except OSError:
        return False


def _version() -> str:
    from . import __version__

    return __version__



# -- committing a copy an earlier commit kept (safestage recover) ------------------------------


class _KeptCommit(StagedDir):
    """The commit of a local directory that an earlier commit kept (its process was killed
    after the block returned, or a publish failed): the same steps, from the checks on. A
    refusal keeps the copy, unlike a fresh commit's: it may be the only one, and what is in
    the way at the destination can be moved."""

    def _refused(self, private: SaveDir, local: Path) -> None:
        private.release()


def commit_kept(dest: Path, private: SaveDir, local: Path, settings: Settings, staging: StagingRoot) -> Manifest:
    """Commit ``local``, a complete checkpoint kept in the locked save directory ``private``,
    to ``dest`` exactly as ``staged_dir`` does once its block has returned. Raises what that
    commit raises; a failure keeps the copy with its record rewritten (``StagedDir._keep``)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(private / _STAGED_COMMIT)  # staged by the failed commit: written anew (O_EXCL)
    commit = _KeptCommit(dest, settings)
    commit.dest, commit.local, commit._staging, commit._private = dest, local, staging, private
    commit._state = "closed"
    commit._commit(private, local)
    assert commit.manifest is not None
    return commit.manifest
