"""A tap on the system calls safestage itself makes, to act at the N-th one (test_invariant_walk).

Every call that a module of the ``safestage`` package (not ``safestage.testing``) makes to
one of the functions below counts as a step of the save, in order. The tap records them (a
dry run gives the list of steps of a whole save), and at one chosen step it can act instead
of the call: raise an OSError of that call's errno, raise KeyboardInterrupt (what Ctrl-C does
there), SIGKILL the process, fork, or run a callback (a concurrent cleaner) and go on.
Calls from other code (pathlib, shutil's own internals, pytest) pass untouched.

``requests=True`` counts the object-store requests too: each call a safestage module makes to
a request function of ``safestage._object_store`` (an upload, a PUT, a GET, a LIST, a batched
DELETE), named ``store.<function>``. The requests themselves run in obstore's Rust runtime,
where no system call of Python's is seen; a step before each is where a process dies between
two requests of a URL commit (after its data objects, before its commit object).

``calls`` counts more functions, each named by its own name: the gloo exchanges of a collective
commit (``_collective._gather``, ``_broadcast``, ``_hold``: between the two collectives of one
exchange), which make no system call of Python's. ``main_only`` counts the main thread's calls
only: the steps where a Ctrl-C can land, in an order the publishing threads do not shuffle.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import os
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

# The request functions of safestage._object_store (requests=True).
_STORE_NAMES = ("upload", "put_bytes", "get", "read", "head", "listing", "delete", "chunks", "download",
                "read_range")  # fmt: skip

# What each call answers when the filesystem fails it: the errno a user would see there.
ERRNO = {
    "open": errno.EACCES,
    "builtins.open": errno.EIO,
    "close": errno.EIO,
    "write": errno.ENOSPC,
    "fsync": errno.EIO,
    "replace": errno.EPERM,
    "unlink": errno.EPERM,
    "mkdir": errno.ENOSPC,
    "rmdir": errno.EBUSY,
    "stat": errno.ESTALE,
    "lstat": errno.EIO,
    "fstat": errno.EIO,
    "scandir": errno.EIO,
    "listdir": errno.EIO,
    "readlink": errno.EIO,
    "chmod": errno.EPERM,
    "fchmod": errno.EPERM,
    "posix_fadvise": errno.EINVAL,
    "flock": errno.ENOLCK,
    "fcntl": errno.EINVAL,
    "rmtree": errno.EBUSY,
    # A store request that fails: the store's 500, after obstore's retries (StoreError, EIO).
    **{f"store.{name}": errno.EIO for name in _STORE_NAMES},
}
_OS_NAMES = (
    "open", "close", "write", "fsync", "replace", "unlink", "mkdir", "rmdir", "stat", "lstat",
    "fstat", "scandir", "listdir", "readlink", "chmod", "fchmod", "posix_fadvise",
)  # fmt: skip


@dataclass(frozen=True)
class Step:
    index: int
    name: str
    arg: str
    thread: str
    module: str  # the safestage module that made the call


def _ours(frame: Any, name: str = "") -> bool:
    module = frame.f_globals.get("__name__", "")
    if name.startswith("store.") and module == "safestage._object_store":
        return False  # a request function calling another: one request, counted once
    return module.startswith("safestage") and not module.startswith("safestage.testing")


class Tap:
    """``with Tap(at=k, action=...) as tap:`` run a save; ``tap.steps`` lists the calls."""

    def __init__(self, at: Optional[int] = None, action: Optional[str] = None,
                 callback: Optional[Callable[[], None]] = None, *, requests: bool = False,
                 calls: tuple[tuple[Any, str], ...] = (), main_only: bool = False,
                 again: Optional[int] = None) -> None:  # fmt: skip
        self.at = at
        self.again = again  # a second step to act at (a second Ctrl-C)
        self.requests = requests
        self.calls = calls  # more functions to count, each (module, name): named by its name
        self.main_only = main_only  # count the main thread's calls only (where Ctrl-C lands)
        self.action = action
        self.callback = callback
        self.steps: list[Step] = []
        self.fired: Optional[Step] = None
        self.fired_again: Optional[Step] = None
        self.forked: Optional[int] = None  # the child's pid, for action="fork"
        self.child: Optional[Callable[[], int]] = None  # what a forked child runs (its exit code)
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    # -- installing ---------------------------------------------------------------------------

    def __enter__(self) -> Tap:
        for name in _OS_NAMES:
            self._patch(os, name, name)
        self._patch(fcntl, "flock", "flock")
        self._patch(fcntl, "fcntl", "fcntl")
        self._patch(shutil, "rmtree", "rmtree")
        self._patch(builtins, "open", "builtins.open")
        if self.requests:
            from safestage import _object_store

            for name in _STORE_NAMES:
                self._patch(_object_store, name, f"store.{name}")
        for owner, attr in self.calls:
            self._patch(owner, attr, attr)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)
        self._saved.clear()

    def _patch(self, owner: Any, attr: str, name: str) -> None:
        real = getattr(owner, attr)
        tap = self

        def tapped(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if not _ours(caller, name) or (
                tap.main_only and threading.current_thread() is not threading.main_thread()
            ):
                return real(*args, **kwargs)
            with tap._lock:
                step = Step(len(tap.steps), name, repr(args[0])[-80:] if args else "",
                            threading.current_thread().name, caller.f_globals["__name__"])  # fmt: skip
                tap.steps.append(step)
                act = step.index == tap.at or (tap.again is not None and step.index == tap.again)
            if not act:
                return real(*args, **kwargs)
            if tap.fired is not None and step.index == tap.again:
                tap.fired_again = step
            else:
                tap.fired = step
            return tap._act(step, real, args, kwargs)

        self._saved.append((owner, attr, real))
        setattr(owner, attr, tapped)

    # -- acting -------------------------------------------------------------------------------

    def _fork_child(self) -> None:
        pid = os.fork()
        if pid:
            self.forked = pid
            return
        self.at = None  # the child's own calls are not acted on again
        code = 70
        try:
            code = self.child() if self.child is not None else 0
        except BaseException:  # noqa: BLE001 - reported, then the exit code says it
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)

    def _act(self, step: Step, real: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        action = self.action
        if action == "oserror":
            code = ERRNO[step.name]
            if step.name == "rmtree" and kwargs.get("ignore_errors"):
                return None  # what a failing rmtree(ignore_errors=True) does: nothing, silently
            if step.name == "close":
                real(*args, **kwargs)  # Linux releases the descriptor even when close fails
            if step.name.startswith("store."):
                from safestage._object_store import StoreError

                raise StoreError(code, f"{step.name} {args[0]}: 500 Internal Server Error (tapped)", str(args[0]))
            raise OSError(code, os.strerror(code), args[0] if args and isinstance(args[0], (str, os.PathLike)) else None)
        if action == "interrupt":
            # What a Ctrl-C does at this point: Python runs SIGINT's current handler in the
            # main thread (default_int_handler raises KeyboardInterrupt; a clean-up that defers
            # interrupts notes it and raises it when done). Other threads never see it.
            if threading.current_thread() is not threading.main_thread():
                self.fired = None
                return real(*args, **kwargs)
            handler = signal.getsignal(signal.SIGINT)
            if step.name == "close":
                real(*args, **kwargs)
                if callable(handler):
                    handler(signal.SIGINT, None)
                return None
            if callable(handler):
                handler(signal.SIGINT, None)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "fork":
            # Another thread forks while this one is at this step (a DataLoader worker, a
            # launcher): the child holds only that thread, with whatever locks and counters
            # the saving thread had at that moment, and saves a file of its own.
            forker = threading.Thread(target=self._fork_child, name="forker")
            forker.start()
            forker.join()
        if action == "callback" and self.callback is not None:
            self.callback()
        return real(*args, **kwargs)
