"""``safestage.recover()`` and `safestage recover [ROOT]`: finish, from the copies kept in a
staging root, the commits and publishes that did not finish.

A commit keeps its complete local copy when it fails, and when its process is killed after
its block returned (preempted; the node survives); a failed single-file publish keeps its
file. Each such copy has a record (``_kept.Record``) saying where it was going, what landed,
which job kept it, and what it is part of. For each kept copy whose owner is gone (nobody
holds its lock, its pid is not running here), recover:

- commits a whole checkpoint to its recorded destination with the one commit sequence,
  resumed from its checks (``_sequence.Commit.resume``: the destination's commit file removed
  first, every file published, the commit file last; the local copy removed once it landed);
- publishes a single file to its destination (``_stage.publish_local``);
- removes a copy whose files are all in the complete commit at its destination already (its
  process ended after the commit file landed, before the copy was removed).

It refuses, touching nothing, what it cannot do right: a part of a checkpoint (one rank's part
of a collective commit, one rank's files of a DCP save, whose ``.metadata`` only the
coordinator writes: no staging root holds the whole, by construction of the record), a
destination whose parent is missing (it never creates parents: on a mount point that is not
mounted they would fill the local disk), a destination holding a complete checkpoint (or a
file) written after the copy was kept (the newer save would be replaced by an older one), a
destination a live process is committing to, a copy whose files are not those its record
lists, and a record it cannot read. Each refusal says why and gives the command that deletes
the copy (``--discard``). A failed recover keeps the copy, its record rewritten, as a failed
commit does. Recover never runs on its own: an activation only names the kept copies.

A copy bound for an object-store URL is recovered the same way, through the store family: the
checkpoint is committed to its prefix (the previous commit object deleted first, every object
uploaded, the commit object created last), a file uploaded to its key. A missing bucket is
refused as a missing parent is (create it, then run recover again); a complete commit object
there written after the copy was kept, or an object at a file's key modified since, is refused
as a newer save is on a path.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import stat
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

from .. import _config, _object_store
from .._config import PathArg, Settings
from .._destination import Destination, ObjectURL, url_of
from .._errors import PublishError, StagingError
from .._kept import Found, Record, SaveDir, discard, scan
from .._paths import real_directory
from .._stage import LocalCopy, StagingRoot, publish_local
from ._sequence import Alone, Commit, check_destination, land, refused, some, walk

log = logging.getLogger("safestage")

Action = Literal[
    "committed",
    "published",
    "removed",
    "would-commit",
    "would-publish",
    "would-remove",
    "refused",
    "failed",
    "in-use",
]
ACTIONS: tuple[Action, ...] = (
    "committed",
    "published",
    "removed",
    "would-commit",
    "would-publish",
    "would-remove",
    "refused",
    "failed",
    "in-use",
)


@dataclass(frozen=True)
class Recovered:
    """One kept copy and what recover did with it. ``action``: "committed" (a checkpoint
    directory, complete at its destination now), "published" (a single file), "removed" (its
    files were already in the complete commit at its destination), "would-commit" /
    "would-publish" / "would-remove" (dry run), "refused" (nothing touched; ``reason`` says why
    and what to do), "failed" (``error``, the PublishError; the copy is kept, its record
    rewritten), or "in-use" (a live process holds it: not touched). ``job`` says which job kept
    it (the default staging root is shared by every job of a user on a host)."""

    local: Path
    destination: Optional[Destination]
    action: Action
    reason: str
    error: Optional[PublishError] = None
    job: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        return {
            "local": str(self.local),
            "destination": None if self.destination is None else str(self.destination),
            "action": self.action,
            "reason": self.reason,
            "errno": None if self.error is None else self.error.errno,
            "job": self.job,
        }


def recover(
    root: Optional[PathArg] = None,
    *,
    dry_run: bool = False,
    dest: Optional[Union[PathArg, ObjectURL]] = None,
) -> list[Recovered]:
    """Commit (a whole checkpoint) or publish (a single file) every copy kept in the staging
    root ``root`` (default SAFESTAGE_DIR, else $TMPDIR/safestage-<uid>) whose owner is gone,
    to the destination its record names; refuse, touching nothing, what cannot be done right.
    ``dest``: only the copies whose destination is ``dest`` (a path or a URL) or lies under it. ``dry_run``:
    only say what would be done. Returns one Recovered per kept copy (live processes' copies
    as "in-use"), in name order. Raises StagingError if the root cannot be listed (a default
    root that does not exist holds nothing: [])."""
    settings = _config.resolve(root=root)
    path = settings.staging_root()
    if settings.root is None and not os.path.lexists(path):
        return []
    if not dry_run:  # checked (local, writable, not planted) and swept as any activation does
        path = StagingRoot(path, is_default=settings.root is None, warn_kept=False).path
    only: Optional[Destination] = None
    if dest is not None:
        only = url_of(dest)
        if only is None:
            assert not isinstance(dest, ObjectURL)
            only = _kernel_path(dest)
    try:
        entries = scan(path)
    except OSError as exc:
        raise StagingError(
            exc.errno,
            f"safestage recover: cannot list the staging root {path}: [Errno {exc.errno}] "
            f"{exc.strerror}: name the staging root the job used (SAFESTAGE_DIR or staged(root)).",
            str(path),
        ) from exc
    chosen = [found for found in entries if _chosen(found, only)]
    live: dict[Destination, Path] = {}  # destination -> the copy a live process commits it from
    held: list[tuple[Found, SaveDir]] = []
    results: list[Recovered] = []
    try:
        for found in chosen:
            if found.disposable:
                continue  # still being written, or already committed: never a kept copy
            save_dir, why = found.take()
            if save_dir is None:
                if found.record is not None:  # an ordinary save in progress has none: nothing kept
                    live[found.record.destination] = found.local
                    results.append(_result(found, "in-use", f"not touched: {why}"))
                continue
            if found.content() is None:
                save_dir.release()  # only torn temps: the sweep's, not ours
                continue
            held.append((found, save_dir))
        for found, save_dir in held:
            results.append(_recover_one(found, save_dir, settings, live, dry_run))
    finally:
        for _, save_dir in held:
            save_dir.release()  # a copy recovered released it already
    return sorted(results, key=lambda result: str(result.local))


def _kernel_path(path: PathArg) -> Path:
    """``--dest`` as the records name destinations (the kernel's path), whether or not it still
    exists (retention may have removed the checkpoint since): its nearest existing ancestor
    resolved, the rest as given."""
    text = os.path.abspath(os.fspath(path))
    head, tail = text, list[str]()
    while True:
        real = real_directory(head)
        if real is not None:
            return real.joinpath(*reversed(tail))
        head, name = os.path.split(head)
        if not name:
            return Path(text)
        tail.append(name)


def _chosen(found: Found, only: Optional[Destination]) -> bool:
    """Whether ``--dest`` ``only`` takes ``found``: by the destination its record names, even a
    record this safestage cannot use (a newer version), which is then refused as a plain
    recover refuses it, never passed over as "no kept copy"."""
    if only is None:
        return True
    destination = found.destination
    if destination is None:
        return False  # no record, or one naming no destination: whose it is cannot be told
    return destination == only or only in destination.parents


def _result(
    found: Found, action: Action, reason: str, error: Optional[PublishError] = None
) -> Recovered:
    record = found.record
    return Recovered(found.local, found.destination, action, reason, error,
                     None if record is None else record.job.describe())  # fmt: skip


# -- recovering one copy ------------------------------------------------------------------------


def _recover_one(
    found: Found, save_dir: SaveDir, settings: Settings, live: dict[Destination, Path], dry_run: bool
) -> Recovered:
    record = found.record
    local = found.local

    def refusal(why: str) -> Recovered:
        return _result(found, "refused", f"{why}. Nothing was touched; the copy is kept: `safestage recover "
                                         f"--discard {local}` deletes it")  # fmt: skip

    if record is None:
        return refusal(str(found.problem) if found.problem is not None else (
            "it has no record of where it was going (a copy kept by safestage before 0.2, or a "
            "single-file save killed while publishing): copy it to where it belongs by hand"))  # fmt: skip
    dest = record.destination
    if record.kind == "directory" and _landed_already(dest, local, record):
        # Its process ended after the commit file landed, before the copy was removed (a rank
        # of a collective commit killed at its last step, say): nothing is left to do.
        if dry_run:
            return _result(found, "would-remove", f"its files are in the complete commit of {dest}: the "
                           "copy would be removed")  # fmt: skip
        save_dir.remove()
        return _result(found, "removed", f"its files are in the complete commit of {dest} (it landed "
                       "before the copy's process ended): the copy was removed")  # fmt: skip
    if record.part.of == "unknown":
        return refusal(f"it is {record.part.describe()}")
    if not record.part.whole:
        # One rank's files are not the checkpoint: committing them alone would make a checkpoint
        # that verifies complete and that no reader can load (a DCP save without .metadata).
        return refusal(f"it is {record.part.describe()}: no staging root holds the whole checkpoint, so "
                       "it cannot be committed from here; re-run the save (or resume from the last "
                       "complete checkpoint)")  # fmt: skip
    why = _destination_problem(dest, record, live)
    if why is not None:
        return refusal(why)
    if record.kind == "directory":
        return _recover_directory(found, save_dir, local, record, settings, dry_run, refusal)
    return _recover_file(found, save_dir, local, record, settings, dry_run, refusal)


def _destination_problem(dest: Destination, record: Record, live: dict[Destination, Path]) -> Optional[str]:
    if dest in live:
        return (
            f"a live process is committing {dest} from {live[dest]}: let it finish, then look again"
        )
    if isinstance(dest, ObjectURL):
        return _object_problem(dest, record)
    if real_directory(str(dest.parent)) is None:
        return (
            f"the parent directory of {dest} does not exist (or is not a directory): mount or "
            "create it, then run recover again. recover never creates it: on a mount point that "
            "is not mounted it would fill the local disk"
        )
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{dest} cannot be inspected: [Errno {exc.errno}] {exc.strerror}"
    if record.kind == "directory":
        if not stat.S_ISDIR(info.st_mode):
            return f"{dest} is not a directory (a file or a symlink is in the way): remove it first"
        newer = _newer_commit(dest, record.time)
        if newer is not None:
            return (
                f"{dest} holds a complete checkpoint committed {newer}, after this copy was kept "
                f"({_when(record.time)}): a newer save of it would be replaced by an older one. "
                "Delete the copy if the newer one is what you want"
            )
        return None
    if not stat.S_ISREG(info.st_mode):
        return f"{dest} is not a regular file: remove it first"
    if info.st_mtime > record.time:
        return (
            f"{dest} was written {_when(info.st_mtime)}, after this copy was kept "
            f"({_when(record.time)}): a newer save of it would be replaced by an older one. "
            "Delete the copy if the newer file is what you want"
        )
    return None


def _object_problem(dest: ObjectURL, record: Record) -> Optional[str]:
    """``_destination_problem`` of a URL: the store is asked what is there (a LIST of the
    checkpoint's prefix, or a HEAD of the file's key); a bucket that cannot be reached is
    refused as a missing parent is."""
    try:
        if record.kind == "directory":
            newer = _newer_commit(dest, record.time)
            modified = None
        else:
            newer = None
            info = _object_store.head(dest)
            modified = None if info is None else info.modified
    except OSError as exc:
        return (f"{dest} cannot be inspected: {exc} Nothing is uploaded until the store answers: "
                "create the bucket (or fix the credentials), then run recover again")  # fmt: skip
    if newer is not None:
        return (f"{dest} holds a complete checkpoint committed {newer}, after this copy was kept "
                f"({_when(record.time)}): a newer save of it would be replaced by an older one. "
                "Delete the copy if the newer one is what you want")  # fmt: skip
    if modified is not None and modified > record.time:
        return (f"{dest} was written {_when(modified)}, after this copy was kept ({_when(record.time)}): "
                "a newer save of it would be replaced by an older one. Delete the copy if the newer "
                "object is what you want")  # fmt: skip
    return None


def _newer_commit(dest: Destination, kept_at: float) -> Optional[str]:
    """When ``dest``'s complete checkpoint was committed, if that is after ``kept_at``. A URL:
    one LIST of its prefix, one GET of its commit object (the store's OSError raised)."""
    from ._verify import check, check_objects, listed_below, read_commit, read_commit_object

    if isinstance(dest, ObjectURL):
        listed = listed_below(dest)
        manifest, problem, mtime = read_commit_object(dest, listed)
        if problem is not None and problem.kind == "unreadable":
            raise PublishError(errno.EIO, problem.message, str(dest))
        complete = manifest is not None and check_objects(dest, manifest, listed, deep=False).complete
    else:
        manifest, _, mtime = read_commit(dest)
        complete = manifest is not None and check(dest, manifest, deep=False).complete
    if manifest is None or not complete:
        return None  # nothing complete to lose: the commit replaces what is there
    committed = mtime
    with contextlib.suppress(ValueError):
        committed = datetime.datetime.fromisoformat(manifest.committed_at).timestamp()
    return _when(committed) if committed > kept_at else None


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )


def _landed_already(dest: Destination, local: Path, record: Record) -> bool:
    """Whether ``dest`` is complete, its commit file lists every file the record names, and
    every one of them still in ``local`` with the same size and CRC-32 (read here; a publish
    by rename moved the others): then the copy is redundant."""
    from ._verify import verify

    try:
        result = verify(dest)
        if not result.complete or result.manifest is None:
            return False
        listed = {entry.path: entry for entry in result.manifest.files}
        named = [*record.left, *record.landed]
        if not named or any(path not in listed for path in named):
            return False
        for path, size in walk(local, dest).files:
            entry = listed.get(path)
            if entry is None or entry.size != size:
                return False
            digest = 0
            with open(local / path, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest = zlib.crc32(chunk, digest)
            if f"{digest:08x}" != entry.digest:
                return False
        return True
    except (OSError, PublishError, ValueError):
        return False


def _recover_directory(
    found: Found,
    save_dir: SaveDir,
    local: Path,
    record: Record,
    settings: Settings,
    dry_run: bool,
    refusal: Callable[[str], Recovered],
) -> Recovered:
    dest = record.destination
    if not local.is_dir() or local.is_symlink():
        return refusal(f"its copy {local} is missing or not a directory")
    try:
        tree = walk(local, dest)
        if isinstance(dest, Path):  # a bucket holds no directory, symlink or FIFO in the way
            check_destination(dest, tree)
    except PublishError as exc:
        return refusal(str(exc).split(" Nothing was published")[0].rstrip("."))
    except OSError as exc:
        return refusal(
            f"its copy cannot be read: [Errno {exc.errno}] {exc.strerror} ({exc.filename})"
        )
    have = set(tree.paths)
    want = set(record.left) | set(record.landed)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        moved = [path for path in missing if path in record.landed]
        return refusal(
            "its files are not those its record lists"
            + (f": {len(missing)} missing ({some(missing)})" if missing else "")
            + (f"; {len(extra)} not in the record ({some(extra)})" if extra else "")
            + (
                " (a commit on the staging root's own filesystem moves the files that landed)"
                if moved
                else ""
            )
            + ": it cannot be committed as it was saved; re-run the save"
        )
    size = sum(nbytes for _, nbytes in tree.files)
    if dry_run:
        return _result(
            found, "would-commit", f"would commit {len(tree.files)} files, {size} bytes to {dest}"
        )
    started = time.perf_counter()
    commit = Commit.resume(record, save_dir, settings)
    try:
        commit.hand_off(tree)  # its record rewritten: a recover killed now is recovered again
        manifest = land(commit, Alone(), tree, tree)
    except PublishError as exc:
        if refused(exc):  # in the way since we looked: kept (a resumed commit's refusal)
            return refusal(str(exc).split(" Nothing was published")[0].rstrip("."))
        return _result(
            found, "failed", f"{exc} (the copy is kept; its record says what landed)", exc
        )
    log.info(
        "recovered %s: committed %d files, %d bytes from %s", dest, len(manifest.files), size, local
    )
    return _result(
        found, "committed",
        f"committed {len(manifest.files)} files, {manifest.total_bytes} bytes in "
        f"{time.perf_counter() - started:.1f} s; the copy was removed",
    )  # fmt: skip


def _recover_file(
    found: Found,
    save_dir: SaveDir,
    local: Path,
    record: Record,
    settings: Settings,
    dry_run: bool,
    refusal: Callable[[str], Recovered],
) -> Recovered:
    dest = record.destination
    try:
        info = os.lstat(local)
    except OSError:
        return refusal(f"its copy {local} is missing: re-run the save")
    if not stat.S_ISREG(info.st_mode):
        return refusal(f"its copy {local} is not a regular file")
    if dry_run:
        return _result(found, "would-publish", f"would publish {info.st_size} bytes to {dest}")
    from .. import _save

    staging = _save.staging_root(settings)
    copy = LocalCopy(save_dir, local, dest, time.perf_counter(), 0.0)
    try:
        published = publish_local(copy, settings, staging)
    except PublishError as exc:
        return _result(found, "failed", f"{exc} (the copy is kept)", exc)
    except OSError as exc:  # the copy vanished meanwhile (StagingError)
        return _result(found, "failed", str(exc), PublishError(exc.errno, str(exc), str(local)))
    log.info("recovered %s: published %d bytes from %s", dest, published.bytes, local)
    return _result(
        found,
        "published",
        f"published {published.bytes} bytes ({published.publish}); the copy was removed",
    )


def discard_copy(path: PathArg) -> Optional[str]:
    """`safestage recover --discard PATH`: delete the kept copy at ``path`` once its owner is
    gone; None when done, else why not."""
    return discard(Path(os.path.abspath(os.fspath(path))))
