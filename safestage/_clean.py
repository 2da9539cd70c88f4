"""`safestage clean PATH`: remove safestage's own leftovers whose owner process is gone.

Looks at the entries of PATH only (not recursively): a destination directory holds the
sibling temp files of `replace` (``.<name>.safestage-<host>-<pid>-<token>.tmp``) and any
`safestage doctor` probe directory (``.safestage-doctor-<host>-<pid>-<token>``); a staging
root holds the per-save directories (``safestage-<host>-<pid>-<token>``). Nothing else is
ever touched: a name must match those patterns exactly (see _names), and have the file type
safestage creates (a regular file, a directory; never a symlink).

An entry is removed when its owner is gone: on this host, ``kill(pid, 0)`` finds no such
process; on another host liveness cannot be checked, so it is removed only with
``older_than`` and an mtime older than that. A staging directory that still holds a
finished file is kept whatever its owner: a failed publish keeps the only complete copy
there (its PublishError says so), and a crash during publishing leaves one too.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from ._names import Owner, parse_doctor_dir, parse_stage_dir, parse_temp_name

# What each kind of leftover is, and the file type safestage creates for it.
KINDS = {
    "temp": "temp file",
    "staging-dir": "staging directory",
    "doctor-dir": "doctor probe directory",
}


@dataclass(frozen=True)
class Entry:
    """One leftover and what was done with it: action is "removed", "would-remove" (dry
    run), "kept" or "failed"; reason says why."""

    name: str
    kind: str
    host: str
    pid: int
    action: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def clean(
    directory: Path,
    *,
    dry_run: bool = False,
    older_than: Optional[float] = None,
    now: Optional[float] = None,
) -> list[Entry]:
    """Remove (or with ``dry_run`` list) the dead leftovers among the entries of ``directory``."""
    clock = time.time() if now is None else now
    entries = []
    with os.scandir(directory) as listing:
        names = sorted(item.name for item in listing)
    for name in names:
        match = _classify(name)
        if match is None:
            continue  # not ours: never looked at again
        kind, owner = match
        entries.append(_handle(directory / name, kind, owner, dry_run, older_than, clock))
    return entries


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
    path: Path, kind: str, owner: Owner, dry_run: bool, older_than: Optional[float], now: float
) -> Entry:
    def entry(action: str, reason: str) -> Entry:
        return Entry(path.name, kind, owner.host, owner.pid, action, reason)

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
    gone, reason = _owner_gone(owner, info.st_mtime, older_than, now)
    if not gone:
        return entry("kept", reason)
    if kind == "staging-dir":
        finished = _finished_file(path)
        if finished is not None:
            return entry(
                "kept",
                f"{reason}, but it holds {finished}, possibly the only complete copy of a save "
                "whose publish did not finish: copy it to its destination, then delete it by hand",
            )
    if dry_run:
        return entry("would-remove", reason)
    error = _remove(path, kind)
    if error is not None:
        return entry("failed", f"{reason}; removing it failed: {error}")
    return entry("removed", reason)


def _owner_gone(
    owner: Owner, mtime: float, older_than: Optional[float], now: float
) -> tuple[bool, str]:
    """(gone?, why)."""
    if owner.is_this_host():
        if _process_alive(owner.pid):
            return False, f"its owner, pid {owner.pid}, is running"
        return True, f"its owner, pid {owner.pid}, is gone"
    age = now - mtime
    if older_than is None:
        return False, (
            f"made on host {owner.host}: pid {owner.pid} cannot be checked from here "
            "(pass --older-than SECONDS to remove old ones)"
        )
    if age <= older_than:
        return (
            False,
            f"made on host {owner.host}, modified {age:.0f} s ago (not older than {older_than:g} s)",
        )
    return (
        True,
        f"made on host {owner.host}, untouched for {age:.0f} s (older than {older_than:g} s)",
    )


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


def _finished_file(directory: Path) -> Optional[str]:
    """A file in a private staging directory that may be a finished save.

    safetensors 0.8 writes a hidden ``.tmpXXXXXX`` and renames it to the final name when it
    is complete, so hidden files are torn writes; any other file may be the complete staged
    copy (and for other writers it cannot be told apart from a torn one), so it is kept.
    """
    try:
        children = sorted(directory.iterdir())
    except OSError:
        return "files it cannot list"  # do not guess
    for child in children:
        if not child.name.startswith(".") and not child.is_symlink() and child.is_file():
            return child.name
    return None


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
