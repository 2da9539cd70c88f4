"""The exceptions safestage raises.

Each subclasses the builtin that callers already catch: a ConfigError is a ValueError, a
StagingError or PublishError is an OSError with ``errno`` and ``filename`` set, so code
that handles a failed ``save_file`` today keeps handling it. All of them pickle (they
cross process boundaries in torchrun and multiprocessing workers).
"""

from __future__ import annotations

import os
from typing import Any, Optional


class SafestageError(Exception):
    """Base class of every error safestage raises itself."""


class ConfigError(SafestageError, ValueError):
    """A bad option: names the option, where it came from, and the accepted values."""


class _PathError(SafestageError, OSError):
    """An OSError whose message says what failed, where, the errno and what to do.

    ``str(exc)`` is the whole message; ``exc.errno``, ``exc.strerror`` and ``exc.filename``
    are set as on any OSError.
    """

    def __init__(self, errno: Optional[int], message: str, filename: Optional[str] = None) -> None:
        strerror = os.strerror(errno) if errno else None
        super().__init__(errno, strerror, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errno, self.message, self.filename), self.__dict__)


class StagingError(_PathError):
    """The staging root is missing, unusable, on a network/FUSE mount, or ran out of room."""


class PublishError(_PathError):
    """Copying the staged file to its destination failed.

    ``staged_path`` is where the complete staged copy is kept (None if it could not be
    kept), so nothing is lost: the message gives the ``safestage recover`` command that
    publishes (or commits) it once the process has ended; or retry the save.

    For a directory commit (``staged_dir``), ``landed`` and ``not_landed`` list the relative
    paths of the files that reached the destination and of those that did not (kept under
    ``staged_path``); no commit file was written. Both are None for a single file.
    """

    staged_path: Optional[str] = None
    step: Optional[str] = None
    landed: Optional[tuple[str, ...]] = None
    not_landed: Optional[tuple[str, ...]] = None

    def __init__(
        self,
        errno: Optional[int],
        message: str,
        filename: Optional[str] = None,
        *,
        staged_path: Optional[str] = None,
        step: Optional[str] = None,
        landed: Optional[tuple[str, ...]] = None,
        not_landed: Optional[tuple[str, ...]] = None,
    ) -> None:
        super().__init__(errno, message, filename)
        self.staged_path = staged_path
        self.step = step
        self.landed = landed
        self.not_landed = not_landed



class FetchError(_PathError):
    """Downloading a committed checkpoint from an object store failed (``safestage.fetch``):
    an object missing (ENOENT), overwritten since the commit (ESTALE), not matching its CRC-32
    (EBADMSG), or the store's or the local disk's error. The local copy has no commit file."""

def as_safetensors_error(exc: BaseException) -> BaseException:
    """Make ``exc``, raised inside a patched save, also a ``safetensors.SafetensorError``
    (in place: its traceback and chain stay as they are). Anything else is returned as is."""
    if type(exc) not in (PublishError, StagingError):
        return exc
    try:
        from ._safetensors_errors import BY_BASE
    except ImportError:  # a safetensors without SafetensorError at the top: nothing to add
        return exc
    exc.__class__ = BY_BASE[type(exc)]
    return exc


def as_torch_error(exc: BaseException) -> BaseException:
    """Make ``exc``, raised inside a staged ``torch.save``, also a ``RuntimeError`` (what
    torch.save's own writer raises when a write fails), in place. Anything else is returned
    as is."""
    if type(exc) not in (PublishError, StagingError):
        return exc
    from ._torch_errors import BY_BASE

    exc.__class__ = BY_BASE[type(exc)]
    return exc
