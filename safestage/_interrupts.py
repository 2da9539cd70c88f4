"""Clean-ups that a Ctrl-C cannot cut short, and steps that take it at a point of their choosing.

A KeyboardInterrupt that lands while safestage removes its temp file, closes a descriptor
or deletes its rename probe would leave that file behind (issue 9). Python runs signal
handlers in the main thread only, so there a clean-up swaps SIGINT's handler for one that
just notes the signal, and hands it to the previous handler once the clean-up is done: the
interrupt still happens, right after. (Blocking the signal with pthread_sigmask would not
do: another thread of the process would take it.) Other threads never see KeyboardInterrupt.

A collective commit goes further: its ranks must pass the same agreement points in the same
order, so an interrupt raised inside one of its exchanges (or between two) would leave this rank
one exchange behind the others for the rest of the job. It defers interrupts from its first
exchange to its last and takes a noted one (``Noted.take``) at its next agreement point, where
it is told to every rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Optional


class Noted:
    """The interrupts a deferral kept from its handler (``previous``), until it ends."""

    def __init__(self, previous: Any = None) -> None:
        self.previous = previous
        self.frames: list[Optional[FrameType]] = []
        self.held = False  # its owner takes what is noted: the deferral's end does not hand it over

    def hold(self) -> None:
        self.held = True

    def note(self, signum: int, frame: Optional[FrameType]) -> None:
        self.frames.append(frame)

    def take(self) -> Optional[BaseException]:
        """The interrupts noted so far, each handed to its handler now, in order: what the first
        that raises raises (KeyboardInterrupt, or what a handler of the program's raises); None
        if none was noted or the handler raises nothing (one that only sets a flag, SIG_IGN).
        SIG_DFL is taken as Python's default (KeyboardInterrupt): ended there, the process
        would leave the other ranks waiting."""
        frames, self.frames = self.frames, []
        for frame in frames:
            if self.previous == signal.SIG_DFL:
                return KeyboardInterrupt()
            if not callable(self.previous):  # SIG_IGN, or a handler not set from Python
                continue
            try:
                self.previous(signal.SIGINT, frame)
            except BaseException as exc:
                return exc
            finally:
                self._kept_deferring()
        return None

    def _kept_deferring(self) -> None:
        """After the program's handler ran: one that set another handler (a first Ctrl-C asks
        for a stop, and arms the default for a second) made that the program's choice, to be
        restored at the end, and must not end the deferral before then."""
        if self not in _deferring:
            return
        now = signal.getsignal(signal.SIGINT)
        if now != self.note:
            self.previous = now
            signal.signal(signal.SIGINT, self.note)


@contextlib.contextmanager
def deferred() -> Iterator[Noted]:
    """SIGINT noted, not raised, until the block ends, then handed to its handler. In a deferral
    already running (an inner clean-up), the same one: its end hands it over."""
    if threading.current_thread() is not threading.main_thread():
        yield Noted()
        return
    if _deferring and signal.getsignal(signal.SIGINT) == _deferring[-1].note:
        yield _deferring[-1]
        return
    try:
        noted = Noted(signal.getsignal(signal.SIGINT))
        signal.signal(signal.SIGINT, noted.note)
    except (ValueError, OSError):  # not the main interpreter: nothing to defer
        yield Noted()
        return
    _deferring.append(noted)
    try:
        yield noted
    finally:
        _deferring.remove(noted)
        signal.signal(signal.SIGINT, noted.previous)
        if noted.frames and not noted.held:
            _deliver(noted.previous, noted.frames[0])


def taken() -> Optional[BaseException]:
    """``Noted.take`` of this thread's deferral; None outside one, and off the main thread
    (which never sees a KeyboardInterrupt)."""
    if not _deferring or threading.current_thread() is not threading.main_thread():
        return None
    return _deferring[-1].take()


# the deferrals running in the main thread, innermost last
_deferring: list[Noted] = []


def after_fork_in_child() -> None:  # registered by _lifecycle
    # A child forked (from another thread) during a deferred clean-up inherits the noting
    # handler, and no clean-up of its own will ever restore it: give it the real one back.
    if _deferring and signal.getsignal(signal.SIGINT) == _deferring[0].note:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGINT, _deferring[0].previous)
    _deferring.clear()


def _deliver(handler: Any, frame: Optional[FrameType]) -> None:
    if callable(handler):
        handler(signal.SIGINT, frame)  # default_int_handler raises KeyboardInterrupt here
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)
