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
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted:
            _deliver(previous, noted[0])


def _deliver(handler: Any, frame: Optional[FrameType]) -> None:
    if callable(handler):
        handler(signal.SIGINT, frame)  # default_int_handler raises KeyboardInterrupt here
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)
