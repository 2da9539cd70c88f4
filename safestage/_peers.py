"""The ranks of one distributed commit, and how they talk: safestage's own gloo group.

A collective ``staged_dir(group=...)`` exchanges a few small messages (who is there, what each
rank wrote, what landed, whether the commit file did) over a process group of safestage's
own, made once per user group with ``new_group(backend="gloo")`` over the same ranks:

- gloo runs on CPU whatever the job's backend is (NCCL object collectives would need a GPU
  per call), and DCP's ``async_save`` does the same for the same reason;
- the job's own collectives never interleave with ours, so a commit may run while training
  goes on (a background commit), and a failure of ours never poisons the job's group;
- its timeout is ours: ``timeout`` seconds for a rank that neither answers nor dies. A rank
  that dies (SIGKILL, the OOM killer) closes its connections, and gloo reports that to the
  others at once (measured: within 0.2 s).

Every message is a small object sent through ``all_gather_object``: all ranks see the same
list, so all of them take the same branch afterwards without a second round.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from ._errors import ConfigError
from ._names import HOST

log = logging.getLogger("safestage")

# How long a rank waits for another that neither answers nor dies (a dead process is noticed
# at once). It bounds, too, how much later than the first rank the last one may reach the
# commit (its block still writing): ten minutes.
DEFAULT_TIMEOUT = 600.0

_lock = threading.Lock()
_groups: dict[tuple[tuple[int, ...], float], Any] = {}  # (ranks, timeout) -> our gloo group


class PeerLost(Exception):
    """A rank of the commit stopped answering: it died, or timed out (``timeout``)."""


class Peers:
    """This rank's view of one distributed commit: its global rank, the ranks of the group
    (global, in group order; the first one coordinates) and safestage's gloo group."""

    def __init__(self, group: Any, timeout: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "safestage.staged_dir(group=...) needs torch.distributed initialized "
                "(torch.distributed.init_process_group) in every rank of the group"
            )
        if not timeout > 0:
            raise ConfigError(f"safestage.staged_dir: timeout must be a number of seconds > 0, not {timeout!r}")
        self._dist = dist
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(group))
        self.rank: int = dist.get_rank()
        if self.rank not in self.ranks:
            raise ConfigError(f"safestage.staged_dir: rank {self.rank} is not in the group it was given")
        if len(self.ranks) != dist.get_world_size():
            # torch names a group made by its members alone (use_local_synchronization) from
            # the ranks and how many groups each member already has: members of different
            # other groups disagree and never connect. Until that is solved, the world only.
            raise ConfigError(
                f"safestage.staged_dir(group=...): the group has ranks {list(self.ranks)}, not every "
                f"rank of the job ({dist.get_world_size()}): a collective commit runs over the whole "
                "world (group=torch.distributed.group.WORLD), every rank writing its own files"
            )
        self.index = self.ranks.index(self.rank)
        self.coordinator = self.ranks[0]
        self.timeout = float(timeout)
        self.group = _own_group(dist, group, self.ranks, self.timeout)
        self.pids: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), from the enter exchange

    @property
    def is_coordinator(self) -> bool:
        return self.index == 0

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in group order (the same list on every rank). PeerLost if
        a rank died or did not answer within the timeout."""
        gathered: list[Any] = [None] * len(self.ranks)
        try:
            self._dist.all_gather_object(gathered, value, group=self.group)
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out", ...
            raise self._lost(exc) from exc
        return gathered

    def _lost(self, exc: RuntimeError) -> PeerLost:
        _forget(self.ranks, self.timeout)  # a gloo group that lost a peer is broken for good
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        gone = [rank for rank, (host, pid) in sorted(self.pids.items()) if host == HOST and not _alive(pid)]
        if gone:
            who = "rank " + ", ".join(map(str, gone)) + f" (on this host, {HOST}) died"
        elif "timed out" in text.lower() or "timeout" in text.lower():
            who = f"a rank did not answer within the timeout ({self.timeout:g} s)"
        else:
            who = "a rank died or lost its connection"
        return PeerLost(f"{who} during the commit ({text})")


def _own_group(dist: Any, group: Any, ranks: tuple[int, ...], timeout: float) -> Any:
    """Our gloo group over ``ranks``: made by the first collective commit over them (every
    rank of the group enters it, in the same order), then reused."""
    key = (ranks, timeout)
    with _lock:
        existing = _groups.get(key)
    if existing is not None:
        return existing
    try:  # every rank of the job calls it, in the same order (Peers allows the world only)
        made = dist.new_group(list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise PeerLost(f"could not make safestage's gloo group over ranks {list(ranks)}: {exc}") from exc
    with _lock:
        _groups[key] = made
    return made


def _forget(ranks: tuple[int, ...], timeout: float) -> None:
    with _lock:
        broken = _groups.pop((ranks, timeout), None)
    if broken is not None:
        try:
            import torch.distributed as dist

            dist.destroy_process_group(broken)
        except Exception as exc:  # already torn down with the job's default group
            log.debug("could not destroy safestage's broken gloo group: %s", exc)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a killed rank stays a zombie until its launcher reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def after_fork_in_child() -> None:
    """Process groups do not survive fork(): a child starts with none of ours."""
    global _lock
    _lock = threading.Lock()
    _groups.clear()

