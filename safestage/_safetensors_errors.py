"""safestage's errors as safetensors' own ``SafetensorError`` too (imported with safetensors).

Code that wraps ``save_file`` in ``except SafetensorError`` today must keep catching a failed
save once staging is on: an error raised from inside a patched save is an instance of these
classes, which are at once safestage's class (an ``OSError`` with errno, filename and
``staged_path``) and safetensors'. A module of their own, so they pickle by reference.
"""

from __future__ import annotations

from safetensors import SafetensorError

from . import _errors


class PublishError(_errors.PublishError, SafetensorError):
    __doc__ = _errors.PublishError.__doc__


class StagingError(_errors.StagingError, SafetensorError):
    __doc__ = _errors.StagingError.__doc__


BY_BASE: dict[type[BaseException], type[BaseException]] = {
    _errors.PublishError: PublishError,
    _errors.StagingError: StagingError,
}
