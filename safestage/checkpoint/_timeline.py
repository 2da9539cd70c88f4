"""A run's timeline: the checkpoints a run abandoned when it resumed from an older one.

Run 1 commits checkpoint-100 to checkpoint-500; 500 is bad, so run 2 resumes from
checkpoint-300 and commits checkpoint-350 (unsloth-zoo#782, transformers#37260,
SimpleTuner#2989, RLinf#1469). By step number checkpoint-500 is still the newest; by history it
belongs to a timeline that run 2 abandoned, and resuming from it after the next preemption
would go back into the bad run. The rule: a checkpoint is abandoned when a save of a lower step
of its series *began* after it did (the commit file's ``started_at``; its ``committed_at`` for
commits that did not record it). A save that began earlier and lands later (background commits
out of order) abandons nothing. So, just before a commit file is published:

- every committed sibling of a higher step whose save began before this one is set aside: a
  small marker file in it (``_SAFESTAGE_SET_ASIDE.json``) says by which checkpoint, when, why;
- a resumed commit (``safestage recover`` of a copy an earlier run kept) is itself set aside if
  a committed sibling of a lower step began after it: recovering run 1's checkpoint-400 after
  run 2 committed 350 lands it complete, and set aside.

A commit reads only what this needs: the parent's listing, and of each higher-step sibling (of
each lower-step one too, for a resumed commit) its commit file and marker, never its files: a
commit's cost does not grow with the run's earlier checkpoints (benchmarks/commit_siblings.py).

A commit that does not know when its save began (``commit_in_place`` of a directory someone
wrote) sets nothing aside.

On an object store the same rule holds with the store's means: the siblings are the checkpoint
prefixes of one paginated LIST of the run (one request per 1,000 objects), a sibling's commit
object is read (one GET) only if it is of a higher step (a lower one too, for a resumed commit)
and the listing shows no marker object beside it, and the marker is an object
``<sibling>/_SAFESTAGE_SET_ASIDE.json``, which the readers of a URL honour as they honour the file.

What a set-aside checkpoint is to the readers: ``verify`` still says complete (its files are
intact, and it can be loaded by path) and names what set it aside; ``latest_complete`` never
names it; retention (``keep=``, ``safestage.prune``) neither counts nor removes it (removing the
highest steps of a run on an inference would be the most destructive retention there is): a
WARNING names it once, the user deletes it if it is not wanted, and a re-commit of the same
directory (the new timeline reaching that step again) replaces it, its marker removed with the
commit file before anything is written.

The series of a name is the name with its last run of digits as the step: ``checkpoint-500``
is step 500 of ``checkpoint-*``; ``checkpoint-500-merged`` is of another series
(``checkpoint-*-merged``), so a merged export is never set aside by, nor sets aside, a training
checkpoint. Names that carry two counters (Lightning's ``epoch=E-step=S``) form one series per
epoch: a rollback across an epoch boundary is not seen (two counters cannot be told from a
run number and a step). A sibling that is a symlink is never written through. Times are the
committing hosts' clocks: hosts whose clocks disagree by more than the time between a save and
the next run's first save can hide a rollback, never invent one between saves of one process.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from pathlib import Path
from typing import Callable, Optional

from .._destination import Destination
from ._manifest import SET_ASIDE_NAME as MARKER_NAME
from ._manifest import Manifest
from ._verify import Listed, listed_below, read_commit, read_commit_object, set_aside_by

log = logging.getLogger("safestage")

FORMAT = "safestage.set-aside"
VERSION = 1

_LAST_DIGITS = re.compile(r"([0-9]+)(?!.*[0-9])", re.S)  # ASCII digits, as the patterns' steps


def series(name: str) -> Optional[tuple[str, str, int]]:
    """(head, tail, step) of a step-numbered name, its last run of digits being the step; None
    for a name without digits."""
    match = _LAST_DIGITS.search(name)
    if match is None:
        return None
    return name[: match.start()], name[match.end() :], int(match[1])


def set_aside(
    dest: Destination, started: float, write: Callable[[Destination, bytes], None], *, resumed: bool = False
) -> list[Destination]:
    """Before ``dest``'s commit file is published (its save began at ``started``): mark what
    this save abandons, with ``write(path, bytes)`` (the commit's own publish), and, for a
    ``resumed`` commit, ``dest`` itself if a later save abandoned it. Never raises: a
    checkpoint that cannot be marked is a WARNING (latest_complete may still name it). Returns
    those marked."""
    own = series(dest.name)
    if own is None:
        return []
    head, tail, step = own
    siblings = _Siblings(dest)
    try:
        names = siblings.names()
    except OSError as exc:
        log.debug("cannot look for checkpoints to set aside beside %s: %s", dest, exc)
        return []
    marked: list[Destination] = []
    for name in sorted(names):
        other = series(name)
        if other is None or other[:2] != (head, tail) or other[2] == step:
            continue
        if other[2] < step and not resumed:
            continue  # the run's earlier checkpoints: only a resumed commit asks about them
        sibling = dest.parent / name
        if isinstance(sibling, Path) and sibling.is_symlink():
            continue  # a link may lead into another run: never written through, never followed
        began = siblings.began(name, recorded_only=other[2] < step)
        if began is None:
            continue
        if other[2] > step and began < started and not siblings.marked(name):
            target, by, by_step, abandoned, its_step = sibling, dest.name, step, name, other[2]
        elif other[2] < step and resumed and began > started and not siblings.marked(dest.name):
            # This copy's run was abandoned before it could land: it lands set aside.
            target, by, by_step, abandoned, its_step = dest, name, other[2], dest.name, step
        else:
            continue
        if _mark(target, by, by_step, abandoned, its_step, write):
            marked.append(target)
    return marked


class _Siblings:
    """The checkpoints beside ``dest`` in its run, read as the destination's family reads them:
    a directory's listing and commit files, or one LIST of a run URL and its commit objects."""

    def __init__(self, dest: Destination) -> None:
        self.dest = dest
        self._listed: Optional[dict[str, Listed]] = None

    def names(self) -> list[str]:
        if isinstance(self.dest, Path):
            return os.listdir(self.dest.parent)
        below: dict[str, Listed] = {}
        for path, info in listed_below(self.dest.parent).items():
            name, slash, rest = path.partition("/")
            if slash and rest:  # an object directly in the run is no checkpoint
                below.setdefault(name, {})[rest] = info
        self._listed = below
        return list(below)

    def began(self, name: str, *, recorded_only: bool) -> Optional[float]:
        if isinstance(self.dest, Path):
            return _began(self.dest.parent / name, recorded_only=recorded_only)
        listed = (self._listed or {}).get(name, {})
        manifest, _, mtime = read_commit_object(self.dest.parent / name, listed)
        return _began_of(manifest, mtime, recorded_only=recorded_only)

    def marked(self, name: str) -> bool:
        if isinstance(self.dest, Path):
            return _marked(self.dest.parent / name)
        return MARKER_NAME in (self._listed or {}).get(name, {})


def _marked(directory: Path) -> bool:
    """Whether ``directory`` carries a set-aside marker; one that cannot be told (EIO from a
    lookup) is marked again: the write says so if it fails too."""
    try:
        return set_aside_by(directory) is not None
    except OSError:
        return False


def _began(directory: Path, *, recorded_only: bool) -> Optional[float]:
    """When the committed checkpoint ``directory``'s save began (None: no commit file that
    parses, or, with ``recorded_only``, not recorded). Its commit file only, never its files:
    a commit's cost must not grow with the checkpoints beside it (a rollback is a matter of
    when saves began, and a torn sibling is never named by latest_complete anyway)."""
    manifest, _, mtime = read_commit(directory)
    return _began_of(manifest, mtime, recorded_only=recorded_only)


def _began_of(manifest: Optional[Manifest], mtime: float, *, recorded_only: bool) -> Optional[float]:
    if manifest is None:
        return None
    for text in (manifest.started_at, "" if recorded_only else manifest.committed_at):
        if text:
            try:
                return datetime.datetime.fromisoformat(text).timestamp()
            except ValueError:
                pass
    return None if recorded_only else mtime


def _mark(
    target: Destination, by: str, by_step: int, name: str, step: int, write: Callable[[Destination, bytes], None]
) -> bool:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    document = {"format": FORMAT, "version": VERSION, "by": by, "at": now,
                "why": f"{by} (step {by_step}) began after {name} (step {step}) had: a run resumed from an "
                       "older checkpoint and went on from there"}  # fmt: skip
    try:
        write(target / MARKER_NAME, (json.dumps(document, indent=1) + "\n").encode())
    except OSError as exc:
        log.warning("safestage: %s was abandoned (%s began after it, from an older checkpoint), but could not "
                    "be set aside (%s): latest_complete may still name it", target, by, exc)  # fmt: skip
        return False
    log.warning("safestage: set aside %s: %s began after it, from an older checkpoint (a resumed run's new "
                "timeline); latest_complete no longer names it", target, by)  # fmt: skip
    return True
