"""Retention that waits for durability: ``safestage.prune``, ``staged_dir(keep=N)`` and
`safestage prune`.

Asynchronous saves keep losing checkpoints to retention that does not wait: Megatron-Bridge#5184
deleted the checkpoint that had just finished because a newer one, still being written, looked
newest. Here "newest" means "newest complete": a checkpoint counts once its commit file has
landed and every file it lists is there (``_verify``, the shallow check ``latest_complete``
makes), in ``latest_complete``'s order (the step number, then the commit time), and only if no
resumed run set it aside (``_timeline``).

What is removed, among the directories of ``parent`` whose names match ``pattern`` (its last
``*`` standing for the step number, as for ``latest_complete``):

- complete checkpoints beyond the ``keep`` newest complete ones;
- incomplete ones with a lower step number than the newest complete one (a killed or failed
  save's leftovers; a kept copy of one holds all its files, so `safestage recover` loses
  nothing by it).

What is never removed: the newest complete checkpoint (``keep`` >= 1) and the one just
committed; a checkpoint a resumed run set aside (``_timeline``: it is never counted either, and
never named by ``latest_complete``; the new timeline replaces it when it reaches that step, or
the user deletes it, told once by a WARNING); an incomplete one whose step is not lower than the newest complete one's (a save in
progress, Megatron-Bridge#5184); anything while no checkpoint is complete; a symlink (never a
candidate: not counted either; what it points to is judged under its own name only); one whose commit file or files cannot be read (EACCES, EIO: it cannot be told
apart from a complete one); one that a live process is committing or writing into, as far as
safestage can see it: this process's jobs (``_work``), and other processes of this host whose
locked save directory in a staging root we know of (the default root, ``SAFESTAGE_DIR``,
``root=``, the roots this process used) records the checkpoint (``_kept``). A checkpoint kept
beyond ``keep`` for such a reason is named in a WARNING, once per process.

Not seen: processes on other hosts (their locks live in their kernel), writers that do not go
through safestage, and ``commit_in_place`` in another process. safestage's own writers never
write into a checkpoint older than the newest complete one except to re-commit it, so only a
re-commit of an old step from another host (or by a plain writer) can race a prune; the check
and the removal are not atomic either. No mtime rule is added on top: a recent mtime proves
nothing about a writer that pauses, and an old one nothing about one that just started.

A removal removes the commit file first (a half-removed checkpoint is never complete, and
readers skip it), then the tree bottom-up with unlink and rmdir only (no rename: object-store
mounts have none), oldest first, stopping at the first failure.

A run URL (``s3://bucket/run``) is pruned the same way, from one paginated LIST of the run and
one GET of each commit object the listing shows (each checked against the listing, as
``latest_complete`` checks it): a checkpoint is the objects below ``run/<name>/``, so an object
whose name the pattern does not take, even one sharing a checkpoint's name as a prefix
(``checkpoint-100-merged/``, a plain object ``checkpoint-100``), is never read nor removed. A
removal deletes the commit object first, in a request of its own, then every other object below
the checkpoint's prefix (listed again, so that nothing listed since is left behind) in batched
deletes. Multipart uploads a killed writer left in flight are part of its checkpoint too: on
S3 a prune lists them (ListMultipartUploads of the run, one request a page), counts a checkpoint
that has nothing else (killed during its first large file) as an incomplete one, and a removal
aborts every upload below the checkpoint's prefix (listed again) before it deletes the commit
object and the rest. Uploads below a checkpoint that stays (the newest complete one, a save in
progress) or below a name the pattern does not take are never aborted. Where they cannot be
listed (GCS, Azure, S3 without static keys: ``_object_store.uploads_in_flight``) the bucket's
lifecycle rule for incomplete multipart uploads removes them (docs/object-stores.md).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union, overload

from .. import _kept, _object_store, _save, _work
from .._config import ENV_DIR, PathArg, default_root, env_value
from .._destination import Destination, ObjectURL, url_of
from .._errors import ConfigError
from .._paths import real_directory
from .._publish import fsync_directory
from ._manifest import COMMIT_NAME
from ._verify import (
    Listed,
    SetAside,
    as_path,
    candidate_steps,
    check,
    check_objects,
    check_pattern,
    describe_error,
    marker_problem,
    matcher,
    read_commit,
    read_commit_object,
    run_listing,
    set_aside_by,
    set_aside_object,
)

log = logging.getLogger("safestage")


@dataclass(frozen=True)
class Decision:
    """What a prune does with one checkpoint: ``action`` "remove" or "keep", and why.
    ``routine``: kept for the ordinary reasons (among the newest), not worth a line.
    ``loud``: worth a WARNING, once per process (kept beyond keep for a reason the caller
    should know, set aside by a resumed run, or could not be read)."""

    path: Destination
    action: str
    reason: str
    routine: bool = False
    loud: bool = False


@dataclass(frozen=True)
class Retention:
    """``staged_dir(keep=N)``: what to prune in the destination's parent after each commit."""

    keep: int
    pattern: str

    def after_commit(
        self,
        dest: Destination,
        staging_root: Optional[Path],
        *,
        spare: Optional[Mapping[Path, str]] = None,
    ) -> list[Destination]:
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


@overload
def prune(parent: ObjectURL, keep: int, pattern: str = ..., *, root: Optional[PathArg] = ...,
          dry_run: bool = ...) -> list[ObjectURL]: ...  # fmt: skip
@overload
def prune(parent: os.PathLike[str], keep: int, pattern: str = ..., *, root: Optional[PathArg] = ...,
          dry_run: bool = ...) -> list[Path]: ...  # fmt: skip
@overload
def prune(parent: str, keep: int, pattern: str = ..., *, root: Optional[PathArg] = ...,
          dry_run: bool = ...) -> list[Destination]: ...  # fmt: skip
def prune(
    parent: Union[PathArg, ObjectURL],
    keep: int,
    pattern: str = "checkpoint-*",
    *,
    root: Optional[PathArg] = None,
    dry_run: bool = False,
) -> list[Any]:  # the overloads say which: a list is invariant
    """Remove the complete checkpoints in ``parent`` beyond the ``keep`` newest complete ones,
    and the incomplete ones older than the newest complete one that no live process is
    committing; return what was removed (``dry_run``: what would be), oldest first.

    ``pattern`` is an fnmatch pattern of checkpoint names whose last ``*`` stands for the step
    number, ordered as ``latest_complete`` orders them. ``root``: a staging root to look in for
    live commits, besides the default root, ``SAFESTAGE_DIR`` and the roots this process used.
    Never removes the newest complete checkpoint, an incomplete one at least as new (a save in
    progress), or one a live process of this host is committing (see the module docstring for
    what cannot be seen). Raises ConfigError for a bad ``keep`` or ``pattern``, the OSError when
    ``parent`` cannot be listed or a removal fails (naming the path, the errno, and what was
    removed before). ``parent`` may be a run URL (``s3://bucket/run``): the same rules, on its
    objects (the module docstring); what is removed is then ObjectURLs."""
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


def retention_for(dest: PathArg, keep: object) -> Optional[Retention]:
    """``staged_dir(dest, keep=...)``: None without keep; else the pattern of ``dest``'s
    siblings, its name with the trailing step number as ``*`` (checkpoint-1000 ->
    checkpoint-*, step_000100 -> step_*), which matches step numbers only. ConfigError if the
    name ends in no digits."""
    if keep is None:
        return None
    count = check_keep(keep, "safestage.staged_dir")
    url = url_of(dest)
    name = url.name if url is not None else as_path(dest).name
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
    candidates += _save.checked_roots()  # a root= passed to staged_dir, never to prune
    found: list[Path] = []
    for candidate in candidates:
        real = real_directory(candidate)
        if real is not None and real not in found:
            found.append(real)
    return found


def _claim_on(path: Destination, claims: Mapping[Destination, str]) -> Optional[str]:
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
    set_aside: Optional[SetAside] = None


def plan(
    parent: Union[PathArg, ObjectURL],
    keep: int,
    pattern: str,
    *,
    roots: list[Path],
    protect: Optional[Destination] = None,
    spare: Optional[Mapping[Path, str]] = None,
) -> list[Decision]:
    """What a prune of ``parent`` does with each checkpoint matching ``pattern``, newest first.
    Reads only: the listing, each commit file, the files of committed candidates. ``protect``:
    never remove it (the checkpoint ``staged_dir(keep=)`` has just committed). ``spare``:
    never remove these either (kernel paths), each for the reason given (the Trainer's
    ``best_model_checkpoint``, which its ``load_best_model_at_end`` loads)."""
    base: Destination
    kernel_base: Destination
    inspect: Callable[[str, int], Optional[_Candidate]]
    run = url_of(parent)
    if run is not None:  # one LIST of the run; its objects by checkpoint
        steps, below = run_listing(run, pattern)
        _add_upload_only(run, pattern, steps, below)
        base = kernel_base = run
        inspect = lambda name, step: _inspect_objects(run, name, step, below[name])  # noqa: E731
    else:
        assert not isinstance(parent, ObjectURL)
        directory = as_path(parent)
        steps = candidate_steps(directory, pattern)  # a symlink is none: never counted nor removed
        base, kernel_base = directory, real_directory(directory) or directory
        inspect = lambda name, step: _inspect(directory, name, step)  # noqa: E731
    candidates = []
    for name in sorted(steps, key=lambda n: (steps[n], n), reverse=True):
        candidate = inspect(name, steps[name])
        if candidate is not None:
            candidates.append(candidate)
    complete = sorted((c for c in candidates if c.complete and c.set_aside is None),
                      key=lambda c: (c.step, c.mtime, c.name), reverse=True)  # fmt: skip
    if not complete:
        return [Decision(base / c.name, "keep", "no checkpoint here is complete yet: nothing is removed"
                         if c.unreadable is None else f"could not be read ({c.unreadable})",
                         routine=c.unreadable is None, loud=c.unreadable is not None)
                for c in candidates]  # fmt: skip
    newest = complete[0]
    kept_complete = {c.name for c in complete[:keep]}
    wanted: dict[str, str] = {}
    newer = (
        f"the {keep} newest complete ones"
        if keep > 1
        else f"the newest complete one, {newest.name}"
    )
    for c in complete[keep:]:
        wanted[c.name] = f"complete, older than {newer}"
    for c in candidates:
        if not c.complete and c.unreadable is None and c.step < newest.step:
            wanted[c.name] = (
                f"not complete, and older than the newest complete checkpoint {newest.name}"
            )
    claims: Optional[dict[Destination, str]] = None
    decisions = []
    for c in candidates:
        path = base / c.name
        if c.name not in wanted:
            loud = c.unreadable is not None or c.set_aside is not None
            decisions.append(Decision(path, "keep", _why_kept(c, newest, keep, kept_complete),
                                      routine=not loud, loud=loud))  # fmt: skip
            continue
        why_not = None
        if c.step < 0:
            why_not = "no step number in its name: prune never removes it"
        elif protect is not None and kernel_base / c.name == protect:
            why_not = "just committed"
        elif spare and isinstance(kernel_base, Path) and kernel_base / c.name in spare:
            why_not = spare[kernel_base / c.name]
        else:
            if claims is None:  # only when something is to go: the roots are read once
                claims = {**_kept.claims(roots), **_work.busy()}
            why_not = _claim_on(kernel_base / c.name, claims)
        if why_not is not None:
            decisions.append(Decision(path, "keep", f"{why_not} (it would go otherwise: {wanted[c.name]})",
                                      routine=c.step < 0, loud=c.step >= 0))  # fmt: skip
        else:
            decisions.append(Decision(path, "remove", wanted[c.name]))
    return decisions


def _add_upload_only(run: ObjectURL, pattern: str, steps: dict[str, int], below: dict[str, Listed]) -> None:
    """Add to ``run_listing``'s checkpoints those that are nothing but multipart uploads in
    flight (a save killed during its first large file): incomplete ones, with no objects."""
    takes = matcher(pattern)
    for upload in _object_store.uploads_in_flight(run) or ():
        name, slash, rest = upload.url.relative_to(run).partition("/")
        if not slash or not rest or name in steps:
            continue
        step = takes(name)
        if step is not None:
            steps[name], below[name] = step, {}


def _inspect(base: Path, name: str, step: int) -> Optional[_Candidate]:
    """One entry of the parent, or None if it is no directory (a symlink is none either)."""
    path = base / name
    candidate = _Candidate(name, step)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None  # removed meanwhile
    except OSError as exc:
        candidate.unreadable = describe_error(exc)
        return candidate
    if not stat.S_ISDIR(info.st_mode):
        return None  # a file matching the pattern, or a symlink (made meanwhile): not a checkpoint
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
    if result.complete:
        try:
            candidate.set_aside = set_aside_by(path)
        except OSError as exc:  # whether it was set aside cannot be told: as any unreadable one
            candidate.unreadable = marker_problem(exc).message
            return candidate
    candidate.complete = result.complete
    return candidate


def _inspect_objects(run: ObjectURL, name: str, step: int, listed: Listed) -> _Candidate:
    """``_inspect`` of the checkpoint ``run/name`` whose objects ``listed`` holds: its commit
    object read (one GET) only if the listing shows one."""
    checkpoint = run / name
    candidate = _Candidate(name, step)
    manifest, problem, modified = read_commit_object(checkpoint, listed)
    if manifest is None:
        if problem is not None and problem.kind == "unreadable":
            candidate.unreadable = problem.message
        return candidate
    candidate.committed, candidate.mtime = True, modified
    result = check_objects(checkpoint, manifest, listed, deep=False)
    unreadable = [p for p in result.problems if p.kind == "unreadable"]
    if unreadable:
        candidate.unreadable = f"{unreadable[0].path}: {unreadable[0].message}"
    if result.complete:
        try:
            candidate.set_aside = set_aside_object(checkpoint, listed)
        except OSError as exc:
            candidate.unreadable = marker_problem(exc).message
            return candidate
    candidate.complete = result.complete
    return candidate


def _why_kept(c: _Candidate, newest: _Candidate, keep: int, kept_complete: set[str]) -> str:
    if c.set_aside is not None:
        return (f"{c.set_aside.describe()}; retention neither counts nor removes it: delete it if "
                "it is not wanted (a re-commit of its step replaces it)")  # fmt: skip
    if c.unreadable is not None:
        return f"could not be read ({c.unreadable}): it cannot be told apart from a complete one"
    if c.name in kept_complete:
        return (
            "the newest complete checkpoint"
            if c is newest
            else f"one of the {keep} newest complete"
        )
    return (f"not complete, and not older than the newest complete checkpoint {newest.name}: "
            "a save in progress (Megatron-Bridge#5184)")  # fmt: skip


# -- removal ---------------------------------------------------------------------------------------


def apply(decisions: list[Decision], *, dry_run: bool = False) -> list[Destination]:
    """Remove (``dry_run``: only log) what ``decisions`` say, oldest first; return those paths.
    Each is logged at INFO; so is each checkpoint kept for a reason other than being new.
    Stops at the first failure, raising its OSError naming the path and what was removed."""
    removed: list[Destination] = []
    for decision in reversed(decisions):
        if decision.action != "remove":
            if decision.loud and _first_time(decision):
                log.warning("safestage.prune: keeping %s: %s", decision.path, decision.reason)
            else:
                log.log(logging.DEBUG if decision.routine else logging.INFO,
                        "safestage.prune: keeping %s: %s", decision.path, decision.reason)  # fmt: skip
            continue
        level = logging.WARNING if decision.loud else logging.INFO
        if dry_run:
            log.log(level, "safestage.prune: would remove %s (%s)", decision.path, decision.reason)
        elif not remove_checkpoint(decision.path, removed):
            log.warning("safestage.prune: removed every object of %s (%s), but a multipart upload in flight "
                        "below it could not be aborted (said above): it is not counted as removed, and the next "
                        "prune tries again", decision.path, decision.reason)  # fmt: skip
            continue
        else:
            log.log(level, "safestage.prune: removed %s (%s)", decision.path, decision.reason)
        removed.append(decision.path)
    return removed


_warned: set[tuple[Destination, str]] = set()  # (checkpoint, why kept) already said in this process
_warned_lock = threading.Lock()


def _first_time(decision: Decision) -> bool:
    with _warned_lock:
        key = (decision.path, decision.reason)
        if key in _warned:
            return False
        _warned.add(key)
        return True


Removed = Union[list[Destination], tuple[Destination, ...]]


def remove_checkpoint(path: Destination, removed_before: Removed = ()) -> bool:
    """Remove the checkpoint directory ``path``: its commit file first (made durable where the
    mount lets directories be fsync'ed), then everything else, bottom-up, with unlink and
    rmdir only. Never follows a symlink inside it. A checkpoint URL: its multipart uploads in
    flight aborted, then its commit object, then every object below its prefix, in batched
    deletes. Whether nothing of it is left that can be seen: False where an upload could not
    be aborted (its objects are gone all the same). Raises the OSError of a removal that failed."""
    if isinstance(path, ObjectURL):
        return _remove_objects(path, removed_before)
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
    return True


def _remove_objects(checkpoint: ObjectURL, removed_before: Removed) -> bool:
    commit_removed = False
    try:
        # Its multipart uploads in flight first: one that completes after the listing below
        # would leave an object behind, one aborted first never lands.
        uploads = _object_store.uploads_in_flight(checkpoint) or []
        aborted = _object_store.abort_uploads(uploads)
        if aborted:
            log.info("safestage.prune: aborted %d multipart upload(s) in flight below %s: %s", len(aborted),
                     checkpoint, ", ".join(upload.url.key for upload in aborted))  # fmt: skip
        objects = _object_store.listing(checkpoint)  # below "run/name/" only: never a sibling
        commit = checkpoint / COMMIT_NAME
        if any(info.key == commit.key for info in objects):
            _object_store.delete([commit])
            commit_removed = True
        _object_store.delete([ObjectURL(checkpoint.scheme, checkpoint.bucket, info.key)
                              for info in objects if info.key != commit.key])  # fmt: skip
        return len(aborted) == len(uploads)
    except OSError as exc:
        state = ("its commit object was removed first: it is no longer complete (verify and latest_complete "
                 "skip it)" if commit_removed else "its commit object is untouched")  # fmt: skip
        before = f"; removed before it: {', '.join(map(str, removed_before))}" if removed_before else ""
        raise type(exc)(exc.errno, f"safestage.prune could not remove {checkpoint}: {exc}; {state}{before}",
                        str(checkpoint)) from exc  # fmt: skip


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


def _removal_error(path: Path, exc: OSError, commit_removed: bool, removed_before: Removed) -> OSError:
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
        exc.errno,
        f"safestage.prune could not remove {path}: {describe_error(exc)}: {advice}; {state}{before}",
        where,
    )
