"""Pipelined publishing: the caller serializes the next shard while earlier ones publish.

Serialization stays synchronous (safetensors 0.8 passes raw data pointers that are valid
only during the serialize_file call); only the copy to the destination moves to a worker.
Bounded: at most ``background=N`` files publish at once and the saving thread waits for a
free slot, so the staging root holds at most N + 1 files of the run at any time. Publishes
of the same destination run in order. Nothing is dropped: waiting raises the first error
(every error is logged), and interpreter exit completes whatever is pending.

Each publish runs on a daemon worker of _lifecycle, so that exit waits for it here, in
``_complete_at_exit``, and not in threading's join of non-daemon threads (which runs before
atexit and turns a Ctrl-C into "Exception ignored" and exit status 0). A Ctrl-C there ends
the process with status 130, naming what is not published and where its complete staged
copy is kept. A publish that fails with nobody left to raise it to (the program exits
without closing its stage) is written to stderr whatever the logging setup, and the process
exits with status 1 (``os._exit`` after flushing logging and the standard streams): a
program that lost a checkpoint must not look successful. Where no thread can be had (a pids
limit, interpreter shutdown on 3.12+) or exit is under way, the publish runs in the caller.

The publisher belongs to one process: a child made by ``fork()`` starts without it (its
threads and publishes are the parent's) and makes a fresh one if it needs one.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Callable, Optional

from . import _loud
from ._interrupts import deferred
from ._lifecycle import start_worker

log = logging.getLogger("safestage")


class _Publish:
    """One background publish; ``finished`` and ``error`` are set under the publisher's lock."""

    def __init__(self, dest: Path, kept: Optional[Path], owner: object, kind: str) -> None:
        self.dest, self.kept, self.owner, self.kind = dest, kept, owner, kind
        self.finished = False
        self.error: Optional[BaseException] = None


class BackgroundPublisher:
    """Every background publish of the process, and its error until it is raised: an owner
    (a Stage, a Lightning plugin) waits for its own with ``wait(owner)``, ``safestage.wait()``
    for all of them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._condition = threading.Condition()
        # In submission order; a success is forgotten at the next submit, an error once raised.
        self._publishes: list[_Publish] = []

    def submit(
        self,
        job: Callable[[], object],
        dest: Path,
        *,
        max_pending: int,
        owner: object,
        kept: Optional[Path] = None,
        not_started: Callable[[BaseException], None],
        kind: str = "file",
    ) -> None:
        """Run ``job`` on a worker once fewer than ``max_pending`` publishes of ``kind`` (a
        "file", or a directory "commit") are running and no earlier publish of ``dest`` is
        pending; the caller waits until then. Interrupted during that wait,
        ``not_started(exc)`` runs (the caller keeps its copy) and ``exc`` is raised; from then
        on the publish is the publisher's, its error raised by wait()."""
        publish = _Publish(dest, kept, owner, kind)
        try:
            with self._condition:
                self._condition.wait_for(
                    lambda: len(self._running(kind=kind)) < max_pending and not self._running(dest=dest)
                )
                self._publishes = [p for p in self._publishes if not p.finished or p.error is not None]
                self._publishes.append(publish)
        except BaseException as exc:
            not_started(exc)
            raise
        handed = False
        try:
            with deferred():  # a Ctrl-C cutting Thread.start() short may have started it anyway
                if not _exiting:
                    with contextlib.suppress(RuntimeError):  # no thread to be had
                        start_worker(functools.partial(self._run, publish, job),
                                     name="safestage-publish", daemon=True)  # fmt: skip
                        handed = True
        finally:
            if not handed:  # here and now, then
                self._run(publish, job)

    def _run(self, publish: _Publish, job: Callable[[], object]) -> None:
        error: Optional[BaseException] = None
        try:
            job()
        except BaseException as exc:
            error = exc
            _loud.error(f"background {'commit' if publish.kind == 'commit' else 'publish'} of {publish.dest} failed: {exc}")
        finally:
            with self._condition:
                publish.error, publish.finished = error, True
                self._condition.notify_all()

    def _running(self, dest: Optional[Path] = None, owner: object = None, kind: Optional[str] = None) -> list[_Publish]:
        return [
            p for p in self._publishes
            if not p.finished and (dest is None or p.dest == dest) and (owner is None or p.owner is owner)
            and (kind is None or p.kind == kind)
        ]  # fmt: skip

    def make_room(self, kind: str, limit: int) -> None:
        """Wait until fewer than ``limit`` publishes of ``kind`` are running (a background
        commit waits so before its block starts: never more local copies than that)."""
        with self._condition:
            self._condition.wait_for(lambda: len(self._running(kind=kind)) < limit)

    def settle(self, dest: Optional[Path] = None, *, owner: object = None) -> None:
        """Wait until no publish of ``dest`` (of ``owner``; None: any) is pending, raising
        nothing: a later synchronous save of the same file must land after it, never under it."""
        with self._condition:
            self._condition.wait_for(lambda: not self._running(dest, owner))

    def settle_under(self, directory: Path) -> None:
        """Wait until no publish of a file under ``directory`` is pending: a checkpoint
        committed there must not have an older save land in it after its commit file."""
        with self._condition:
            self._condition.wait_for(lambda: not any(directory in p.dest.parents for p in self._running()))

    def end_threads(self) -> None:
        """Once nothing is publishing, wait for the threads of the finished publishes to be
        gone (a Lightning fit ends so: its test harness fails a test that leaves threads)."""
        with self._condition:
            if self._running():
                return
        for thread in threading.enumerate():
            if thread.name == "safestage-publish" and thread is not threading.current_thread():
                thread.join(timeout=5.0)

    def running(self, owner: object) -> int:
        """How many of ``owner``'s publishes are not finished yet."""
        with self._condition:
            return len(self._running(owner=owner))

    def pending(self) -> int:
        with self._condition:
            return len(self._running())

    def pending_copies(self) -> list[tuple[Path, Optional[Path]]]:
        with self._condition:
            return [(p.dest, p.kept) for p in self._running()]

    def failures(self, owner: object = None, *, finished_only: bool = False) -> list[BaseException]:
        """Wait for ``owner``'s publishes (None: every one); return their errors, which are
        then observed (never returned again). ``finished_only``: do not wait."""
        with self._condition:
            chosen = [p for p in self._publishes if owner is None or p.owner is owner]
            if finished_only:
                chosen = [p for p in chosen if p.finished]
            self._condition.wait_for(lambda: all(p.finished for p in chosen))
            self._publishes = [p for p in self._publishes if p not in chosen]
        return [p.error for p in chosen if p.error is not None]

    def wait(self, owner: object = None, *, finished_only: bool = False) -> None:
        """Raise the first of ``failures()``, with a note naming every other destination that
        failed (each was also reported when it failed)."""
        failed = self.failures(owner, finished_only=finished_only)
        if not failed:
            return
        first, others = failed[0], [str(error) for error in failed[1:]]
        if others and hasattr(first, "add_note"):
            first.add_note(f"{len(others)} more background publish(es) failed too:")
            for text in others:
                first.add_note(f"  {text}")
        raise first


_publisher: Optional[BackgroundPublisher] = None
_publisher_lock = threading.Lock()
_exiting = False  # set at exit: a save from an atexit handler run after ours publishes inline
# Who may publish in the background here: owners adopted in this very process (a forked
# child inherits the parent's Stages and plugins but none of their publishes: reset at fork).
_owners: weakref.WeakSet[object] = weakref.WeakSet()


def publisher() -> BackgroundPublisher:
    global _publisher
    with _publisher_lock:
        if _publisher is None:
            _publisher = BackgroundPublisher()
        return _publisher


def adopt(owner: object) -> None:
    """``owner`` (a Stage opening, a plugin made or unpickled) lives in this process: its
    saves may publish in the background here."""
    _owners.add(owner)


def may_defer(owner: object) -> bool:
    """Whether a save of ``owner`` may return before its publish: only in the process that
    adopted it, and not in a multiprocessing child. A forked child, or a Pool worker (any
    start method) that may be terminated as soon as its task returns, publishes before its
    save returns (so no publisher ever exists there, and exit has nothing to wait for)."""
    if owner not in _owners:
        return False
    multiprocessing = sys.modules.get("multiprocessing")
    return multiprocessing is None or multiprocessing.parent_process() is None


def _current() -> Optional[BackgroundPublisher]:
    current = _publisher
    return current if current is not None and current.pid == os.getpid() else None


def wait(owner: object = None, *, finished_only: bool = False) -> None:
    """Wait for ``owner``'s background publishes (None: every one in the process, as
    ``safestage.wait()``); raise the first error."""
    current = _current()
    if current is not None:
        current.wait(owner, finished_only=finished_only)


def running(owner: object) -> int:
    current = _current()
    return current.running(owner) if current is not None else 0


def settle(dest: Optional[Path] = None, *, owner: object = None) -> None:
    """Wait for any background publish of ``dest`` (of ``owner``) in this process, raising
    nothing (none pending: returns at once)."""
    current = _current()
    if current is not None:
        current.settle(dest, owner=owner)


def settle_under(directory: Path) -> None:
    """Wait for any background publish of a file under ``directory`` in this process."""
    current = _current()
    if current is not None:
        current.settle_under(directory)


def make_room(kind: str, limit: int) -> None:
    current = _current()
    if current is not None:
        current.make_room(kind, limit)


def failures() -> list[BaseException]:
    """Wait for every background publish in the process; return the errors of those nobody
    has waited for (now seen), for a caller that decides which of them are errors."""
    current = _current()
    return current.failures() if current is not None else []


def end_threads() -> None:
    """Wait for this process's finished publishing threads to be gone, if nothing is publishing."""
    current = _current()
    if current is not None:
        current.end_threads()


def _complete_at_exit() -> None:
    """Registered when safestage is imported, so that it runs after the handlers registered
    later (atexit is last-in, first-out) and only those registered earlier can be skipped
    by the exit below. Our workers are daemon threads: this is where exit waits for them."""
    global _exiting
    _exiting = True
    current = _current()
    if current is None:
        return
    try:
        failures = current.failures()
    except KeyboardInterrupt:
        # Ctrl-C while exit waits for a publish: the interpreter would go on and kill the
        # publishing thread mid-copy. Say what is not published and where its data is.
        lines = [
            f"safestage: interrupted at exit while publishing {dest}; it is NOT complete there"
            + (f"; the complete staged copy is kept at {kept}" if kept is not None else "")
            + "\n"
            for dest, kept in current.pending_copies()
        ] or ["safestage: interrupted at exit while waiting for background publishes\n"]
        _exit_loudly(lines, status=130)
        return
    except BaseException:
        return
    if failures:
        _exit_loudly(
            [
                f"safestage: a background publish failed and nobody waited for it; the file is "
                f"NOT at its destination: {error}\n"
                for error in failures
            ],
            status=1,
        )


def _exit_loudly(lines: list[str], *, status: int) -> None:
    # Straight to file descriptor 2: the program may have closed or replaced sys.stderr.
    for line in lines:
        _loud.write_stderr(line)
    with contextlib.suppress(Exception):
        logging.shutdown()
    for each in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if each is not None:
                each.flush()
    os._exit(status)


def after_fork_in_child() -> None:  # registered by _lifecycle
    global _publisher, _publisher_lock, _owners
    _publisher = None  # the parent's workers and publishes do not exist here
    _publisher_lock = threading.Lock()
    _owners = weakref.WeakSet()


atexit.register(_complete_at_exit)
