"""Retention that waits for durability: ``safestage.prune``, ``staged_dir(keep=N)`` and
`safestage prune`.

Asynchronous saves keep losing checkpoints to retention that does not wait: Megatron-Bridge#5184
deleted the checkpoint that had just finished because a newer one, still being written, looked
newest. Here "newest" means "newest complete": a checkpoint counts once its commit file has
landed and every file it lists is there (``_verify``, the shallow check ``latest_complete``
makes), in ``latest_complete``'s order (the step number in the name, then the commit time).

What is removed, among the directories of ``parent`` matching ``pattern``:

- complete checkpoints beyond the ``keep`` newest complete ones;
- incomplete ones with a lower step number than the newest complete one (a killed or failed
  save's leftovers).

What is never removed: the newest complete checkpoint (``keep`` >= 1); an incomplete one whose
step is not lower than the newest complete one's (a save in progress, Megatron-Bridge#5184);
anything while no checkpoint is complete; a name without a step number (a hand-made
``checkpoint-best``); a symlink (nor what it points to); one whose commit file or files cannot
be read (EACCES, EIO: it cannot be told apart from a complete one); one that a live process is
committing or writing into, as far as safestage can see it:

- this process: a ``staged_dir`` commit of it (``_inflight``), a background publish or a save
  in progress of a file under it (``_background``, ``_save``);
- other processes of this host: a staging directory in a staging root we know of (the default
  root, ``SAFESTAGE_DIR``, ``root=``, the roots this process used) whose owner holds its lock
  (``_locks``) and whose ``safestage-kept.json`` names the checkpoint or a file in it (written
  when a commit starts publishing, before the destination is touched);
- and one that a kept copy is for (the same record, its owner gone or its commit failed): the
  destination holds the files that landed, the kept copy the rest; a recover needs both.

Not seen: processes on other hosts (their locks live in their kernel), writers that do not go
through safestage, and ``commit_in_place`` in another process. safestage's own writers never
write into a checkpoint older than the newest complete one except to re-commit it, so only a
re-commit of an old step from another host (or by a plain writer) can race a prune; the check
and the removal are not atomic either. No mtime rule is added on top: a recent mtime proves
nothing about a writer that pauses, and an old one nothing about one that just started.

A removal removes the commit file first (a half-removed checkpoint is never complete, and
readers skip it), then the tree bottom-up with unlink and rmdir only (no rename: object-store
mounts have none), oldest first, stopping at the first failure.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from . import _background, _inflight, _save
from ._clean import _process_alive, kept_destination
from ._config import ENV_DIR, PathArg, default_root, env_value
from ._errors import ConfigError
from ._locks import taken
from ._manifest import COMMIT_NAME
from ._names import DISPOSABLE_MARKER, parse_stage_dir
from ._paths import real_directory
from ._publish import fsync_directory
from ._verify import _text, as_path, check, list_run_directory, read_commit, step_of

log = logging.getLogger("safestage")


@dataclass(frozen=True)
class Decision:
    """What a prune does with one checkpoint: ``action`` "remove" or "keep", and why.
    ``routine``: kept for the ordinary reasons (among the newest), not worth a line."""

    path: Path
    action: str
    reason: str
    routine: bool = False
    unreadable: bool = False  # kept because it could not be read: a WARNING, as latest_complete's


@dataclass(frozen=True)
class Retention:
    """``staged_dir(keep=N)``: what to prune in the destination's parent after each commit."""

    keep: int
    pattern: str

    def after_commit(
        self, dest: Path, staging_root: Optional[Path], *, spare: Optional[Mapping[Path, str]] = None
    ) -> list[Path]:
        """Prune ``dest.parent`` once ``dest``'s commit file has landed. Never raises (but a
        KeyboardInterrupt): the checkpoint is complete, and a cleanup that could not be done must not
        make a landed commit look failed (nor, for a background commit, fail the next save).
        It is logged as a WARNING naming what stays and what to run. ``spare``: see ``plan``."""
        try:
            decisions = plan(dest.parent, self.keep, self.pattern,
                             roots=known_roots(staging_root), protect=dest, spare=spare)  # fmt: skip
            return apply(decisions)
        except Exception as exc:  # not only OSError: nothing here may fail a landed commit
            log.warning(
                "safestage: %s was committed (it is complete), but retention (keep=%d) could not "
                "prune %s: %s. Nothing else is affected; the next commit with keep= tries again, "
                "or run `safestage prune %s --keep %d --pattern '%s'`",
                dest, self.keep, dest.parent, exc, dest.parent, self.keep, self.pattern,
                exc_info=not isinstance(exc, OSError),  # a bug: its traceback too
            )  # fmt: skip
            return []


def prune(
    parent: PathArg,
    keep: int,
    pattern: str = "checkpoint-*",
    *,
    root: Optional[PathArg] = None,
    dry_run: bool = False,
) -> list[Path]:
    """Remove the complete checkpoints in ``parent`` beyond the ``keep`` newest complete ones,
    and the incomplete ones older than the newest complete one that no live process is
    committing; return what was removed (``dry_run``: what would be), oldest first.

    ``pattern`` is an fnmatch pattern of checkpoint names, ordered as ``latest_complete``
    orders them. ``root``: a staging root to look in for live commits, besides the default
    root, ``SAFESTAGE_DIR`` and the roots this process used. Never removes the newest complete
    checkpoint, an incomplete one at least as new (a save in progress), or one a live process
    of this host is committing (see the module docstring for what cannot be seen). Raises
    ConfigError for a bad ``keep`` or ``pattern``, the OSError when ``parent`` cannot be listed
    or a removal fails (naming the path, the errno, and what was removed before)."""
    keep = check_keep(keep, "safestage.prune")
    check_pattern(pattern, "safestage.prune")
    decisions = plan(parent, keep, pattern, roots=known_roots(root))
    return apply(decisions, dry_run=dry_run)


# -- arguments -------------------------------------------------------------------------------------


def check_keep(keep: object, where: str) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(
            f"{where}: keep={keep!r}: expected an integer >= 1 (how many complete checkpoints "
            "to keep; the newest complete one is never removed)"
        )
    return keep


def check_pattern(pattern: object, where: str) -> str:
    if not isinstance(pattern, str) or not pattern or "/" in pattern:
        raise ConfigError(
            f"{where}: pattern={pattern!r}: expected an fnmatch pattern of checkpoint names "
            "in the parent directory, such as 'checkpoint-*' (not empty, no '/')"
        )
    return pattern


def retention_for(dest: PathArg, keep: object) -> Optional[Retention]:
    """``staged_dir(dest, keep=...)``: None without keep; else the pattern of ``dest``'s
    siblings, its name with the trailing step number as ``*`` (checkpoint-1000 ->
    checkpoint-*, step_000100 -> step_*). ConfigError if the name ends in no digits."""
    if keep is None:
        return None
    count = check_keep(keep, "safestage.staged_dir")
    name = as_path(dest).name
    stem = name.rstrip("0123456789")
    if not name or stem == name or not stem:
        raise ConfigError(
            f"safestage.staged_dir: keep={count} needs the checkpoint's step number at the end "
            f"of its name (checkpoint-1000, step_000100), to find its siblings; {name!r} has none. "
            "Name checkpoints with their step last, or prune with safestage.prune(parent, keep, pattern)"
        )
    return Retention(count, _escaped(stem) + "*")


def _escaped(text: str) -> str:
    """``text`` as an fnmatch pattern matching itself only."""
    return "".join(f"[{char}]" if char in "*?[" else char for char in text)


# -- what is live ----------------------------------------------------------------------------------


def known_roots(root: Optional[PathArg] = None) -> list[Path]:
    """The staging roots to look in for live commits: ``root``, SAFESTAGE_DIR, the default
    root, and the roots this process used; those that exist, each once."""
    candidates: list[Path] = []
    if root is not None:
        candidates.append(as_path(root))
    configured = env_value(os.environ, ENV_DIR)
    if configured is not None:
        candidates.append(Path(configured))
    candidates.append(default_root())
    # This process's checked roots (a root= passed to staged_dir, never to prune).
    candidates += [path for (pid, path, _) in list(_save._roots) if pid == os.getpid()]
    found: list[Path] = []
    for candidate in candidates:
        real = real_directory(candidate)
        if real is not None and real not in found:
            found.append(real)
    return found


def busy_destinations() -> dict[Path, str]:
    """Destinations this process is committing or publishing into now: {path: what}."""
    busy: dict[Path, str] = {}
    for dest in _inflight.committing_now():
        busy[dest] = "this process is committing it"
    current = _background._current()
    if current is not None:
        for dest, _ in current.pending_copies():
            busy.setdefault(dest, f"this process is publishing {dest} in the background")
    with _save._progress:
        saving = list(_save._saving)
    for dest in saving:
        busy.setdefault(dest, f"this process is saving {dest}")
    return busy


def _staging_claims(roots: list[Path]) -> dict[Path, str]:
    """{destination: why} of the staging directories in ``roots`` that record one: a live
    commit (its owner holds the lock) or a kept copy (the owner gone, or its commit failed).
    A directory marked disposable whose owner is gone holds nothing needed (_names)."""
    claims: dict[Path, str] = {}
    for root in roots:
        try:
            with os.scandir(root) as listing:
                names = [entry.name for entry in listing if entry.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.debug("cannot look for live commits in %s: %s", root, exc)
            continue
        for name in sorted(names):
            owner = parse_stage_dir(name)
            if owner is None:
                continue
            directory = root / name
            destination = kept_destination(directory)
            if destination is None:
                continue
            with taken(directory, directory=True) as locked:
                live = locked is False or (locked is None and owner.is_this_host() and _process_alive(owner.pid))
            if live:
                why = f"pid {owner.pid} is committing it (its staging directory {directory} is locked)"
            elif os.path.lexists(directory / DISPOSABLE_MARKER):
                continue
            else:
                why = (f"a kept copy of a commit that did not finish is at {directory}: recover it, "
                       "or delete that copy, and prune removes it")  # fmt: skip
            claims.setdefault(Path(destination), why)
    return claims


def _claim_on(path: Path, claims: dict[Path, str]) -> Optional[str]:
    """Why ``path`` (a checkpoint, the kernel's path) is claimed: itself or a file under it."""
    for claimed, why in claims.items():
        if claimed == path or path in claimed.parents:
            return why
    return None


# -- the plan --------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    name: str
    step: int
    mtime: float = 0.0
    committed: bool = False
    complete: bool = False
    unreadable: Optional[str] = None
    symlink: bool = False


def plan(
    parent: PathArg,
    keep: int,
    pattern: str,
    *,
    roots: list[Path],
    protect: Optional[Path] = None,
    spare: Optional[Mapping[Path, str]] = None,
) -> list[Decision]:
    """What a prune of ``parent`` does with each checkpoint matching ``pattern``, newest first.
    Reads only: the listing, each commit file, the files of committed candidates. ``protect``:
    never remove it (the checkpoint ``staged_dir(keep=)`` has just committed). ``spare``:
    never remove these either (kernel paths), each for the reason given (the Trainer's
    ``best_model_checkpoint``, which its ``load_best_model_at_end`` loads)."""
    base = as_path(parent)
    listing = list_run_directory(base)
    kernel_base = real_directory(base) or base
    candidates = []
    for name in sorted((n for n in listing if fnmatch.fnmatchcase(n, pattern)), key=lambda n: (step_of(n), n), reverse=True):
        candidate = _inspect(base, name)
        if candidate is not None:
            candidates.append(candidate)
    complete = sorted((c for c in candidates if c.complete), key=lambda c: (c.step, c.mtime, c.name), reverse=True)
    if not complete:
        return [Decision(base / c.name, "keep", "no checkpoint here is complete yet: nothing is removed"
                         if c.unreadable is None else f"could not be read ({c.unreadable})",
                         routine=c.unreadable is None, unreadable=c.unreadable is not None)
                for c in candidates]  # fmt: skip
    newest = complete[0]
    kept_complete = {c.name for c in complete[:keep]}
    wanted: dict[str, str] = {}
    newer = f"the {keep} newest complete ones" if keep > 1 else f"the newest complete one, {newest.name}"
    for c in complete[keep:]:
        wanted[c.name] = f"complete, older than {newer}"
    for c in candidates:
        if not c.complete and c.unreadable is None and c.step < newest.step:
            wanted[c.name] = f"not complete, and older than the newest complete checkpoint {newest.name}"
    claims: Optional[dict[Path, str]] = None
    decisions = []
    for c in candidates:
        path = base / c.name
        if c.name not in wanted:
            decisions.append(Decision(path, "keep", _why_kept(c, newest, keep, kept_complete),
                                      routine=c.unreadable is None, unreadable=c.unreadable is not None))  # fmt: skip
            continue
        why_not = None
        if c.step < 0:
            why_not = "no step number in its name: prune never removes it"
        elif c.symlink:
            why_not = "a symlink: prune removes neither it nor what it points to"
        elif protect is not None and kernel_base / c.name == protect:
            why_not = "just committed"
        elif spare and kernel_base / c.name in spare:
            why_not = spare[kernel_base / c.name]
        else:
            if claims is None:  # only when something is to go: the roots are read once
                claims = {**_staging_claims(roots), **busy_destinations()}
            why_not = _claim_on(kernel_base / c.name, claims)
        if why_not is not None:  # a name without a step number is the user's: DEBUG, not a line per commit
            decisions.append(Decision(path, "keep", why_not, routine=c.step < 0))
        else:
            decisions.append(Decision(path, "remove", wanted[c.name]))
    return decisions


def _inspect(base: Path, name: str) -> Optional[_Candidate]:
    """One entry of the parent, or None if it is no directory (nor a symlink to one)."""
    path = base / name
    candidate = _Candidate(name, step_of(name))
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None  # removed meanwhile
    except OSError as exc:
        candidate.unreadable = _text(exc)
        return candidate
    if stat.S_ISLNK(info.st_mode):
        candidate.symlink = True
        if not os.path.isdir(path):
            return None
    elif not stat.S_ISDIR(info.st_mode):
        return None  # a file matching the pattern: not a checkpoint
    manifest, problem, mtime = read_commit(path)
    if manifest is None:
        if problem is not None and problem.kind == "unreadable":
            candidate.unreadable = problem.message
        return candidate
    candidate.committed, candidate.mtime = True, mtime
    result = check(path, manifest, deep=False)
    unreadable = [p for p in result.problems if p.kind == "unreadable"]
    if unreadable:
        candidate.unreadable = f"{unreadable[0].path}: {unreadable[0].message}"
    candidate.complete = result.complete
    return candidate


def _why_kept(c: _Candidate, newest: _Candidate, keep: int, kept_complete: set[str]) -> str:
    if c.unreadable is not None:
        return f"could not be read ({c.unreadable}): it cannot be told apart from a complete one"
    if c.name in kept_complete:
        return "the newest complete checkpoint" if c is newest else f"one of the {keep} newest complete"
    return (f"not complete, and not older than the newest complete checkpoint {newest.name}: "
            "a save in progress (Megatron-Bridge#5184)")  # fmt: skip


# -- removal ---------------------------------------------------------------------------------------


def apply(decisions: list[Decision], *, dry_run: bool = False) -> list[Path]:
    """Remove (``dry_run``: only log) what ``decisions`` say, oldest first; return those paths.
    Each is logged at INFO; so is each checkpoint kept for a reason other than being new.
    Stops at the first failure, raising its OSError naming the path and what was removed."""
    removed: list[Path] = []
    for decision in reversed(decisions):
        if decision.action != "remove":
            level = logging.WARNING if decision.unreadable else logging.DEBUG if decision.routine else logging.INFO
            log.log(level, "safestage.prune: keeping %s: %s", decision.path, decision.reason)
            continue
        if dry_run:
            log.info("safestage.prune: would remove %s (%s)", decision.path, decision.reason)
        else:
            remove_checkpoint(decision.path, removed)
            log.info("safestage.prune: removed %s (%s)", decision.path, decision.reason)
        removed.append(decision.path)
    return removed


def remove_checkpoint(path: Path, removed_before: Union[list[Path], tuple[Path, ...]] = ()) -> None:
    """Remove the checkpoint directory ``path``: its commit file first (made durable where the
    mount lets directories be fsync'ed), then everything else, bottom-up, with unlink and
    rmdir only. Never follows a symlink inside it."""
    commit_removed = False
    try:
        try:
            os.unlink(path / COMMIT_NAME)
            commit_removed = True
            fsync_directory(path)
        except FileNotFoundError:
            pass  # not complete: nothing vouches for it
        _remove_below(path)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)
    except OSError as exc:
        raise _removal_error(path, exc, commit_removed, removed_before) from exc


def _remove_below(directory: Path) -> None:
    with os.scandir(directory) as listing:
        entries = [(entry.path, entry.is_dir(follow_symlinks=False)) for entry in listing]
    for entry_path, is_dir in entries:
        try:
            if is_dir:
                _remove_below(Path(entry_path))
                os.rmdir(entry_path)
            else:
                os.unlink(entry_path)
        except FileNotFoundError:
            continue  # gone meanwhile


def _removal_error(path: Path, exc: OSError, commit_removed: bool, removed_before: Union[list[Path], tuple[Path, ...]]) -> OSError:
    where = os.fsdecode(exc.filename) if exc.filename else str(path)
    if exc.errno == errno.ENOTEMPTY:
        advice = "something is writing into it: find that writer, let it finish, then prune again"
    else:
        advice = "check that this user may delete files there and that the mount is writable, then prune again"
    if where == str(path / COMMIT_NAME):
        state = "it is untouched"
    elif commit_removed:
        state = "its commit file was removed first: it is no longer complete (verify and latest_complete skip it)"
    else:
        state = "it was not complete (no commit file); what is left of it stays"
    before = f"; removed before it: {', '.join(map(str, removed_before))}" if removed_before else ""
    # str() of the OSError ends with the path that failed (``where``).
    return type(exc)(
        exc.errno, f"safestage.prune could not remove {path}: {_text(exc)}: {advice}; {state}{before}", where
    )
