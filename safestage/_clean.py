"""`safestage clean PATH`: remove safestage's own leftovers whose owner process is gone.

Looks at the entries of PATH: a destination directory holds the sibling temp files of
`replace` (``.<name>.safestage-<host>-<pid>-<token>.tmp``) and any `safestage doctor` probe
directory (``.safestage-doctor-<host>-<pid>-<token>``); a staging root holds the per-save
directories (``safestage-<host>-<pid>-<token>``). ``recursive`` (the command, and every
re-commit of a checkpoint) also looks for temp files, and only those, in every subdirectory:
a commit killed while publishing ``shards/s0.bin`` leaves ``shards/.s0.bin.safestage-...tmp``.
It never follows a symlink and never enters a staging or probe directory. Nothing else is
ever touched: a name must match those patterns exactly (see _names), and have the file type
safestage creates (a regular file, a directory; never a symlink).

An entry is removed only when its owner is gone. A live owner holds a flock on its entry
(``_locks``), which is seen across PID namespaces, so an entry that cannot be locked is
kept. A staging root is local, so its lock is the whole answer; beside a destination the
lock counts only for entries made on this host (another host's kernel keeps its own locks),
and where the filesystem has no locks, liveness cannot be checked: another host's entries,
and this host's on such filesystems, are removed only with ``older_than`` and an mtime
older than that. A pid of this host that is still running also keeps an entry (it may be
a pid reused by another process: that only delays the cleanup).

A staging directory that holds anything but safetensors' own torn temp (``.tmpXXXXXX``)
is never removed, whatever its owner: a failed or interrupted publish keeps the only
complete copy there (its PublishError says so), and so does a crash while publishing.
Only the user, naming it, deletes a kept copy. The one exception is a ``staged_dir``
directory marked ``safestage-disposable``: its owner died while the checkpoint was still
being written into it (never complete), or after the commit had landed (published). A kept
copy's ``safestage-kept.json`` (``_stage.record_kept``) says which destination it was for.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from ._locks import taken
from ._names import (
    DISPOSABLE_MARKER,
    KEPT_RECORD,
    Owner,
    is_writer_temp,
    parse_doctor_dir,
    parse_stage_dir,
    parse_temp_name,
)

log = logging.getLogger("safestage")

# What each kind of leftover is, and the file type safestage creates for it ("directory": a
# subdirectory a recursive clean could not list).
KINDS = {
    "temp": "temp file",
    "staging-dir": "staging directory",
    "doctor-dir": "doctor probe directory",
    "directory": "directory",
}


@dataclass(frozen=True)
class Entry:
    """One leftover and what was done with it: action is "removed", "would-remove" (dry
    run), "kept" or "failed"; reason says why. ``name`` is relative to the directory cleaned;
    ``destination``, for a kept copy that recorded it, is where that copy was to go."""

    name: str
    kind: str
    host: str
    pid: int
    action: str
    reason: str
    destination: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def clean(
    directory: Path,
    *,
    dry_run: bool = False,
    older_than: Optional[float] = None,
    now: Optional[float] = None,
    recursive: bool = False,
    temps_only: bool = False,
) -> list[Entry]:
    """Remove (or with ``dry_run`` list) the dead leftovers among the entries of ``directory``;
    ``recursive``: and the dead temp files in its subdirectories. ``temps_only``: temp files
    alone (a commit cleaning its destination). Raises OSError if ``directory`` cannot be
    listed; a subdirectory that cannot be is a "failed" entry."""
    clock = time.time() if now is None else now
    entries = []
    with os.scandir(directory) as listing:
        found = [(item.name, item.is_dir(follow_symlinks=False)) for item in listing]
    stack = [("", found)]
    while stack:
        prefix, items = stack.pop()
        for name, is_dir in sorted(items):
            relative = f"{prefix}{name}"
            match = _classify(name)
            if match is None:
                if recursive and is_dir:
                    try:
                        with os.scandir(directory / relative) as listing:
                            below = [(item.name, item.is_dir(follow_symlinks=False)) for item in listing]
                    except OSError as exc:
                        entries.append(Entry(relative, "directory", "", 0, "failed",
                                             f"cannot list it: [Errno {exc.errno}] {exc.strerror}"))  # fmt: skip
                        continue
                    stack.append((f"{relative}/", below))
                continue  # not ours: never looked at again
            kind, owner = match
            if kind != "temp" and (prefix or temps_only):
                continue  # below the top, only temp files are safestage's to clean
            entries.append(_handle(directory / relative, relative, kind, owner, dry_run, older_than, clock))
    return sorted(entries, key=lambda entry: entry.name)


def remove_dead_temps(directory: Path) -> dict[str, str]:
    """Before a commit of the checkpoint ``directory``: remove the temp files that killed
    safestage writers left in it and below (``clean``'s rules). Returns why each remaining
    temp file stays ({relative path: reason}); never raises (the commit does not depend on it)."""
    try:
        entries = clean(directory, recursive=True, temps_only=True)
    except OSError as exc:
        log.warning("%s: could not look for dead temp files: %s", directory, exc)
        return {}
    for entry in entries:
        log.debug("%s: %s", directory, entry.to_json())
    return {entry.name: entry.reason for entry in entries if entry.action != "removed"}


def _classify(name: str) -> Optional[tuple[str, Owner]]:
    for kind, parse in (
        ("temp", parse_temp_name),
        ("staging-dir", parse_stage_dir),
        ("doctor-dir", parse_doctor_dir),
    ):
        owner = parse(name)
        if owner is not None:
            return kind, owner
    return None


def _handle(
    path: Path, name: str, kind: str, owner: Owner, dry_run: bool, older_than: Optional[float], now: float
) -> Entry:
    destination: Optional[str] = None

    def entry(action: str, reason: str) -> Entry:
        return Entry(name, kind, owner.host, owner.pid, action, reason, destination)

    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return entry("kept", "vanished while cleaning (its owner finished?)")
    except OSError as exc:
        return entry("failed", f"cannot inspect it: [Errno {exc.errno}] {exc.strerror}")
    wanted = stat.S_ISREG if kind == "temp" else stat.S_ISDIR
    if not wanted(info.st_mode):
        return entry(
            "kept",
            f"not a {'regular file' if kind == 'temp' else 'directory'}: safestage did not make it",
        )
    if kind == "staging-dir":
        destination = kept_destination(path)
    with taken(path, directory=kind != "temp") as locked:
        gone, reason = _owner_gone(kind, owner, locked, info.st_mtime, older_than, now)
        if not gone:
            return entry("kept", reason)
        if kind == "staging-dir":
            content = _kept_content(path)
            if content is not None:
                where = "its destination" if destination is None else destination
                return entry(
                    "kept",
                    f"{reason}, but it holds {content!r}, possibly the only complete copy of a "
                    f"save{'' if destination is None else f' for {destination}'} whose publish "
                    f"did not finish: copy it to {where}, then delete the directory by hand",
                )
        if dry_run:
            return entry("would-remove", reason)
        error = _remove(path, kind)  # still under our lock: no owner can claim it meanwhile
    if error is not None:
        return entry("failed", f"{reason}; removing it failed: {error}")
    return entry("removed", reason)


def _owner_gone(
    kind: str,
    owner: Owner,
    locked: Optional[bool],
    mtime: float,
    older_than: Optional[float],
    now: float,
) -> tuple[bool, str]:
    """(gone?, why). ``locked``: True we hold the entry's lock, False a live owner holds
    it, None the lock cannot tell."""
    if locked is False:
        return False, "in use: its owner holds its lock (it may run in another PID namespace)"
    this_host = owner.is_this_host()
    if this_host and _process_alive(owner.pid):
        return False, f"its owner, pid {owner.pid}, is running"
    # A staging root is a local filesystem: its locks are kernel-wide, whatever the host name.
    if locked and (this_host or kind == "staging-dir"):
        return True, (
            f"its owner, pid {owner.pid}, is gone (nobody holds its lock)"
            if this_host
            else f"made on host {owner.host}; nobody holds its lock"
        )
    why = (
        f"made on host {owner.host}: pid {owner.pid} cannot be checked from here"
        if not this_host
        else "this filesystem cannot tell whether its owner lives (no locks)"
    )
    age = now - mtime
    if older_than is None:
        return False, f"{why} (pass --older-than SECONDS to remove old ones)"
    if age <= older_than:
        return False, f"{why}; modified {age:.0f} s ago (not older than {older_than:g} s)"
    return True, f"{why}; untouched for {age:.0f} s (older than {older_than:g} s)"


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except (OverflowError, ValueError):
        return False  # no process can have that pid
    return True


def kept_destination(directory: Path) -> Optional[str]:
    """The destination a kept copy in the staging directory ``directory`` was for, from its
    record; None if it has none (a copy kept by safestage before 0.2, a SIGKILLed single-file
    save) or it cannot be read."""
    try:
        with open(directory / KEPT_RECORD, "rb") as handle:
            document = json.loads(handle.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    destination = document.get("destination") if isinstance(document, dict) else None
    return destination if isinstance(destination, str) else None


def _kept_content(directory: Path) -> Optional[str]:
    """The first entry of a private staging directory that may be a complete copy, or None
    if it holds nothing but safetensors' own torn temp files (``.tmpXXXXXX``, which 0.8
    renames to the final name once complete; safestage never stages under such a name)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return "entries it cannot list"  # do not guess
    if DISPOSABLE_MARKER in names:
        return None  # staged_dir: still being written, or already published (_names)
    names = [name for name in names if name != KEPT_RECORD]  # what a copy was for is no copy
    # Only a regular file can be safetensors' temp: a directory of that name (a staged_dir
    # named so) holds a checkpoint.
    return next((name for name in names if not (is_writer_temp(name) and _is_file(directory / name))), None)


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False  # gone meanwhile, or cannot tell: keep the directory


def _remove(path: Path, kind: str) -> Optional[str]:
    try:
        if kind == "temp":
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
