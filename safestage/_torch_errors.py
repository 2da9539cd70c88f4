"""safestage's errors as ``RuntimeError`` too, for a staged ``torch.save``.

``torch.save`` onto a path raises ``RuntimeError`` when its zip writer fails (an upload that
fails at close gives "basic_ios::clear: iostream error"), so code that wraps it in ``except
RuntimeError`` must keep catching a failed save once torch.save is staged. An error raised from
a staged torch.save is an instance of these classes: at once safestage's (an ``OSError`` with
errno, filename and ``staged_path``) and a ``RuntimeError``. A module of their own, so they
pickle by reference (as _safetensors_errors).
"""

from __future__ import annotations

from . import _errors


class PublishError(_errors.PublishError, RuntimeError):
    __doc__ = _errors.PublishError.__doc__


class StagingError(_errors.StagingError, RuntimeError):
    __doc__ = _errors.StagingError.__doc__


BY_BASE: dict[type[BaseException], type[BaseException]] = {
    _errors.PublishError: PublishError,
    _errors.StagingError: StagingError,
}
