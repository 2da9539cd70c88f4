"""The serialize_file wrapper and the process-wide activation stack.

The hook point is the module global ``serialize_file`` of safetensors, safetensors.torch,
safetensors.numpy and safetensors.paddle: their ``save_file`` looks it up at call time, so
wrapping the global also catches every library that bound ``save_file`` at import time
(``from safetensors.torch import save_file`` in megatron-bridge, transformers, accelerate,
peft).

wrapt has no unpatch, so we restore by hand, and only where the global is still our wrapper:
if someone wrapped on top of ours we leave theirs alone, and our wrapper inside it turns into
a pass-through because it consults the activation stack on every call. Post-import hooks are
registered once per process (wrapt cannot unregister them) and do nothing while inactive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ._errors import PublishError, StagingError, as_safetensors_error
from ._paths import resolve_destination

if TYPE_CHECKING:
    from ._api import Stage

log = logging.getLogger("safestage")

TARGET_MODULES = ("safetensors", "safetensors.torch", "safetensors.numpy", "safetensors.paddle")
ATTRIBUTE = "serialize_file"

_lock = threading.RLock()
_active: list[Stage] = []
_ours: list[Any] = []  # our FunctionWrapper objects currently installed (compared by identity)
_hooks_registered = False
_in_save = threading.local()
# Local directories that are staging already (safestage.staged_dir yields one): a save into
# them, from any thread, goes straight to the original writer instead of being staged twice.
_unstaged_dirs: list[Path] = []


def current_stage() -> Optional[Stage]:
    """The stage a save in this thread goes through: the innermost one this thread opened,
    else the innermost one open in the process (saves from worker threads are staged too)."""
    with _lock:
        if not _active:
            return None
        me = threading.get_ident()
        for stage in reversed(_active):
            if stage._opened_by == me:
                return stage
        return _active[-1]


def begin_save() -> Optional[Stage]:
    """current_stage(), with the save counted in it under the same lock: a stage whose
    close() has begun is never picked, and one that was picked waits for the save."""
    with _lock:
        stage = current_stage()
        if stage is not None:
            stage._begin_save()
        return stage


def _after_fork_in_child() -> None:
    # A thread of the parent may have held the lock at fork(): it never releases it here.
    global _lock
    _lock = threading.RLock()
    for stage in _active:
        stage._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def is_active() -> bool:
    """Whether staging is on in this process (some activation is open)."""
    with _lock:
        return bool(_active)


def push(stage: Stage) -> None:
    with _lock:
        _active.append(stage)
        if len(_active) == 1:
            _register_hooks()
            _install_all()


def remove(stage: Stage) -> None:
    """End one activation; activations may end in any order (threads overlap)."""
    with _lock:
        for index in range(len(_active) - 1, -1, -1):
            if _active[index] is stage:
                del _active[index]
                break
        if not _active:
            _restore_all()


def installed_modules() -> list[str]:
    """Names of loaded target modules whose serialize_file is (or wraps) our wrapper."""
    with _lock:
        return [
            name
            for name in TARGET_MODULES
            if _wraps_ours(getattr(sys.modules.get(name), ATTRIBUTE, None))
        ]


def _is_ours(candidate: object) -> bool:
    return any(candidate is wrapper for wrapper in _ours)


def _install(module: Any) -> None:
    current = getattr(module, ATTRIBUTE, None)
    if current is None or _is_ours(current):
        return
    import wrapt

    wrapper = wrapt.FunctionWrapper(current, _staging_wrapper)
    setattr(module, ATTRIBUTE, wrapper)
    _ours.append(wrapper)


def _install_all() -> None:
    for name in TARGET_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _install(module)


def _restore_all() -> None:
    for name in TARGET_MODULES:
        module = sys.modules.get(name)
        current = getattr(module, ATTRIBUTE, None) if module is not None else None
        if current is not None and _is_ours(current):
            # A module imported while we were active may have bound our wrapper from
            # ``safetensors``: unwrap to whatever it wrapped.
            setattr(module, ATTRIBUTE, current.__wrapped__)
        elif current is not None and _wraps_ours(current):
            log.debug("%s.%s was wrapped over ours; leaving it", name, ATTRIBUTE)
    _ours[:] = [w for w in _ours if _still_referenced(w)]


def _wrapper_chain(candidate: object) -> list[object]:
    """``candidate`` and what it wraps, outermost first (bounded: wrappers can be cyclic)."""
    chain: list[object] = []
    while candidate is not None and len(chain) < 16:
        chain.append(candidate)
        candidate = getattr(candidate, "__wrapped__", None)
    return chain


def _wraps_ours(candidate: object) -> bool:
    return any(_is_ours(link) for link in _wrapper_chain(candidate))


def _still_referenced(wrapper: Any) -> bool:
    # Keep wrappers someone else still holds inside theirs, so _is_ours stays right for them.
    return any(
        link is wrapper
        for name in TARGET_MODULES
        for link in _wrapper_chain(getattr(sys.modules.get(name), ATTRIBUTE, None))
    )


def _on_import(module: Any) -> None:
    # A hook that raises breaks the user's import (wrapt): never let one escape.
    try:
        with _lock:
            if _active:
                _install(module)
    except Exception:  # pragma: no cover - defensive
        log.warning("could not patch %s", getattr(module, "__name__", module), exc_info=True)


def _register_hooks() -> None:
    global _hooks_registered
    if _hooks_registered:
        return
    import wrapt

    for name in TARGET_MODULES:
        # Not a string target with "?": that would import eagerly; a name waits for the import.
        wrapt.register_post_import_hook(_on_import, name)
    _hooks_registered = True


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    """Saves made by this thread inside the block go straight to the original writer."""
    previous = getattr(_in_save, "active", False)
    _in_save.active = True
    try:
        yield
    finally:
        _in_save.active = previous


def add_unstaged_dir(directory: Path) -> None:
    """Saves into ``directory`` or below (the kernel's path) are not staged until removed."""
    with _lock:
        _unstaged_dirs.append(directory)


def remove_unstaged_dir(directory: Path) -> None:
    with _lock:
        for index in range(len(_unstaged_dirs) - 1, -1, -1):
            if _unstaged_dirs[index] == directory:
                del _unstaged_dirs[index]
                break


def _in_unstaged_dir(dest: Path) -> bool:
    with _lock:
        return any(dest.is_relative_to(directory) for directory in _unstaged_dirs)


def _filename_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """(filename, positional?) of serialize_file(tensor_dict, filename, metadata=None)."""
    if len(args) >= 2:
        return args[1], True
    return kwargs.get("filename"), False


def _staging_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if getattr(_in_save, "active", False) or not _active:
        return wrapped(*args, **kwargs)
    filename, positional = _filename_argument(args, kwargs)
    dest = _destination(filename)
    if dest is None or _in_unstaged_dir(dest):
        # Not a path we can stage, or a destination a plain save rejects before writing
        # (missing directory, a directory, a trailing slash): let safetensors raise exactly
        # its own error. A staged_dir's local directory is a staging directory already.
        return wrapped(*args, **kwargs)
    stage = begin_save()
    if stage is None:
        return wrapped(*args, **kwargs)

    def serialize(staged: str) -> None:
        if positional:
            call_args = (args[0], staged, *args[2:])
            wrapped(*call_args, **kwargs)
        else:
            wrapped(*args, **{**kwargs, "filename": staged})

    try:
        with bypass():  # a wrapper over ours, calling back into us, must not stage twice
            return stage._save(serialize, dest)
    except (PublishError, StagingError) as exc:
        as_safetensors_error(exc)  # still caught by `except SafetensorError` (issue 9)
        raise
    finally:
        stage._end_save()


def _destination(filename: Any) -> Optional[Path]:
    """Where a plain save of ``filename`` writes, resolved by the kernel (_paths)."""
    if not isinstance(filename, (str, os.PathLike)):
        return None
    text = os.fspath(filename)
    if not isinstance(text, str):
        return None
    return resolve_destination(text)
