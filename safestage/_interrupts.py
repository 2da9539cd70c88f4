"""Clean-ups that a Ctrl-C cannot cut short.

A KeyboardInterrupt that lands while safestage removes its temp file, closes a descriptor
or deletes its rename probe would leave that file behind (issue 9). Python runs signal
handlers in the main thread only, so there a clean-up swaps SIGINT's handler for one that
just notes the signal, and hands it to the previous handler once the clean-up is done: the
interrupt still happens, right after. (Blocking the signal with pthread_sigmask would not
do: another thread of the process would take it.) Other threads never see KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Optional


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[Optional[FrameType]] = []

    def note(signum: int, frame: Optional[FrameType]) -> None:
        noted.append(frame)

    try:
        previous = signal.signal(signal.SIGINT, note)
    except (ValueError, OSError):  # not the main interpreter: nothing to defer
        yield
        return
    _deferring.append((note, previous))
    try:
        yield
    finally:
        _deferring.remove((note, previous))
        signal.signal(signal.SIGINT, previous)
        if noted:
            _deliver(previous, noted[0])


# (noting handler, the handler it replaced) while a clean-up defers interrupts
_deferring: list[tuple[Any, Any]] = []


def after_fork_in_child() -> None:  # registered by _lifecycle
    # A child forked (from another thread) during a deferred clean-up inherits the noting
    # handler, and no clean-up of its own will ever restore it: give it the real one back.
    if _deferring and signal.getsignal(signal.SIGINT) is _deferring[0][0]:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGINT, _deferring[0][1])
    _deferring.clear()



def _deliver(handler: Any, frame: Optional[FrameType]) -> None:
    if callable(handler):
        handler(signal.SIGINT, frame)  # default_int_handler raises KeyboardInterrupt here
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)
