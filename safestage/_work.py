"""Work in flight in this process: one registry, one handle per job.

A job is one save of a file or one commit of a checkpoint directory, from the moment it
starts until it has landed or failed, on whatever thread it runs. Whatever must know what is
in flight asks here: retention never removes a checkpoint a job of this process is writing
(Megatron-Bridge#5184); a save of a file lands after every earlier background job of that
file, and a commit after every background job under its directory; a Stage closes once its
jobs are done; exit waits for the background ones.

A job starts in its caller (``running``) and may be handed to a worker there (``hand_off``):
a background publish, a background commit. Either way its handle is the same ``Job``:
``done()``, ``wait()`` (its result, or its error raised), and its error lives in one place,
the job, until somebody has seen it: ``wait()`` on the handle, the owner's wait (a Stage's
close, a Lightning plugin's teardown, a CommitCallback's next save), ``safestage.wait()``, the
next ``staged_dir`` (``raise_unseen``), or exit, with status 1.

Background work is bounded: at most ``limit`` jobs of a kind on workers at once (the caller
waits for a slot, so the staging root never holds more copies than that), jobs of one
destination one after the other. Each runs on a daemon worker of _lifecycle, so that exit
waits for it here, in ``_complete_at_exit``, and not in threading's join of non-daemon threads
(which runs before atexit and turns a Ctrl-C into "Exception ignored" and exit status 0). A
Ctrl-C there ends the process with status 130, naming what is not published and where its
complete copy is kept; a failure nobody saw is written to stderr whatever the logging setup
and ends it with status 1 (``os._exit``): a program that lost a checkpoint must not look
successful. Where no thread can be had (a pids limit, interpreter shutdown on 3.12+) or exit is
under way, the work runs in the caller.

The registry belongs to one process. A child made by ``fork()`` starts with none of the
parent's jobs, may not defer work of owners it inherited (a forked worker may be ended with
``os._exit`` as soon as its task returns), and a handle it inherited is not its own: ``done()``
and ``wait()`` raise RuntimeError naming the process that runs the job.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

from . import _loud
from ._destination import Destination
from ._interrupts import deferred
from ._lifecycle import start_worker

log = logging.getLogger("safestage")

Kind = Literal["file", "commit"]


class Job:
    """One save or commit in flight, and its handle: ``done()``, ``wait()``, ``error``."""

    def __init__(self, kind: Kind, dest: Destination, owner: object, kept: Optional[Path]) -> None:
        self.kind, self.dest, self.owner = kind, dest, owner
        self.kept = kept  # where its complete copy is kept meanwhile (named if exit is cut short)
        self.pid = os.getpid()
        self.thread: Optional[int] = threading.get_ident()  # None once handed to a worker
        self.finished = False
        self.error: Optional[BaseException] = None
        self.result: Any = None
        self.seen = False  # its error was raised to somebody

    @property
    def background(self) -> bool:
        return self.thread is None

    def done(self) -> bool:
        """Whether it has landed or failed."""
        self._own()
        return self.finished

    def wait(self) -> Any:
        """Its result once it has landed; its error, raised, if it failed (every time)."""
        self._own()
        with _condition:
            _loud.wait_saying(_condition, lambda: self.finished, lambda: _listed([self]), level=logging.INFO)
            self.seen = True
            if self in _jobs:
                _jobs.remove(self)
        if self.error is not None:
            raise self.error
        return self.result

    def _own(self) -> None:
        if self.pid != os.getpid():
            raise RuntimeError(
                f"safestage: the {self.kind} of {self.dest} runs in process {self.pid}, not in this "
                f"one (pid {os.getpid()}, forked from it): only that process can wait for it. Its "
                "result is at the destination once it lands (safestage.verify, latest_complete)."
            )

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else "landed" if self.finished else "running"
        return f"<safestage job {self.kind} {state} dest={str(self.dest)!r}>"


_condition = threading.Condition()
_jobs: list[Job] = []  # running, and finished with an error nobody has seen yet
_then: dict[Destination, list[Callable[[], None]]] = {}  # when_idle actions, by destination
_exiting = False  # set at exit: work submitted from an atexit handler after ours runs inline
# Who may defer work here: owners adopted in this very process (a forked child inherits the
# parent's Stages and plugins, but none of their jobs: reset at fork).
_owners: weakref.WeakSet[object] = weakref.WeakSet()


# -- starting and ending a job ---------------------------------------------------------------------


def start(kind: Kind, dest: Destination, owner: object, *, kept: Optional[Path] = None) -> Job:
    """A job that runs in the calling thread from now on; ``finish`` ends it."""
    job = Job(kind, dest, owner, kept)
    with _condition:
        _jobs.append(job)
    return job


def finish(
    job: Job, *, error: Optional[BaseException] = None, result: Any = None, seen: bool = False
) -> None:
    """End ``job``: landed (``result``) or failed (``error``; ``seen`` if its caller raises it)."""
    with _condition:
        job.error, job.result, job.finished = error, result, True
        job.seen = job.seen or seen or error is None
        if job.seen and job in _jobs:
            _jobs.remove(job)
        actions = _due_actions(job.dest)
        _condition.notify_all()
    for action in actions:
        action()


def abandon(job: Job, exc: BaseException) -> None:
    """``job``'s caller raised ``exc`` before the save's pipeline (``running``) took the job
    (a Ctrl-C as it began): it ends so, seen, never 'in flight' for the life of the process
    (retention would spare its checkpoint, ``when_idle`` would wait for it)."""
    if not job.finished and not job.background:
        finish(job, error=exc, seen=True)


@contextlib.contextmanager
def running(kind: Kind, dest: Destination, owner: object, *, job: Optional[Job] = None) -> Iterator[Job]:
    """A job running in the calling thread for the block (``job``: one already started, as
    ``_patch`` starts it under its own lock); ended when the block ends, with the block's
    exception as its error (seen: the caller raises it), unless the block handed it off."""
    job = job if job is not None else start(kind, dest, owner)
    try:
        yield job
    except BaseException as exc:
        if not job.background:
            finish(job, error=exc, seen=True)
        raise
    if not job.background:
        finish(job, result=job.result)


def hand_off(
    job: Job,
    work: Callable[[], Any],
    *,
    limit: int,
    kept: Optional[Path] = None,
    not_started: Callable[[BaseException], None],
) -> None:
    """Go on with ``job`` on a worker, once fewer than ``limit`` background jobs of its kind
    run and none of its destination does; the caller waits until then. Interrupted during that
    wait, ``not_started(exc)`` runs (the caller keeps its copy) and ``exc`` is raised. From then
    on the job is the worker's: ``work()``'s result or error becomes the job's."""
    try:
        with _condition:
            _loud.wait_saying(
                _condition,
                lambda: (
                    len(_running(kind=job.kind, background=True)) < limit
                    and not _running(dest=job.dest, background=True)
                ),
                lambda: f"{_listed(_running(dest=job.dest, background=True) or _running(kind=job.kind, background=True))} "
                f"to land before the {_KIND[job.kind]} of {job.dest} goes to the background (at most {limit} at once)",
            )
            job.thread, job.kept = None, kept
    except BaseException as exc:
        # Not handed (a Ctrl-C as the wait ends, even once it was marked so): its caller's
        # again, which ends it; else it would be 'in background' for ever and close() wait.
        job.thread = threading.get_ident()
        not_started(exc)
        raise
    handed = False
    try:
        with deferred():  # a Ctrl-C cutting Thread.start() short may have started it anyway
            if not _exiting:
                with contextlib.suppress(RuntimeError):  # no thread to be had
                    start_worker(
                        functools.partial(_run, job, work),
                        name=f"safestage-{job.kind}",
                        daemon=True,
                    )
                    handed = True
    finally:
        if not handed:  # here and now, then
            _run(job, work)


def submit(
    work: Callable[[], Any],
    kind: Kind,
    dest: Path,
    owner: object,
    *,
    limit: int,
    kept: Optional[Path] = None,
    not_started: Callable[[BaseException], None],
) -> Job:
    """A job that runs on a worker from the start (``hand_off``); returns its handle."""
    job = start(kind, dest, owner)
    try:
        hand_off(job, work, limit=limit, kept=kept, not_started=not_started)
    except BaseException as exc:
        if not job.background:
            finish(job, error=exc, seen=True)
        raise
    return job


def _run(job: Job, work: Callable[[], Any]) -> None:
    try:
        result = work()
    except BaseException as exc:
        _loud.error(f"background {'commit' if job.kind == 'commit' else 'publish'} of {job.dest} failed: {exc}")
        finish(job, error=exc)
    else:
        finish(job, result=result)


# -- who may defer ---------------------------------------------------------------------------------


def adopt(owner: object) -> None:
    """``owner`` (a Stage opening, a plugin made or unpickled) lives in this process: its
    work may go on in the background here."""
    _owners.add(owner)


def may_defer(owner: object) -> bool:
    """Whether work of ``owner`` may go on after its call returned: only in the process that
    adopted it, and not in a multiprocessing child. A forked child, or a Pool worker (any start
    method) that may be terminated as soon as its task returns, finishes its work before the
    call returns (so nothing of it is ever pending at its exit)."""
    if owner not in _owners:
        return False
    multiprocessing = sys.modules.get("multiprocessing")
    return multiprocessing is None or multiprocessing.parent_process() is None


# -- what is in flight -----------------------------------------------------------------------------


_KIND = {"file": "background save", "commit": "background commit"}


def _listed(jobs: list[Job]) -> str:
    """What a wait waits for: the jobs, by what they are and where they go (under _condition)."""
    named = [f"the {_KIND[job.kind] if job.background else job.kind.replace('file', 'save')} of {job.dest}" for job in jobs[:3]]
    more = f" and {len(jobs) - 3} more" if len(jobs) > 3 else ""
    return (", ".join(named) + more) or "nothing"


def _running(
    *,
    dest: Optional[Destination] = None,
    owner: object = None,
    kind: Optional[str] = None,
    background: Optional[bool] = None,
    under: Optional[Destination] = None,
) -> list[Job]:
    """The running jobs that match (under _condition)."""
    return [
        job for job in _jobs
        if not job.finished and (dest is None or job.dest == dest) and (owner is None or job.owner is owner)
        and (kind is None or job.kind == kind) and (background is None or job.background == background)
        and (under is None or under in job.dest.parents)
    ]  # fmt: skip


def busy() -> dict[Destination, str]:
    """The destinations this process is saving or committing now: {path: what}."""
    with _condition:
        jobs = _running()
    busy: dict[Destination, str] = {}
    for job in jobs:
        what = "committing" if job.kind == "commit" else "saving"
        when = " in the background" if job.background else ""
        busy.setdefault(job.dest, f"this process is {what} {job.dest}{when}")
    return busy


def running_count(owner: object) -> int:
    """How many of ``owner``'s jobs are on workers now."""
    with _condition:
        return len(_running(owner=owner, background=True))


def pending_copies() -> list[tuple[Destination, Optional[Path]]]:
    with _condition:
        return [(job.dest, job.kept) for job in _running(background=True)]


# -- waiting ---------------------------------------------------------------------------------------


def settle(
    dest: Optional[Destination] = None, *, owner: object = None, under: Optional[Destination] = None
) -> None:
    """Wait, raising nothing, until no background job of ``dest`` (of ``owner``, under the
    directory ``under``; None: any) runs: a later save of the same file must land after it,
    never under it, and a commit file after every file saved into its checkpoint."""
    with _condition:
        _loud.wait_saying(
            _condition,
            lambda: not _running(dest=dest, owner=owner, under=under, background=True),
            lambda: f"{_listed(_running(dest=dest, owner=owner, under=under, background=True))} to land first",
        )


def settle_copies(owner: object, *, but: Job) -> bool:
    """Wait until no background job of ``owner`` but ``but`` holds a complete local copy
    (its ``kept``) that is still to be published; False when none did (nothing to wait for).
    Those never wait for anything themselves: a worker may wait for them."""

    def holding() -> list[Job]:
        return [job for job in _running(owner=owner, background=True) if job is not but and job.kept is not None]

    with _condition:
        if not holding():
            return False
        _condition.wait_for(lambda: not holding())
    return True


def make_room(kind: Kind, limit: int) -> None:
    """Wait until fewer than ``limit`` background jobs of ``kind`` run (a background commit
    waits so before its block starts: never more local copies than that)."""
    with _condition:
        _loud.wait_saying(
            _condition,
            lambda: len(_running(kind=kind, background=True)) < limit,
            lambda: f"{_listed(_running(kind=kind, background=True))} to land (at most {limit} in flight)",
        )


def wait_for_threads(owner: object) -> None:
    """Until ``owner``'s jobs running in other threads have ended or gone to a worker (a Stage
    closing waits for the saves it accepted; its own thread's are not waited for)."""
    me = threading.get_ident()
    with _condition:
        _condition.wait_for(
            lambda: not [job for job in _running(owner=owner) if job.thread not in (None, me)]
        )


def when_idle(dest: Destination, action: Callable[[], None]) -> None:
    """Run ``action`` once no job of ``dest`` runs: now, or by the thread that ends the last
    one (Lightning's top-k removal of a checkpoint still being saved or published)."""
    with _condition:
        if _running(dest=dest):
            _then.setdefault(dest, []).append(action)
            return
    action()


def _due_actions(dest: Destination) -> list[Callable[[], None]]:
    """Under _condition: the when_idle actions of ``dest`` now that none of its jobs runs."""
    if dest not in _then or _running(dest=dest):
        return []
    return _then.pop(dest)


def failures(
    owner: object = None, *, kind: Optional[Kind] = None, finished_only: bool = False
) -> list[BaseException]:
    """Wait for ``owner``'s background jobs (None: every one; ``kind``: of that kind only);
    return the errors nobody has seen, now seen. ``finished_only``: do not wait."""
    with _condition:
        chosen = [job for job in _jobs if (owner is None or job.owner is owner) and kind in (None, job.kind)]
        if finished_only:
            chosen = [job for job in chosen if job.finished]
        else:
            chosen = [job for job in chosen if job.background or job.finished]
        _loud.wait_saying(
            _condition,
            lambda: all(job.finished for job in chosen),
            lambda: _listed([job for job in chosen if not job.finished]),
            level=logging.INFO,
        )
        errors = [job.error for job in chosen if job.error is not None and not job.seen]
        for job in chosen:
            job.seen = True
            if job in _jobs:  # a job that landed was forgotten when it finished
                _jobs.remove(job)
    return [error for error in errors if error is not None]


def wait(owner: object = None, *, finished_only: bool = False) -> None:
    """Raise the first of ``failures()``, with a note naming every other that failed (each
    was also reported when it failed)."""
    _raise_first(failures(owner, finished_only=finished_only))


def raise_unseen(match: Callable[[Job], bool], note: Union[str, Callable[[Job], str]]) -> None:
    """Raise the error of a finished job that ``match``es and nobody has seen (once; its own
    ``wait()`` raises it again), with ``note`` (``{dest}`` is its destination; a callable
    writes it from the job): the next staged_dir raises a background commit's failure so, the
    next save through a stage a background save's."""
    with _condition:
        failed = [job for job in _jobs if job.finished and not job.seen and match(job)]
        for job in failed:
            job.seen = True
            _jobs.remove(job)
    errors = [job.error for job in failed if job.error is not None]
    if errors and hasattr(errors[0], "add_note"):
        errors[0].add_note(note(failed[0]) if callable(note) else note.format(dest=failed[0].dest))
    _raise_first(errors)


def _raise_first(errors: list[BaseException]) -> None:
    if not errors:
        return
    first, others = errors[0], [str(error) for error in errors[1:]]
    if others and hasattr(first, "add_note"):
        first.add_note(f"{len(others)} more background save(s) failed too:")
        for text in others:
            first.add_note(f"  {text}")
    raise first


def end_threads() -> None:
    """Once nothing runs in the background, wait for the finished workers' threads to be gone
    (a Lightning fit ends so: its test harness fails a test that leaves threads)."""
    with _condition:
        if _running(background=True):
            return
    for thread in threading.enumerate():
        if (
            thread.name.startswith("safestage-")
            and thread.daemon
            and thread is not threading.current_thread()
        ):
            thread.join(timeout=5.0)


# -- exit and fork ---------------------------------------------------------------------------------


def _complete_at_exit() -> None:
    """Registered when safestage is imported, so that it runs after the handlers registered
    later (atexit is last-in, first-out) and only those registered earlier can be skipped by
    the exit below. Our workers are daemon threads: this is where exit waits for them."""
    global _exiting
    _exiting = True
    try:
        errors = failures()
    except KeyboardInterrupt:
        # Ctrl-C while exit waits: the interpreter would go on and kill the worker mid-copy.
        # Say what is not complete and where its data is.
        lines = [
            f"safestage: interrupted at exit while {'committing' if job.kind == 'commit' else 'publishing'} "
            f"{job.dest}; it is NOT complete there"
            + (f"; the complete staged copy is kept at {job.kept}" if job.kept is not None else "")
            + "\n"
            for job in _running(background=True)
        ] or ["safestage: interrupted at exit while waiting for background saves\n"]
        _exit_loudly(lines, status=130)
        return
    except BaseException:
        return
    if not errors:
        # A worker goes on a moment after its job has finished (its frames, a copy's storages,
        # are freed): the interpreter must not tear torch down under it (std::terminate,
        # status 134).
        with contextlib.suppress(BaseException):
            end_threads()
        return
    if errors:
        _exit_loudly(
            [
                f"safestage: a background save failed and nobody waited for it; it is NOT at its "
                f"destination: {error}\n"
                for error in errors
            ],
            status=1,
        )


def _exit_loudly(lines: list[str], *, status: int) -> None:
    # Straight to file descriptor 2: the program may have closed or replaced sys.stderr.
    for line in lines:
        _loud.write_stderr(line)
    with contextlib.suppress(Exception):
        logging.shutdown()
    for each in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if each is not None:
                each.flush()
    os._exit(status)


def after_fork_in_child() -> None:  # registered by _lifecycle
    global _condition, _owners
    _condition = threading.Condition()  # a parent thread may have held it at fork()
    _jobs.clear()  # the parent's jobs: neither run nor fail here
    _then.clear()
    _owners = weakref.WeakSet()


atexit.register(_complete_at_exit)
