"""``safestage.staged_dir``: a whole checkpoint directory, written locally, committed last.

The block writes the checkpoint into a local directory; when it returns, the one commit
sequence (``_sequence``) lands it: alone, or, with ``group=``, as every rank's part of one
collective commit (``_collective``). The object ``staged_dir()`` returns is the commit's handle:
``wait()`` (the manifest, or the error), ``done()``; a background commit (``background=``) goes
on on a safestage worker after the block (``_work``). The block of a background commit returns
without waiting for the saves inside it either: each safetensors save (and torch.save under
``torch_save``) into its local directory returns once its tensors are copied (planned
``deferred``, _save), and the commit checks the directory once they are written.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Optional, Union

from .. import _config, _interrupts, _patch, _work, _writers  # noqa: F401 - _writers: what a block's hooked save does
from .._config import PathArg, Publish, Settings
from .._destination import Destination
from .._errors import ConfigError
from .._kept import Part
from .._save import Deferred
from . import _prune, _sequence
from ._manifest import Manifest
from ._sequence import Alone, Commit, Peers

# How long a rank of a collective commit waits for one that neither answers nor dies (a dead
# process is noticed at once). It bounds, too, how much later than the first rank the last one
# may reach the commit (its block still writing): ten minutes.
DEFAULT_TIMEOUT = 600.0


class StagedDir:
    """The context manager ``safestage.staged_dir()`` returns, and its commit's handle. ``with``
    yields the local directory to write the checkpoint into; once the commit has landed,
    ``records`` lists the published files (the commit file last) and ``manifest`` is what the
    commit file says."""

    def __init__(
        self,
        dest: PathArg,
        settings: Settings,
        *,
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        background: int = 0,
        retention: Optional[_prune.Retention] = None,
    ) -> None:
        self._commit = Commit(dest, settings, retention=retention)
        # The job's group, until the commit joins it: a handle kept to the commit must not keep
        # the job's process group alive after its destroy_process_group() (a fork after it
        # would crash or hang at the child's exit, freeing it there).
        self._group, self._timeout = group, timeout
        self._collective = group is not None
        self._background = background  # commits in flight at most (0: the block's end commits)
        self._peers: Optional[Peers] = None
        self._job: Optional[_work.Job] = None
        self._deferred: Optional[Deferred] = None  # a background commit's saves, written later
        self._state = "new"

    @property
    def dest(self) -> Optional[Destination]:
        return self._commit.dest

    @property
    def local(self) -> Optional[Path]:
        return self._commit.local

    @property
    def records(self) -> list[Any]:
        return self._commit.records

    @property
    def manifest(self) -> Optional[Manifest]:
        return self._commit.manifest

    @property
    def settings(self) -> Settings:
        return self._commit.settings

    @property
    def background(self) -> int:
        """How many commits may be in flight after their blocks returned (0: this one lands
        before its block's end returns)."""
        return self._background

    def __enter__(self) -> Path:
        if self._state != "new":
            raise RuntimeError(
                "this staged_dir was already used; call safestage.staged_dir() again"
            )
        if self._collective:
            with _interrupts.deferred() as noted:  # first of all: see _enter_collective
                return self._enter_collective(noted)
        self._state = "open"
        self._group = None  # never kept past here: see __init__ (the job's group is for a collective)
        _work.adopt(self)  # its commit may go on in the background in this process only
        if self._background:  # never more local copies than commits allowed in flight
            _work.make_room("commit", self._background)
        _raise_unseen()
        self._peers = Alone()
        local = _sequence.enter(self._commit, self._peers)
        if self._background and _work.may_defer(self):
            self._deferred = Deferred(self.settings)
            _work.adopt(self._deferred)  # this process's: a forked child writes before returning
        _patch.add_unstaged_dir(local, self._deferred)
        return local

    def _enter_collective(self, noted: _interrupts.Noted) -> Path:
        """Step 1 of a collective commit, which every rank reaches whatever stops it before:
        told there, every rank raises (``Peers.agreeing``): a Ctrl-C while it waits for an
        earlier background commit (whose exchanges share its gloo group: the wait cannot be
        cut short), that commit's failure not yet seen. What is noted after step 1 is taken
        at step 2, never raised out of ``__enter__`` (``__exit__`` would not run)."""
        from ._collective import Collective

        self._state = "open"
        group, self._group = self._group, None  # never kept past here: see __init__
        _work.adopt(self)  # its commit may go on in the background in this process only
        _work.make_room("commit", 1)  # every earlier one: their exchanges share its gloo group
        problem: Optional[BaseException] = None
        try:
            _raise_unseen()
        except BaseException as failed:
            problem = failed
        try:
            self._peers = peers = Collective.join(group, self._timeout, self._commit._argument)
        except BaseException:
            if problem is not None:
                raise problem  # noqa: B904 - the earlier commit's failure first; the join's error is its context
            raise
        self._commit.part = Part("collective", peers.rank, peers.world_size)
        local = _sequence.enter(self._commit, peers, problem)
        _patch.add_unstaged_dir(local, None)
        peers.carry(noted)
        return local

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        commit, peers = self._commit, self._peers
        assert commit.local is not None and commit.dest is not None and peers is not None, (
            "__exit__ without __enter__"
        )
        # First: from here on a collective's Ctrl-C is told to every rank (Peers.agreeing).
        late: Optional[BaseException] = None
        with peers.agreeing():
            landed, late = self._exit(exc)
        if landed:
            _sequence.retain(commit, peers)  # a Ctrl-C stops it: the commit has landed
        if late is not None:
            raise late

    def _exit(self, exc: Optional[BaseException]) -> tuple[bool, Optional[BaseException]]:
        """The block's end: whether a synchronous commit landed (retention is due), and an
        interrupt that came after it landed (raised once the handle holds the manifest)."""
        commit, peers = self._commit, self._peers
        assert commit.local is not None and commit.dest is not None and peers is not None
        self._state = "closed"
        _patch.remove_unstaged_dir(commit.local)
        deferred = self._deferred
        if exc is not None:  # nothing is published; the block's exception propagates
            if deferred is not None:
                deferred.settle()  # written (or failed) before the directory goes
            _sequence.check(commit, peers, exc)
            return False, None
        late: Optional[BaseException] = None
        with _work.running("commit", commit.dest, self) as job:
            self._job = job
            if deferred is not None and deferred.jobs:
                # Saves of the block still serializing from their copies: the checks wait for
                # them, on the worker.
                # Not kept (complete) until they are: _land_later says so then.
                _work.hand_off(job, functools.partial(self._land_later, deferred, job), limit=self._background,
                               not_started=functools.partial(self._keep_later, deferred))  # fmt: skip
                return False, None
            if not (self._background and _work.may_defer(self)):
                try:
                    job.result = _sequence.run(commit, peers, with_retention=False)
                except BaseException as stopped:
                    if commit.manifest is None:
                        raise
                    # Interrupted once the commit file had landed (the interrupt is whatever the
                    # SIGINT handler raised): the handle's wait() returns the manifest; the
                    # interrupt goes on from the block's end.
                    job.result, late = commit.manifest, stopped
                return late is None, late
            # The rest on a safestage worker; a collective's exchanges run on safestage's own gloo
            # group, never the job's, so training's collectives go on meanwhile. A Ctrl-C once
            # its checks passed is the training's: the commit goes on.
            checked = _sequence.check(commit, peers, None)
            assert checked is not None

            def not_started(exc: BaseException) -> None:
                commit.keep(exc, tree=checked[0])
                peers.ended()

            try:
                _work.hand_off(
                    job, lambda: _sequence.land(commit, peers, *checked), limit=1 if self._collective else self._background,
                    kept=commit.local, not_started=not_started,
                )  # fmt: skip
            except BaseException as interrupted:
                # A Ctrl-C before the hand-off: the copy, recorded, is kept and named
                # (hand_off keeps it itself on its own failures: no-op then).
                if not job.background:
                    not_started(interrupted)
                raise
        return False, None

    def _land_later(self, deferred: Deferred, job: _work.Job) -> Manifest:
        """A background commit whose block's saves were deferred: once they are written, steps
        2 to 7 on the worker. A save that failed fails the commit as a block that raised."""
        commit, peers = self._commit, self._peers
        assert peers is not None
        try:
            deferred.wait()
        except BaseException as failed:
            deferred.settle()  # every other save of the block too, before its copy goes
            _sequence.check(commit, peers, failed)  # nothing published; the copy removed
            raise
        job.kept = commit.local  # complete from now on: named if exit is cut short
        manifest = _sequence.run(commit, peers)
        assert manifest is not None
        return manifest

    def _keep_later(self, deferred: Deferred, interrupted: BaseException) -> None:
        """Interrupted while waiting for a commit slot: the copy is kept once its saves are
        written, as a complete block's copy is (removed if one of them failed)."""
        try:
            deferred.wait()
        except Exception:
            deferred.settle()
            self._commit.discard()
            return
        self._commit.keep(interrupted)

    def __repr__(self) -> str:
        return (
            f"<safestage.StagedDir {self._state} dest={str(self.dest or self._commit._argument)!r}>"
        )

    # -- the handle of a commit ----------------------------------------------------------------

    def wait(self) -> Manifest:
        """The manifest of the landed commit, once it has landed (a background commit: wait
        for it); raises its error if it failed (every time wait() is called). In a process
        forked from the one that runs the commit, RuntimeError: it is not this process's."""
        if self._state != "closed":
            raise RuntimeError(
                "StagedDir.wait() is for after the block: the commit starts when it returns"
            )
        if self._job is None:
            raise RuntimeError(f"{self.dest}: the block raised, so nothing was committed")
        manifest: Manifest = self._job.wait()
        return manifest

    def done(self) -> bool:
        """Whether the commit has finished (landed or failed); False before the block returned.
        In a forked child, RuntimeError (the commit runs in the parent)."""
        if self._job is None:
            return self._state == "closed"
        return self._job.done()


def _raise_unseen() -> None:
    _work.raise_unseen(lambda job: isinstance(job.owner, StagedDir),
                       "safestage: raised here, at the next staged_dir: the background commit of {dest} failed")  # fmt: skip


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
    ``_SAFESTAGE_COMMIT.json`` is written last. ``dest`` is created if missing (its parent
    must exist). If the block raises, nothing is published and ``local`` is removed; so too,
    with StagingError, if it wrote no file (nothing at ``dest`` is removed). If a
    publish fails, PublishError says which files landed; no commit file is written and the
    local copy is kept (``safestage recover`` commits it). Options are checked here
    (ConfigError), ``dest`` and the staging root when the block starts.

    ``background=True``: the commit goes on on safestage's threads once the block has
    returned, and the object ``staged_dir()`` returned is its handle (``wait()``: the
    manifest, or the PublishError; ``done()``). At most one commit is in flight (``N``: at
    most N): the next ``staged_dir`` waits before its block. A failed background commit is
    raised by ``wait()``, by the next ``staged_dir`` and, if nobody saw it, at exit (status 1).
    The block itself does not wait for its safetensors saves (nor, under ``torch_save``, its
    ``torch.save``s): each returns once its tensors are copied, and is written from the copy
    on safestage's threads; the commit checks the directory once they are written, and a save
    that failed fails it (nothing is committed).

    ``keep=N``: once the commit file has landed, prune ``dest``'s parent of the checkpoints
    named like it (its name with the trailing step number as ``*``, which matches step numbers
    only) beyond the N newest complete ones, as ``safestage.prune`` does; a failure there is a
    WARNING, never an error of the landed commit.

    ``group``, a torch.distributed process group spanning the world
    (``torch.distributed.group.WORLD``), makes it a collective: every rank enters with the same
    ``dest`` and writes its own files under its own staging root; they land in one directory
    with one commit file, listing every file and its rank, and every rank returns once it has
    landed or raises. ``timeout`` is how many seconds a rank waits for one that neither answers
    nor dies (a rank that dies is noticed at once).
    """
    _config.reject_removed(removed, "safestage.staged_dir")
    # background= is the commits in flight; never SAFESTAGE_BACKGROUND (files a Stage publishes).
    settings = _config.resolve(root=root, publish=publish, fsync=fsync, background=0)
    in_flight = commits_in_flight(background, "safestage.staged_dir")
    if group is not None and in_flight > 1:
        raise ConfigError(
            f"safestage.staged_dir(group=..., background={background!r}): a collective commit runs "
            "one at a time (its exchanges share one gloo group): use background=True"
        )
    if group is not None and not (
        isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    ):
        raise ConfigError(
            f"safestage.staged_dir: timeout must be a number of seconds > 0, not {timeout!r}"
        )
    return StagedDir(dest, settings, group=group, timeout=float(timeout), background=in_flight,
                     retention=_prune.retention_for(dest, keep))  # fmt: skip


def commits_in_flight(background: object, where: str) -> int:
    """``background`` of a commit: False (or 0) synchronous, True one commit in flight, N at
    most N (never from SAFESTAGE_BACKGROUND, which is for the saves staging intercepts)."""
    if isinstance(background, bool):
        return int(background)
    if isinstance(background, int) and 0 <= background <= _config.MAX_BACKGROUND:
        return background
    raise ConfigError(
        f"{where}: background={background!r} is not a boolean or a whole number from 0 to "
        f"{_config.MAX_BACKGROUND}: use False (commit before the block's end returns), True (one "
        "commit in the background at a time) or N (at most N)"
    )
