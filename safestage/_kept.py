"""Save directories and the copies they keep: the one place that writes, reads and finds them.

Every save and every commit works in a save directory of its own under the staging root
(``safestage-<host>-<pid>-<token>``, 0700), which its owner holds a lock on for as long as it
lives (``SaveDir``, ``_locks``). What a directory holds decides what becomes of it once its
owner is gone:

- nothing worth keeping: a file save's torn temp (safetensors' ``.tmpXXXXXX``), or a
  checkpoint directory marked disposable (``safestage-disposable``: its block was still
  writing it, or its commit had landed). Sweeps remove it;
- a kept copy: from the moment it may hold the only complete copy of a save, a record beside
  it (``safestage-kept.json``, ``Record``) says what the copy is for: its destination, the
  files still to publish and those that landed, which job kept it, and what it is part of
  (``Part``): the whole checkpoint, one rank's part of a collective commit, or one rank's files
  of a DCP save (whose ``.metadata`` only the coordinator writes, once every rank's files
  landed). Only the whole can be committed from one staging root: `safestage recover` does
  that when asked, and refuses the rest by construction. Nothing else removes a kept copy but
  the user (``discard``).

``scan`` is the one listing of a staging root; ``Found.owner_gone`` the one answer to
whether its owner lives (``_locks.owner_gone``). Activation sweeps (``sweep``), `safestage
clean`, `safestage recover` and retention's view of commits in flight (``claims``) all use them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from . import _loud
from ._destination import Destination, UnsupportedDestination, url_of
from ._interrupts import deferred
from ._locks import close_quietly, owner_gone, taken, try_lock
from ._names import DISPOSABLE_MARKER, HOST, KEPT_RECORD, Owner, is_writer_temp, parse_stage_dir

log = logging.getLogger("safestage")

FORMAT = "safestage.kept"
VERSION = 2  # 2: "part" and "job"; 1 (safestage 0.2, 0.3) is read too


# -- a save directory ------------------------------------------------------------------------------


class SaveDir:
    """One save's private directory (0700) under the staging root, and the flock on it that
    tells every sweeper, in any PID namespace, that its owner is alive (``_locks``)."""

    def __init__(self, path: Path, lock_fd: Optional[int]) -> None:
        self.path = path
        self._lock_fd = lock_fd
        if lock_fd is not None:
            _held.add(self)

    def release(self) -> None:
        """Drop the lock: what the directory still holds is then protected by its content
        alone (a kept copy is never swept). Idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            close_quietly(fd)

    def remove(self) -> None:
        """Remove the directory (under the lock, so no sweeper races us); never raises, and a
        Ctrl-C meanwhile is raised after it."""
        with deferred():
            try:
                remove_tree(self.path)
            finally:
                self.release()

    def mark_disposable(self) -> None:
        """Nothing in it is worth keeping if its owner dies now (being written, or landed)."""
        fd = os.open(self.path / DISPOSABLE_MARKER, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(fd)

    def keep(self, record: Record) -> None:
        """From now on it may hold the only complete copy: recorded, and never swept."""
        write_record(self.path, record)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path / DISPOSABLE_MARKER)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __repr__(self) -> str:
        return f"<SaveDir {self.path} {'locked' if self._lock_fd is not None else 'released'}>"


# Save directories whose lock this process holds: a forked child closes its inherited copy of
# each lock (a flock belongs to the open file, so a child outliving its killed parent would
# otherwise keep the copy "in use" for recover and sweeps).
_held: weakref.WeakSet[SaveDir] = weakref.WeakSet()


def after_fork_in_child() -> None:  # registered by _lifecycle
    for save_dir in list(_held):
        fd, save_dir._lock_fd = save_dir._lock_fd, None
        if fd is not None:
            close_quietly(fd)
    _held.clear()


def remove_tree(path: Path) -> None:
    """Remove a private staging directory; never raise (cleanup must not mask the real error)."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning("could not remove staging directory %s", path)


# -- the record --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """What a kept copy is part of: the ``whole`` save, rank ``rank`` of ``world_size``'s part of
    a ``collective`` commit (a world of one is the whole), or one rank's files of a ``dcp``
    save (never the whole: the coordinator writes DCP's .metadata once every rank's landed)."""

    of: Literal["whole", "collective", "dcp", "unknown"] = "whole"
    rank: int = 0
    world_size: int = 1

    @property
    def whole(self) -> bool:
        return self.of == "whole" or (self.of == "collective" and self.world_size == 1)

    def describe(self) -> str:
        if self.of == "unknown":
            return (
                "a checkpoint copy recorded by safestage 0.3 or older, which did not say whether it "
                "is the whole checkpoint or one rank's files of a DCP save (if it is a whole "
                "staged_dir checkpoint, copy its files into place and run safestage.commit_in_place)"
            )
        # world_size 0: recorded by safestage 0.3, which named no rank (_part).
        who = f"rank {self.rank} of {self.world_size}'s" if self.world_size else "one rank's (safestage 0.3 named none)"
        if self.of == "dcp":
            return (
                f"{who} files of a DCP save (DCP's .metadata, which every reader opens first, is "
                "written by the coordinator only once every rank's files have landed)"
            )
        return f"{who} part of a collective commit"

    def to_json(self) -> dict[str, Any]:
        return {"of": self.of, "rank": self.rank, "world_size": self.world_size}


WHOLE = Part()


@dataclass(frozen=True)
class JobIdentity:
    """Which job kept a copy: the default staging root is shared by every job of a user on a
    host, so a copy must say whose it is."""

    host: str
    pid: int
    command: str
    id: Optional[str] = None  # the scheduler's job id, if the environment names one

    def describe(self) -> str:
        job = f", job {self.id}" if self.id else ""
        return f"pid {self.pid} on {self.host}{job}: {self.command}"

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "command": self.command, "id": self.id}


# Environment variables that name a job, the first one set wins.
_JOB_VARIABLES = (
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "PBS_JOBID",
    "LSB_JOBID",
    "JOB_ID",
    "KUBERNETES_POD_NAME",
)


def this_job() -> JobIdentity:
    argv = (
        [os.path.basename(sys.argv[0]), *sys.argv[1:]]
        if sys.argv and sys.argv[0]
        else [sys.executable]
    )
    command = " ".join(argv)
    job_id = next((os.environ[name] for name in _JOB_VARIABLES if os.environ.get(name)), None)
    return JobIdentity(HOST, os.getpid(), command[:300], job_id)


def _destination_of(named: object) -> Optional[Destination]:
    """The destination a record names: an absolute path, or an object-store URL."""
    if not isinstance(named, str):
        return None
    try:
        url = url_of(named)
    except UnsupportedDestination:
        return None
    if url is not None:
        return url
    return Path(named) if os.path.isabs(named) else None


@dataclass(frozen=True)
class Record:
    """What a kept copy is for (``safestage-kept.json``, beside the copy in its save directory).

    ``local``: the copy's name in the save directory; ``kind``: "file" or "directory";
    ``left`` and ``landed``: its paths (relative to the copy) still to publish and already
    published; ``commit_file``: a commit file is still to write; ``started``: when the save
    began (a resumed commit keeps its place in the run's timeline); ``time``: when recorded."""

    destination: Destination
    local: str
    kind: Literal["file", "directory"]
    part: Part = WHOLE
    left: tuple[str, ...] = ()
    landed: tuple[str, ...] = ()
    commit_file: bool = False
    started: float = 0.0
    time: float = field(default_factory=time.time)
    error: Optional[str] = None
    job: JobIdentity = field(default_factory=this_job)
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "destination": str(self.destination),
            "local": self.local,
            "kind": self.kind,
            "part": self.part.to_json(),
            "left": sorted(self.left),
            "landed": sorted(self.landed),
            "commit_file": self.commit_file,
            "started": self.started,
            "time": self.time,
            "error": self.error,
            "job": self.job.to_json(),
        }


class RecordError(ValueError):
    """A record that cannot be used: what is wrong with it, and what it seemed to name (for
    people choosing what to do with the copy)."""

    def __init__(self, message: str, destination: Optional[str] = None, local: Optional[str] = None) -> None:
        super().__init__(message)
        self.destination, self.local = destination, local


def write_record(save_dir: Path, record: Record) -> None:
    """Write ``record`` beside the copy, atomically (a kill leaves the previous record whole).
    Best effort: a full staging root must not hide the error that kept the copy (the error
    names the copy itself)."""
    # The part file is named like safetensors' torn temp: a sweep knows it is no copy.
    target, part = save_dir / KEPT_RECORD, save_dir / ".tmpkeptjs"
    try:
        with open(part, "w", encoding="utf-8", errors="surrogateescape") as handle:
            json.dump(record.to_json(), handle, indent=1)
        os.replace(part, target)
    except (OSError, ValueError) as exc:
        log.debug("could not record what %s is for: %s", save_dir / record.local, exc)
        with contextlib.suppress(OSError):
            os.unlink(part)


def read_record(save_dir: Path) -> tuple[Optional[Record], Optional[RecordError]]:
    """(the record, None), (None, None) if there is none, or (None, why it cannot be used)."""
    try:
        with open(save_dir / KEPT_RECORD, "rb") as handle:
            data = handle.read(1 << 20)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, RecordError(f"its {KEPT_RECORD} cannot be read: [Errno {exc.errno}] {exc.strerror}")
    try:
        return parse_record(data), None
    except RecordError as exc:
        return None, RecordError(f"its {KEPT_RECORD} {exc}", exc.destination, exc.local)


def parse_record(data: bytes) -> Record:
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"is not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise RecordError(f'is not a safestage record (no "format": {FORMAT!r})')
    named, copy = document.get("destination"), document.get("local")
    seems = (
        named if _destination_of(named) is not None else None,
        copy if isinstance(copy, str) and copy not in ("", ".", "..") and "/" not in copy else None,
    )
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RecordError(f"has a bad version {version!r}", *seems)
    if version > VERSION:
        raise RecordError(
            f"was written by a newer safestage (version {version}; this one reads up to "
            f"{VERSION}): recover it with that safestage",
            *seems,
        )
    destination, local, kind = (
        document.get("destination"),
        document.get("local"),
        document.get("kind"),
    )
    where = _destination_of(destination)
    if where is None:
        raise RecordError(f"names no absolute destination ({destination!r})")
    if not isinstance(local, str) or local in ("", ".", "..") or "/" in local or "\x00" in local:
        raise RecordError(f"names no local copy inside it ({local!r})")
    if kind not in ("directory", "file"):
        raise RecordError(f"has an unknown kind {kind!r}")
    paths = {}
    for key in ("left", "landed"):
        value = document.get(key)
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise RecordError(f"has no list of paths {key!r}")
        paths[key] = tuple(value)
    recorded = document.get("time")
    if not isinstance(recorded, (int, float)) or isinstance(recorded, bool):
        raise RecordError("has no time")
    started = document.get("started", recorded)
    error = document.get("error")
    return Record(
        destination=where,
        local=local,
        kind=kind,
        part=_part(document, kind, version),
        left=paths["left"],
        landed=paths["landed"],
        commit_file=bool(document.get("commit_file", kind == "directory")),
        started=float(started)
        if isinstance(started, (int, float)) and not isinstance(started, bool)
        else float(recorded),
        time=float(recorded),
        error=error if isinstance(error, str) else None,
        job=_job(document.get("job")),
        version=version,
    )


def _part(document: dict[str, Any], kind: str, version: int) -> Part:
    if version == 1:
        # safestage 0.2 and 0.3: a collective commit's copy had "rank" and "world_size" at the
        # top; a directory copy without them may be a whole staged_dir checkpoint or one rank's
        # files of a 0.3 DCP save (its writers recorded neither, and their names do not tell:
        # the HuggingFace writer's shards look like any model's). A file is a file.
        if "rank" in document or "world_size" in document:
            return Part(
                "collective", _count(document.get("rank"), 0), _count(document.get("world_size"), 0)
            )
        return WHOLE if kind == "file" else Part("unknown", 0, 0)
    value = document.get("part")
    if not isinstance(value, dict) or value.get("of") not in ("whole", "collective", "dcp"):
        raise RecordError(f"says nothing valid of what the copy is part of ({value!r})")
    rank, world = _count(value.get("rank"), -1), _count(value.get("world_size"), -1)
    if rank < 0 or world < 1 or rank >= world:
        raise RecordError(f"names no rank of a world ({value!r})")
    return Part(value["of"], rank, world)


def _count(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _job(value: object) -> JobIdentity:
    if not isinstance(value, dict):
        return JobIdentity("?", 0, "unknown (recorded by safestage 0.3 or older)")
    host, pid, command, job_id = (value.get(key) for key in ("host", "pid", "command", "id"))
    return JobIdentity(
        host if isinstance(host, str) else "?",
        _count(pid, 0),
        command if isinstance(command, str) else "?",
        job_id if isinstance(job_id, str) else None,
    )


# -- one listing of a staging root -----------------------------------------------------------------


@dataclass
class Found:
    """A save directory in a staging root, as a listing sees it."""

    path: Path
    owner: Owner
    disposable: bool
    record: Optional[Record]
    problem: Optional[RecordError]  # why its record cannot be used

    @property
    def local(self) -> Path:
        """The kept copy itself (the save directory when no record names it)."""
        if self.record is not None:
            return self.path / self.record.local
        if self.problem is not None and self.problem.local is not None:
            return self.path / self.problem.local
        return self.path

    @property
    def destination(self) -> Optional[Destination]:
        """Where the copy was going, if its record (even one this safestage cannot use) says."""
        if self.record is not None:
            return self.record.destination
        if self.problem is not None and self.problem.destination is not None:
            return _destination_of(self.problem.destination)
        return None

    def content(self) -> Optional[str]:
        """The first entry that may be a complete copy, or None if it holds nothing worth
        keeping: disposable, or only safetensors' own torn temp files (``.tmpXXXXXX``, which
        0.8 renames to the final name once complete; safestage never stages under such a name)."""
        try:
            names = sorted(os.listdir(self.path))
        except OSError:
            return "entries it cannot list"  # do not guess
        if DISPOSABLE_MARKER in names:
            return None
        names = [name for name in names if name != KEPT_RECORD and name != ".tmpkeptjs"]
        # Only a regular file can be safetensors' temp: a directory of that name (a staged_dir
        # named so) holds a checkpoint.
        return next(
            (name for name in names if not (is_writer_temp(name) and _is_file(self.path / name))),
            None,
        )

    @contextlib.contextmanager
    def taken(self) -> Iterator[tuple[bool, str]]:
        """(gone, why) of its owner, holding its lock meanwhile when gone: nobody can claim it
        while the block removes or reads it."""
        with taken(self.path, directory=True) as locked:
            yield owner_gone(self.owner, locked, local=True)

    def take(self) -> tuple[Optional[SaveDir], str]:
        """Its lock, kept (a SaveDir the caller releases), if its owner is gone; else (None, why
        it is in use)."""
        fd, locked = try_lock(self.path, directory=True)
        if locked and self.owner.is_this_host() and self.owner.pid == os.getpid():
            # A copy this very process kept (its commit failed): the lock says it all.
            return SaveDir(self.path, fd), "kept by this process, which holds no lock on it any more"
        gone, why = owner_gone(self.owner, locked, local=True)
        if not gone or fd is None:
            if fd is not None:
                close_quietly(fd)
            return None, why
        return SaveDir(self.path, fd), why

    def describe(self) -> str:
        """What the copy is and whose, for people choosing what to do with it."""
        if self.record is None:
            return f"a copy of pid {self.owner.pid} on {self.owner.host}"
        what = "checkpoint" if self.record.kind == "directory" else "file"
        part = "" if self.record.part.whole else f" ({self.record.part.describe()})"
        return f"a {what} for {self.record.destination}{part}, kept by {self.record.job.describe()}"


def scan(root: Path) -> list[Found]:
    """Every save directory in the staging root ``root`` that this user owns, in name order.
    Raises OSError if ``root`` cannot be listed."""
    found: list[Found] = []
    for name in sorted(os.listdir(root)):
        owner = parse_stage_dir(name)
        if owner is None:
            continue
        path = root / name
        try:
            info = os.lstat(path)
            names = (
                os.listdir(path)
                if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
                else None
            )
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if names is None:
            continue  # not a directory, or another user's (0700: theirs to recover)
        record, problem = read_record(path) if KEPT_RECORD in names else (None, None)
        found.append(Found(path, owner, DISPOSABLE_MARKER in names, record, problem))
    return found


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False  # gone meanwhile, or cannot tell: keep the directory


# -- what the readers do with it -------------------------------------------------------------------


@dataclass(frozen=True)
class Swept:
    """One save directory and what a sweep did: "removed", "would-remove", "kept", "failed"."""

    found: Found
    action: str
    reason: str


def sweep(root: Path, *, dry_run: bool = False, warn_kept: bool = False) -> list[Swept]:
    """Remove the save directories in ``root`` whose owner is gone and that hold nothing worth
    keeping; keep, naming them, the kept copies. ``warn_kept``: an activation's sweep names the
    kept copies on stderr too, once per process and root, whatever the logging setup (a copy
    a killed job left is a checkpoint not at its destination). Raises OSError if ``root``
    cannot be listed."""
    results = []
    kept: list[Found] = []
    for found in scan(root):
        with found.taken() as (gone, why):
            if not gone:
                results.append(Swept(found, "kept", why))
                continue
            content = found.content()
            if content is not None:
                kept.append(found)
                results.append(
                    Swept(found, "kept", f"{why}, but it holds {content!r}: {_advice(root, found)}")
                )
                continue
            if dry_run:
                results.append(Swept(found, "would-remove", why))
                continue
            error = removal_error(found.path)
        results.append(Swept(found, "failed", f"{why}; removing it failed: {error}") if error
                       else Swept(found, "removed", why))  # fmt: skip
    if kept and warn_kept and root not in _warned:
        _warned.add(root)
        _say_kept(
            root,
            f"{len(kept)} kept cop{'y' if len(kept) == 1 else 'ies'} in the staging root {root}, "
            "the only complete copy of a save that did not land: "
            + "; ".join(f"{found.local} ({found.describe()})" for found in kept[:3])
            + ("; ..." if len(kept) > 3 else "")
            + f". safestage never publishes one on its own (newer checkpoints may exist since): "
            f"`safestage recover {root}` commits or publishes each, or says why not (--dry-run: "
            "only say; --dest PATH: only those for PATH)"
        )
    return results


_warned: set[Path] = set()  # roots whose kept copies this process has named on stderr


def _say_kept(root: Path, message: str) -> None:
    """Name the kept copies of ``root`` once per node and job, not once per rank (every rank
    of a node shares its root, and sweeps it at activation). A worker torchrun started
    (TORCHELASTIC_RUN_ID, as torch.distributed.is_torchelastic_launched() reads it) whose
    environment activates staging on this root says nothing: its launcher, a Python process
    with the same environment, activated on it at start-up and named them before starting
    it. Else local rank 0 of the node names them; another rank logs them at INFO."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None and _environment_root() == root:
        log.info("%s (named by torchrun's launcher at its start-up)", message)
    elif _loud.speaks_for_node():
        _loud.warning(message)
    else:
        log.info("%s (named by local rank 0)", message)


def _environment_root() -> Optional[Path]:
    """The staging root the environment activates on (what the start-up hook of any Python
    process with this environment checked and swept), or None."""
    from ._config import resolve, switched_on  # the start-up hook's own rule
    from ._paths import real_directory

    try:
        if not switched_on(os.environ):
            return None
        root = resolve(environ=os.environ).staging_root()
    except Exception:  # a bad variable: no launcher activated on it either
        return None
    return real_directory(root) or root  # as StagingRoot names it


def _advice(root: Path, found: Found) -> str:
    what = found.describe()
    if found.record is None:
        return (f"possibly the only complete copy of a save ({what}) whose publish did not "
                f"finish, with no record of where it was going: copy it to where it belongs, "
                f"then `safestage recover --discard {found.path}`")  # fmt: skip
    return (f"the only complete copy of {what}: {recover_command(root, found.record.destination)} "
            f"finishes it (or says why not); `safestage recover --discard {found.local}` deletes it")  # fmt: skip


def recover_command(root: Path, destination: Destination) -> str:
    """The command that finishes the kept copies in ``root`` meant for ``destination``."""
    return f"`safestage recover {root} --dest {destination}`"


def claims(roots: list[Path]) -> dict[Destination, str]:
    """{destination: why} of the commits in flight in ``roots``: save directories whose owner
    lives and whose record names a destination. A kept copy whose owner is gone claims
    nothing: it holds every file of its checkpoint (recover commits it whole), so removing what
    landed at the destination loses nothing, and an answer that depended on knowing the root
    the copy lies in would differ from one shell to the next."""
    found_claims: dict[Destination, str] = {}
    for root in roots:
        try:
            entries = scan(root)
        except OSError as exc:
            log.debug("cannot look for commits in flight in %s: %s", root, exc)
            continue
        for found in entries:
            if found.record is None:
                continue
            with found.taken() as (gone, _):
                pass
            if not gone:
                why = f"pid {found.owner.pid} is committing it (its staging directory {found.path} is locked)"
                found_claims.setdefault(found.record.destination, why)
    return found_claims


def discard(path: Path) -> Optional[str]:
    """Delete the kept copy at ``path`` (the copy, or its save directory), once its owner is
    gone; None when it is gone, else why it was not removed (nothing is touched then)."""
    save_dir = path if parse_stage_dir(path.name) is not None else path.parent
    owner = parse_stage_dir(save_dir.name)
    if owner is None:
        return f"{path} is not a copy kept in a staging root (no safestage-<host>-<pid>-<token> directory)"
    try:
        info = os.lstat(save_dir)
    except FileNotFoundError:
        return f"{save_dir} does not exist"
    except OSError as exc:
        return f"{save_dir} cannot be inspected: [Errno {exc.errno}] {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return f"{save_dir} is not a save directory of this user"
    with taken(save_dir, directory=True) as locked:
        gone, why = owner_gone(owner, locked, local=True)
        if not gone:
            return f"{save_dir} is in use: {why}"
        error = removal_error(save_dir)
    return None if error is None else f"removing {save_dir} failed: {error}"


def discard_for(staged_path: Optional[str]) -> bool:
    """Remove the copy a failed publish of this process kept (``PublishError.staged_path``),
    for a caller that knows the file is not wanted any more (the transformers Trainer deleted
    the checkpoint it was for). Only a save directory of ours; returns whether it is gone."""
    if staged_path is None:
        return False
    save_dir = Path(staged_path).parent
    if parse_stage_dir(save_dir.name) is None:
        return False
    remove_tree(save_dir)
    return not save_dir.exists()


def removal_error(path: Path, *, file: bool = False) -> Optional[str]:
    """Remove ``path`` (a directory tree, or a ``file``); what went wrong, said for a report,
    or None (removed, or already gone)."""
    try:
        if file:
            os.unlink(path)
        else:
            shutil.rmtree(path)  # refuses a symlink, never follows one inside
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"[Errno {exc.errno}] {exc.strerror}" + (
            f" ({exc.filename})" if exc.filename else ""
        )
    return None
