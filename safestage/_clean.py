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

The save directories of a staging root are ``_kept``'s: what they hold decides (a kept copy
is never removed; `safestage recover` finishes it, ``--discard`` deletes it), and ``clean``
reports what ``_kept.sweep`` did with them.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from ._kept import removal_error, sweep
from ._locks import owner_gone, taken
from ._names import Owner, parse_doctor_dir, parse_stage_dir, parse_temp_name

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
    entries = [] if temps_only else [
        Entry(item.found.path.name, "staging-dir", item.found.owner.host, item.found.owner.pid, item.action,
              item.reason, None if item.found.record is None else str(item.found.record.destination))
        for item in sweep(directory, dry_run=dry_run)
    ]  # fmt: skip
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
                            below = [
                                (item.name, item.is_dir(follow_symlinks=False)) for item in listing
                            ]
                    except OSError as exc:
                        entries.append(Entry(relative, "directory", "", 0, "failed",
                                             f"cannot list it: [Errno {exc.errno}] {exc.strerror}"))  # fmt: skip
                        continue
                    stack.append((f"{relative}/", below))
                continue  # not ours: never looked at again
            kind, owner = match
            if kind != "temp" and (prefix or temps_only):
                continue  # below the top, only temp files are safestage's to clean
            if kind == "staging-dir" and is_dir:
                continue  # _kept's (above); a planted link or file of that name is reported below
            entries.append(
                _handle(directory / relative, relative, kind, owner, dry_run, older_than, clock)
            )
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
    path: Path,
    name: str,
    kind: str,
    owner: Owner,
    dry_run: bool,
    older_than: Optional[float],
    now: float,
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
    with taken(path, directory=kind != "temp") as locked:
        gone, reason = owner_gone(
            owner, locked, local=False, mtime=info.st_mtime, older_than=older_than, now=now
        )
        if not gone:
            return entry("kept", reason)
        if dry_run:
            return entry("would-remove", reason)
        # Still under our lock: no owner can claim it meanwhile.
        error = removal_error(path, file=kind == "temp")
    if error is not None:
        return entry("failed", f"{reason}; removing it failed: {error}")
    return entry("removed", reason)
