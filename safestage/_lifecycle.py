"""The process lifecycle in one place: what a forked child resets, and how our threads run.

fork(). A child made by ``fork()`` (a DataLoader worker, a multiprocessing Pool) inherits
our memory but none of the parent's other threads: a lock one of them held stays locked
forever, their publishes never finish here, and descriptors they were writing stay open.
Every module keeps its own reset function; this module registers the one at-fork hook that
runs them, in the order below, each only if its module was imported. Add a reset here, never
with a ``register_at_fork`` of its own: ``grep -rl register_at_fork safestage`` lists only
this file.

Threads. Every thread of ours (a followed copy, a background publish, a directory commit's
publishers) is started by ``start_worker`` and waited on through ``Worker.wait`` (or the
background publisher's condition), never ``Thread.join()``: on CPython 3.11 a join() that a
KeyboardInterrupt cuts short can mark the live thread as stopped, and the next join() returns
at once (bpo-45274).

Clean-ups that a Ctrl-C must not cut short run inside ``_interrupts.deferred()``.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Callable, Optional

# (module, its reset function), run in this order in a forked child.
AFTER_FORK_IN_CHILD: tuple[tuple[str, str], ...] = (
    # First: close our destination write descriptors before anything else runs in the child
    # (on mountpoint-s3 a copy held by a worker keeps the parent's upload open).
    ("safestage._fork_fds", "after_fork_in_child"),
    # Ctrl-C gets its real handler back if the fork came during a deferred clean-up.
    ("safestage._interrupts", "after_fork_in_child"),
    # Locks that a parent thread may have held at fork(): fresh ones.
    ("safestage._mounts", "after_fork_in_child"),
    ("safestage._publish", "after_fork_in_child"),
    ("safestage._autoload", "after_fork_in_child"),
    # Per-process state: the checked staging roots, the parent's jobs (the registry of work in
    # flight), the activation stack.
    ("safestage._save", "after_fork_in_child"),
    # The parent's save directories' locks: closed here, so only the parent holds them.
    ("safestage._kept", "after_fork_in_child"),
    ("safestage._work", "after_fork_in_child"),
    ("safestage._snapshot", "after_fork_in_child"),
    ("safestage._patch", "after_fork_in_child"),
    # Object-store clients: a parent's connection pool (and its runtime's threads) is not the child's.
    ("safestage._object_store", "after_fork_in_child"),
    # safestage's gloo groups: process groups do not survive fork().
    ("safestage.checkpoint._collective", "after_fork_in_child"),
)


def _after_fork_in_child() -> None:
    for module_name, function in AFTER_FORK_IN_CHILD:
        module = sys.modules.get(module_name)
        if module is None:
            continue  # never imported: nothing of it to reset
        try:
            getattr(module, function)()
        except Exception:  # one failing reset must not skip the others
            traceback.print_exc()


_registered = False


def register() -> None:
    """Install the at-fork hook (once per process; the package's import calls this)."""
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _registered = True


class Worker:
    """One of our threads, waited on through an Event (see the module docstring)."""

    def __init__(self, target: Callable[[], None], *, name: str, daemon: bool) -> None:
        self._done = threading.Event()

        def run() -> None:
            try:
                target()
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=name, daemon=daemon)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until the target has returned (or raised); False if ``timeout`` passed first."""
        return self._done.wait(timeout)


def start_worker(target: Callable[[], None], *, name: str, daemon: bool = False) -> Worker:
    """Start ``target`` on a thread of its own. RuntimeError when no thread can be had (a
    container at its pids limit, RLIMIT_NPROC, interpreter shutdown on 3.12+): the caller
    then does the work itself."""
    worker = Worker(target, name=name, daemon=daemon)
    worker._thread.start()
    return worker


register()
