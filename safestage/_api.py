"""The public handle: ``staged()`` as a with-block or decorator, ``activate()`` for long runs."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional

from . import _config, _patch
from ._config import UNSET, PathArg, Settings
from ._stage import PublishRecord, StagingArea, save_staged


class Stage(contextlib.ContextDecorator):
    """One activation of staging. ``records`` lists every file it published, in order.

    While any Stage is open, every ``safetensors`` save in the process (all threads) is staged.
    A save uses the innermost Stage its own thread opened, else the innermost one open in
    the process; that Stage's settings apply and it receives the record.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.records: list[PublishRecord] = []
        self._records_lock = threading.Lock()
        self._area: Optional[StagingArea] = None
        self._state = "new"  # new -> open -> closed
        self._opened_by: Optional[int] = None  # thread ident: its saves prefer this stage

    @property
    def staging_root(self) -> Path:
        return self.settings.staging_root()

    @property
    def active(self) -> bool:
        return self._state == "open"

    def _open(self) -> Stage:
        if self._state != "new":
            raise RuntimeError(
                "this safestage Stage was already used; call safestage.staged() again for a new one"
            )
        self._area = StagingArea(self.staging_root, is_default=self.settings.root is None)
        self._state = "open"
        self._opened_by = threading.get_ident()
        _patch.push(self)
        return self

    def close(self) -> None:
        """End this activation (idempotent). The original serialize_file returns when the
        last open activation ends."""
        if self._state == "open":
            self._state = "closed"
            _patch.remove(self)

    def __enter__(self) -> Stage:
        return self._open()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()

    def _recreate_cm(self) -> Stage:
        # As a decorator, each call gets a fresh activation with the same settings.
        return Stage(self.settings)

    def _save(self, serialize: Callable[[str], None], dest: Path) -> None:
        area = self._area
        assert area is not None, "a Stage saves only while open"
        record = save_staged(serialize, dest, self.settings, area)
        with self._records_lock:
            self.records.append(record)

    def __repr__(self) -> str:
        return (
            f"<safestage.Stage {self._state} root={str(self.staging_root)!r} "
            f"publish={self.settings.publish!r} fsync={self.settings.fsync} "
            f"records={len(self.records)}>"
        )


def staged(
    root: Optional[PathArg] = None,
    *,
    publish: Any = UNSET,
    fsync: Any = UNSET,
) -> Stage:
    """Stage every safetensors save made inside the block (or the decorated function).

    ``root`` is a local directory to serialize into (default: SAFESTAGE_DIR, else
    $TMPDIR/safestage-<uid>). ``publish`` is "auto", "replace" or "direct"; ``fsync``
    flushes each published file to stable storage. Arguments beat SAFESTAGE_* variables.
    Options are checked here (ConfigError); the staging root when the block starts
    (StagingError).
    """
    return Stage(_config.resolve(root=root, publish=publish, fsync=fsync))


def activate(
    root: Optional[PathArg] = None,
    *,
    publish: Any = UNSET,
    fsync: Any = UNSET,
) -> Stage:
    """Like ``staged()``, already entered: call ``.close()`` on the handle to end it."""
    return staged(root, publish=publish, fsync=fsync)._open()


def is_active() -> bool:
    """Whether staging is on in this process."""
    return _patch.is_active()
