"""The public handle: ``staged()`` as a with-block or decorator, ``activate()`` for long runs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Union

if TYPE_CHECKING:
    from concurrent.futures import Future

from . import _background, _config, _patch
from ._config import PathArg, Publish, Settings
from ._errors import PublishError, StagingError, as_safetensors_error
from ._mounts import is_local_disk
from ._names import staged_name
from ._paths import absolute, resolve_destination
from ._stage import (
    PublishRecord,
    StagedFile,
    StagingArea,
    follow_strategy,
    keep_unpublished,
    publish_staged,
    write_following,
    write_staged,
    write_unstaged,
)

log = logging.getLogger("safestage")


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
        self._area: Optional[StagingArea] = None
        self._state = "new"  # new -> open -> closed
        self._opened_by: Optional[int] = None  # thread ident: its saves prefer this stage
        self._pid = os.getpid()  # background publishing only in the process that opened it
        self._futures: list[Future[PublishRecord]] = []  # background publishes of this stage
        self._idle = threading.Condition()  # saves in progress, by thread: close() waits
        self._saving: Counter[int] = Counter()

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
        """End this activation (idempotent): wait for the saves it accepted (other threads'
        too) and its background publishes, raising the first error. The original
        serialize_file returns when the last activation ends."""
        if self._state == "open":
            self._state = "closed"
            _patch.remove(self)  # from here on no save can pick this stage
        me = threading.get_ident()
        with self._idle:  # a save of this very thread (a writer closing its stage) is not waited for
            self._idle.wait_for(lambda: sum(self._saving.values()) == self._saving[me])
        self.wait()

    def _begin_save(self) -> None:
        """Called under the activation lock with the stage chosen for a save (_patch)."""
        with self._idle:
            self._saving[threading.get_ident()] += 1

    def _end_save(self) -> None:
        with self._idle:
            me = threading.get_ident()
            self._saving[me] -= 1
            if self._saving[me] <= 0:
                del self._saving[me]
            self._idle.notify_all()

    def _after_fork_in_child(self) -> None:
        # The parent's threads, publishes and lock holders do not exist here.
        self._futures = []
        self._idle = threading.Condition()
        self._saving = Counter()
        self._records_lock = threading.Lock()

    def wait(self) -> None:
        """Wait for this stage's background publishes; raise the first error (all are logged)."""
        futures, self._futures = self._futures, []
        if futures:
            _background.publisher().wait(futures)  # type: ignore[arg-type]

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
        dest: Path,
        *,
        as_error: Callable[[BaseException], BaseException] = as_safetensors_error,
        needs: Optional[int] = None,
    ) -> None:
        """One save of any writer: ``serialize(path)`` writes the file; ``as_error`` gives
        safestage's errors the class that writer's callers catch (SafetensorError for
        safetensors, RuntimeError for torch.save); ``needs``, the file's size if known,
        lets a staging root that cannot hold it refuse before anything is written."""
        area = self._area
        assert area is not None, "a Stage saves only while open"
        if self.settings.skip_local_disk and is_local_disk(dest.parent):
            self._record(write_unstaged(serialize, dest, self.settings))
            return
        background = self._publishes_in_background()
        if not background and follow_strategy(self.settings, dest, area, needs) is not None:
            _background.settle(dest)  # an earlier background publish of it lands first
            try:
                record = write_following(serialize, dest, area, self.settings, needs=needs)
            except (PublishError, StagingError) as exc:
                as_error(exc)  # callers catch SafetensorError today (issue 9)
                raise
            self._record(record)
            return
        if background:
            self._make_room(needs, dest, area)  # checked here: write_staged need not again
        item = write_staged(serialize, dest, area, needs=None if background else needs)
        if not background:
            _background.settle(dest)  # an earlier background publish of it lands first
            self._publish(item, area, as_error)
            return
        try:
            future = _background.publisher().submit(
                lambda: self._publish(item, area, as_error),
                dest,
                max_pending=self.settings.background,
                kept=item.path,
            )
        except BaseException as exc:  # Ctrl-C while waiting for a slot: keep and name the copy
            keep_unpublished(item, exc)
            raise
        # A stage that lives as long as the process (SAFESTAGE_BACKGROUND=1) must not keep
        # every future: drop those that succeeded; failures stay until raised.
        self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]
        self._futures.append(future)

    def _make_room(self, needs: Optional[int], dest: Path, area: StagingArea) -> None:
        """background: a root too full for this file now may hold it once this stage's
        pending publishes have landed and their staged copies are gone; wait for those before
        refusing (review 5). Their failures are raised where they always are (close)."""
        try:
            area.check_room(needs, dest)
        except StagingError:
            pending = [f for f in self._futures if not f.done()]
            if not pending:
                raise
            log.info(
                "%s: the staging root is full until %d pending publish(es) land; waiting",
                dest, len(pending),
            )
            concurrent.futures.wait(pending)
            area.check_room(needs, dest)

    def _publishes_in_background(self) -> bool:
        """background=True, in the process that opened the stage, and not a multiprocessing
        child: a forked child, or a Pool worker (any start method) that may be terminated
        as soon as its task returns, publishes before its save returns."""
        if not self.settings.background or os.getpid() != self._pid:
            return False
        multiprocessing = sys.modules.get("multiprocessing")
        return multiprocessing is None or multiprocessing.parent_process() is None

    def _publish(
        self,
        item: StagedFile,
        area: StagingArea,
        as_error: Callable[[BaseException], BaseException] = as_safetensors_error,
    ) -> PublishRecord:
        try:
            record = publish_staged(item, self.settings, area)
        except (PublishError, StagingError) as exc:
            as_error(exc)  # callers catch SafetensorError today (issue 9)
            raise
        self._record(record)
        return record

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
    **removed: NoReturn,
) -> Stage:
    """Stage every safetensors save made inside the block (or the decorated function).

    ``root`` is a local directory to serialize into (default: SAFESTAGE_DIR, else
    $TMPDIR/safestage-<uid>). ``publish`` is "auto", "replace" or "direct"; ``fsync``
    flushes each published file to stable storage. ``background=True`` returns from each
    save once it is staged and publishes on worker threads, at most 2 files at once
    (``background=N``: at most N); the block's end waits for them. ``skip_local_disk=True``
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
    )._open()


def force_follow(stage: Stage, follow: Optional[bool] = True) -> Stage:
    """Internal seam for tests and benchmarks, in no public signature: a new Stage like
    ``stage`` with following forced on (True: also saves of unknown size), off (False) or
    automatic (None, the default of every public entry)."""
    return Stage(dataclasses.replace(stage.settings, follow=follow))


def wait() -> None:
    """Wait for every pending background publish in the process; raise the first error."""
    _background.wait_all()


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
    target = _checked_destination(dest)
    area = StagingArea(settings.staging_root(), is_default=settings.root is None)
    started = time.perf_counter()
    item = None
    private = area.new_private_dir()
    _patch.add_unstaged_dir(private.path)  # a safetensors save into it is not staged again
    try:
        local = private / staged_name(target.name)
        try:
            yield local
        except BaseException:
            private.remove()
            raise
        finally:
            _patch.remove_unstaged_dir(private.path)
        item = StagedFile(private, local, target, started, time.perf_counter() - started)
        _check_written(item)
    finally:
        if item is None:
            private.release()
    _background.settle(target)  # an earlier background publish of it lands first
    # A symlink left by the writer (a cache's file): publish its bytes, never the link, and
    # never touch its target (a rename would move the link and chmod the target).
    publish_staged(item, settings, area, copy=stat.S_ISLNK(os.lstat(local).st_mode))


def _check_written(item: StagedFile) -> None:
    """The writer must have left one regular file (or a symlink to one) at the local path;
    anything else is an error, and whatever it wrote is kept and named, never deleted."""
    local = item.path
    try:
        info = os.lstat(local)
    except FileNotFoundError:
        item.private.remove()
        raise StagingError(
            errno.ENOENT,
            f"safestage.staged_file: nothing was written to {local}, so nothing was published to {item.dest}.",
            str(local),
        ) from None
    if stat.S_ISREG(info.st_mode) or (stat.S_ISLNK(info.st_mode) and local.is_file()):
        return
    kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
    item.private.release()  # kept: it may hold hours of work (a save_state, a DCP save)
    raise StagingError(
        errno.EISDIR if stat.S_ISDIR(info.st_mode) else errno.EINVAL,
        f"safestage.staged_file: the writer made {kind} at {local} where a file was expected, "
        f"so nothing was published to {item.dest}. What it wrote is kept at {local}; for a "
        "whole directory use safestage.staged_dir().",
        str(local),
    )


def save_one(write: Callable[[str], None], dest: PathArg, settings: Settings) -> PublishRecord:
    """One save outside any activation (for integrations such as safestage.lightning):
    ``write(local_path)`` writes the file into a fresh private staging directory, which is
    then published to ``dest`` by the publisher of every staged save. Raises what a staged
    save raises (StagingError, PublishError with the complete copy kept); a writer's own
    error removes the staged file and reaches the caller unchanged."""
    target = _checked_destination(dest)
    if _patch.in_unstaged_dir(target):
        # Into staged_dir's local directory or staged_file's path: staging already, and its
        # owner publishes it (staging it again would publish after the owner had committed).
        return write_unstaged(write, target, settings)
    area = StagingArea(settings.staging_root(), is_default=settings.root is None)
    item = write_staged(write, target, area)
    _background.settle(target)  # an earlier background publish of it lands first
    return publish_staged(item, settings, area)


def save_one_background(
    write: Callable[[str], None], dest: PathArg, settings: Settings
) -> Future[PublishRecord]:
    """save_one() with the publish on the background publisher (pipelined publishing):
    ``write`` runs now, in the caller; the publish runs on a worker once fewer than
    ``settings.background`` files are publishing and no earlier publish of ``dest`` is
    pending. The future's result is the record; its exception the PublishError."""
    target = _checked_destination(dest)
    if _patch.in_unstaged_dir(target):  # as in save_one: written now, nothing to publish
        from concurrent.futures import Future

        done: Future[PublishRecord] = Future()
        done.set_result(write_unstaged(write, target, settings))
        return done
    area = StagingArea(settings.staging_root(), is_default=settings.root is None)
    item = write_staged(write, target, area)
    try:
        return _background.publisher().submit(
            lambda: publish_staged(item, settings, area),
            target,
            max_pending=settings.background,
            kept=item.path,
        )
    except BaseException as exc:  # Ctrl-C while waiting for a slot: keep and name the copy
        keep_unpublished(item, exc)
        raise


def _checked_destination(dest: PathArg) -> Path:
    """The kernel's path of ``dest`` (see _paths), or the error a plain open would give."""
    text = os.fspath(dest)
    target = resolve_destination(text)
    if target is not None:
        return target
    shown = absolute(text)
    if text.endswith("/") or os.path.basename(text) in ("", ".", ".."):
        raise PublishError(
            errno.EISDIR,
            f"safestage: {text!r} names a directory (trailing slash, '.' or '..'): name a file.",
            str(shown),
        )
    if os.path.isdir(text):
        raise PublishError(
            errno.EISDIR, f"safestage: {shown} is a directory: name a file inside it.", str(shown)
        )
    code = _open_error(os.path.dirname(text) or ".")
    if code == errno.ENOTDIR:
        advice = "a component of its directory is not a directory"
    elif code == errno.EACCES:
        advice = "this user may not search its directory: fix the permissions"
    else:
        advice = "its directory does not exist: create it before saving"
    raise PublishError(
        code, f"safestage: cannot save to {shown}: [Errno {code}] {os.strerror(code)}: {advice}.", str(shown)
    )


def _open_error(directory: str) -> int:
    """The errno the kernel gives for ``directory`` (ENOENT if it gives none)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno or errno.ENOENT
    os.close(fd)
    return errno.ENOENT


def is_active() -> bool:
    """Whether staging is on in this process."""
    return _patch.is_active()
