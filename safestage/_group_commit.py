"""``staged_dir(dest, group=...)``: one checkpoint directory written by many ranks, one commit.

Every rank of the group enters with the same ``dest`` and writes its own files into a local
directory under its own node's staging root (nodes need not share one; the destination may be
the only filesystem they share). The protocol, in the order every rank follows it (each
exchange is one ``all_gather_object`` on safestage's own gloo group, ``_peers``):

1. enter: who is there (host, pid), and whether each rank could start (its destination path,
   its staging root). A rank that could not, or a different ``dest``: every rank raises and
   none runs its block.
2. the block returns: what each rank wrote, or that its block raised, or that its files were
   refused (``_commit._scan`` / ``_check_destination``). Any of these, or two ranks writing
   the same path: every rank raises, nothing is published, every local copy is removed.
3. the coordinator (the group's first rank) creates the directories of every rank and removes
   the previous commit file, once, before any rank publishes; the others wait for its word.
4. every rank publishes its own files, in parallel with the others, exchanging a heartbeat
   every ``HEARTBEAT`` seconds: so the timeout bounds a silent rank, never a long upload, and
   a failure anywhere stops new files everywhere.
5. what landed: every rank's entries (path, size, CRC-32), or which file failed on which rank.
6. the coordinator writes one commit file listing every file and the rank that wrote it,
   last; every rank returns once it has landed, or raises.

A rank that dies (SIGKILL, OOM) is noticed by the others at their next exchange (gloo reports
the closed connection at once): they raise PublishError, no commit file is written (the
coordinator writes it only after step 5 heard from every rank), and each keeps its local copy
as a failed single-process commit does (its record says which rank of how many it was).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from . import _background, _save
from ._commit import (
    _discard,
    _local_name,
    _mark_disposable,
    _prepare_destination,
    _scan,
    _Tree,
    _version,
    _Work,
    destination_directory,
)
from ._errors import PublishError
from ._interrupts import deferred
from ._manifest import FileEntry, Manifest, new_manifest, parse
from ._patch import add_unstaged_dir, remove_unstaged_dir
from ._peers import PeerLost, Peers
from ._publish import Published

if TYPE_CHECKING:
    from ._commit import StagedDir

log = logging.getLogger("safestage")


def _inflight_registered_dest(function: Any) -> Any:
    """From step 3 until it lands or fails, retention in this process never removes dest."""
    from ._inflight import committing

    def wrapper(stage: StagedDir, peers: Peers, private: Any, local: Path, dest: Path, *args: Any) -> None:
        with committing(dest):
            function(stage, peers, private, local, dest, *args)

    return wrapper

# Seconds between the heartbeats of ranks publishing (step 4): the latest a failure elsewhere
# stops this rank's next file, and the most the last rank to finish waits for the others.
HEARTBEAT = 0.25


def enter(stage: StagedDir) -> Path:
    """Step 1, on every rank: its local directory, or every rank raises."""
    try:
        peers = Peers(stage._group, stage._timeout)
    except PeerLost as exc:
        raise PublishError(errno.EPIPE, f"safestage could not start the commit of {stage._dest_argument}: {exc}",
                           str(stage._dest_argument), step="collective") from exc  # fmt: skip
    dest: Optional[Path] = None
    private = local = None
    problem: Optional[BaseException] = None
    try:
        dest = destination_directory(stage._dest_argument)
        stage._staging, private = _save.save_dir(stage.settings)
        local = private / _local_name(dest.name)
        _mark_disposable(private)
        os.mkdir(local)
    except BaseException as exc:  # told to every rank, then raised here
        problem = exc
    mine = (_where(), None if problem is not None else str(dest), _describe(problem))
    try:
        states = peers.exchange(mine)
    except PeerLost as exc:
        _drop(private, local)
        raise _lost_error(peers, stage._dest_argument, exc, "before any rank wrote anything") from exc
    peers.pids = {rank: tuple(state[0]) for rank, state in zip(peers.ranks, states)}
    failed = [(rank, state[2]) for rank, state in zip(peers.ranks, states) if state[1] is None]
    dests = {state[1] for state in states if state[1] is not None}
    if failed or len(dests) > 1:
        _drop(private, local)
        if problem is not None:
            raise problem
        if failed:
            rank, text = failed[0]
            raise PublishError(
                errno.ECANCELED,
                f"safestage did not start the commit of {stage._dest_argument}: rank {rank} could not: "
                f"{text}. No rank runs its block; nothing was written.",
                str(stage._dest_argument),
                step="collective",
            )
        shown = ", ".join(f"rank {rank}: {state[1]}" for rank, state in zip(peers.ranks, states))
        raise PublishError(
            errno.EINVAL,
            f"safestage.staged_dir(group=...): the ranks named different destinations ({shown}): "
            "every rank of the group must enter with the same dest. Nothing was written.",
            str(dest),
            step="collective",
        )
    assert dest is not None and private is not None and local is not None
    stage.dest, stage.local, stage._private, stage._peers = dest, local, private, peers
    stage._distributed = {"rank": peers.rank, "world_size": len(peers.ranks)}
    add_unstaged_dir(local)
    return local


def leave(stage: StagedDir, exc: Optional[BaseException]) -> None:
    """Steps 2 to 6, on every rank. Returns when the commit landed; raises otherwise (the
    block's own exception on the rank whose block raised)."""
    peers: Peers = stage._peers
    private, local, dest = stage._private, stage.local, stage.dest
    assert private is not None and local is not None and dest is not None
    remove_unstaged_dir(local)
    tree: Optional[_Tree] = None
    problem: Optional[BaseException] = exc
    if problem is None:
        try:
            tree = _scan(local, dest)
            from ._commit import _check_destination

            _check_destination(dest, tree)
        except BaseException as refused:  # told to every rank, then raised here
            problem = refused
    mine = ("ready", tree.files, tree.directories, tree.empty) if tree is not None and problem is None \
        else ("stopped", _describe(problem))  # fmt: skip
    try:
        states = peers.exchange(mine)
    except PeerLost as lost:
        if problem is not None:  # nothing published; this rank's own exception goes first
            _drop(private, local)
            if exc is not None:
                return
            raise problem from lost
        _keep(stage, tree, {}, lost)
        raise _lost_error(peers, dest, lost, "before any rank published", local) from lost
    stopped = [(rank, state[1]) for rank, state in zip(peers.ranks, states) if state[0] != "ready"]
    if stopped or problem is not None:
        _drop(private, local)
        if exc is not None:
            return  # the block's exception propagates
        if problem is not None:
            raise problem
        rank, text = stopped[0]
        raise PublishError(
            errno.ECANCELED,
            f"safestage did not commit {dest}: on rank {rank}, {text}. No rank published anything; "
            "the previous commit, if any, is untouched; every rank's local copy was removed.",
            str(dest),
            step="collective",
            landed=(),
        )
    assert tree is not None
    union, owners, clash = _union(peers.ranks, states)
    if clash is not None:
        _drop(private, local)
        raise PublishError(
            errno.EEXIST,
            f"safestage will not commit {dest}: {clash}. Every rank must write paths of its own. "
            "Nothing was published; every rank's local copy was removed.",
            str(dest),
            step="collective",
            landed=(),
        )
    stage._hand_off(private, local, tree)
    if stage._in_flight and _background.may_defer(stage):
        # Steps 3 to 6 on a publisher thread; their exchanges run on safestage's own gloo
        # group, never the job's, so training's collectives go on meanwhile.
        from . import _commit

        with _commit._started_lock:
            _commit._started.append(stage)

        def job() -> None:
            try:
                _commit_files(stage, peers, private, local, dest, tree, union, owners)
            except BaseException as exc:
                stage._error = exc
                raise

        _background.publisher().submit(
            job, dest, max_pending=1, owner=stage, kept=local, kind="commit",
            not_started=lambda exc: _keep(stage, tree, {}, exc),
        )  # fmt: skip
        return
    _commit_files(stage, peers, private, local, dest, tree, union, owners)


@_inflight_registered_dest
def _commit_files(
    stage: StagedDir,
    peers: Peers,
    private: Any,
    local: Path,
    dest: Path,
    tree: _Tree,
    union: _Tree,
    owners: dict[str, int],
) -> None:
    published: dict[str, Published] = {}
    files = [path for path, _ in tree.files]
    try:
        _background.settle_under(dest)
        # 3. the coordinator prepares the destination, once, before anyone publishes.
        word: Any = None
        if peers.is_coordinator:
            try:
                _, stage._removed_commit = _prepare_destination(dest, union, local, stage.settings.fsync)
            except PublishError as failed:
                word = failed
        words = peers.exchange(None if word is None else _describe(word))
        if words[0] is not None:
            if word is not None:
                raise word
            raise PublishError(
                errno.ECANCELED,
                f"safestage could not commit {dest}: the coordinator, rank {peers.coordinator}, "
                f"could not prepare it: {words[0]}",
                str(dest), staged_path=str(local), step="collective", landed=(), not_landed=tuple(files),
            )  # fmt: skip
        # 4. every rank publishes its own files; 5. what landed, everywhere.
        own_error: Optional[BaseException] = None
        try:
            stage._publish_files(tree, local, published, set(), wait=lambda work: _heartbeat(peers, work))
        except PeerLost:
            raise
        except BaseException as failed:  # told to every rank, then raised here
            own_error = failed
        entries = [(path, result.nbytes, result.digest or "") for path, result in published.items()]
        outcomes = peers.exchange(("failed", _describe(own_error)) if own_error is not None else ("published", entries))
        failures = [(rank, state[1]) for rank, state in zip(peers.ranks, outcomes) if state[0] != "published"]
        if failures:
            if own_error is not None and not isinstance(own_error, Exception):
                raise own_error  # KeyboardInterrupt, SystemExit: as they are
            rank, text = failures[0]
            error = PublishError(
                getattr(own_error, "errno", None) or errno.ECANCELED,
                f"safestage could not commit {dest}: rank {rank} could not publish: {text}. "
                f"No commit file was written: {dest} is not complete. This rank's copy is kept in {local}.",
                str(dest), staged_path=str(local), step="collective",
                landed=tuple(sorted(published)), not_landed=tuple(sorted(set(files) - set(published))),
            )  # fmt: skip
            raise error from own_error
        # 6. the commit file, by the coordinator, last.
        manifest: Optional[Manifest] = None
        word = None
        if peers.is_coordinator:
            every = [FileEntry(path, size, digest, rank)
                     for rank, state in zip(peers.ranks, outcomes) for path, size, digest in state[1]]  # fmt: skip
            manifest = new_manifest(every, union.empty, _version())
            try:
                stage._publish_commit_file(manifest, private, local, union, set())
            except PublishError as failed:
                word = failed
        try:
            final = peers.exchange(manifest.encode() if manifest is not None and word is None else _describe(word))
        except PeerLost as lost:
            landed = _landed_with(dest, manifest, published)
            if landed is None:
                raise
            log.warning("safestage: %s: %s, after the commit file landed: the checkpoint is complete", dest, lost)
            final = [landed.encode()]
        if not isinstance(final[0], bytes):
            if word is not None:
                raise word
            raise PublishError(
                errno.ECANCELED,
                f"safestage could not commit {dest}: every file landed, but the coordinator, rank "
                f"{peers.coordinator}, could not write the commit file: {final[0]}. {dest} is not "
                f"complete. This rank's copy is kept in {local}.",
                str(dest), staged_path=str(local), step="commit", landed=tuple(sorted(published)), not_landed=(),
            )  # fmt: skip
    except PeerLost as lost:
        _keep(stage, tree, published, lost)
        raise _lost_error(peers, dest, lost, "no commit file was written", local) from lost
    except BaseException as failed:
        _keep(stage, tree, published, failed)
        raise
    stage._finish(private, local, parse(final[0]))
    if stage._retention is not None and peers.is_coordinator and stage._staging is not None:
        stage._retention.after_commit(dest, stage._staging.path)  # one rank prunes, once it landed


def _heartbeat(peers: Peers, work: _Work) -> Optional[BaseException]:
    """Wait for this rank's publishers, answering the others every HEARTBEAT seconds, until
    every rank's are done. A failure or interrupt anywhere stops new files everywhere."""
    interrupt: Optional[BaseException] = None
    while True:
        try:
            finished = work.finished(HEARTBEAT)
        except BaseException as exc:  # Ctrl-C: stop the copies in flight, tell the others
            work.stop(cancel=True)
            interrupt = interrupt or exc
            finished = False
        try:
            states = peers.exchange((finished, bool(work.errors) or interrupt is not None))
        except PeerLost:
            work.stop(cancel=True)
            work.wait()
            raise
        if any(failed for _, failed in states):
            work.stop(cancel=False)
        if all(done for done, _ in states):
            return interrupt


def _union(ranks: tuple[int, ...], states: list[Any]) -> tuple[_Tree, dict[str, int], Optional[str]]:
    """Every rank's files and directories as one tree, who wrote which file, and the first
    clash: a path two ranks wrote, or a file of one rank where another has a directory."""
    union = _Tree()
    owners: dict[str, int] = {}
    directories: dict[str, int] = {}
    empty: set[str] = set()
    for rank, (_, files, dirs, empties) in zip(ranks, states):
        for directory in dirs:
            directories.setdefault(directory, rank)
        empty.update(empties)
        for path, size in files:
            if path in owners:
                return union, owners, f"ranks {owners[path]} and {rank} both wrote {path}"
            owners[path] = rank
            union.files.append((path, size))
    for path, rank in owners.items():
        if path in directories:
            return union, owners, f"{path} is a file of rank {rank} and a directory of rank {directories[path]}"
    union.directories = sorted(directories, key=lambda path: (path.count("/"), path))
    occupied = {parent for path in [*owners, *directories] for parent in _parents(path)}
    union.empty = sorted(empty - occupied)
    return union, owners, None


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:index]) for index in range(1, len(parts))]


def _landed_with(dest: Path, manifest: Optional[Manifest], published: dict[str, Published]) -> Optional[Manifest]:
    """After a rank was lost at the last step: the commit file at ``dest``, if it is there and
    lists this rank's files as they landed (the coordinator wrote it before the loss)."""
    from ._manifest import COMMIT_NAME

    try:
        found = parse((dest / COMMIT_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    if manifest is not None:
        return found if found.encode() == manifest.encode() else None
    listed = {entry.path: entry for entry in found.files}
    for path, result in published.items():
        entry = listed.get(path)
        if entry is None or entry.size != result.nbytes or entry.digest != (result.digest or ""):
            return None
    return found


def _keep(stage: StagedDir, tree: Optional[_Tree], published: dict[str, Published], exc: BaseException) -> None:
    assert stage._private is not None and stage.local is not None
    stage._keep(stage._private, stage.local, tree, published, exc)


def _drop(private: Any, local: Optional[Path]) -> None:
    """Remove this rank's local copy (nothing of it was published)."""
    if private is None:
        return
    with deferred():
        if local is not None and local.exists():
            _discard(private, local)
        else:
            private.remove()


def _lost_error(
    peers: Peers, dest: Any, lost: PeerLost, state: str, local: Optional[Path] = None
) -> PublishError:
    kept = f" This rank's copy is kept in {local}." if local is not None else ""
    return PublishError(
        errno.EPIPE,
        f"safestage could not commit {dest} (rank {peers.rank} of {len(peers.ranks)}): {lost}; "
        f"{state}, so {dest} is not complete (verify and latest_complete say so).{kept}",
        str(dest),
        staged_path=None if local is None else str(local),
        step="collective",
    )


def _describe(exc: Optional[BaseException]) -> str:
    if exc is None:
        return ""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where() -> tuple[str, int]:
    from ._names import HOST

    return (HOST, os.getpid())
