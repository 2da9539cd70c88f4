"""The public handle: ``staged()`` as a with-block or decorator, ``activate()`` for long runs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, NoReturn, Optional, Union

from . import _config, _hooks, _patch, _save, _work, _writers  # noqa: F401 - _hooks, _writers: what a hooked save does
from ._config import PathArg, Publish, Settings
from ._destination import Destination
from ._errors import as_safetensors_error
from ._stage import PublishRecord

log = logging.getLogger("safestage")


def _raised_at_the_next_save(dest: Destination, job: _work.Job) -> str:
    """The note of a background save's failure raised at the next save (Stage._begin_save)."""
    if job.kept is not None and job.kept.exists():
        where = f"its complete copy is kept at {job.kept}: `safestage recover` publishes it"
    else:
        where = "no copy of it was kept: save it again"
    return (
        f"safestage: raised at the next save (of {dest}, not made): the background save of "
        f"{job.dest} failed earlier and it is NOT there; {where}"
    )


class Stage(contextlib.ContextDecorator):
    """One activation of staging. ``records`` lists every file it published, in order.

    While any Stage is open, every ``safetensors`` save in the process (all threads) is staged.
    A save uses the innermost Stage its own thread opened, else the innermost one open in
    the process; that Stage's settings apply and it receives the record. Closing a Stage
    waits for every save it accepted, in any thread.

    After ``fork()`` a child inherits open Stages but none of the parent's publishes, and
    its saves publish before they return even with ``background=True``: a forked worker
    (multiprocessing's fork start method) may end with ``os._exit`` or be terminated as soon
    as its task returns, and nothing may be pending then.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.records: list[PublishRecord] = []
        self._records_lock = threading.Lock()
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
        _save.staging_root(self.settings, opening=True)  # a bad root fails here, before any save
        _work.adopt(self)  # its saves may publish in the background in this process
        self._state = "open"
        self._opened_by = threading.get_ident()
        _patch.push(self)
        return self

    def close(self) -> None:
        """End this activation (idempotent): wait for the saves it accepted (other threads'
        too) and its background publishes, raising the first error. The original
        serialize_file returns when the last activation ends."""
        if self._state == "open":
            self._state = "closed"
            _patch.remove(self)  # from here on no save can pick this stage
        # A save of this very thread (a writer closing its stage) is not waited for.
        _work.wait_for_threads(self)
        _work.wait(self)  # its background publishes; the first error is raised

    def _begin_save(self, dest: Destination) -> _work.Job:
        """Called under the activation lock with the stage chosen for a save (_patch): the
        save is this stage's job from now on, so close() waits for it. A background save of
        this stage that failed since is raised here instead, before this save is made
        (docs/asynchronous.md: a run activated from the environment has no close() to see it)."""
        _work.raise_unseen(lambda job: job.owner is self and job.kind == "file",
                           functools.partial(_raised_at_the_next_save, dest))  # fmt: skip
        return _work.start("file", dest, self)

    def _after_fork_in_child(self) -> None:
        # The parent's threads and lock holders do not exist here (nor its jobs: the registry
        # starts afresh in the child, without this stage's).
        self._records_lock = threading.Lock()

    def __enter__(self) -> Stage:
        return self._open()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # the block's own exception wins; publish failures are logged, not raised over it
            self.close()
        except Exception as publish_error:
            log.error("while handling %r: %s", exc, publish_error)

    def _recreate_cm(self) -> Stage:
        # As a decorator, each call gets a fresh activation with the same settings.
        return Stage(self.settings)

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        """As a decorator. A generator function is staged while it runs (from its first
        next() to its end), a coroutine function while it is awaited: ContextDecorator alone
        would close the stage when the call returns, before the body ever runs."""
        import functools
        import inspect

        if inspect.isasyncgenfunction(func):
            raise TypeError(
                f"safestage.staged() cannot decorate the async generator {func.__qualname__}: "
                "use `with safestage.staged(...):` inside it"
            )
        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def generator(*args: Any, **kwargs: Any) -> Any:
                with self._recreate_cm():
                    return (yield from func(*args, **kwargs))

            return generator
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def coroutine(*args: Any, **kwargs: Any) -> Any:
                with self._recreate_cm():
                    return await func(*args, **kwargs)

            return coroutine
        return super().__call__(func)

    def _save(
        self,
        serialize: Callable[[str], None],
        dest: Destination,
        *,
        as_error: Callable[[BaseException], BaseException] = as_safetensors_error,
        needs: Optional[int] = None,
        job: Optional[_work.Job] = None,
        snapshot: Optional[_save.Snapshot] = None,
    ) -> None:
        """One save of any writer through the one pipeline (_save.run): ``serialize(path)``
        writes the file; ``as_error`` gives safestage's errors the class that writer's
        callers catch (SafetensorError for safetensors, RuntimeError for torch.save);
        ``snapshot`` copies its state for a background save to return after the copy."""
        assert self._state != "new", "a Stage saves only once open"
        _save.run(serialize, dest, self.settings, owner=self, record=self._record, needs=needs, as_error=as_error,
                  job=job, snapshot=snapshot)  # fmt: skip

    def _record(self, record: PublishRecord) -> None:
        with self._records_lock:
            self.records.append(record)

    def __repr__(self) -> str:
        return (
            f"<safestage.Stage {self._state} root={str(self.staging_root)!r} "
            f"publish={self.settings.publish!r} fsync={self.settings.fsync} "
            f"background={self.settings.background} torch_save={self.settings.torch_save} "
            f"records={len(self.records)}>"
        )


def staged(
    root: Optional[PathArg] = None,
    *,
    publish: Optional[Publish] = None,
    fsync: bool = True,
    background: Union[bool, int, None] = None,
    skip_local_disk: Optional[bool] = None,
    torch_save: Optional[bool] = None,
    snapshot_budget: Union[int, str, None] = None,
    **removed: NoReturn,
) -> Stage:
    """Stage every safetensors save made inside the block (or the decorated function).

    ``root`` is a local directory to serialize into (default: SAFESTAGE_DIR, else
    $TMPDIR/safestage-<uid>). ``publish`` is "auto", "replace" or "direct"; ``fsync``
    flushes each published file to stable storage. ``background=True`` returns from each
    save once a copy of its state is taken (its tensors copied into host buffers, within
    ``snapshot_budget``: bytes, "8GiB" or "25%" of memory; 0: no copies, the save is
    serialized before it returns), then serializes and publishes on safestage's threads, at
    most 2 saves landing at once (``background=N``: at most N); the block's end waits for
    them and raises the first failure. ``skip_local_disk=True``
    writes destinations on local disk with the original writer (no staging) and stages the
    rest. ``torch_save=True`` also stages ``torch.save(obj, path)`` (file objects pass
    through); it patches ``torch.save`` while the block runs. A synchronous ``replace`` save
    of a safetensors file of 64 MiB or more is copied while the writer is still writing it,
    checked by CRC-32 before it is committed. None means SAFESTAGE_* variable, else default.
    Options are checked here (ConfigError, also for the names removed in 0.2: follow=,
    max_pending=, when=); the staging root when the block starts (StagingError).
    """
    _config.reject_removed(removed, "safestage.staged")
    return Stage(
        _config.resolve(
            root=root,
            publish=publish,
            fsync=fsync,
            background=background,
            skip_local_disk=skip_local_disk,
            torch_save=torch_save,
            snapshot_budget=snapshot_budget,
        )
    )


def activate(
    root: Optional[PathArg] = None,
    *,
    publish: Optional[Publish] = None,
    fsync: bool = True,
    background: Union[bool, int, None] = None,
    skip_local_disk: Optional[bool] = None,
    torch_save: Optional[bool] = None,
    snapshot_budget: Union[int, str, None] = None,
    **removed: NoReturn,
) -> Stage:
    """Like ``staged()``, already entered: call ``.close()`` on the handle to end it."""
    _config.reject_removed(removed, "safestage.activate")
    return staged(
        root,
        publish=publish,
        fsync=fsync,
        background=background,
        skip_local_disk=skip_local_disk,
        torch_save=torch_save,
        snapshot_budget=snapshot_budget,
    )._open()


def force_follow(stage: Stage, follow: Optional[bool] = True) -> Stage:
    """Internal seam for tests and benchmarks, in no public signature: a new Stage like
    ``stage`` with following forced on (True: also saves of unknown size), off (False) or
    automatic (None, the default of every public entry)."""
    return Stage(dataclasses.replace(stage.settings, follow=follow))


def wait() -> None:
    """Wait for every pending background publish in the process; raise the first error.
    The one wait: a Stage's close() and a Lightning plugin's teardown() wait for their own."""
    _work.wait()


@contextlib.contextmanager
def staged_file(
    dest: PathArg,
    root: Optional[PathArg] = None,
    *,
    publish: Optional[Publish] = None,
    fsync: bool = True,
) -> Iterator[Path]:
    """Yield a local path for any writer; publish it to ``dest`` when the block succeeds.

        with safestage.staged_file("/mnt/s3/ckpt/optimizer.pt") as local:
            torch.save(optimizer.state_dict(), local)

    Same strategies and guarantees as staged saves. If the block raises, nothing is
    published and the local file is removed.
    """
    settings = _config.resolve(root=root, publish=publish, fsync=fsync)
    with _save.local_file(_save.destination(dest), settings) as local:
        yield local


def is_active() -> bool:
    """Whether staging is on in this process."""
    return _patch.is_active()
