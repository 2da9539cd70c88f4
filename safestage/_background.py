"""Pipelined publishing: the caller serializes the next shard while earlier ones publish.

Serialization stays synchronous (safetensors 0.8 passes raw data pointers that are valid
only during the serialize_file call); only the copy to the destination moves to a worker.
Bounded: at most ``max_pending`` files publish at once and the saving thread waits for a free
slot, so the staging root holds at most max_pending + 1 files of the run at any time.
Publishes of the same destination run in order. Nothing is dropped: waiting raises the
first error (every error is logged), and interpreter exit completes whatever is pending.

A publish that fails with nobody left to raise it to (the program exits without closing
its stage) is written to stderr whatever the logging setup, and the process exits with
status 1 (``os._exit`` after flushing logging and the standard streams): a program that
lost a checkpoint must not look successful.

The publisher belongs to one process: a child made by ``fork()`` starts without it (its
threads, pending map and futures are the parent's) and makes a fresh one if it needs one.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

from . import _loud

if TYPE_CHECKING:  # concurrent.futures is imported on first background use, not at start-up
    from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("safestage")

T = TypeVar("T")


class BackgroundPublisher:
    """A process-wide pool of publishing threads with a bound on pending files. It owns every
    background publish's future and error: an owner (a Stage, a Lightning plugin) waits for
    its own with ``wait(owner)``, ``safestage.wait()`` for all of them."""

    def __init__(self, workers: int = 8) -> None:
        self.pid = os.getpid()
        self._workers = workers
        self._executor: Optional[ThreadPoolExecutor] = None  # started by the first submit
        self._condition = threading.Condition()
        # ticket -> (destination, where its complete staged copy is), while publishing
        self._pending: dict[object, tuple[Path, Optional[Path]]] = {}
        self._unobserved: dict[Future[object], object] = {}  # future -> owner, insertion-ordered

    def submit(
        self,
        job: Callable[[], T],
        dest: Path,
        *,
        max_pending: int,
        owner: object,
        kept: Optional[Path] = None,
    ) -> Future[T]:
        """Run ``job`` on a worker once fewer than ``max_pending`` files are publishing and
        no earlier publish of ``dest`` is pending. Blocks the caller until then."""
        ticket = object()

        def run() -> T:
            # Report and release the slot inside the job, before its future completes: a done
            # callback would run after wait() has already returned to the caller.
            try:
                return job()
            except BaseException as exc:
                _loud.error(f"background publish of {dest} failed: {exc}")
                raise
            finally:
                with self._condition:
                    del self._pending[ticket]
                    self._condition.notify_all()

        with self._condition:
            self._condition.wait_for(
                lambda: len(self._pending) < max_pending and not self._publishing(dest)
            )
            self._pending[ticket] = (dest, kept)
            try:
                if self._executor is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="safestage-publish")
                future: Future[T] = self._executor.submit(run)
            except RuntimeError:  # interpreter shutting down: publish here and now instead
                del self._pending[ticket]
                future = _run_inline(job)
            for done in [f for f in self._unobserved if f.done() and f.exception() is None]:
                del self._unobserved[done]  # nothing to raise: a long run keeps no history
            self._unobserved[future] = owner  # type: ignore[index]
        return future

    def _publishing(self, dest: Path) -> bool:
        return any(pending == dest for pending, _ in self._pending.values())

    def settle(self, dest: Path) -> None:
        """Wait until no publish of ``dest`` is pending: a later synchronous save of the same
        file must land after it, never under it."""
        with self._condition:
            self._condition.wait_for(lambda: not self._publishing(dest))

    def settle_under(self, directory: Path) -> None:
        """Wait until no publish of a file under ``directory`` is pending: a checkpoint
        committed there must not have an older save land in it after its commit file."""
        with self._condition:
            self._condition.wait_for(
                lambda: not any(directory in dest.parents for dest, _ in self._pending.values())
            )

    def running(self, owner: object) -> list[Future[object]]:
        """``owner``'s publishes not finished yet."""
        with self._condition:
            return [f for f, o in self._unobserved.items() if o is owner and not f.done()]

    def wait(self, owner: object = None, *, finished_only: bool = False) -> None:
        """Wait for ``owner``'s publishes (None: every publish in the process); raise the
        first error, with a note naming every other destination that failed (each was also
        reported when it failed). Each error is raised once: a publish already waited for is
        skipped. ``finished_only``: do not wait, raise what has already failed."""
        with self._condition:
            chosen = [
                f for f, o in self._unobserved.items()
                if (owner is None or o is owner) and (f.done() or not finished_only)
            ]  # fmt: skip
        failed = [(future, error) for future in chosen if (error := future.exception()) is not None]
        with self._condition:
            for future in chosen:
                self._unobserved.pop(future, None)
        if not failed:
            return
        first = failed[0][1]
        others = [str(error) for _, error in failed[1:]]
        if others and hasattr(first, "add_note"):
            first.add_note(f"{len(others)} more background publish(es) failed too:")
            for text in others:
                first.add_note(f"  {text}")
        raise first

    def end_threads(self) -> None:
        """End the publishing threads if nothing is publishing; the next submit starts new
        ones. A Lightning fit ends so: its test harness fails a test that leaves threads."""
        with self._condition:
            if self._pending:
                return
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def pending_copies(self) -> list[tuple[Path, Optional[Path]]]:
        with self._condition:
            return list(self._pending.values())

    def pending(self) -> int:
        with self._condition:
            return len(self._pending)

    def unobserved_failures(self) -> list[BaseException]:
        """Wait for every publish nobody waited for; return their errors (now observed)."""
        with self._condition:
            chosen, self._unobserved = list(self._unobserved), {}
        return [error for error in (future.exception() for future in chosen) if error is not None]


_publisher: Optional[BackgroundPublisher] = None
_publisher_lock = threading.Lock()
# Who may publish in the background here: owners adopted in this very process (a forked
# child inherits the parent's Stages and plugins but none of their publishes: reset at fork).
_owners: weakref.WeakSet[object] = weakref.WeakSet()


def publisher() -> BackgroundPublisher:
    global _publisher
    with _publisher_lock:
        if _publisher is None:
            _publisher = BackgroundPublisher()
            _finalize_in_multiprocessing_child()
        return _publisher


def adopt(owner: object) -> None:
    """``owner`` (a Stage opening, a plugin made or unpickled) lives in this process: its
    saves may publish in the background here."""
    _owners.add(owner)


def may_defer(owner: object) -> bool:
    """Whether a save of ``owner`` may return before its publish: only in the process that
    adopted it, and not in a multiprocessing child. A forked child, or a Pool worker (any
    start method) that may be terminated as soon as its task returns, publishes before its
    save returns."""
    if owner not in _owners:
        return False
    multiprocessing = sys.modules.get("multiprocessing")
    return multiprocessing is None or multiprocessing.parent_process() is None


def wait(owner: object = None, *, finished_only: bool = False) -> None:
    """Wait for ``owner``'s background publishes (None: every one in the process, as
    ``safestage.wait()``); raise the first error."""
    current = _publisher
    if current is not None and current.pid == os.getpid():
        current.wait(owner, finished_only=finished_only)


def failures() -> list[BaseException]:
    """Wait for every background publish in the process; return the errors of those nobody
    has waited for (now seen), for a caller that decides which of them are errors."""
    current = _publisher
    if current is None or current.pid != os.getpid():
        return []
    return current.unobserved_failures()


def running(owner: object) -> list[Future[object]]:
    current = _publisher
    return current.running(owner) if current is not None and current.pid == os.getpid() else []


def settle(dest: Path) -> None:
    """Wait for any background publish of ``dest`` in this process (none: returns at once)."""
    current = _publisher
    if current is not None and current.pid == os.getpid():
        current.settle(dest)


def end_threads() -> None:
    """End this process's publishing threads if nothing is publishing."""
    current = _publisher
    if current is not None and current.pid == os.getpid():
        current.end_threads()


def settle_under(directory: Path) -> None:
    """Wait for any background publish of a file under ``directory`` in this process."""
    current = _publisher
    if current is not None and current.pid == os.getpid():
        current.settle_under(directory)


def _complete_at_exit() -> None:
    """Registered when safestage is imported, so that it runs after the handlers registered
    later (atexit is last-in, first-out) and only those registered earlier can be skipped
    by the exit below. concurrent.futures has normally run every queued publish by now."""
    current = _publisher
    if current is None or current.pid != os.getpid():
        return
    try:
        failures = current.unobserved_failures()
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


def _finalize_in_multiprocessing_child() -> None:
    # A multiprocessing child ends with os._exit after its own finalizers: atexit never runs
    # there, so the exit check is registered with multiprocessing too.
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is None or multiprocessing.parent_process() is None:
        return
    from multiprocessing import util

    util.Finalize(None, _complete_at_exit, exitpriority=100)


def after_fork_in_child() -> None:  # registered by _lifecycle
    global _publisher, _publisher_lock, _owners
    _publisher = None  # the parent's pool threads and futures do not exist here
    _publisher_lock = threading.Lock()
    _owners = weakref.WeakSet()


atexit.register(_complete_at_exit)


def _run_inline(job: Callable[[], T]) -> Future[T]:
    from concurrent.futures import Future

    future: Future[T] = Future()
    try:
        future.set_result(job())
    except BaseException as exc:
        _loud.error(f"publish failed: {exc}")
        future.set_exception(exc)
    return future
