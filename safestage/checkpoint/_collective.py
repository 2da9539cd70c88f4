"""``staged_dir(dest, group=...)``: what only a collective commit needs, on top of the one
commit sequence (``_sequence``): the ranks' agreement points as exchanges, the union of what
they wrote and its clashes, the heartbeat while they publish, and naming the rank that failed.

Every rank of the group enters with the same ``dest`` and writes its own files into a local
directory under its own node's staging root (nodes need not share one; the destination may be
the only filesystem they share). Each agreement point of the sequence is one all-gather of
objects (``_gather``: ``all_gather_object``'s way, its works kept until the next one), the last
a broadcast of the coordinator's word (``_broadcast``), on a gloo group of safestage's own, made
once per group and ended with the job's groups:

- gloo runs on CPU whatever the job's backend is (NCCL object collectives would need a GPU
  per call), and DCP's ``async_save`` does the same for the same reason;
- the job's own collectives never interleave with ours, so a commit may run while training
  goes on (a background commit), and a failure of ours never poisons the job's group;
- its timeout is ours: ``timeout`` seconds for a rank that neither answers nor dies. A rank
  that dies (SIGKILL, the OOM killer) closes its connections, and gloo reports that to the
  others at once (measured: within 0.2 s).

All ranks see the same gathered list, so all of them take the same branch afterwards:

1. started: who is there (host, pid) and whether each rank could start (its destination, its
   staging root). A rank that could not, or a different ``dest``: every rank raises and none
   runs its block.
2. written: what each rank wrote, or that its block raised, or that its files were refused.
   Any of these, or two ranks writing the same path: every rank raises, nothing is published,
   every local copy is removed.
3. prepared: the coordinator (the group's first rank) creates every rank's directories and
   removes the previous commit file, once, before any rank publishes; the others wait for it.
4. publishing: every rank publishes its own files, in parallel with the others, exchanging a
   heartbeat every ``HEARTBEAT`` seconds: the timeout bounds a silent rank, never a long
   upload, and a failure anywhere stops new files everywhere. In two phases: the data; then,
   once every rank's data has landed (the heartbeat of the first phase ends on every rank
   at once), the files that make a stock reader trust the directory (``meta.pt``,
   ``.metadata``: ``_sequence.trust_last``), so that no rank's trust file ever lands beside
   another rank's old data.
5. landed: every rank's entries (path, size, CRC-32), or which file failed on which rank.
6. committed: the coordinator writes one commit file listing every file and the rank that
   wrote it, last; every rank returns once it has landed, or raises.

A rank that dies is noticed by the others at their next exchange (``Lost``): they raise
PublishError, no commit file is written (the coordinator writes it only after step 5 heard from
every rank), and each keeps its local copy, its record saying which rank of how many it was.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import threading
import weakref
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Optional

from .._destination import Destination
from .._errors import ConfigError, PublishError
from .._interrupts import Noted, deferred, taken
from .._locks import process_alive
from .._names import HOST
from .._publish import Published
from ._manifest import FileEntry, Manifest, parse
from ._sequence import Lost, Tree, Work, read_commit_bytes

log = logging.getLogger("safestage")

# Seconds between the heartbeats of ranks publishing (step 4): the latest a failure elsewhere
# stops this rank's next file, and the most the last rank to finish waits for the others.
HEARTBEAT = 0.25

_lock = threading.Lock()
# (ranks, timeout) -> our gloo group, held weakly: torch's registry (dist.new_group) holds it, so
# that the job's destroy_process_group() frees it and stops its threads as it does the job's own
# groups. Held strongly, it outlived that: its threads and sockets ran for the rest of the
# process, a later job's commit reused a destroyed group, and a fork() after it hung inside
# fork (the child's handler dropped it: see after_fork_in_child).
_groups: dict[tuple[tuple[int, ...], float], weakref.ref[Any]] = {}
# The works of each group's last exchange, held until its next one (see _gather).
_held: dict[tuple[tuple[int, ...], float], tuple[Any, ...]] = {}


class PeerLost(Lost):
    """A rank of the commit stopped answering: it died, or timed out (``timeout``).
    ``timed_out``: nobody was seen to die, a rank only did not answer in time.
    ``commit_pending``: so lost at the last step by a rank that is not the coordinator, before
    the commit file was there: a coordinator slower than the timeout may still write it."""

    timed_out = False
    commit_pending = False


class Collective:
    """This rank's view of one collective commit: its global rank, the ranks of the group
    (global, in group order; the first one coordinates) and safestage's gloo group."""

    def __init__(self, group: Any, timeout: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "safestage.staged_dir(group=...) needs torch.distributed initialized "
                "(torch.distributed.init_process_group) in every rank of the group"
            )
        self._dist = dist
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(group))
        self.rank: int = dist.get_rank()
        if self.rank not in self.ranks:
            raise ConfigError(
                f"safestage.staged_dir: rank {self.rank} is not in the group it was given"
            )
        if len(self.ranks) != dist.get_world_size():
            # torch names a group made by its members alone (use_local_synchronization) from
            # the ranks and how many groups each member already has: members of different
            # other groups disagree and never connect. Until that is solved, the world only.
            raise ConfigError(
                f"safestage.staged_dir(group=...): the group has ranks {list(self.ranks)}, not every "
                f"rank of the job ({dist.get_world_size()}): a collective commit runs over the whole "
                "world (group=torch.distributed.group.WORLD), every rank writing its own files"
            )
        self.world_size = len(self.ranks)
        self.coordinator = self.ranks[0]
        self.timeout = float(timeout)
        self.group = _own_group(dist, self.ranks, self.timeout)
        self.pids: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), from the started exchange
        self.dest: Any = None  # the checkpoint, as given, then as the kernel names it
        self._carried: Optional[Noted] = None  # interrupts noted after step 1, for step 2 (carry)
        self._interrupts: list[BaseException] = []  # those taken: raised as they are, never wrapped

    @classmethod
    def join(cls, group: Any, timeout: float, dest: Any) -> Collective:
        try:
            joined = cls(group, timeout)
        except PeerLost as exc:
            raise PublishError(errno.EPIPE, f"safestage could not start the commit of {dest}: {exc}",
                               str(dest), step="collective") from exc  # fmt: skip
        joined.dest = dest
        return joined

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def ended(self) -> None:
        """Let go of the group: a handle kept to a finished commit must not keep it alive after
        the job's destroy_process_group() (a fork after it would crash at the child's exit).
        Held until now, a commit in flight goes on whatever the job tears down meanwhile.
        An interrupt carried from step 1 and never taken (the block raised): raised now."""
        self.group = None
        carried, self._carried = self._carried, None
        if carried is not None and threading.current_thread() is threading.main_thread():
            late = carried.take()
            if late is not None:
                raise late

    def carry(self, noted: Noted) -> None:
        """What ``noted`` (step 1's deferral) notes from now until its end is taken at step 2,
        not raised as the deferral ends: raised out of ``__enter__``, it would skip the block's
        end, and this rank step 2."""
        noted.hold()
        self._carried = noted

    def agreeing(self) -> AbstractContextManager[object]:
        """Interrupts deferred (in the main thread: the one a Ctrl-C reaches) from here to the
        block's end, taken at the next agreement point (``interrupted``). Raised where it lands,
        a Ctrl-C inside an exchange, or between two, left this rank one exchange behind the
        others for the rest of the job: the others read its next commit's first word as this
        one's outcome, and its next commit failed. Told at the next agreement point, it ends
        this commit on every rank there, and every rank stays in step."""
        return deferred()

    def interrupted(self) -> Optional[BaseException]:
        late = taken()
        if late is None and self._carried is not None:
            late = self._carried.take()
        if late is not None:
            self._interrupts.append(late)
        return late

    def _is_interrupt(self, error: Optional[BaseException]) -> bool:
        return any(error is seen for seen in self._interrupts)

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in group order (the same list on every rank). PeerLost if
        a rank died or did not answer within the timeout."""
        try:
            return _gather(self._dist, self.group, (self.ranks, self.timeout), value)
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out", ...
            raise self._lost(exc) from exc

    def announce(self, value: Any) -> Any:
        """The coordinator's ``value``, on every rank (what the others pass is not sent).
        PeerLost as ``exchange``."""
        try:
            return _broadcast(self._dist, self.group, (self.ranks, self.timeout), value,
                              self.ranks.index(self.coordinator))  # fmt: skip
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    # -- the agreement points (_sequence.Peers) --------------------------------------------------

    def started(self, problem: Optional[BaseException], dest: Optional[Destination]) -> None:
        if dest is not None:
            self.dest = dest
        else:
            dest = self.dest
        problem = problem or self.interrupted()
        mine = (
            (HOST, os.getpid()),
            None if problem is not None else str(self.dest),
            _describe(problem),
        )
        try:
            states = self.exchange(mine)
        except PeerLost as lost:
            raise self.lost_error(lost, dest, "before any rank wrote anything", None) from lost
        self.pids = {rank: tuple(state[0]) for rank, state in zip(self.ranks, states)}
        failed = [(rank, state[2]) for rank, state in zip(self.ranks, states) if state[1] is None]
        if problem is not None:
            raise problem
        if failed:
            rank, text = failed[0]
            raise PublishError(
                errno.ECANCELED,
                f"safestage did not start the commit of {dest}: rank {rank} could not: {text}. No "
                "rank runs its block; nothing was written.",
                str(dest),
                step="collective",
            )
        if len({state[1] for state in states}) > 1:
            shown = ", ".join(f"rank {rank}: {state[1]}" for rank, state in zip(self.ranks, states))
            raise PublishError(
                errno.EINVAL,
                f"safestage.staged_dir(group=...): the ranks named different destinations ({shown}): "
                "every rank of the group must enter with the same dest. Nothing was written.",
                str(dest),
                step="collective",
            )

    def written(self, tree: Optional[Tree], problem: Optional[BaseException]) -> Tree:
        problem = problem or self.interrupted()
        mine = ("ready", tree.files, tree.directories, tree.empty) if tree is not None and problem is None \
            else ("stopped", _describe(problem))  # fmt: skip
        try:
            states = self.exchange(mine)
        except PeerLost as lost:
            if problem is not None:  # nothing published; this rank's own exception goes first
                raise problem from lost
            raise
        if problem is not None:
            raise problem
        stopped = [
            (rank, state[1]) for rank, state in zip(self.ranks, states) if state[0] != "ready"
        ]
        if stopped:
            rank, text = stopped[0]
            raise PublishError(
                errno.ECANCELED,
                f"safestage did not commit {self.dest}: on rank {rank}, {text}. No rank "
                "published anything; the previous commit, if any, is untouched; every rank's local "
                "copy was removed.",
                str(self.dest),
                step="refused",
                landed=(),
            )
        union, clash = _union(self.ranks, states)
        if clash is not None:
            raise PublishError(
                errno.EEXIST,
                f"safestage will not commit {self.dest}: {clash}. Every rank must write paths of its "
                "own. Nothing was published; every rank's local copy was removed.",
                str(self.dest),
                step="refused",
                landed=(),
            )
        return union

    def prepared(self, prepare: Callable[[], object], local: Path, paths: list[str]) -> None:
        word: Optional[PublishError] = None
        interrupt = self.interrupted()
        if self.is_coordinator and interrupt is None:
            try:
                prepare()
            except PublishError as failed:
                word = failed
            interrupt = self.interrupted()
        words = self.exchange((_describe(word) if word is not None else None,
                               _describe(interrupt) if interrupt is not None else None))  # fmt: skip
        coordinator_word = words[self.ranks.index(self.coordinator)][0]
        stopped = [(rank, said) for rank, (_, said) in zip(self.ranks, words) if said is not None]
        if coordinator_word is None and not stopped:
            return
        if interrupt is not None:
            raise interrupt
        if word is not None:
            raise word
        if coordinator_word is not None:
            why = f"the coordinator, rank {self.coordinator}, could not prepare it: {coordinator_word}"
        else:
            why = f"rank {stopped[0][0]} was interrupted ({stopped[0][1]}) before any rank published"
        raise PublishError(
            errno.ECANCELED, f"safestage could not commit {self.dest}: {why}",
            str(self.dest), staged_path=str(local), step="collective", landed=(), not_landed=tuple(paths),
        )  # fmt: skip

    def publishing(self, work: Work) -> Optional[BaseException]:
        """Wait for this rank's publishers, answering the others every HEARTBEAT seconds, until
        every rank's are done. A failure or interrupt anywhere stops new files everywhere."""
        interrupt: Optional[BaseException] = None
        while True:
            finished = work.finished(HEARTBEAT)
            late = self.interrupted()
            if late is not None:  # Ctrl-C: stop the copies in flight, tell the others
                work.stop(cancel=True)
                interrupt = interrupt or late
                finished = False
            try:
                states = self.exchange((finished, bool(work.errors) or interrupt is not None))
            except PeerLost:
                work.stop(cancel=True)
                work.wait()
                raise
            if any(failed for _, failed in states):
                work.stop(cancel=False)
            if all(done for done, _ in states):
                return interrupt

    def landed(
        self, entries: list[FileEntry], error: Optional[BaseException], local: Path
    ) -> list[FileEntry]:
        error = self.interrupted() or error  # the user's Ctrl-C goes before this rank's failure
        if error is None:
            mine: tuple[str, Any] = ("published", [(e.path, e.size, e.digest, e.etag) for e in entries])
        else:
            mine = ("interrupted" if self._is_interrupt(error) else "failed", _describe(error))
        outcomes = self.exchange(mine)
        failures = [(rank, how, said) for rank, (how, said) in zip(self.ranks, outcomes) if how != "published"]
        if failures:
            if error is not None and (self._is_interrupt(error) or not isinstance(error, Exception)):
                raise error  # an interrupt (what the SIGINT handler raised), SystemExit: as they are
            rank, how, text = failures[0]
            what = f"was interrupted ({text})" if how == "interrupted" else f"could not publish: {text.rstrip('.')}"
            published = {entry.path for entry in entries}
            raise PublishError(
                getattr(error, "errno", None) or errno.ECANCELED,
                f"safestage could not commit {self.dest}: rank {rank} {what}. No "
                f"commit file was written: {self.dest} is not complete. This rank's copy is kept in {local}.",
                str(self.dest), staged_path=str(local), step="collective",
                landed=tuple(sorted(published)), not_landed=None,
            ) from error  # fmt: skip
        return [FileEntry(path, size, digest, rank, etag)
                for rank, (_, said) in zip(self.ranks, outcomes) for path, size, digest, etag in said]  # fmt: skip

    def committed(
        self, write: Callable[[], Manifest], published: dict[str, Published], dest: Destination
    ) -> Manifest:
        manifest: Optional[Manifest] = None
        word: Optional[BaseException] = None
        said = ""
        if self.is_coordinator:
            word = self.interrupted()  # told before the commit file, none is written
            try:
                if word is None:
                    manifest = write()
                else:
                    said = f"was interrupted before it wrote the commit file ({_describe(word)})"
            except PublishError as failed:
                word = failed
                said = f"could not write the commit file: {_describe(word)}"
        try:
            # Only the coordinator has a word here: a broadcast, so that what every rank holds
            # until the next commit is one manifest (_broadcast), not one per rank.
            coordinator_word = self.announce(manifest.encode() if manifest is not None else said)
        except PeerLost as lost:
            landed = _landed_with(dest, manifest, published)
            if landed is None:
                lost.commit_pending = lost.timed_out and not self.is_coordinator
                raise
            log.warning(
                "safestage: %s: %s, after the commit file landed: the checkpoint is complete",
                dest,
                lost,
            )
            return landed
        if isinstance(coordinator_word, bytes):
            return manifest if manifest is not None else parse(coordinator_word)
        if word is not None:
            raise word
        raise PublishError(
            errno.ECANCELED,
            f"safestage could not commit {dest}: every file landed, but the coordinator, rank "
            f"{self.coordinator}, {coordinator_word}. {dest} is not complete.",
            str(dest), step="commit", landed=tuple(sorted(published)), not_landed=(),
        )  # fmt: skip

    def lost_error(self, lost: Lost, dest: Any, state: str, local: Optional[Path]) -> PublishError:
        kept = f" This rank's copy is kept in {local}." if local is not None else ""
        if getattr(lost, "commit_pending", False):
            outcome = (f"the coordinator, rank {self.coordinator}, had not written the commit file when this rank "
                       f"stopped waiting, and may still write it (one slower than timeout=): `safestage verify "
                       f"{dest}` tells whether {dest} is complete")  # fmt: skip
        else:
            outcome = f"{state}, so {dest} is not complete (verify and latest_complete say so)"
        return PublishError(
            errno.EPIPE,
            f"safestage could not commit {dest} (rank {self.rank} of {len(self.ranks)}): {lost}; "
            f"{outcome}.{kept}",
            str(dest),
            staged_path=None if local is None else str(local),
            step="collective",
        )

    def _lost(self, exc: RuntimeError) -> PeerLost:
        _forget(self.ranks, self.timeout)  # a gloo group that lost a peer is broken for good
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        gone = [
            rank
            for rank, (host, pid) in sorted(self.pids.items())
            if host == HOST and not process_alive(pid)
        ]
        if gone:
            who = "rank " + ", ".join(map(str, gone)) + f" (on this host, {HOST}) died"
        elif "timed out" in text.lower() or "timeout" in text.lower():
            who = f"a rank did not answer within the timeout ({self.timeout:g} s)"
        else:
            who = "a rank died or lost its connection"
        lost = PeerLost(f"{who} during the commit ({text})")
        lost.timed_out = not gone and who.startswith("a rank did not answer")
        return lost


def _union(ranks: tuple[int, ...], states: list[Any]) -> tuple[Tree, Optional[str]]:
    """Every rank's files and directories as one tree, and the first clash: a path two ranks
    wrote, or a file of one rank where another has a directory."""
    union = Tree()
    owners: dict[str, int] = {}
    directories: dict[str, int] = {}
    empty: set[str] = set()
    for rank, (_, files, dirs, empties) in zip(ranks, states):
        for directory in dirs:
            directories.setdefault(directory, rank)
        empty.update(empties)
        for path, size in files:
            if path in owners:
                return union, f"ranks {owners[path]} and {rank} both wrote {path}"
            owners[path] = rank
            union.files.append((path, size))
    for path, rank in owners.items():
        if path in directories:
            return (
                union,
                f"{path} is a file of rank {rank} and a directory of rank {directories[path]}",
            )
    union.directories = sorted(directories, key=lambda path: (path.count("/"), path))
    occupied = {parent for path in [*owners, *directories] for parent in _parents(path)}
    union.empty = sorted(empty - occupied)
    return union, None


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:index]) for index in range(1, len(parts))]


def _landed_with(
    dest: Destination, manifest: Optional[Manifest], published: dict[str, Published]
) -> Optional[Manifest]:
    """After a rank was lost at the last step: the commit file at ``dest``, if it is there and
    lists this rank's files as they landed (the coordinator wrote it before the loss)."""
    try:
        found = parse(read_commit_bytes(dest))
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


def _gather(dist: Any, group: Any, key: tuple[tuple[int, ...], float], value: Any) -> list[Any]:
    """``all_gather_object``, except that each collective's work stays referenced here until the
    next exchange over the same ranks (a lost group's too: see _forget), or exit.

    gloo's worker thread drops its reference to a work a moment after the caller's wait()
    returns. If that is the last one, the work's tensors are freed there, which takes the GIL
    to release their Python objects; when the rank is by then exiting (a commit that raised,
    caught, and the script ending within milliseconds), the interpreter's finalization ends
    that thread mid-destructor and the process aborts ("terminate called without an active
    exception", SIGABRT; pytorch/pytorch#179291). Held here, a work and its tensors are freed
    by Python, on a thread that holds the GIL.

    What is held between commits is the last exchange's: the commit step's is a broadcast of
    the manifest (``_broadcast``), one manifest. A gather holds the group's size times its
    largest payload until the group's next exchange."""
    import pickle

    import torch

    payload = pickle.dumps(value)
    size = dist.get_world_size(group)
    mine = torch.tensor([len(payload)], dtype=torch.long)
    lengths = torch.zeros(size, dtype=torch.long)
    work = dist.all_gather([lengths[i : i + 1] for i in range(size)], mine, group=group, async_op=True)
    _hold(key, work, mine, lengths)
    work.wait()
    longest = int(lengths.max())
    sent = torch.zeros(longest, dtype=torch.uint8)
    sent[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    received = torch.empty(longest * size, dtype=torch.uint8)
    views = [received[i * longest : (i + 1) * longest] for i in range(size)]
    second = dist.all_gather(views, sent, group=group, async_op=True)
    _hold(key, work, second, mine, lengths, sent, received)
    second.wait()
    return [
        pickle.loads(views[i][: int(lengths[i])].numpy().tobytes())  # the job's own ranks, as all_gather_object
        for i in range(size)
    ]


def _broadcast(dist: Any, group: Any, key: tuple[tuple[int, ...], float], value: Any, source: int) -> Any:
    """``broadcast_object_list`` of ``value`` from the group's rank ``source`` (its index in the
    group, not a global rank): what every rank returns. Its works are held as ``_gather``'s, and
    what they hold is one payload, not the group's size times it: the commit step's, the
    manifest, which every rank keeps until the next commit (about 100 bytes a file, 0.2 MB for
    2,000 files, whatever the number of ranks; a gather of it held that once per rank: 0.8 MB
    on 4 ranks, 1 GB on 1,024 ranks of 10 files each).

    Sent on the group itself, as ``_gather``'s all-gathers are: dist.broadcast and dist.get_rank
    look ranks up in torch's registry, which the job's destroy_process_group() empties while a
    background commit may still be at this step (it goes on, on the group it holds)."""
    import pickle

    import torch

    payload = pickle.dumps(value) if group.rank() == source else b""
    length = torch.tensor([len(payload)], dtype=torch.long)
    work = _broadcast_on(dist, group, length, source)
    _hold(key, work, length)
    work.wait()
    if payload:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(length), dtype=torch.uint8)
    second = _broadcast_on(dist, group, buffer, source)
    _hold(key, work, second, length, buffer)
    second.wait()
    return value if payload else pickle.loads(buffer.numpy().tobytes())


def _broadcast_on(dist: Any, group: Any, tensor: Any, source: int) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = source
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def _hold(key: tuple[tuple[int, ...], float], *works_and_tensors: Any) -> None:
    """Keep an exchange's works (and the tensors they fill) until the group's next exchange;
    the previous exchange's go."""
    with _lock:
        _held[key] = works_and_tensors


def _describe(exc: Optional[BaseException]) -> str:
    if exc is None:
        return ""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _own_group(dist: Any, ranks: tuple[int, ...], timeout: float) -> Any:
    """Our gloo group over ``ranks``: made by the first collective commit over them (every
    rank of the group enters it, in the same order), then reused."""
    key = (ranks, timeout)
    with _lock:
        held = _groups.get(key)
    existing = held() if held is not None else None
    if existing is not None and _registered(dist, existing):
        return existing
    try:  # every rank of the job calls it, in the same order (the world only)
        made = dist.new_group(
            list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout)
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise PeerLost(
            f"could not make safestage's gloo group over ranks {list(ranks)}: {exc}"
        ) from exc
    with _lock:
        _groups[key] = weakref.ref(made)
    return made


def _registered(dist: Any, group: Any) -> bool:
    """Whether torch still knows ``group``: destroy_process_group() forgets every group, and one
    something else still holds must not be used again."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def _forget(ranks: tuple[int, ...], timeout: float) -> None:
    with _lock:
        # Its held works stay until a new group's first exchange, or exit: dropped now, right
        # after the failed wait, gloo's thread could free them during finalization (_gather).
        held = _groups.pop((ranks, timeout), None)
    broken = held() if held is not None else None
    if broken is not None:
        try:
            import torch.distributed as dist

            dist.destroy_process_group(broken)
        except Exception as exc:  # already torn down with the job's default group
            log.debug("could not destroy safestage's broken gloo group: %s", exc)


def after_fork_in_child() -> None:  # registered by _lifecycle
    """Process groups do not survive fork(): a child starts with none of ours.

    What the parent's exchanges held is forgotten and never freed, not even at the child's
    exit: a gloo work's destructor in a child meets state of the parent's threads, which the
    child does not have (a 2-rank job that committed, destroyed its groups and forked: the
    child aborted at exit, SIGABRT, when it freed them). The groups themselves are torch's
    (held weakly here); torch's own left alive at fork() make a child that ends with sys.exit
    hang in their destructor at its exit, with or without safestage (glibc's
    pthread_cond_destroy waits for the parent's waiters): end forked children with os._exit
    (multiprocessing does), or destroy the process groups before forking."""
    global _lock
    _lock = threading.Lock()
    _groups.clear()
    for held in _held.values():
        _never_freed(held)
    _held.clear()


def _never_freed(value: Any) -> None:
    """One more reference to ``value`` that nothing drops: freed neither now nor when the
    interpreter tears down its modules."""
    try:
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(value))
    except (ImportError, AttributeError):  # not CPython: kept for the process's life at least
        _kept_forever.append(value)


_kept_forever: list[Any] = []
