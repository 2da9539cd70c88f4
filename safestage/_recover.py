"""``safestage.recover()`` and `safestage recover [ROOT]`: finish, from the copies kept in a
staging root, the commits and publishes that did not finish.

A ``staged_dir`` commit keeps its complete local copy when it fails, and when its process is
killed after the block returned (preempted; the node survives): the save directory then
holds the checkpoint and ``safestage-kept.json`` (``_stage.record_kept``), written when the
commit starts and rewritten when it fails. A failed single-file publish keeps its file with
such a record too. For each kept copy whose owner is gone (nobody holds its lock, its pid
is not running here), recover:

- commits a directory to its recorded destination with the commit of ``staged_dir``
  (``_commit.commit_kept``: the destination's commit file removed first, every file
  published, the commit file last; the local copy removed once it landed);
- publishes a single file to its destination (``_stage.publish_local``).

It refuses, touching nothing, what it cannot do right: a destination whose parent is missing
(it never creates parents: on a mount point that is not mounted they would fill the local
disk), a destination holding a complete checkpoint (or a file) written after the copy was
kept (the newer save would be replaced by an older one), a destination a live process is
committing to, a copy whose files are not those its record lists, a record of a newer format
or without a destination, and a copy of one rank of a distributed commit (one node cannot
write that commit alone). A failed recover keeps the copy, its record rewritten, as a failed
commit does. Recover never runs on its own: an activation only names the kept copies in one
WARNING (``_stage._sweep_dead``).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

from . import _config
from ._clean import _kept_content, _process_alive
from ._config import PathArg, Settings
from ._errors import PublishError, StagingError
from ._locks import BUSY, close_quietly
from ._names import DISPOSABLE_MARKER, HOST, KEPT_RECORD, parse_stage_dir
from ._paths import real_directory
from ._stage import LocalCopy, SaveDir, StagingRoot, publish_local

log = logging.getLogger("safestage")

RECORD_FORMAT = "safestage.kept"
RECORD_VERSION = 1

Action = Literal[
    "committed", "published", "removed", "would-commit", "would-publish", "would-remove", "refused", "failed", "in-use"
]
ACTIONS: tuple[Action, ...] = (
    "committed", "published", "removed", "would-commit", "would-publish", "would-remove", "refused", "failed", "in-use"
)


@dataclass(frozen=True)
class Recovered:
    """One kept copy and what recover did with it. ``action``: "committed" (a checkpoint
    directory, complete at its destination now), "published" (a single file), "removed" (its
    files were already in the complete commit at its destination), "would-commit" /
    "would-publish" / "would-remove" (dry run), "refused" (nothing touched; ``reason`` says why and what to
    do), "failed" (``error``, the PublishError; the copy is kept, its record rewritten), or
    "in-use" (a live process holds it: not touched)."""

    local: Path
    destination: Optional[Path]
    action: Action
    reason: str
    error: Optional[PublishError] = None

    def to_json(self) -> dict[str, Any]:
        return {
            "local": str(self.local),
            "destination": None if self.destination is None else str(self.destination),
            "action": self.action,
            "reason": self.reason,
            "errno": None if self.error is None else self.error.errno,
        }


def recover(root: Optional[PathArg] = None, *, dry_run: bool = False) -> list[Recovered]:
    """Commit (a checkpoint directory) or publish (a single file) every copy kept in the
    staging root ``root`` (default SAFESTAGE_DIR, else $TMPDIR/safestage-<uid>) whose owner
    is gone, to the destination its record names; refuse, touching nothing, what cannot be
    done right. ``dry_run``: only say what would be done. Returns one Recovered per kept copy
    (live processes' copies as "in-use"), in name order. Raises StagingError if the root
    cannot be listed (a default root that does not exist holds nothing: [])."""
    settings = _config.resolve(root=root)
    path = settings.staging_root()
    is_default = settings.root is None
    if is_default and not os.path.lexists(path):
        return []
    staging: Optional[StagingRoot] = None
    if not dry_run:  # checked (local, writable, not planted) and swept as any activation does
        staging = StagingRoot(path, is_default=is_default, warn_kept=False)
        path = staging.path
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise StagingError(
            exc.errno,
            f"safestage recover: cannot list the staging root {path}: [Errno {exc.errno}] "
            f"{exc.strerror}: name the staging root the job used (SAFESTAGE_DIR or staged(root)).",
            str(path),
        ) from exc
    held: list[_Held] = []
    live: dict[Path, Path] = {}  # destination -> the save directory a live process commits it from
    results: list[Recovered] = []
    try:
        for name in names:
            found = _look(path / name)
            if isinstance(found, _Held):
                held.append(found)
            elif found is not None:
                results.append(found)
                if found.destination is not None:
                    live[found.destination] = found.local
        for item in held:
            results.append(_recover_one(item, settings, staging, live, dry_run))
    finally:
        for item in held:
            item.save_dir.release()  # a copy recovered released it already
    return sorted(results, key=lambda result: str(result.local))


# -- finding the kept copies --------------------------------------------------------------------


@dataclass
class _Held:
    """A kept copy whose save directory this process now holds the lock of."""

    save_dir: SaveDir
    record: Optional[dict[str, Any]]
    problem: Optional[str]  # why the record cannot be used, or None


def _look(directory: Path) -> Union[_Held, Recovered, None]:
    """A _Held kept copy (locked by us now), a Recovered "in-use" for one a live process holds,
    or None for anything that is no kept copy of ours (not a save directory, another user's,
    still being written, only torn temps)."""
    owner = parse_stage_dir(directory.name)
    if owner is None:
        return None
    try:
        info = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return None  # another user's copy is theirs to recover (it is 0700 anyway)
    try:
        if DISPOSABLE_MARKER in os.listdir(directory):
            return None  # still being written, or already committed: never a kept copy
    except OSError:
        return None
    record, problem = _read_record(directory)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        close_quietly(fd)
        if exc.errno not in BUSY:
            return None
        return _in_use(directory, record, "a live process holds its lock (saving or committing it now)")
    save_dir = SaveDir(directory, fd)
    mine = owner.host == HOST and owner.pid == os.getpid()  # a copy this process kept: the lock says it all
    if owner.host == HOST and not mine and _process_alive(owner.pid):
        save_dir.release()
        return _in_use(directory, record, f"its owner, pid {owner.pid}, is running (it may retry or raise it)")
    if DISPOSABLE_MARKER in os.listdir(directory) or _kept_content(directory) is None:
        save_dir.release()  # marked meanwhile, or only torn temps: the sweep's, not ours
        return None
    return _Held(save_dir, record, problem)


def _in_use(directory: Path, record: Optional[dict[str, Any]], why: str) -> Optional[Recovered]:
    if record is None:
        return None  # an ordinary save in progress: nothing kept
    destination = record.get("destination")
    return Recovered(
        directory / str(record.get("local", "")),
        Path(destination) if isinstance(destination, str) else None,
        "in-use",
        f"not touched: {why}",
    )


def _read_record(directory: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    try:
        with open(directory / KEPT_RECORD, "rb") as handle:
            data = handle.read(1 << 20)
    except FileNotFoundError:
        return None, (
            f"it has no {KEPT_RECORD}, so its destination is unknown (a copy kept by safestage "
            "before 0.2, or a single-file save killed while publishing): copy it to where it "
            "belongs by hand, then delete the directory"
        )
    except OSError as exc:
        return None, f"its {KEPT_RECORD} cannot be read: [Errno {exc.errno}] {exc.strerror}"
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        return None, f"its {KEPT_RECORD} is not valid JSON ({exc})"
    if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
        return None, f"its {KEPT_RECORD} is not a safestage record (no \"format\": {RECORD_FORMAT!r})"
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return document, f"its {KEPT_RECORD} has a bad version {version!r}"
    if version > RECORD_VERSION:
        return document, (
            f"its {KEPT_RECORD} was written by a newer safestage (version {version}; this one "
            f"reads up to {RECORD_VERSION}): recover it with that safestage"
        )
    return document, _record_problem(document)


def _record_problem(document: dict[str, Any]) -> Optional[str]:
    destination, local, kind = document.get("destination"), document.get("local"), document.get("kind")
    if not isinstance(destination, str) or not os.path.isabs(destination):
        return f"its {KEPT_RECORD} names no absolute destination ({destination!r})"
    if not isinstance(local, str) or local in ("", ".", "..") or "/" in local or "\x00" in local:
        return f"its {KEPT_RECORD} names no local copy inside it ({local!r})"
    if kind not in ("directory", "file"):
        return f"its {KEPT_RECORD} has an unknown kind {kind!r}"
    for key in ("left", "landed"):
        paths = document.get(key)
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            return f"its {KEPT_RECORD} has no list of paths {key!r}"
    if not isinstance(document.get("time"), (int, float)):
        return f"its {KEPT_RECORD} has no time"
    world = document.get("world_size")
    if "rank" in document or (world is not None and world != 1):
        # The distributed commits issue: one rank's copy is part of a checkpoint that every
        # rank commits together; this node alone cannot write that commit file.
        return (
            f"it is rank {document.get('rank', '?')}'s part of a distributed commit of "
            f"{world or '?'} ranks: a single node cannot write that commit alone; re-run the "
            "save (or resume from the last complete checkpoint), then delete the directory"
        )
    return None


# -- recovering one copy ------------------------------------------------------------------------


def _recover_one(
    item: _Held, settings: Settings, staging: Optional[StagingRoot], live: dict[Path, Path], dry_run: bool
) -> Recovered:
    directory = item.save_dir.path
    record = item.record or {}
    destination = record.get("destination")
    dest = Path(destination) if isinstance(destination, str) else None
    local = directory / str(record.get("local")) if isinstance(record.get("local"), str) else directory

    def refused(why: str) -> Recovered:
        return Recovered(local, dest, "refused", f"{why}. Nothing was touched; the copy is kept")

    if dest is not None and record.get("kind") == "directory" and _landed_already(dest, local, record):
        # Its process ended after the commit file landed, before the copy was removed (a rank
        # of a distributed commit killed at its last step, say): nothing is left to do.
        if dry_run:
            return Recovered(local, dest, "would-remove", f"its files are in the complete commit of {dest}: "
                             "the copy would be removed")  # fmt: skip
        from ._commit import _discard

        _discard(item.save_dir, local)
        return Recovered(local, dest, "removed", f"its files are in the complete commit of {dest} (it "
                         "landed before the copy's process ended): the copy was removed")  # fmt: skip
    if item.problem is not None or dest is None:
        return refused(item.problem or f"its {KEPT_RECORD} names no destination")
    why = _destination_problem(dest, record, live)
    if why is not None:
        return refused(why)
    if record["kind"] == "directory":
        return _recover_directory(item, local, dest, record, settings, staging, dry_run, refused)
    return _recover_file(item, local, dest, settings, staging, dry_run, refused)


def _destination_problem(dest: Path, record: dict[str, Any], live: dict[Path, Path]) -> Optional[str]:
    if dest in live:
        return f"a live process is committing {dest} from {live[dest]}: let it finish, then look again"
    parent = dest.parent
    if real_directory(str(parent)) is None:
        return (
            f"the parent directory of {dest} does not exist (or is not a directory): mount or "
            "create it, then run recover again. recover never creates it: on a mount point that "
            "is not mounted it would fill the local disk"
        )
    kind = record["kind"]
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{dest} cannot be inspected: [Errno {exc.errno}] {exc.strerror}"
    kept_at = float(record["time"])
    if kind == "directory":
        if not stat.S_ISDIR(info.st_mode):
            return f"{dest} is not a directory (a file or a symlink is in the way): remove it first"
        newer = _newer_commit(dest, kept_at)
        if newer is not None:
            return (
                f"{dest} holds a complete checkpoint committed {newer}, after this copy was kept "
                f"({_when(kept_at)}): a newer save of it would be replaced by an older one. "
                "Delete the copy if the newer one is what you want"
            )
        return None
    if not stat.S_ISREG(info.st_mode):
        return f"{dest} is not a regular file: remove it first"
    if info.st_mtime > kept_at:
        return (
            f"{dest} was written {_when(info.st_mtime)}, after this copy was kept "
            f"({_when(kept_at)}): a newer save of it would be replaced by an older one. "
            "Delete the copy if the newer file is what you want"
        )
    return None


def _newer_commit(dest: Path, kept_at: float) -> Optional[str]:
    """When ``dest``'s complete checkpoint was committed, if that is after ``kept_at``."""
    from ._verify import check, read_commit

    manifest, _, mtime = read_commit(dest)
    if manifest is None or not check(dest, manifest, deep=False).complete:
        return None  # nothing complete to lose: the commit replaces what is there
    committed = mtime
    with contextlib.suppress(ValueError):
        committed = datetime.datetime.fromisoformat(manifest.committed_at).timestamp()
    return _when(committed) if committed > kept_at else None


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="seconds")


def _landed_already(dest: Path, local: Path, record: dict[str, Any]) -> bool:
    """Whether ``dest`` is complete, its commit file lists every file the record names, and
    every one of them still in ``local`` with the same size and CRC-32 (read here; a publish
    by rename moved the others): then the copy is redundant."""
    import zlib

    from ._commit import _walk
    from ._verify import verify

    try:
        result = verify(dest)
        if not result.complete or result.manifest is None:
            return False
        listed = {entry.path: entry for entry in result.manifest.files}
        named = [*record.get("left", []), *record.get("landed", [])]
        if not named or any(path not in listed for path in named):
            return False
        tree = _walk(local, dest)
        for path, size in tree.files:
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
    item: _Held,
    local: Path,
    dest: Path,
    record: dict[str, Any],
    settings: Settings,
    staging: Optional[StagingRoot],
    dry_run: bool,
    refused: Callable[[str], Recovered],
) -> Recovered:
    from ._commit import _check_destination, _walk, commit_kept

    if not local.is_dir() or local.is_symlink():
        return refused(f"its copy {local} is missing or not a directory")
    try:
        tree = _walk(local, dest)
        _check_destination(dest, tree)
    except PublishError as exc:
        return refused(str(exc).split(" Nothing was published")[0].rstrip("."))
    except OSError as exc:
        return refused(f"its copy cannot be read: [Errno {exc.errno}] {exc.strerror} ({exc.filename})")
    have = {path for path, _ in tree.files}
    want = set(record["left"]) | set(record["landed"])
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        moved = [path for path in missing if path in record["landed"]]
        return refused(
            "its files are not those its record lists"
            + (f": {len(missing)} missing ({_some(missing)})" if missing else "")
            + (f"; {len(extra)} not in the record ({_some(extra)})" if extra else "")
            + (" (a commit on the staging root's own filesystem moves the files that landed)" if moved else "")
            + ": it cannot be committed as it was saved; re-run the save"
        )
    size = sum(nbytes for _, nbytes in tree.files)
    if dry_run:
        return Recovered(local, dest, "would-commit", f"would commit {len(tree.files)} files, {size} bytes to {dest}")
    assert staging is not None
    started = time.perf_counter()
    try:
        manifest = commit_kept(dest, item.save_dir, local, settings, staging)
    except PublishError as exc:
        if exc.step in ("scan", "inspect"):  # in the way since we looked: kept (_KeptCommit)
            return refused(str(exc).split(" Nothing was published")[0].rstrip("."))
        return Recovered(local, dest, "failed", f"{exc} (the copy is kept; its record says what landed)", exc)
    log.info("recovered %s: committed %d files, %d bytes from %s", dest, len(manifest.files), size, local)
    return Recovered(
        local, dest, "committed",
        f"committed {len(manifest.files)} files, {manifest.total_bytes} bytes in "
        f"{time.perf_counter() - started:.1f} s; the copy was removed",
    )  # fmt: skip


def _recover_file(
    item: _Held,
    local: Path,
    dest: Path,
    settings: Settings,
    staging: Optional[StagingRoot],
    dry_run: bool,
    refused: Callable[[str], Recovered],
) -> Recovered:
    try:
        info = os.lstat(local)
    except OSError:
        return refused(f"its copy {local} is missing: re-run the save")
    if not stat.S_ISREG(info.st_mode):
        return refused(f"its copy {local} is not a regular file")
    if dry_run:
        return Recovered(local, dest, "would-publish", f"would publish {info.st_size} bytes to {dest}")
    assert staging is not None
    copy = LocalCopy(item.save_dir, local, dest, time.perf_counter(), 0.0)
    try:
        published = publish_local(copy, settings, staging)
    except PublishError as exc:
        return Recovered(local, dest, "failed", f"{exc} (the copy is kept)", exc)
    except OSError as exc:  # the copy vanished meanwhile (StagingError)
        return Recovered(local, dest, "failed", str(exc), PublishError(exc.errno, str(exc), str(local)))
    log.info("recovered %s: published %d bytes from %s", dest, published.bytes, local)
    return Recovered(
        local, dest, "published",
        f"published {published.bytes} bytes ({published.publish}); the copy was removed",
    )  # fmt: skip


def _some(paths: list[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return shown if len(paths) <= limit else f"{shown} and {len(paths) - limit} more"

