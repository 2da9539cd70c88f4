"""The serialize_file and torch.save wrappers and the process-wide activation stack.

The hook point is the module global ``serialize_file`` of safetensors, safetensors.torch,
safetensors.numpy and safetensors.paddle: their ``save_file`` looks it up at call time, so
wrapping the global also catches every library that bound ``save_file`` at import time
(``from safetensors.torch import save_file`` in megatron-bridge, transformers, accelerate,
peft).

With ``torch_save=True`` the module globals ``torch.save`` and ``torch.serialization.save``
are wrapped too, while some open stage asks for it (and only then: a torch global is a wider
patch than safetensors'). That catches every caller that looks ``torch.save`` up at call time
(``torch.save(...)`` in accelerate, transformers' Trainer, Lightning); code that did ``from
torch import save`` before activation holds the original. Paths are staged like a
safetensors save (same Stage._save, same publisher); file objects and buffers pass through.

While any stage is open, DCP's own writers are staged too (``safestage.dcp.under_switch``):
the hook point is ``_save_state_dict``, a call-time global of ``dcp.save`` (and so of
``dcp.async_save``'s save, in its thread or its process) and of ``torch_save_to_dcp``, which
receives the writer ``dcp.save`` chose (``FileSystemWriter`` for a path) or was given. And
Lightning's sharded saves (``save_checkpoint`` of its FSDP and ModelParallel strategies, a
class attribute) commit the whole directory, ``meta.pt`` included
(``safestage.lightning.sharded_save``).

wrapt has no unpatch, so we restore by hand, and only where the global is still our wrapper:
if someone wrapped on top of ours we leave theirs alone, and our wrapper inside it turns into
a pass-through because it consults the activation stack on every call. The post-import hook
(a finder of our own on sys.meta_path, not wrapt's, whose import costs 0.16 s) is registered
once per process and does nothing while inactive.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import logging
import os
import stat
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ._errors import PublishError, StagingError, as_safetensors_error, as_torch_error
from ._paths import resolve_destination
from ._snapshot import Held, copy_save_file, copy_torch_save, offer, to_host, withdraw

if TYPE_CHECKING:
    from ._api import Stage
    from ._config import Settings
    from ._save import Deferred
    from ._work import Job

log = logging.getLogger("safestage")

TARGET_MODULES = ("safetensors", "safetensors.torch", "safetensors.numpy", "safetensors.paddle")
ATTRIBUTE = "serialize_file"
# torch/__init__.py binds ``save`` from torch.serialization: both globals are the same function.
TORCH_MODULES = ("torch.serialization", "torch")
TORCH_ATTRIBUTE = "save"


# DCP's save of a resolved writer; format_utils (torch_save_to_dcp) bound it at import.
DCP_MODULES = ("torch.distributed.checkpoint.state_dict_saver", "torch.distributed.checkpoint.format_utils")
DCP_ATTRIBUTE = "_save_state_dict"
# Lightning's sharded saves: a method of each strategy class, in both packages of each.
LIGHTNING_METHODS = tuple(
    (f"{package}.strategies.{module}", f"{cls}.save_checkpoint")
    for package in ("lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric")
    for module, cls in (("fsdp", "FSDPStrategy"), ("model_parallel", "ModelParallelStrategy"))
)


@dataclass(frozen=True)
class _Target:
    module: str
    attribute: str  # a module global, or "Class.method"
    # "safetensors", "dcp", "lightning": while any stage is open; "torch": while one has torch_save
    family: str


TARGETS = (
    tuple(_Target(name, ATTRIBUTE, "safetensors") for name in TARGET_MODULES)
    # safetensors 0.8's save_file flattens its tensors (CUDA ones copied to the CPU) through
    # this call-time global: a background save copies them through pinned memory first.
    + tuple(_Target(name, "_flatten_as_ptr", "flatten") for name in ("safetensors.torch",))
    + tuple(_Target(name, DCP_ATTRIBUTE, "dcp") for name in DCP_MODULES)
    + tuple(_Target(name, attribute, "lightning") for name, attribute in LIGHTNING_METHODS)
    + tuple(_Target(name, TORCH_ATTRIBUTE, "torch") for name in TORCH_MODULES)
)

_lock = threading.RLock()
_active: list[Stage] = []
_ours: list[Any] = []  # our FunctionWrapper objects currently installed (compared by identity)
_hooks_registered = False
_in_save = threading.local()
# Local directories that are staging already (staged_file and staged_dir yield one): a save
# into them, from any thread, goes straight to the original writer instead of being staged twice.
_unstaged_dirs: list[Path] = []
# Those of them whose saves are serialized later, from a copy (a background staged_dir's
# local directory: its block returns without waiting for them): {directory: its _save.Deferred}.
_deferring: dict[Path, Deferred] = {}


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


def begin_save(dest: Path, *, torch_save: bool = False) -> Optional[tuple[Stage, Job]]:
    """current_stage(), with the save started as its job under the same lock: a stage whose
    close() has begun is never picked, and one that was picked waits for the save. For a
    torch.save, None unless that stage has torch_save: the stage that takes a save decides."""
    with _lock:
        stage = current_stage()
        if stage is None or (torch_save and not stage.settings.torch_save):
            return None
        return stage, stage._begin_save(dest)


def after_fork_in_child() -> None:  # registered by _lifecycle
    # A thread of the parent may have held the lock at fork(), or been inside a save: neither
    # exists here, and the child's own saves must be staged.
    global _lock, _in_save
    _lock = threading.RLock()
    _in_save = threading.local()
    for stage in _active:
        stage._after_fork_in_child()


def is_active() -> bool:
    """Whether staging is on in this process (some activation is open)."""
    with _lock:
        return bool(_active)


def push(stage: Stage) -> None:
    with _lock:
        _active.append(stage)
        _sync()


def remove(stage: Stage) -> None:
    """End one activation; activations may end in any order (threads overlap)."""
    with _lock:
        for index in range(len(_active) - 1, -1, -1):
            if _active[index] is stage:
                del _active[index]
                break
        _sync()


def _wanted_families() -> set[str]:
    families = {"safetensors", "dcp", "lightning"} if _active else set()
    if _deferring:
        # A background staged_dir's block returns without waiting for its saves, torch.saves
        # included: both are wrapped while one is open (a save elsewhere passes through).
        families.update(("safetensors", "torch"))
    if "safetensors" in families:
        families.add("flatten")
    if any(stage.settings.torch_save for stage in _active):
        families.add("torch")
    return families


def _sync() -> None:
    """Make the installed wrappers match the open stages (under _lock): serialize_file while
    any stage is open, torch.save while one of them has torch_save."""
    families = _wanted_families()
    if families:
        _register_hooks()
    for target in TARGETS:
        module = sys.modules.get(target.module)
        if module is None:
            continue
        if target.family in families:
            _install(module, target)
        else:
            _restore(module, target)
    _ours[:] = [w for w in _ours if _still_referenced(w)]


def installed_modules() -> list[str]:
    """Names of loaded target modules whose serialize_file is (or wraps) our wrapper."""
    with _lock:
        return [
            name
            for name in TARGET_MODULES
            if _wraps_ours(getattr(sys.modules.get(name), ATTRIBUTE, None))
        ]


def installed_targets() -> list[str]:
    """``module.attribute`` of every loaded hook point that is (or wraps) our wrapper."""
    with _lock:
        return [
            f"{target.module}.{target.attribute}"
            for target in TARGETS
            if _wraps_ours(_lookup(sys.modules.get(target.module), target.attribute))
        ]


def _is_ours(candidate: object) -> bool:
    return any(candidate is wrapper for wrapper in _ours)


def _lookup(module: Any, attribute: str) -> Any:
    """``module.attribute``, where ``attribute`` may be ``Class.method``; None if missing."""
    owner = module
    for name in attribute.split("."):
        # A method is read from the class's own namespace (its MRO), never through getattr:
        # getattr binds a wrapper (descriptor) to the class and returns another object, so an
        # installed wrapper would not be recognized, a second one would be stacked on each
        # activation, and close would restore nothing.
        owner = inspect.getattr_static(owner, name, None) if isinstance(owner, type) else getattr(owner, name, None)
    return owner


def _assign(module: Any, attribute: str, value: Any) -> None:
    owner_path, _, name = attribute.rpartition(".")
    setattr(_lookup(module, owner_path) if owner_path else module, name, value)


def _install(module: Any, target: _Target) -> None:
    current = _lookup(module, target.attribute)
    # Already ours, or someone wrapped over ours (theirs calls ours): never stack a second.
    if current is None or _wraps_ours(current):
        return
    # One wrapper per function: torch.save and torch.serialization.save (and the four
    # serialize_file globals) are one function, so they stay one object, as unpatched.
    for wrapper in _ours:
        if wrapper.__wrapped__ is current:
            _assign(module, target.attribute, wrapper)
            return
    wrapper = _wrapper_class()(current, _HANDLERS[target.family])
    wrapper._self_home = (target.module, target.attribute)
    _assign(module, target.attribute, wrapper)
    _ours.append(wrapper)


_WRAPPER_CLASS: Optional[type] = None


def _wrapper_class() -> type:
    """wrapt's FunctionWrapper, made picklable: a wrapper pickles as a reference to the module
    global it replaced (``torch.save`` handed to a spawned process, a ProcessPoolExecutor),
    looked up again on unpickling. Plain wrapt proxies refuse to pickle."""
    global _WRAPPER_CLASS
    if _WRAPPER_CLASS is None:
        import wrapt

        class _BoundWrapper(wrapt.BoundFunctionWrapper):  # type: ignore[type-arg]
            # A hooked method read through an instance or its class (Lightning's strategies'
            # save_checkpoint): pickled as plain Python pickles it, the bound method as the
            # instance's attribute, the function as the class's.
            def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, str]]:
                home = self._self_parent._self_home
                if self._self_instance is None:
                    return (resolve_global, home)
                return (getattr, (self._self_instance, home[1].rpartition(".")[2]))

        class _Wrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
            __bound_function_wrapper__ = _BoundWrapper

            def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[str, str]]:
                return (resolve_global, self._self_home)

        _WRAPPER_CLASS = _Wrapper
    return _WRAPPER_CLASS


def resolve_global(module: str, attribute: str) -> Any:
    """Unpickling a wrapper of ours: whatever the module global is in this process."""
    import importlib

    return _lookup(importlib.import_module(module), attribute)


def _restore(module: Any, target: _Target) -> None:
    current = _lookup(module, target.attribute)
    if current is not None and _is_ours(current):
        # A module imported while we were active may have bound our wrapper from another
        # target module (``torch`` binds torch.serialization.save): unwrap to what it wrapped.
        _assign(module, target.attribute, current.__wrapped__)
    elif current is not None and _wraps_ours(current):
        log.debug("%s.%s was wrapped over ours; leaving it", target.module, target.attribute)


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
        for target in TARGETS
        for link in _wrapper_chain(_lookup(sys.modules.get(target.module), target.attribute))
    )


def _on_import(module: Any) -> None:
    # A hook that raises breaks the user's import (wrapt): never let one escape.
    try:
        with _lock:
            families = _wanted_families()
            for target in TARGETS:
                if target.module == module.__name__ and target.family in families:
                    _install(module, target)
    except Exception:  # pragma: no cover - defensive
        log.warning("could not patch %s", getattr(module, "__name__", module), exc_info=True)


def _register_hooks() -> None:
    """Patch each target module when it is imported (at once if it is already)."""
    global _hooks_registered
    if _hooks_registered:
        return
    sys.meta_path.insert(0, _PostImportFinder())
    _hooks_registered = True


_HOOKED_MODULES = frozenset(target.module for target in TARGETS)


class _PostImportFinder:
    """A post-import hook of our own, not wrapt's: importing wrapt costs ~0.16 s (it pulls in
    asyncio and importlib.metadata), which every process of a job with SAFESTAGE_DIR set
    would pay at start-up, saving or not. It finds a target module through the other
    finders and runs ``_on_import`` right after the module body has executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _HOOKED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader)  # type: ignore[assignment]
                return spec
        return None


class _HookedLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _on_import(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    """Saves made by this thread inside the block go straight to the original writer."""
    previous = getattr(_in_save, "active", False)
    _in_save.active = True
    try:
        yield
    finally:
        _in_save.active = previous


def add_unstaged_dir(directory: Path, deferred: Optional[Deferred] = None) -> None:
    """Saves into ``directory`` or below (the kernel's path) are not staged until removed.
    ``deferred``: safetensors saves into it (and torch.save under torch_save) are copied and
    serialized later (_save.defer), whether or not a stage is open."""
    with _lock:
        _unstaged_dirs.append(directory)
        if deferred is not None:
            _deferring[directory] = deferred
            _sync()


def remove_unstaged_dir(directory: Path) -> None:
    with _lock:
        for index in range(len(_unstaged_dirs) - 1, -1, -1):
            if _unstaged_dirs[index] == directory:
                del _unstaged_dirs[index]
                break
        if _deferring.pop(directory, None) is not None:
            _sync()


def deferred_for(dest: Path) -> Optional[Deferred]:
    with _lock:
        for directory, deferred in _deferring.items():
            if dest.is_relative_to(directory):
                return deferred
        return None


def in_unstaged_dir(dest: Path) -> bool:
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
    try:
        return _stage_file(wrapped, args, kwargs)
    finally:
        withdraw()  # a pinned copy of its CUDA tensors that the save did not keep (_flatten_wrapper)


def _stage_file(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if getattr(_in_save, "active", False) or not (_active or _deferring):
        return wrapped(*args, **kwargs)
    filename, positional = _filename_argument(args, kwargs)
    dest = _destination(filename)

    def snapshot(budget: int) -> Optional[tuple[Callable[[str], None], Held]]:
        copied = copy_save_file(args, kwargs, budget, what=str(dest))  # every argument as at the call
        if copied is None:
            return None
        return functools.partial(_serialize_into, wrapped, copied[0], copied[1], positional), copied[2]

    deferred = deferred_for(dest) if dest is not None else None
    if deferred is not None and dest is not None:
        from ._save import defer

        with bypass():
            return defer(functools.partial(_serialize_into, wrapped, args, kwargs, positional), dest, deferred,
                         snapshot=snapshot)  # fmt: skip
    if dest is None or in_unstaged_dir(dest) or not _active:
        # Not a path we can stage, or a destination a plain save rejects before writing
        # (missing directory, a directory, a trailing slash): let safetensors raise exactly
        # its own error. A staged_file's or staged_dir's local directory is staging already.
        return wrapped(*args, **kwargs)
    begun = begin_save(dest)
    if begun is None:
        return wrapped(*args, **kwargs)
    stage, job = begun

    def serialize(staged: str) -> None:
        if positional:
            call_args = (args[0], staged, *args[2:])
            wrapped(*call_args, **kwargs)
        else:
            wrapped(*args, **{**kwargs, "filename": staged})

    try:
        with bypass():  # a wrapper over ours, calling back into us, must not stage twice
            return stage._save(serialize, dest, needs=_payload_bytes(args, kwargs), job=job,
                               snapshot=snapshot)  # fmt: skip
    except (PublishError, StagingError) as exc:
        as_safetensors_error(exc)  # still caught by `except SafetensorError` (issue 9)
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
    settings = _deferring_settings()
    if getattr(_in_save, "active", False) or settings is None or not isinstance(tensors, dict):
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


def _deferring_settings() -> Optional[Settings]:
    """The settings of a save that may return after a copy: a background stage's, or a
    background staged_dir's when one is open; None otherwise."""
    with _lock:
        stage = current_stage()
        if stage is not None and stage.settings.background:
            return stage.settings
        for deferred in _deferring.values():
            return deferred.settings
    return None


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
    local directory (safestage's own), a save is deferred with or without ``torch_save``."""
    if getattr(_in_save, "active", False) or not (_active or _deferring):
        return wrapped(*args, **kwargs)
    target, positional = (args[1], True) if len(args) >= 2 else (kwargs.get("f"), False)
    dest = _destination(target)
    if dest is not None and os.path.islink(dest):
        # torch.save opens the path: it writes the file a symlink points to (safetensors 0.8
        # renames over the link instead). A loop stays a link: torch raises ELOOP itself.
        dest = _destination(os.path.realpath(dest))
        if dest is not None and os.path.islink(dest):
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

    deferred = deferred_for(dest)
    if deferred is not None:
        from ._save import defer

        with bypass():
            return defer(serialize, dest, deferred, snapshot=snapshot)
    if in_unstaged_dir(dest):
        return wrapped(*args, **kwargs)
    begun = begin_save(dest, torch_save=True)
    if begun is None:
        return wrapped(*args, **kwargs)
    stage, job = begun

    try:
        with bypass():  # the original writes into our staging file: never stage that again
            return stage._save(serialize, dest, as_error=as_torch_error, job=job, snapshot=snapshot)
    except (PublishError, StagingError) as exc:
        as_torch_error(exc)  # still caught by `except RuntimeError`, like torch.save's own
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


def _dcp_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """DCP's ``_save_state_dict``: its own writers, staged and committed (safestage.dcp)."""
    stage = None if getattr(_in_save, "active", False) else current_stage()
    if stage is None:
        return wrapped(*args, **kwargs)
    from .dcp import under_switch  # imports torch's DCP: imported already, it is saving

    return under_switch(wrapped, args, kwargs, stage.settings)


def _lightning_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A Lightning strategy's ``save_checkpoint``: a sharded checkpoint committed whole,
    ``meta.pt`` included (safestage.lightning)."""
    stage = None if getattr(_in_save, "active", False) else current_stage()
    if stage is None or instance is None:
        return wrapped(*args, **kwargs)
    from .lightning import sharded_save  # imports Lightning: imported already, it is saving

    return sharded_save(wrapped, instance, args, kwargs, stage.settings)


_HANDLERS: dict[str, Callable[..., Any]] = {
    "safetensors": _staging_wrapper,
    "flatten": _flatten_wrapper,
    "torch": _torch_save_wrapper,
    "dcp": _dcp_wrapper,
    "lightning": _lightning_wrapper,
}


def _special_file(dest: Path) -> bool:
    """Whether something other than a regular file (a device, FIFO, socket) is at ``dest``."""
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


def _destination(filename: Any) -> Optional[Path]:
    """Where a plain save of ``filename`` writes, resolved by the kernel (_paths)."""
    if not isinstance(filename, (str, os.PathLike)):
        return None
    text = os.fspath(filename)
    if not isinstance(text, str):
        return None
    return resolve_destination(text)
