"""The activation hub: which saves are staged, and the hooks that send them here.

The mechanism only: the activation stack (``push``/``remove``, ``current_stage``,
``begin_save``), the local directories that are staging already, the hook points (``TARGETS``)
and their install and restore (at import too: _post_import), and the pickling of our wrappers.
What a hook does is registered with its hook points by the module that does it (``register``):
the safetensors and torch.save wrappers (_writers), DCP's writers and Lightning's sharded saves
(_hooks, which hands them to safestage.dcp and safestage.lightning). It imports none of them.

wrapt has no unpatch, so we restore by hand, and only where the global is still our wrapper:
if someone wrapped on top of ours we leave theirs alone, and our wrapper inside it turns into
a pass-through because it consults the activation stack on every call. The post-import hook
(a finder of our own on sys.meta_path, not wrapt's, whose import costs 0.16 s) is registered
once per process and does nothing while inactive.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from . import _post_import

if TYPE_CHECKING:
    from ._config import Settings
    from ._work import Job

log = logging.getLogger("safestage")


class Owner(Protocol):
    """Who takes a save (``begin_save``): a Stage (_api), or a background staged_dir's Deferred
    (_save); named by what is used of it, so that this module imports neither."""

    settings: Settings

    def _begin_save(self, dest: Any) -> Job: ...

    def _save(self, serialize: Callable[[str], None], dest: Any, *, as_error: Callable[[BaseException], BaseException],
              needs: Optional[int] = None, job: Optional[Job] = None, snapshot: Optional[Callable[[int], Any]] = None,
              ) -> None: ...  # fmt: skip


class Stage(Owner, Protocol):
    """An activation (_api.Stage)."""

    _opened_by: Optional[int]

    def _after_fork_in_child(self) -> None: ...


@dataclass(frozen=True)
class _Target:
    module: str
    attribute: str  # a module global, or "Class.method"
    family: str  # when it is hooked: see _wanted_families


# Every hook point, as registered (``register``), in this order of families (torch.save last:
# a save there may be one of the others' own writes).
FAMILIES = ("safetensors", "flatten", "dcp", "lightning", "torch")
TARGETS: tuple[_Target, ...] = ()
_HOOKED_MODULES: frozenset[str] = frozenset()

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
_deferring: dict[Path, Owner] = {}
# What each family's hook does, registered by the module that does it (``register``).
Handler = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
_HANDLERS: dict[str, Handler] = {}


def register(family: str, points: tuple[tuple[str, str], ...], handler: Handler) -> None:
    """Hook ``points`` ((module, attribute), the attribute a module global or "Class.method")
    as ``family``: ``handler(wrapped, instance, args, kwargs)`` (wrapt's) runs in place of each
    while the family is wanted; it asks ``current_stage``/``begin_save`` itself who saves."""
    global TARGETS, _HOOKED_MODULES
    with _lock:
        _HANDLERS[family] = handler
        targets = [target for target in TARGETS if target.family != family]
        targets += [_Target(module, attribute, family) for module, attribute in points]
        TARGETS = tuple(sorted(targets, key=lambda target: FAMILIES.index(target.family)))
        _HOOKED_MODULES = frozenset(target.module for target in TARGETS)
        if _active or _deferring:
            _sync()


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


def begin_save(dest: Any, *, torch_save: bool = False) -> Optional[tuple[Owner, Job]]:
    """Who takes a save of ``dest``, with the save started as its job under the same lock: the
    background staged_dir whose local directory holds it (torch.save too), else None inside
    another staging directory, else current_stage(): a stage whose close() has begun is never
    picked, and one that was picked waits for the save. For a torch.save, None unless that
    stage has torch_save: the stage that takes a save decides."""
    with _lock:
        for directory, deferred in _deferring.items():
            if dest.is_relative_to(directory):
                return deferred, deferred._begin_save(dest)
        if in_unstaged_dir(dest):
            return None
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


def takes_saves() -> bool:
    """Whether any save may be taken (a stage or a deferring directory is open); unlocked."""
    return bool(_active or _deferring)


def background_settings() -> Optional[Settings]:
    """The settings of a save that may return after a copy: a background stage's, else an
    open background staged_dir's; None otherwise."""
    with _lock:
        stage = current_stage()
        if stage is not None and stage.settings.background:
            return stage.settings
        return next((deferred.settings for deferred in _deferring.values()), None)


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
    global _hooks_registered
    families = _wanted_families()
    if families and not _hooks_registered:  # once per process: it does nothing while inactive
        _post_import.watch(lambda name: name in _HOOKED_MODULES, _on_import)
        _hooks_registered = True
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
        return [target.module for target in TARGETS if target.family == "safetensors"
                and _wraps_ours(_lookup(sys.modules.get(target.module), target.attribute))]  # fmt: skip


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


@functools.cache
def _wrapper_class() -> type:
    """wrapt's FunctionWrapper, made picklable: a wrapper pickles as a reference to the module
    global it replaced (``torch.save`` handed to a spawned process, a ProcessPoolExecutor),
    looked up again on unpickling. Plain wrapt proxies refuse to pickle."""
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

    return _Wrapper


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


def bypassed() -> bool:
    """Whether this thread's saves go straight to the original writer (``bypass``)."""
    return bool(getattr(_in_save, "active", False))


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    """Saves made by this thread inside the block go straight to the original writer."""
    previous = getattr(_in_save, "active", False)
    _in_save.active = True
    try:
        yield
    finally:
        _in_save.active = previous


def add_unstaged_dir(directory: Path, deferred: Optional[Owner] = None) -> None:
    """Saves into ``directory`` or below (the kernel's path) are not staged until removed.
    ``deferred``: it takes the safetensors saves and torch.saves into it (``begin_save``),
    whether or not a stage is open: copied and serialized later (_save.plan: deferred)."""
    with _lock:
        _unstaged_dirs.append(directory)
        if deferred is not None:
            _deferring[directory] = deferred
            _sync()


def remove_unstaged_dir(directory: Path) -> None:
    with _lock:
        if directory in _unstaged_dirs:
            _unstaged_dirs.remove(directory)
        if _deferring.pop(directory, None) is not None:
            _sync()


def in_unstaged_dir(dest: Any) -> bool:
    with _lock:
        return any(dest.is_relative_to(directory) for directory in _unstaged_dirs)


