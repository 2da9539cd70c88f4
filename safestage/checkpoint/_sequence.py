"""The one commit sequence: how a checkpoint directory lands, complete, with its commit file last.

A training checkpoint is a directory (shards, index, config and tokenizer JSON, torch.save
pickles, DCP's .metadata). A job killed while writing one in place leaves a directory that
looks complete and is not, and no destination we serve can fix that with a directory rename
(mountpoint-s3 has none, gcsfuse's is not atomic). Every way of committing (``staged_dir``, its
collective form, the DCP writers, ``commit_in_place``, ``safestage recover``) runs these steps
of one ``Commit``, in this order:

1. open: a fresh local directory in a save directory of this process's staging root (0700,
   locked; marked disposable: a process killed now leaves nothing worth keeping); saves into
   it are not staged a second time;
2. check: what was written there (``Tree``: refused are symlinks, FIFOs, sockets, devices,
   the commit file's name, safestage's temp names, a ``.safetensors`` file that is not one)
   and what is in the way at the destination, before the destination is touched. A refusal
   removes the local copy (refused as it is, it would be refused again), except in a resumed
   commit, whose copy may be the only one;
3. hand off: from here on the local copy may be the only complete one: its record
   (``_kept.Record``, saying what the copy is part of) is written and it is no longer
   disposable. From here on any failure keeps it;
4. prepare (the coordinator, once): this process's background saves of files under the
   destination land first; the destination and its directories are created, its commit file
   removed (a commit killed half-way then leaves no old commit file vouching for a mix of old
   and new files), with the files that make a stock reader trust it (``VOUCHING``, the trust
   files: Lightning's ``meta.pt``, then the HuggingFace index, then DCP's ``.metadata``) and
   the temp files killed commits left (``commit_in_place``, whose files are the
   destination's, removes only the commit file);
5. publish: every file by ``_publish.publish_file`` (rename / replace / direct, size checked,
   modes as for every save), its CRC-32 computed while it is copied: the data ``COPIES`` at
   once; then, once every rank's data has landed, the trust files, one at a time
   (``.metadata`` first, ``meta.pt`` last): a commit killed before its commit file never
   leaves a trust file beside data it does not describe;
6. commit file (the coordinator): the checkpoints this save's run abandoned are set aside
   (``_timeline``), then the commit file (``_manifest``) is published last, atomically where
   the destination can rename, direct where it cannot (an object store shows it only once
   complete);
7. finish (the local copy goes, marked disposable first) or keep (it stays, its record saying
   what landed; ``safestage recover`` finishes it).

Agreement. In a collective commit every rank runs these steps for its own files, and the ranks
agree at five points (``Peers``): started, what was written (their union), prepared, landed,
committed (and between the two phases of publish). A single process is a world of one whose
agreement points are the identity (``Alone``); a collective commit's are exchanges over gloo
(``_collective``, which holds what only a collective needs: the union and its clashes, the
heartbeat, naming the rank that failed); a DCP save's are DCP's own collectives (its hooks call
the steps: ``safestage.dcp``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

from .. import _object_store, _save, _work
from .._clean import remove_dead_temps
from .._config import PathArg, Settings
from .._destination import Destination, ObjectURL, url_of
from .._errors import PublishError, StagingError
from .._interrupts import deferred
from .._kept import WHOLE, JobIdentity, Part, Record, SaveDir, this_job
from .._lifecycle import start_worker
from .._names import DISPOSABLE_MARKER, KEPT_RECORD, is_writer_temp, parse_temp_name
from .._paths import real_directory
from .._publish import Digest, Published, fsync_directory, kept_copy_text, publish_file
from .._stage import PublishRecord, StagingRoot
from . import _timeline
from ._manifest import (
    COMMIT_NAME,
    SET_ASIDE_NAME,
    Crc32,
    FileEntry,
    Manifest,
    new_manifest,
    parse,
    unsafe_path,
)

log = logging.getLogger("safestage")

# Files of one commit publishing at once: two, on every way of committing (benchmarks/README.md).
COPIES = 2
# A commit's own files in its save directory, beside (never inside) the local copy.
_STAGED_COMMIT = "safestage-commit.json"
_STAGED_MARKER = "safestage-set-aside.json"
# The files that make a stock reader trust a checkpoint directory without asking safestage (the
# trust files): Lightning's meta.pt (what makes a directory a sharded checkpoint to Lightning,
# which then asks DCP), the HuggingFace index (transformers, DCP's HuggingFace reader) and DCP's
# .metadata (dcp.load opens it first; torchtitan takes a step with it as complete). A commit
# removes them from the destination before it publishes anything, with the commit file, in this
# order (the outermost reader's first); it publishes them after every other file of every rank
# has landed, one at a time, in the reverse order, just before the commit file. A commit killed
# at any point then leaves none of them vouching for a mix of old and new files.
VOUCHING = ("meta.pt", "model.safetensors.index.json", ".metadata")


# Every index of sharded weights is a trust file of the HuggingFace index's rank: transformers
# loads the shards that pytorch_model.bin.index.json names as it does model.safetensors.index.json's,
# and diffusers a subfolder's diffusion_pytorch_model.safetensors.index.json, whatever they hold.
_INDEXES = (".safetensors.index.json", ".bin.index.json")


def _trust_rank(path: str) -> Optional[int]:
    """Where ``path`` is in ``VOUCHING``'s order (a trust file), or None (data)."""
    name = path.rpartition("/")[2]
    if name in VOUCHING:
        return VOUCHING.index(name)
    return VOUCHING.index("model.safetensors.index.json") if name.endswith(_INDEXES) else None


def trust_last(files: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
    """The paths of ``files`` to publish: the data, largest first; then the trust files (a
    ``VOUCHING`` name or an index of sharded weights, at any depth), in the order they are
    published, one at a time."""
    data = [path for path, _ in sorted(files, key=lambda item: (-item[1], item[0]))
            if _trust_rank(path) is None]  # fmt: skip
    ranked = [(rank, path) for path, _ in files if (rank := _trust_rank(path)) is not None]
    return data, [path for _, path in sorted(ranked, key=lambda item: (-item[0], item[1]))]


# Steps whose PublishError is a refusal: nothing was published, the copy is not worth keeping.
REFUSALS = frozenset({"scan", "inspect", "refused"})


def refused(error: BaseException) -> bool:
    return isinstance(error, PublishError) and error.step in REFUSALS


@dataclass
class Tree:
    """What was written into the local directory (relative '/'-separated paths)."""

    files: list[tuple[str, int]] = field(default_factory=list)  # (path, size)
    directories: list[str] = field(default_factory=list)  # every directory, parents first
    empty: list[str] = field(default_factory=list)  # those with nothing inside

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.files]


class Lost(Exception):
    """Another rank of the commit stopped answering (``_collective`` says which and why)."""


# -- one commit --------------------------------------------------------------------------------------


class Commit:
    """One commit of the checkpoint directory ``dest`` by this process: the whole of it (a
    world of one), or this rank's files of a collective or DCP commit (``part``). Its methods
    are the steps of the module docstring; ``run_check`` ... ``land`` run them in order."""

    def __init__(
        self,
        dest: Union[PathArg, Destination],
        settings: Settings,
        *,
        part: Part = WHOLE,
        started: Optional[float] = None,
        retention: Any = None,
    ) -> None:
        self.settings = settings
        self.part = part
        # When the save began: its place in the run's timeline (_timeline). None: not known
        # (files another writer put in place), and then it sets nothing aside.
        self.started: Optional[float] = time.time() if started is None else started
        self.retention = retention  # keep=N: prune the siblings once landed (_prune.Retention)
        self.spare: dict[Path, str] = {}  # checkpoints retention must not remove, and why
        self.resumed = False  # a kept copy committed again (recover): a refusal keeps it
        self.copies = COPIES  # files publishing at once (a seam for tests and benchmarks)
        self.job: Optional[JobIdentity] = None  # who kept the copy, if not this process (recover)
        self._argument = dest
        self.dest: Optional[Destination] = None  # the kernel's path or the URL, once opened
        self.staging: Optional[StagingRoot] = None
        self.save_dir: Optional[SaveDir] = None
        self.local: Optional[Path] = None
        self.removed_commit = False  # the destination's previous commit file is gone
        self.records: list[PublishRecord] = []
        self.manifest: Optional[Manifest] = None
        self._writing: Optional[bytes] = None  # the commit file being published

    @classmethod
    def resume(cls, record: Record, save_dir: SaveDir, settings: Settings) -> Commit:
        """The commit of a copy an earlier commit kept (``safestage recover``), from step 2 on."""
        commit = cls(record.destination, settings, part=record.part, started=record.started)
        commit.resumed, commit.job = True, record.job  # the job that kept it keeps its name
        commit.dest, commit.save_dir, commit.local = (
            record.destination,
            save_dir,
            save_dir / record.local,
        )
        commit.staging = _save.staging_root(settings)
        # Staged by the failed commit (killed between staging one and publishing it): written
        # anew, with O_EXCL. A stale set-aside marker in the way would leave what this commit
        # abandons not set aside, and latest_complete naming it.
        for staged in (_STAGED_COMMIT, _STAGED_MARKER):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(save_dir / staged)
        return commit

    @classmethod
    def in_place(
        cls,
        dest: Path,
        settings: Settings,
        *,
        started: Optional[float] = None,
        retention: Any = None,
    ) -> Commit:
        """The commit of files another writer put at ``dest`` (``commit_in_place``): no local
        copy; a save directory only for the commit file. ``started``: when the writer began,
        if the caller knows (the Trainer's callback does; a plain commit_in_place of a directory
        written who knows when does not, and sets nothing aside)."""
        commit = cls(dest, settings, started=started, retention=retention)
        commit.started = started
        commit.dest = dest
        return commit

    def __repr__(self) -> str:
        return (
            f"<Commit {self.part.of} dest={str(self.dest or self._argument)!r} local={self.local}>"
        )

    # 1. open -----------------------------------------------------------------------------------

    def open(self) -> Path:
        """The destination checked (its parent must exist) and a fresh local directory."""
        dest = destination_directory(self._argument)
        staging, save_dir = _save.save_dir(self.settings)
        local = save_dir / _local_name(dest.name)
        try:
            save_dir.mark_disposable()  # until the block returns: an unfinished checkpoint
            os.mkdir(local)
        except BaseException:
            with deferred():
                save_dir.remove()
            raise
        self.dest, self.staging, self.save_dir, self.local = dest, staging, save_dir, local
        return local

    # 2. check ----------------------------------------------------------------------------------

    def check(self, paths: Optional[list[str]] = None) -> Tree:
        """What the local directory holds (only ``paths`` of it, if given), refused before the
        destination is touched if it cannot be committed as it is."""
        dest, local = self._opened()
        tree = scan(local, dest)
        if paths is not None:
            wanted = set(paths)
            tree.files = [(path, size) for path, size in tree.files if path in wanted]
        if isinstance(dest, Path):  # keys are flat: nothing can be in the way in a bucket
            check_destination(dest, tree)
        return tree

    # 3. hand off -------------------------------------------------------------------------------

    def hand_off(self, tree: Tree, *, landed: tuple[str, ...] = ()) -> None:
        """The local copy may be the only complete one from now on: recorded, never swept."""
        self._record(left=tree.paths, landed=landed)

    # 4. prepare --------------------------------------------------------------------------------

    def prepare(self, tree: Optional[Tree], *, vouching: tuple[str, ...] = ()) -> dict[str, str]:
        """The coordinator, once, before any file of this commit is published anywhere.
        Returns why each temp file that stays at the destination stays ({path: reason})."""
        dest: Destination
        local: Optional[Path]
        if self.local is None and isinstance(self.dest, ObjectURL):
            # DCP's coordinator prepares before it opens its local directory (safestage.dcp):
            # a bucket has no files in place, so there is no copy to name yet.
            dest, local = self.dest, None
        else:
            dest, local = self._opened()
        _work.settle(under=dest)  # an older background save of a file in it lands now, never after
        self.removed_commit, staying = prepare_destination(dest, tree or Tree(), local, fsync=self.settings.fsync,
                                                           vouching=vouching)  # fmt: skip
        return staying

    # 5. publish --------------------------------------------------------------------------------

    def publish(
        self,
        tree: Tree,
        published: dict[str, Published],
        wait: Optional[Callable[[Work], Optional[BaseException]]] = None,
    ) -> Optional[BaseException]:
        """Publish every file of ``tree`` into ``published`` in two phases: the data, largest
        first, ``COPIES`` at once; then, once every rank's data has landed, the trust files
        (``trust_last``), one at a time. Returns this rank's failure (a PublishError saying
        what landed) or raises an interrupt. After a failure no new file starts and those in
        flight finish; after an interrupt those in flight stop too (at their next chunk):
        nothing is copied once this has returned or raised. ``wait``: how to wait for the
        copies of a phase (a collective commit's heartbeat, which returns once every rank's
        are done: every rank waits twice, or, once a failure or interrupt anywhere stopped
        the first phase, every rank once)."""
        dest, local = self._opened()
        assert self.staging is not None
        data, trust = trust_last(tree.files)
        order = data + trust
        publish_one = functools.partial(self._publish_one, local, dest, self.staging.device)
        interrupt: Optional[BaseException] = None
        errors: dict[str, BaseException] = {}
        for phase, copies in ((data, self.copies), (trust, 1)):
            work = Work(phase, _digest_factory)
            try:
                for index in range(min(copies, len(phase))):
                    start_worker(
                        functools.partial(work.run, publish_one), name=f"safestage-commit-{index}"
                    )
            except BaseException as exc:  # KeyboardInterrupt: stop the copies in flight
                interrupt = interrupt or exc
                work.stop(cancel=True)
            absorbed = work.wait() if wait is None else wait(work)
            interrupt = interrupt or absorbed
            for path in phase:
                if path in work.published:
                    published[path] = work.published[path]
                    self._note_published(dest / path, work.published[path])
            errors.update(work.errors)
            if work.stopped:  # a failure or interrupt here or on another rank: no trust file
                break
        if interrupt is not None:
            raise interrupt
        failures = [(path, errors[path]) for path in order if path in errors]
        if not failures:
            return None
        first = failures[0][1]
        if not isinstance(first, OSError):
            return first  # not an I/O failure (a bug, MemoryError): as it is
        error = _partial_error(dest, local, order, published, failures, self.removed_commit, self.part)
        error.__cause__ = first
        return error

    def _publish_one(
        self, local: Path, dest: Destination, device: int, path: str, digest: Callable[[], Digest]
    ) -> Published:
        # What was in the way was refused before (check_destination). keep_source: on the
        # staging root's own filesystem the file is linked, never moved, into place, so that a
        # copy kept after a failure still holds every file (recover commits it whole, and
        # retention may remove what landed).
        return publish_file(
            local / path, dest / path, publish=self.settings.publish, fsync=self.settings.fsync,
            staging_device=device, digest=digest, keep_source=True,
        )  # fmt: skip

    # 6. the commit file ------------------------------------------------------------------------

    def commit_file(self, entries: list[FileEntry], empty: list[str]) -> Manifest:
        """Set aside what this save's run abandoned, then publish the commit file, last."""
        dest = self._opened()[0]
        manifest = new_manifest(entries, empty, version(), self.started)
        if self.started is not None:
            _timeline.set_aside(dest, self.started, self._write_marker, resumed=self.resumed)
        self._writing = manifest.encode()
        target = dest / COMMIT_NAME
        try:
            result = self._publish_bytes(self._writing, _STAGED_COMMIT, target)
        except OSError as exc:
            landed = tuple(sorted(entry.path for entry in entries))
            if isinstance(dest, ObjectURL) and exc.errno != errno.EEXIST:
                # A request the store received before a timeout or a cut may still complete:
                # the outcome is the store's to tell, not this error's.
                outcome = (f"{dest} is not complete unless the store still completes a request it "
                           "received before the error: verify says which. If not, commit again")  # fmt: skip
            else:
                outcome = (f"{dest} is therefore not complete"
                           f"{_previous(self.removed_commit, ' (the previous commit file was removed first)')} "
                           "(verify and latest_complete say so). Commit again")  # fmt: skip
            raise PublishError(
                exc.errno,
                f"safestage could not commit {dest}: all {len(landed)} files landed, but the "
                f"commit file {COMMIT_NAME} could not be written ({exc}). {outcome}"
                + (f"; the local copy is kept at {self.local}." if self.local is not None else "."),
                str(target),
                staged_path=None if self.local is None else str(self.local),
                step="commit",
                landed=landed,
                not_landed=(),
            ) from exc
        self._note_published(target, result)
        self.manifest = manifest
        return manifest

    def landed_already(self) -> bool:
        """Whether the commit file being published is at the destination (after an interrupt:
        did it land?)."""
        if self._writing is None or self.dest is None:
            return False
        if isinstance(self.dest, ObjectURL):
            try:
                return _object_store.read(self.dest / COMMIT_NAME) == self._writing
            except OSError:
                return False
        try:
            with open(self.dest / COMMIT_NAME, "rb") as handle:
                return handle.read() == self._writing
        except OSError:
            return False

    def _write_marker(self, target: Destination, data: bytes) -> None:
        if isinstance(target, ObjectURL):
            _object_store.put_bytes(target, data)  # a marker may replace a marker: no create
            return
        self._publish_bytes(data, _STAGED_MARKER, target)

    def _publish_bytes(self, data: bytes, name: str, target: Destination) -> Published:
        """Publish ``data`` as ``target``: written into the save directory, then published like
        any file (replace where the destination can rename, direct where it cannot). On an
        object store, one conditional PUT that creates the object or fails: a second writer of
        the same checkpoint gets an error and overwrites no commit object."""
        if isinstance(target, ObjectURL):
            return _create_object(target, data)
        if self.save_dir is None:  # commit_in_place: a save directory for the commit file only
            self.staging, self.save_dir = _save.save_dir(self.settings)
        assert self.staging is not None
        staged = self.save_dir / name
        try:
            _write_new_file(staged, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(staged)  # a torn local copy helps nobody (a full staging root)
            raise
        try:
            return publish_file(staged, target, publish=self.settings.publish, fsync=self.settings.fsync,
                                staging_device=self.staging.device)  # fmt: skip
        finally:
            with contextlib.suppress(OSError):
                os.unlink(staged)

    # 7. finish or keep -------------------------------------------------------------------------

    def finish(self) -> None:
        """Landed: nothing in the save directory is needed any more."""
        save_dir, self.save_dir = self.save_dir, None
        if save_dir is None:
            return
        with deferred():
            with contextlib.suppress(OSError):  # a kill during the removal leaves junk only
                save_dir.mark_disposable()
            save_dir.remove()

    def discard(self) -> None:
        """Nothing was published, and the copy is not worth keeping (the block raised, or it
        was refused): remove it, the disposable marker last."""
        save_dir, self.save_dir = self.save_dir, None
        if save_dir is None:
            return
        if self.resumed:  # recover: a refused copy may be the only one
            save_dir.release()
            return
        with deferred():
            save_dir.remove()

    def keep(
        self, exc: BaseException, landed: Iterable[str] = (), tree: Optional[Tree] = None
    ) -> None:
        """The local copy stays, its record saying what landed (``landed``: paths) and why,
        and is never swept: it may be the only complete copy of the checkpoint (``safestage
        recover``)."""
        save_dir = self.save_dir
        if save_dir is None or self.local is None:
            return
        self.save_dir = None
        done = sorted(landed)
        with deferred():
            every = tree.paths if tree is not None else _files_in(self.local)
            self._record(save_dir, left=[p for p in every if p not in done], landed=done, error=exc)
            save_dir.release()
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
            note(exc, _kept_text(self.dest, self.local, done, self.part))

    # -- helpers -----------------------------------------------------------------------------------

    def _opened(self) -> tuple[Destination, Path]:
        assert self.dest is not None, "a commit step before open()"
        if self.local is not None:
            return self.dest, self.local
        assert isinstance(self.dest, Path), "a commit in place is a commit of files at a path"
        return self.dest, self.dest

    def _record(
        self,
        save_dir: Optional[SaveDir] = None,
        *,
        left: list[str],
        landed: Any,
        error: Optional[BaseException] = None,
    ) -> None:
        save_dir = save_dir or self.save_dir
        assert save_dir is not None and self.dest is not None and self.local is not None
        save_dir.keep(Record(
            destination=self.dest, local=self.local.name, kind="directory", part=self.part,
            left=tuple(left), landed=tuple(landed), commit_file=True, started=self.started or time.time(),
            error=None if error is None else str(error), job=self.job or this_job(),
        ))  # fmt: skip

    def _note_published(self, target: Destination, result: Published) -> None:
        self.records.append(PublishRecord(
            destination=target, bytes=result.nbytes, publish=result.strategy, seconds=result.seconds,
            serialize_seconds=0.0, publish_seconds=result.seconds,
        ))  # fmt: skip


# -- agreement ----------------------------------------------------------------------------------------


class Peers(Protocol):
    """The agreement points of a commit. Each raises when the commit cannot go on: a refusal
    (a PublishError whose step is in REFUSALS: nothing is kept), a ``Lost`` peer, or a failure."""

    rank: int
    world_size: int

    @property
    def is_coordinator(self) -> bool: ...

    def started(self, problem: Optional[BaseException], dest: Optional[Destination]) -> None: ...

    def written(self, tree: Optional[Tree], problem: Optional[BaseException]) -> Tree: ...

    def prepared(self, prepare: Callable[[], object], local: Path, paths: list[str]) -> None: ...

    def publishing(self, work: Work) -> Optional[BaseException]: ...

    def landed(
        self, entries: list[FileEntry], error: Optional[BaseException], local: Path
    ) -> list[FileEntry]: ...

    def committed(
        self, write: Callable[[], Manifest], published: dict[str, Published], dest: Destination
    ) -> Manifest: ...

    def lost_error(
        self, lost: Lost, dest: Any, state: str, local: Optional[Path]
    ) -> PublishError: ...

    def ended(self) -> None:
        """The commit is over (landed, failed or refused): no agreement point follows."""

    def agreeing(self) -> contextlib.AbstractContextManager[object]:
        """Around steps that run agreement points: an interrupt is raised in none of them, nor
        between two, but taken at the next one (``interrupted``) and told to every rank there."""

    def interrupted(self) -> Optional[BaseException]:
        """The interrupt noted since the last agreement point, if any (taken: raised by the
        caller once every rank has heard of it)."""


class Alone:
    """A world of one: every agreement point is the commit's own answer."""

    rank = 0
    world_size = 1
    is_coordinator = True

    def ended(self) -> None:
        pass

    def agreeing(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()  # a Ctrl-C stops a world of one where it lands

    def interrupted(self) -> Optional[BaseException]:
        return None

    def started(self, problem: Optional[BaseException], dest: Optional[Destination]) -> None:
        if problem is not None:
            raise problem

    def written(self, tree: Optional[Tree], problem: Optional[BaseException]) -> Tree:
        if problem is not None:
            raise problem
        assert tree is not None
        return tree

    def prepared(self, prepare: Callable[[], object], local: Path, paths: list[str]) -> None:
        prepare()

    def publishing(self, work: Work) -> Optional[BaseException]:
        return work.wait()

    def landed(
        self, entries: list[FileEntry], error: Optional[BaseException], local: Path
    ) -> list[FileEntry]:
        if error is not None:
            raise error
        return entries

    def committed(
        self, write: Callable[[], Manifest], published: dict[str, Published], dest: Destination
    ) -> Manifest:
        return write()

    def lost_error(self, lost: Lost, dest: Any, state: str, local: Optional[Path]) -> PublishError:
        raise AssertionError("a world of one loses no peer")  # pragma: no cover


# -- the sequence, run ---------------------------------------------------------------------------------


def enter(commit: Commit, peers: Peers, problem: Optional[BaseException] = None) -> Path:
    """Step 1 on every rank: its local directory, or every rank raises and none writes.
    ``problem``: what stopped this rank before it could start, told to every rank likewise."""
    with peers.agreeing():
        if problem is None:
            try:
                commit.open()
            except BaseException as exc:  # told to every rank, then raised here
                problem = exc
        try:
            peers.started(problem, commit.dest if problem is None else None)
        except BaseException:
            commit.discard()
            peers.ended()
            raise
        late = peers.interrupted()
        if late is not None:  # told to the others where they next agree, as if the block raised it
            check(commit, peers, late)
            raise late
    assert commit.local is not None
    return commit.local


def check(
    commit: Commit, peers: Peers, exc: Optional[BaseException]
) -> Optional[tuple[Tree, Tree]]:
    """Steps 2 and 3 once the block has returned (``exc``: what it raised). Returns (this
    rank's tree, the union of every rank's), or None when the block raised (nothing was
    published; the block's exception propagates); raises when the commit cannot go on."""
    with peers.agreeing():
        try:
            checked = _check(commit, peers, exc)
        except BaseException:
            peers.ended()
            raise
        if checked is None:
            peers.ended()
        return checked


def _check(
    commit: Commit, peers: Peers, exc: Optional[BaseException]
) -> Optional[tuple[Tree, Tree]]:
    tree: Optional[Tree] = None
    problem: Optional[BaseException] = exc
    if problem is None:
        try:
            tree = commit.check()
        except BaseException as failed:  # told to every rank, then raised here
            problem = failed
    try:
        union = peers.written(tree, problem)
    except BaseException as stopped:
        if exc is not None or refused(stopped):
            commit.discard()  # nothing published; not worth keeping
            if exc is not None:
                return None
        elif isinstance(stopped, Lost):
            commit.keep(stopped, tree=tree)
            raise peers.lost_error(
                stopped, commit.dest, "before any rank published", commit.local
            ) from stopped
        elif commit.part.of == "collective":  # an interrupt: a part no recover commits alone
            commit.discard()
        else:  # an interrupt while checking: the block returned, so the copy is complete
            commit.keep(stopped, tree=tree)
        raise
    assert tree is not None
    if not union.files:
        # Every rank's block wrote nothing (or only directories): committed, an empty checkpoint
        # would be the newest complete one, and a save that went to the destination itself
        # (dcp.save(checkpoint_id=dest) in the block) would lose its .metadata to the prepare.
        # The same on every rank: the union is.
        commit.discard()
        raise _nothing_written(commit, collective=commit.part.of != "whole")
    try:
        commit.hand_off(tree)
    except BaseException as failed:
        commit.keep(failed, tree=tree)
        raise
    return tree, union


def _nothing_written(commit: Commit, *, collective: bool) -> StagingError:
    """As ``staged_file`` refuses a save that wrote nothing."""
    dest, local = commit._opened()
    return StagingError(
        errno.ENOENT,
        f"safestage.staged_dir: nothing was written to {local}{', nor by any other rank' if collective else ''}, "
        f"so nothing was committed to {dest}. Nothing there was removed (a previous commit, or what a save "
        "wrote there directly, stays as it is) and no retention ran. Save into the directory the block "
        "yields (`with safestage.staged_dir(dest) as local:`, then save into local); for DCP, "
        "dcp.save(state, checkpoint_id=local), or storage_writer=safestage.dcp.StagedWriter(dest) without "
        "staged_dir.",
        str(local),
    )


def land(commit: Commit, peers: Peers, tree: Tree, union: Tree) -> Manifest:
    """Steps 4 to 7, on every rank: returns the manifest once the commit file has landed;
    otherwise keeps the copy and raises. Then retention (the coordinator's; never raises)."""
    with peers.agreeing():
        manifest = _landed(commit, peers, tree, union)
    retain(commit, peers)
    return manifest


def run(
    commit: Commit, peers: Peers, exc: Optional[BaseException] = None, *, with_retention: bool = True
) -> Optional[Manifest]:
    """Steps 2 to 7 in the caller: the synchronous commit of a block that returned (``exc``:
    what it raised). A collective's interrupt between the checks and the landing is told to
    every rank at step 3; one between ``check`` and ``land`` would leave this rank behind.
    ``with_retention``: retention too (else the caller's, once it holds the manifest)."""
    with peers.agreeing():
        checked = check(commit, peers, exc)
        if checked is None:
            return None
        try:
            manifest = _landed(commit, peers, *checked)
        except BaseException as stopped:
            # A Ctrl-C of a world of one before the landing began: the copy, recorded, is kept
            # (the landing keeps it itself on its own failures: no-op then).
            commit.keep(stopped, tree=checked[0])
            raise
    if with_retention:
        retain(commit, peers)
    return manifest


def _landed(commit: Commit, peers: Peers, tree: Tree, union: Tree) -> Manifest:
    try:
        return _land(commit, peers, tree, union)
    finally:
        peers.ended()


def _land(commit: Commit, peers: Peers, tree: Tree, union: Tree) -> Manifest:
    dest, local = commit._opened()
    published: dict[str, Published] = {}
    try:
        peers.prepared(lambda: commit.prepare(union, vouching=VOUCHING), local, tree.paths)
        try:
            own = commit.publish(tree, published, wait=peers.publishing)
        except Lost:
            raise
        except BaseException as stopped:  # an interrupt (what a SIGINT handler raised): told at the next step
            own = stopped
        rank = None if commit.part.of == "whole" else commit.part.rank  # a collective's files say whose
        entries = [FileEntry(path, result.nbytes, result.digest or "", rank, result.etag)
                   for path, result in published.items()]  # fmt: skip
        every = peers.landed(entries, own, local)
        manifest = peers.committed(lambda: commit.commit_file(every, union.empty), published, dest)
    except Lost as lost:
        commit.keep(lost, published, tree)
        raise peers.lost_error(lost, dest, "no commit file was written", local) from lost
    except BaseException as exc:
        if not isinstance(exc, Exception) and commit.landed_already():
            # Interrupted after the commit file landed: the checkpoint is complete (its handle's
            # wait() returns the manifest).
            assert commit._writing is not None
            commit.manifest = parse(commit._writing)
            commit.finish()
            note(exc, f"safestage: interrupted after {dest} was committed (it is complete)")
            raise
        commit.keep(exc, published, tree)
        raise
    commit.manifest = manifest
    commit.finish()
    log.debug("%s: committed %d files, %d bytes", dest, len(manifest.files), manifest.total_bytes)
    late = peers.interrupted()
    if late is not None:  # after the last agreement point: every rank has the commit file
        note(late, f"safestage: interrupted after {dest} was committed (it is complete)")
        raise late
    return manifest


def retain(commit: Commit, peers: Peers) -> None:
    """keep=N, once the commit landed: the coordinator prunes (never raises; a Ctrl-C stops it,
    the commit complete all the same)."""
    if commit.retention is None or not peers.is_coordinator or commit.staging is None:
        return
    assert commit.dest is not None
    try:
        commit.retention.after_commit(commit.dest, commit.staging.path, spare=commit.spare)
    except BaseException as exc:
        note(exc, f"safestage: interrupted while pruning beside {commit.dest}, which was committed (it is "
                  "complete); the next commit with keep= prunes again")  # fmt: skip
        raise


# -- the local directory --------------------------------------------------------------------------


def _local_name(name: str) -> str:
    """The local directory is named like the destination, for people reading a PublishError
    (the destination "/" has no name)."""
    # Never a name a sweep could take for safetensors' torn temp (.tmpXXXXXX), as local_name.
    if name in (
        "",
        DISPOSABLE_MARKER,
        KEPT_RECORD,
        _STAGED_COMMIT,
        _STAGED_MARKER,
    ) or is_writer_temp(name):
        return f"{name}.dir"
    return name


def _files_in(local: Path) -> list[str]:
    """The files of a local copy the commit did not get to scan (a Ctrl-C while checking)."""
    try:
        return walk(local, local).paths
    except (OSError, PublishError):
        return []


def scan(local: Path, dest: Destination) -> Tree:
    """Every file and directory written into ``local``, without following anything. Refused,
    before anything is published: symlinks (they could point anywhere, and object stores cannot
    hold one), FIFOs, sockets and devices, an entry at the top named like the commit file or the
    set-aside marker, names of safestage's temp files (a re-commit would remove them), and a
    ``.safetensors`` file that is not one (``verify --deep`` would reject the fresh checkpoint:
    the rule ``commit_in_place`` follows)."""
    try:
        tree = walk(local, dest)
        for path, size in tree.files:
            if path.endswith(".safetensors"):
                problem = _not_safetensors(local / path, size)
                if problem is not None:
                    raise refusal(dest, tree, local / path, f"is not a complete safetensors file: {problem}",
                                  errno.EBADMSG, step="scan")  # fmt: skip
        return tree
    except PublishError:
        raise
    except OSError as exc:  # a directory the block left unreadable, say
        raise refusal(
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


def walk(local: Path, dest: Destination) -> Tree:
    tree = Tree()
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
                what = "commit file" if path == COMMIT_NAME else "set-aside marker"
                problem = f"{problem}: that name is safestage's {what}, choose another"
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
                raise refusal(dest, None, Path(entry.path), problem, errno.EINVAL, step="scan")
            tree.files.append((path, info.st_size))
    tree.directories.sort(key=lambda path: (path.count("/"), path))
    return tree


# -- the destination ----------------------------------------------------------------------------------


def destination_directory(dest: Union[PathArg, Destination]) -> Destination:
    """The kernel's path of the checkpoint directory ``dest`` (symlinks followed, as any
    writer into it would), which may not exist yet; its parent must. Raised before the block
    runs, so that a typo costs nothing: PublishError ENOTDIR (a file is there), ENOENT (the
    parent is missing: a commit creates the checkpoint directory, never its parents, which
    on an unmounted mount point would quietly fill the local disk). An object-store URL is
    its own answer (a bucket has no directories to check); it must name a prefix below the
    bucket, as a checkpoint directory is below a run."""
    url = url_of(dest)
    if url is not None:
        if not url.key:
            raise PublishError(
                errno.EINVAL,
                f"safestage.staged_dir: {dest} is a bucket: name the checkpoint's prefix in it "
                f"({url.scheme}://{url.bucket}/run/checkpoint-100).",
                str(dest),
            )
        return url
    assert not isinstance(dest, ObjectURL)
    text = os.fspath(dest)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text or "\x00" in text:
        raise PublishError(
            errno.EINVAL, f"safestage.staged_dir: {text!r} is not a directory path", text
        )
    stripped = text.rstrip("/") or "/"
    existing = real_directory(stripped)
    if existing is not None:
        return existing
    head, name = os.path.split(stripped)
    if os.path.lexists(stripped):
        existing = real_directory(stripped)  # made meanwhile (another commit of it starting)?
        if existing is not None:
            return existing
    if name in ("", ".", "..") or (os.path.lexists(stripped) and real_directory(stripped) is None):
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
            "directory): create it first. safestage creates the checkpoint directory itself, "
            "never its parents (on a mount point that is not mounted they would land on the "
            "local disk).",
            text,
        )
    return parent / name


def check_destination(dest: Path, tree: Tree) -> None:
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
                present = {
                    entry.name: entry for entry in listing if entry.name in wanted.get(relative, {})
                }
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
                raise refusal(
                    dest, tree, dest / path, f"is {have} where the checkpoint has {where}"
                    + (" (safestage never writes through a symlink: it could point outside the "
                       "checkpoint)" if have == "a symlink" else "")
                    + ". Remove it from the destination", errno.ENOTDIR if want == "directory"
                    else errno.EISDIR if have == "a directory" else errno.EINVAL, step="inspect",
                )  # fmt: skip


def prepare_destination(
    dest: Destination, tree: Tree, local: Optional[Path], *, fsync: bool, vouching: tuple[str, ...] = ()
) -> tuple[bool, dict[str, str]]:
    """Create ``dest`` and its subdirectories. Before anything is written there, remove its
    commit file and set-aside marker, the files that make a stock reader trust it
    (``vouching``: DCP's .metadata), and the temp files of killed commits (at any depth).
    Returns whether a previous commit file was removed, and why each temp file that stays
    stays."""
    if isinstance(dest, ObjectURL):
        return _prepare_prefix(dest, tree, local, vouching), {}
    assert local is not None
    step = "mkdir"
    removed = False
    staying: dict[str, str] = {}
    try:
        if not _make_directory(dest):
            step = "invalidate"
            if vouching:  # and the other trust files this commit publishes (deeper down, indexes)
                others = [path for path in trust_last(tree.files)[1] if path not in vouching]
                vouching = (*vouching, *reversed(others))
            removed = remove_commit_file(dest)
            unvouch(dest, fsync=fsync, vouching=vouching, removed=removed)
            step = "mkdir"
            staying = remove_dead_temps(dest)  # a re-commit: what killed commits left goes now
        for directory in tree.directories:
            _make_directory(dest / directory)
    except OSError as exc:
        failed = Path(os.fsdecode(exc.filename)) if exc.filename else dest / COMMIT_NAME
        if step == "invalidate" and not removed:
            what = (f"could not remove the previous commit file {failed}" if failed.name == COMMIT_NAME
                    else f"could not remove {failed}")  # fmt: skip
            state = "Nothing was published; the previous commit, if any, is untouched."
        elif step == "invalidate":  # the commit file went; a file after it (meta.pt) could not
            what = f"could not remove {failed} (it makes a stock reader trust the directory)"
            state = (f"Nothing was published, but the previous commit file was removed first: {dest} "
                     "is not complete until a commit succeeds (verify and latest_complete say so).")  # fmt: skip
        else:
            what = f"could not create directory {exc.filename or dest}"
            state = (
                "Nothing was published"
                + _previous(
                    removed,
                    f", but the previous commit file was removed first: {dest} is not complete "
                    "until a commit succeeds (verify and latest_complete say so)",
                )
                + "."
            )
        raise PublishError(
            exc.errno,
            f"safestage could not commit {dest}: {what}: [Errno {exc.errno}] {exc.strerror}. "
            f"{state}" + ("" if local == dest else f" The checkpoint is kept at {local}."),
            str(dest),
            staged_path=None if local == dest else str(local),
            step=step,
            landed=(),
            not_landed=tuple(sorted(tree.paths)),
        ) from exc
    return removed, staying


def _prepare_prefix(dest: ObjectURL, tree: Tree, local: Optional[Path], vouching: tuple[str, ...]) -> bool:
    """``prepare_destination`` on an object store: the previous commit object goes first, in a
    request of its own (a commit killed after it leaves no commit vouching for a mix of old and
    new objects), then the set-aside marker and the trust files, in one batched delete. There
    are no directories to make and no temps to sweep (an upload in flight is invisible)."""
    commit = dest / COMMIT_NAME
    removed = False
    try:
        removed = _object_store.head(commit) is not None
        if removed:
            _object_store.delete([commit])
        others = [path for path in trust_last(tree.files)[1] if path not in vouching]
        _object_store.delete([dest / name for name in (SET_ASIDE_NAME, *vouching, *reversed(others))])
    except _object_store.StoreError as exc:
        state = ("Nothing was published" + _previous(removed, ", but the previous commit object was "
                 f"removed first: {dest} is not complete until a commit succeeds") + ".")  # fmt: skip
        raise PublishError(
            exc.errno, f"safestage could not commit {dest}: {exc.message} {state}"
            + ("" if local is None else f" The checkpoint is kept at {local}."), str(dest),
            staged_path=None if local is None else str(local), step="invalidate", landed=(), not_landed=tuple(sorted(tree.paths)),
        ) from exc  # fmt: skip
    return removed


def read_commit_bytes(dest: Destination) -> bytes:
    """The bytes of ``dest``'s commit file (FileNotFoundError if there is none)."""
    target = dest / COMMIT_NAME
    if isinstance(target, ObjectURL):
        data = _object_store.read(target)
        if data is None:
            raise FileNotFoundError(errno.ENOENT, f"{target}: no such object", str(target))
        return data
    return target.read_bytes()


def _create_object(target: ObjectURL, data: bytes) -> Published:
    """The commit object, created only if none is there (If-None-Match: *; GCS: generation 0)."""
    started = time.perf_counter()
    try:
        etag = _object_store.put_bytes(target, data, create=True)
    except _object_store.StoreError as exc:
        # A create the store did but whose answer was lost or failed (a 500, a reset) may have
        # landed: obstore's retry then meets it (412; 409 on Azure), or the error is the lost
        # answer itself. This commit's own object, byte for byte, is this commit done, never
        # "another writer".
        landed = _own_object(target, data)
        if landed is not None:
            log.info("safestage: %s had landed although its request failed (%s): committed", target, exc)
            return Published("upload", len(data), time.perf_counter() - started, None, landed)
        if exc.errno == errno.EEXIST:
            raise PublishError(
                errno.EEXIST,
                f"safestage: {target} was created by another writer while this one committed "
                f"{target.parent}: two jobs are saving the same checkpoint. This commit wrote no "
                "commit object and overwrote none; its objects may have replaced the other "
                "writer's, whose commit then no longer matches them (verify and latest_complete "
                "say so). Give each job its own run prefix.",
                str(target),
                step="commit",
            ) from exc
        raise
    return Published("upload", len(data), time.perf_counter() - started, None, etag)


def _own_object(target: ObjectURL, data: bytes) -> Optional[str]:
    """The ETag of ``target`` if it holds exactly ``data`` (None: not there, another's, or the
    store cannot say now)."""
    try:
        found = _object_store.get(target, limit=len(data))
    except OSError:
        return None
    if found is None or found[0] != data:
        return None
    return found[1].etag or ""


def invalidate(dest: Path, *, fsync: bool, vouching: tuple[str, ...] = ()) -> bool:
    """Remove ``dest``'s commit file, if any, before anything of a new commit is written there:
    a commit killed half-way then leaves no commit file at all, never an old one vouching for a
    mix of old and new files. Then its set-aside marker (the directory is being rewritten, not
    abandoned) and the ``vouching`` files (paths relative to ``dest``), in their order, before
    any data file is replaced. True if there was a commit file."""
    removed = remove_commit_file(dest)
    unvouch(dest, fsync=fsync, vouching=vouching, removed=removed)
    return removed


def remove_commit_file(dest: Path) -> bool:
    """The first step of ``invalidate``: True if there was a commit file (a caller whose next
    step fails must then say that it is gone)."""
    try:
        os.unlink(dest / COMMIT_NAME)
        return True
    except FileNotFoundError:
        return False


def unvouch(dest: Path, *, fsync: bool, vouching: tuple[str, ...], removed: bool) -> None:
    """The rest of ``invalidate``, the commit file gone (``removed``: there was one)."""
    others = False
    for name in (SET_ASIDE_NAME, *vouching):
        try:
            os.unlink(dest / name)
            others = True
        except FileNotFoundError:
            pass
    if fsync and (removed or others):
        fsync_directory(dest)  # the removal first, on disk too, before any new file


def _make_directory(path: Path) -> bool:
    """mkdir ``path``: True if this made it, False if a real directory was there already."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):  # appeared since check_destination looked
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise NotADirectoryError(
            errno.ENOTDIR, f"it is {kind}, where the checkpoint has a directory", str(path)
        )
    return False


def refusal(
    dest: Destination, tree: Optional[Tree], path: Path, problem: str, code: int, *, step: str
) -> PublishError:
    """A commit refused before the destination was touched. The local copy is removed (by the
    caller): refused as it is, it would be refused again, and kept copies that nobody can
    commit would pile up in the staging root."""
    return PublishError(
        code,
        f"safestage will not commit {dest}: {path} {problem}. Nothing was published; the "
        f"previous commit, if any, is untouched. The local copy was removed: fix this and "
        f"save the checkpoint again.",
        str(path),
        step=step,
        landed=(),
        not_landed=None if tree is None else tuple(sorted(tree.paths)),
    )


# -- publishing many files at once ---------------------------------------------------------------------


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


class Work:
    """The files of one commit, handed out to worker threads one at a time (_lifecycle: an
    interrupt can land inside ``Thread.start()``, and an executor would by then have queued
    work that the half-started thread runs after we raised; here it finds the work stopped).

    Completion is counted here, not with Thread.join(): on CPython 3.11 a join() that a
    KeyboardInterrupt cuts short can mark a live thread as stopped (the bpo-45274 handling
    releases the thread's own state lock), and a later join() then returns at once."""

    def __init__(
        self, order: list[str], digest: Callable[[threading.Event], Callable[[], Digest]]
    ) -> None:
        self._paths = iter(order)
        self._exhausted = not order
        self._running = 0  # workers publishing a file right now
        self._done = threading.Condition()
        self._failed = threading.Event()  # set: no worker takes another file
        self._cancel = threading.Event()  # set: the copies in flight stop at their next chunk
        self._digest = digest(self._cancel)
        self.published: dict[str, Published] = {}
        self.errors: dict[str, BaseException] = {}

    @property
    def stopped(self) -> bool:
        """Whether a failure or an interrupt (here, or told by another rank) stopped it."""
        return self._failed.is_set()

    def stop(self, *, cancel: bool) -> None:
        with self._done:
            self._failed.set()
            if cancel:
                self._cancel.set()
            self._done.notify_all()

    def run(self, publish: Callable[[str, Callable[[], Digest]], Published]) -> None:
        while True:
            with self._done:
                path = None if self._failed.is_set() else next(self._paths, None)
                if path is None:
                    self._exhausted = True
                    self._done.notify_all()
                    return
                self._running += 1
            try:
                result = publish(path, self._digest)
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


def _write_new_file(path: Path, payload: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        data = memoryview(payload)
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


# -- what a failure says --------------------------------------------------------------------------------


def _partial_error(
    dest: Destination,
    local: Path,
    order: list[str],
    published: dict[str, Published],
    failures: list[tuple[str, BaseException]],
    removed_commit: bool,
    part: Part,
) -> PublishError:
    path, first = failures[0]
    assert isinstance(first, OSError)
    landed = tuple(sorted(published))
    missing = tuple(sorted(p for p in order if p not in published))
    return PublishError(
        first.errno,
        f"safestage could not commit {dest}: {len(landed)} of {len(order)} files landed "
        f"({some(landed)}), {len(missing)} did not ({some(missing)}). No commit file was "
        f"written{_previous(removed_commit)}: {dest} is not complete (verify and latest_complete "
        f"say so). {_kept_sentence(local, part)} First error, for {path}: {_without_kept_copy(first)}",
        str(dest),
        staged_path=str(local),
        step=getattr(first, "step", None),
        landed=landed,
        not_landed=missing,
    )


def _kept_sentence(local: Path, part: Part) -> str:
    """Where the files are and what recover can do with them: a whole checkpoint it commits;
    one rank's part it never does (no staging root holds the whole)."""
    if part.whole:
        return f"The checkpoint is kept whole in {local}: `safestage recover` commits it."
    return (f"This rank's files are kept in {local}; they are {part.describe()}, which `safestage "
            f"recover` never commits alone: save the checkpoint again, then `safestage recover "
            f"--discard {local}` deletes them.")  # fmt: skip


def _without_kept_copy(error: BaseException) -> str:
    """A file's PublishError without its advice on its staged copy (a single file's: the
    commit's own sentence says what becomes of the local copy)."""
    if isinstance(error, PublishError) and error.staged_path is not None:
        return error.message.replace(kept_copy_text(Path(error.staged_path)), "").rstrip()
    return str(error)


def some(paths: Any, limit: int = 5) -> str:
    paths = list(paths)
    if not paths:
        return "none"
    shown = ", ".join(paths[:limit])
    return shown if len(paths) <= limit else f"{shown} and {len(paths) - limit} more"


def _previous(removed: bool, text: str = " and the previous commit file was removed first") -> str:
    """What an error after the invalidation says about the previous commit, if there was one."""
    return text if removed else ""


def _kept_text(dest: Optional[Destination], local: Path, published: list[str], part: Part) -> str:
    landed = f"; {len(published)} files had landed ({some(published)})" if published else ""
    return (
        f"safestage: interrupted while committing {dest}; no commit file was written{landed}. "
        + _kept_sentence(local, part)
    )


def note(exc: BaseException, text: str) -> None:
    log.warning("%s", text)
    if hasattr(exc, "add_note"):  # Python 3.11+: shown under the traceback
        exc.add_note(text)


def version() -> str:
    # The package's own (hatch reads it there); loaded whenever this module is, so looked up
    # rather than imported: this module sits below the package's front door.
    return str(sys.modules[__name__.partition(".")[0]].__version__)
