"""The serialize_file and torch.save wrappers: what a hooked safetensors or torch.save save does.

The hook point of safetensors is the module global ``serialize_file`` of its modules (see
_patch): every ``save_file`` looks it up at call time, so wrapping the global also catches every
library that bound ``save_file`` at import time (``from safetensors.torch import save_file`` in
megatron-bridge, transformers, accelerate, peft).

With ``torch_save=True`` the module globals ``torch.save`` and ``torch.serialization.save``
are wrapped too, while some open stage asks for it (and only then: a torch global is a wider
patch than safetensors'). That catches every caller that looks ``torch.save`` up at call time
(``torch.save(...)`` in accelerate, transformers' Trainer, Lightning); code that did ``from
torch import save`` before activation holds the original. Paths are staged like a
safetensors save (same Stage._save, same publisher); file objects and buffers pass through.

Imported by whatever may open a stage or a deferring directory (_api, staged_dir): importing
it registers the wrappers with _patch.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from pathlib import Path
from typing import Any, Callable, Optional

from . import _patch
from ._destination import Destination, file_url
from ._errors import PublishError, StagingError, as_safetensors_error, as_torch_error
from ._interrupts import deferred
from ._paths import resolve_destination
from ._snapshot import Held, copy_save_file, copy_torch_save, offer, to_host, withdraw
from ._work import Job, abandon

log = logging.getLogger("safestage")


def _filename_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """(filename, positional?) of serialize_file(tensor_dict, filename, metadata=None)."""
    if len(args) >= 2:
        return args[1], True
    return kwargs.get("filename"), False


def _staging_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    try:
        return _stage_file(wrapped, args, kwargs)
    finally:
        withdraw()  # a pinned copy of its CUDA tensors that the save did not keep (_flatten_wrapper)


def _stage_file(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _patch.bypassed() or not _patch.takes_saves():
        return wrapped(*args, **kwargs)
    filename, positional = _filename_argument(args, kwargs)
    dest = _destination(filename)

    def snapshot(budget: int) -> Optional[tuple[Callable[[str], None], Held]]:
        copied = copy_save_file(args, kwargs, budget, what=str(dest))  # every argument as at the call
        if copied is None:
            return None
        return functools.partial(_serialize_into, wrapped, copied[0], copied[1], positional), copied[2]

    # Not a path we can stage, or a destination a plain save rejects before writing (missing
    # directory, a directory, a trailing slash): let safetensors raise exactly its own error.
    # A staged_file's or staged_dir's local directory is staging already (begin_save: None),
    # but a background staged_dir's takes the save (deferred: _save.plan).
    def serialize(staged: str) -> None:
        if positional:
            call_args = (args[0], staged, *args[2:])
            wrapped(*call_args, **kwargs)
        else:
            wrapped(*args, **{**kwargs, "filename": staged})

    begun: Optional[tuple[_patch.Owner, Job]] = None
    try:
        with deferred():  # a Ctrl-C as the save begins is raised where its job is known (below)
            begun = _patch.begin_save(dest) if dest is not None else None
        if begun is None or dest is None:
            return wrapped(*args, **kwargs)
        owner, job = begun
        with _patch.bypass():  # a wrapper over ours, calling back into us, must not stage twice
            return owner._save(serialize, dest, as_error=as_safetensors_error, needs=_payload_bytes(args, kwargs),
                               job=job, snapshot=snapshot)  # fmt: skip
    except BaseException as exc:
        if isinstance(exc, (PublishError, StagingError)):
            as_safetensors_error(exc)  # still caught by `except SafetensorError` (issue 9)
        if begun is not None:
            abandon(begun[1], exc)
        raise


def _serialize_into(
    wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], positional: bool, staged: str
) -> None:
    """serialize_file(tensor_dict, filename, metadata=None) with ``staged`` as its filename."""
    if positional:
        wrapped(args[0], staged, *args[2:], **kwargs)
    else:
        wrapped(*args, **{**kwargs, "filename": staged})


def _flatten_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """safetensors.torch._flatten_as_ptr(tensors, keep_alive): where the save may return after
    a copy of its state, CUDA tensors are copied into one pinned buffer first, issued at once
    (safetensors copies each into pageable memory), and the buffer becomes the save's copy."""
    tensors = args[0] if args else kwargs.get("tensors")
    settings = _patch.background_settings()
    if _patch.bypassed() or settings is None or not isinstance(tensors, dict):
        return wrapped(*args, **kwargs)
    try:
        moved = to_host(tensors, settings.snapshot_bytes())
    except Exception as exc:  # never a failed save for want of a faster copy
        log.warning("safestage: copying the tensors into pinned memory failed (%s); saving as is", exc)
        moved = None
    if moved is None:
        return wrapped(*args, **kwargs)
    host, held = moved
    offer(held)  # taken by this save's copy_specs, else released at its end (withdraw)
    try:
        return wrapped(host, *args[1:], **kwargs) if args else wrapped(**{**kwargs, "tensors": host})
    except BaseException:
        withdraw()
        raise


def _payload_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[int]:
    """The tensor bytes a serialize_file call will write (the header adds a little), from
    safetensors 0.8's TensorSpec.data_len or 0.4-0.7's {"data": bytes} specs; None if the
    specs say nothing (the write itself then finds out)."""
    specs = args[0] if args else kwargs.get("tensor_dict")
    if not isinstance(specs, dict):
        return None
    total = 0
    try:
        for spec in specs.values():
            size = getattr(spec, "data_len", None)
            if size is None and isinstance(spec, dict):
                data = spec.get("data")
                size = len(data) if data is not None else None
            if not isinstance(size, int):
                return None
            total += size
    except Exception:  # an unexpected spec type: no estimate, never a failed save
        return None
    return total


def _torch_save_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """torch.save(obj, f, ...): a str or PathLike ``f`` is staged and published like a
    safetensors save; file objects and buffers (Lightning's BytesIO, DCP's streams) pass
    through untouched, and so does every other argument. Into a background staged_dir's
    local directory (safestage's own), a save is taken with or without ``torch_save``."""
    if _patch.bypassed() or not _patch.takes_saves():
        return wrapped(*args, **kwargs)
    target, positional = (args[1], True) if len(args) >= 2 else (kwargs.get("f"), False)
    dest = _destination(target)
    if isinstance(dest, Path) and os.path.islink(dest):
        # torch.save opens the path: it writes the file a symlink points to (safetensors 0.8
        # renames over the link instead). A loop stays a link: torch raises ELOOP itself.
        dest = _destination(os.path.realpath(dest))
        if isinstance(dest, Path) and os.path.islink(dest):
            dest = None
    if dest is None or _special_file(dest):
        # A buffer, or a path a plain torch.save rejects (missing parent, a directory, a
        # trailing slash): torch raises exactly its own error. A device or FIFO there
        # (torch.save(x, "/dev/null")): torch writes into it, and so must we, never replace it.
        return wrapped(*args, **kwargs)
    serialize = functools.partial(_torch_save_into, wrapped, args, kwargs, positional)

    def snapshot(budget: int) -> Optional[tuple[Callable[[str], None], Held]]:
        copied = copy_torch_save(args, kwargs, budget, what=str(dest))  # every argument as at the call
        if copied is None:
            return None
        return functools.partial(_torch_save_into, wrapped, copied[0], copied[1], positional), copied[2]

    begun: Optional[tuple[_patch.Owner, Job]] = None
    try:
        with deferred():  # a Ctrl-C as the save begins is raised where its job is known (below)
            begun = _patch.begin_save(dest, torch_save=True)
        if begun is None:
            return wrapped(*args, **kwargs)
        owner, job = begun
        with _patch.bypass():  # the original writes into our staging file: never stage that again
            return owner._save(serialize, dest, as_error=as_torch_error, job=job, snapshot=snapshot)
    except BaseException as exc:
        if isinstance(exc, (PublishError, StagingError)):
            as_torch_error(exc)  # still caught by `except RuntimeError`, like torch.save's own
        if begun is not None:
            abandon(begun[1], exc)
        raise


def _torch_save_into(
    wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], positional: bool, staged: str
) -> None:
    """torch.save(obj, f, ...) with ``staged`` as its ``f``."""
    if positional:
        call_args, call_kwargs = (args[0], staged, *args[2:]), kwargs
    else:
        call_args, call_kwargs = args, {**kwargs, "f": staged}
    run_torch_writer(lambda: wrapped(*call_args, **call_kwargs), staged)



def _special_file(dest: Destination) -> bool:
    """Whether something other than a regular file (a device, FIFO, socket) is at ``dest``."""
    if not isinstance(dest, Path):
        return False  # an object
    try:
        info = os.stat(dest)
    except OSError:
        return False
    return not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode)


def run_torch_writer(call: Callable[[], Any], staged: str) -> None:
    """Run a torch.save into the staging file ``staged``. torch's zip writer reports a failed
    write as a RuntimeError without errno; turn that into the OSError it was, so that
    write_local reports a StagingError (full root: ENOSPC) like for a safetensors save."""
    try:
        call()
    except RuntimeError as exc:
        code = _torch_write_errno(exc, staged)
        if code is None:
            raise  # not an I/O failure (say, an object that cannot be pickled)
        raise OSError(code, f"{os.strerror(code)} ({exc})", staged) from exc


# What torch's C++ zip writer says when a write fails; it carries no errno.
_TORCH_WRITE_FAILURES = ("file write failed", "iostream error", "unexpected pos")


def _torch_write_errno(exc: RuntimeError, staged: str) -> Optional[int]:
    """The errno behind a failed torch.save into the staging root, so that it becomes a
    StagingError like a safetensors save's: ENOSPC when the root is full, else EIO."""
    if not any(marker in str(exc) for marker in _TORCH_WRITE_FAILURES):
        return None
    try:
        full = os.statvfs(os.path.dirname(staged)).f_bavail == 0
    except OSError:
        full = False
    return errno.ENOSPC if full else errno.EIO


def _destination(filename: Any) -> Optional[Destination]:
    """Where a plain save of ``filename`` writes, resolved by the kernel (_paths), or the object
    an ``s3://``/``gs://``/``az://`` URL names (a scheme not served is refused here)."""
    if not isinstance(filename, (str, os.PathLike)):
        return None
    url = file_url(filename)
    if url is not None:
        return url
    text = os.fspath(filename)
    if not isinstance(text, str):
        return None
    return resolve_destination(text)


_patch.register("safetensors", tuple((name, "serialize_file") for name in
                ("safetensors", "safetensors.torch", "safetensors.numpy", "safetensors.paddle")), _staging_wrapper)  # fmt: skip
# safetensors 0.8's save_file flattens its tensors (CUDA ones copied to the CPU) through this
# call-time global: a background save copies them through pinned memory first.
_patch.register("flatten", (("safetensors.torch", "_flatten_as_ptr"),), _flatten_wrapper)
# torch/__init__.py binds ``save`` from torch.serialization: both globals are the same function.
_patch.register("torch", (("torch.serialization", "save"), ("torch", "save")), _torch_save_wrapper)
