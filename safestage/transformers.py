"""transformers: a ``TrainerCallback`` that commits each checkpoint the Trainer has written.

    from safestage.transformers import CommitCallback

    trainer = transformers.Trainer(..., callbacks=[CommitCallback()])
    trainer.train(resume_from_checkpoint=safestage.latest_complete(args.output_dir))

The Trainer writes ``checkpoint-N`` straight into ``output_dir``, from every rank
(``model.safetensors`` and ``optimizer.pt`` from rank 0, ``rng_state_<rank>.pth`` from each),
with ``torch.save`` and plain ``open()`` (``trainer_state.json``), and its own resume
(``resume_from_checkpoint=True``) picks the newest directory whether or not its writer
finished (transformers#35782). With staging on (``SAFESTAGE_DIR`` and
``SAFESTAGE_TORCH_SAVE=1``) each file lands whole; this callback makes the directory land
whole: once every rank is done (a barrier on the default torch.distributed group), the
process that saves (``args.should_save``: world rank 0, or each node's local rank 0 with
``save_on_each_node``) reads every file back and writes the commit file last
(``safestage.commit_in_place``). ``safestage.latest_complete(output_dir)`` then names the
newest checkpoint that was committed, never one a killed job left half-written.

Before the Trainer writes into a ``checkpoint-N`` that already holds a commit file (a run
resumed from an older checkpoint than the newest one), that commit file is removed, so a kill
during the rewrite cannot leave an old commit vouching for new files.

On many nodes each node stages under its own ``SAFESTAGE_DIR``; the saving process reads back
the other nodes' files through the destination. Not ``staged_dir(group=...)``: that collective
hands each rank a local directory to write into, and the Trainer writes ``checkpoint-N`` at
``output_dir`` itself (its rotation, ``best_model_checkpoint`` and ``push_to_hub`` look there);
under DDP rank 0 writes all but the other ranks' RNG files, so digests gathered from the ranks
would spare it little of the read-back (docs/integrations.md, "Many ranks and many nodes").

``CommitCallback(keep=N)`` prunes ``output_dir`` after each commit has landed (safestage's
retention, which counts only complete checkpoints), in place of the Trainer's
``save_total_limit``, which rotates before the commit (Megatron-Bridge#5184).
``CommitCallback(background=True)`` commits on a safestage thread while training goes on, one
at a time, waited for before the Trainer writes the next checkpoint (docs/integrations.md). In
one process the wait for its files (``SAFESTAGE_BACKGROUND``: written and published on safestage's
threads from copies of the state) goes on that thread too, so the Trainer's loop waits only for
the copies; with several ranks ``on_save`` waits for this rank's files before the barrier.

``CommitCallback(destination="s3://bucket/run")`` (or another directory) commits each local
``checkpoint-N`` to ``destination/checkpoint-N`` instead, through ``staged_dir``: its files
are linked (copied across devices) into a local directory of the staging root on the Trainer's
thread, then uploaded and the commit object created last, in the background with
``background=True``; ``keep=N`` prunes ``destination``. The local ``output_dir`` stays the
Trainer's own (resume from it, or from ``safestage.fetch``).

What it holds is glue only: when to commit (the Trainer's events, the barrier) and where
(``checkpoint-<global_step>`` under ``output_dir``). Reading back and committing are the core's.
transformers is imported when this module is.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback

from ._config import PathArg, Publish
from ._destination import Destination, url_of
from ._errors import ConfigError, PublishError
from ._paths import real_directory
from .checkpoint._manifest import Manifest

__all__ = ["CommitCallback"]

log = logging.getLogger("safestage")

_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


class CommitCallback(TrainerCallback):  # type: ignore[misc]
    """Commit every checkpoint the Trainer saves, once all ranks have written it.

    ``root`` (the staging root, where the commit file is written before it is published),
    ``publish`` and ``fsync`` mean what they mean for ``safestage.staged()`` (argument >
    SAFESTAGE_* variable > default). After each commit, ``committed`` holds
    ``(checkpoint path, manifest, seconds)``. A checkpoint that fails its read-back raises
    PublishError from ``on_save`` and gets no commit file: the run stops, as it would if the
    Trainer's own write had failed. So does a failed background publish, except one of a file
    of a checkpoint the Trainer's rotation deleted (a WARNING, its staged copy removed); a
    checkpoint without ``trainer_state.json`` is never committed.

    ``keep=N``: after each commit has landed, the process that committed prunes ``output_dir``
    as ``safestage.prune(output_dir, keep=N, pattern="checkpoint-*")`` does (the N newest
    complete checkpoints stay, a save in progress is never touched), sparing the Trainer's
    ``best_model_checkpoint``; a prune that fails is a WARNING, never a failed commit. Use it
    instead of the Trainer's ``save_total_limit``, which rotates before the new checkpoint is
    committed (a WARNING at ``on_train_begin`` says so).

    ``background=True``: ``on_save`` hands the read-back and the commit to a safestage thread
    and returns; training goes on. One at a time: before the Trainer writes the next
    checkpoint (and at the next ``on_save``, at ``on_train_end``) the callback waits for it,
    and raises its PublishError there if it failed (as ``safestage.wait()`` and exit do).

    ``destination`` (an object-store URL, ``s3://bucket/run``, ``gs://``, ``az://``, or a
    directory): each checkpoint is committed to ``destination/checkpoint-N`` with
    ``safestage.staged_dir`` (the files of ``output_dir/checkpoint-N``, linked or copied into
    its local directory on the Trainer's thread; with ``background=True`` uploaded and
    committed while training goes on), and ``keep=N`` prunes ``destination``, never
    ``output_dir``. ``best_model_checkpoint`` is not spared there (it names a local path).
    The saving process commits what it sees in ``output_dir``: one node, or a shared one.
    """

    def __init__(
        self,
        root: Optional[PathArg] = None,
        *,
        publish: Optional[Publish] = None,
        fsync: bool = True,
        keep: Optional[int] = None,
        background: bool = False,
        destination: Optional[PathArg] = None,
    ) -> None:
        from . import _config, _work
        from .checkpoint import _prune

        self._settings = _config.resolve(
            root=root, publish=publish, fsync=fsync
        )  # ConfigError now, not at step N
        if not isinstance(background, bool):
            raise ConfigError(
                f"safestage.transformers.CommitCallback: background={background!r}: expected True "
                "(commit on a safestage thread, one at a time) or False"
            )
        self._background = background
        self._retention = (
            None if keep is None
            else _prune.Retention(_prune.check_keep(keep, "safestage.transformers.CommitCallback"), f"{_PREFIX}-*")
        )  # fmt: skip
        self._keep = keep
        # Where each checkpoint is committed, if not in place: a URL (url_of) or a directory.
        self._destination: Optional[Destination] = (
            None if destination is None else url_of(destination) or Path(os.fspath(destination))
        )
        self._pending: Optional[tuple[Path, Any, float]] = None  # a background staged_dir's commit
        self.committed: list[tuple[Path, Manifest, float]] = []
        self._started: Optional[float] = None  # when the Trainer began writing the checkpoint
        _work.adopt(self)  # its commits may run in the background in this process only

    # -- the Trainer's events -------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from . import _work

        _work.adopt(self)  # also when made in another process (unpickled, forked)
        if args.should_save and args.save_total_limit is not None and args.save_total_limit > 0:
            self._warn_rotation(args.save_total_limit)
        if state.global_step > 0 and args.should_save and self._destination is None:
            resumed = self._checkpoint(args, state)
            from .checkpoint._verify import verify

            if resumed.is_dir() and not verify(resumed).complete:
                log.warning(
                    "resuming at step %d, but %s was never committed (a torn "
                    "checkpoint?); resume from safestage.latest_complete(%r) instead",
                    state.global_step, resumed, str(args.output_dir),
                )  # fmt: skip

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:
            self._before_save(args, state)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:
            self._before_save(args, state)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # save_strategy="best" decides to save after evaluating, past on_step_end: the previous
        # background commit lands before the Trainer writes and rotates (_wait_for_commit).
        if args.save_strategy == "best":
            self._wait_for_commit("before the Trainer saves again")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from . import _work

        checkpoint = self._checkpoint(args, state)
        self._wait_for_commit("at the next on_save")  # landed before the next one, or raised
        started, self._started = self._started, None  # this checkpoint's; the next sets its own
        spare = self._best(state)
        if self._destination is not None:
            self._commit_elsewhere(args, checkpoint)
            return
        if self._background and _work.may_defer(self) and not _many_ranks():
            # One process: its files are all the commit waits for, so that wait goes on the
            # commit's thread too, and the Trainer's loop waits only for the copies of its state
            # (SAFESTAGE_BACKGROUND saves return after a copy). One commit at a time: the next
            # save waits for it first (_before_save, on_save).
            work = functools.partial(self._land_and_commit, args, checkpoint, spare, started)
            _work.submit(work, "commit", real_directory(checkpoint) or checkpoint, self, limit=1,
                         not_started=lambda exc: None)  # fmt: skip
            return
        # This rank's background publishes (SAFESTAGE_BACKGROUND) have landed or failed; a
        # failure is raised unless it is a file of a checkpoint the rotation deleted.
        _raise_unless_rotated(_work.failures(), checkpoint)
        _barrier()  # every rank has written its files
        dest = self._committable(args, checkpoint)
        if dest is None:
            return
        work = functools.partial(self._commit, checkpoint, dest, spare, started)
        if self._background and _work.may_defer(self):
            # The Trainer has written every file (the barrier above): reading them back and
            # writing the commit file go on on a safestage thread while training goes on. One
            # at a time: the next save waits for it first (_before_save, on_save).
            _work.submit(work, "commit", dest, self, limit=1, not_started=lambda exc: None)
            return
        with _work.running(
            "commit", dest, self
        ):  # a prune of this process never removes it meanwhile
            work()

    def _land_and_commit(
        self, args: Any, checkpoint: Path, spare: dict[Path, str], started: Optional[float]
    ) -> None:
        """One process, in the background: once its files have landed, the commit."""
        from . import _work

        _raise_unless_rotated(_work.failures(kind="file"), checkpoint)
        dest = self._committable(args, checkpoint)
        if dest is not None:
            self._commit(checkpoint, dest, spare, started)

    def _committable(self, args: Any, checkpoint: Path) -> Optional[Path]:
        """Where to commit ``checkpoint`` once its files have landed; None when this process
        does not commit or the Trainer's rotation removed it."""
        if not args.should_save:
            return None
        if not checkpoint.is_dir():
            # The Trainer's own rotation (save_total_limit) runs before on_save and can delete the
            # checkpoint it has just written: it keeps the highest step numbers when directory
            # mtimes are less than 1 s apart, and a run resumed from an older checkpoint writes
            # lower ones. Nothing to commit; the Trainer decided.
            log.warning(
                "%s: not there any more (removed by save_total_limit?): not committed", checkpoint
            )
            return None
        if _rotated(checkpoint):
            # The rotation deleted it while files of it were still publishing in the background:
            # rmtree (ignore_errors) could not remove the directory they landed in after its
            # listing. What is left is a fragment, never a checkpoint to commit.
            log.warning(
                "%s: removed by save_total_limit while files of it were still publishing "
                "(SAFESTAGE_BACKGROUND); not committed: what is left (%s) is not a checkpoint",
                checkpoint, ", ".join(sorted(p.name for p in checkpoint.iterdir())) or "nothing",
            )  # fmt: skip
            return None
        return real_directory(checkpoint) or checkpoint

    def _commit_elsewhere(self, args: Any, checkpoint: Path) -> None:
        """``destination``: once every rank has written ``checkpoint``, the saving process
        commits its files to ``destination/checkpoint-N`` (staged_dir: the one commit
        sequence), in the background with ``background=True``."""
        from . import _work
        from .checkpoint._staged_dir import staged_dir

        _raise_unless_rotated(_work.failures(), checkpoint)
        _barrier()  # every rank has written its files
        local_dir = self._committable(args, checkpoint)
        if local_dir is None:
            return
        assert self._destination is not None
        began = time.perf_counter()
        settings = self._settings
        handle = staged_dir(str(self._destination / checkpoint.name), settings.root, publish=settings.publish,
                            fsync=settings.fsync, keep=self._keep, background=self._background)  # fmt: skip
        with handle as local:
            _link_tree(local_dir, local)
        if self._background:
            self._pending = (checkpoint, handle, began)
            return
        self._landed(checkpoint, handle.wait(), began)

    def _landed(self, checkpoint: Path, manifest: Manifest, began: float) -> None:
        seconds = time.perf_counter() - began
        self.committed.append((checkpoint, manifest, seconds))
        log.info(
            "%s: committed to %s (%d files, %d bytes) in %.3fs",
            checkpoint, self._destination, len(manifest.files), manifest.total_bytes, seconds,
        )  # fmt: skip

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._wait_for_commit("at the end of training")  # the last checkpoint has landed, or raised

    # -- glue -----------------------------------------------------------------------------------

    def _checkpoint(self, args: Any, state: Any) -> Path:
        return Path(args.output_dir) / f"{_PREFIX}-{state.global_step}"

    def _commit(
        self, checkpoint: Path, dest: Path, spare: dict[Path, str], started: Optional[float]
    ) -> None:
        """Commit ``checkpoint`` in place, then (keep=N) prune its siblings: on the Trainer's
        thread, or on a safestage thread (background=True)."""
        from .checkpoint._in_place import commit_written

        began = time.perf_counter()
        manifest = commit_written(
            dest, self._settings, started=started, retention=self._retention, spare=spare
        )
        seconds = time.perf_counter() - began
        self.committed.append((checkpoint, manifest, seconds))
        log.info(
            "%s: committed (%d files, %d bytes) in %.3fs",
            checkpoint, len(manifest.files), manifest.total_bytes, seconds,
        )  # fmt: skip

    def _best(self, state: Any) -> dict[Path, str]:
        """The Trainer's best checkpoint (``load_best_model_at_end`` loads it at the end, and the
        Trainer's own rotation spares it): keep= never removes it either."""
        best = getattr(state, "best_model_checkpoint", None)
        if not best:
            return {}
        path = real_directory(best)
        return (
            {}
            if path is None
            else {path: "the Trainer's best_model_checkpoint (load_best_model_at_end loads it)"}
        )

    def _wait_for_commit(self, where: str) -> None:
        """Wait for this callback's background commit, if one is in flight; raise its error."""
        from . import _work

        try:
            _work.wait(self)
            pending, self._pending = self._pending, None
            if pending is not None:  # destination=, background=True: its staged_dir's handle
                checkpoint, handle, began = pending
                self._landed(checkpoint, handle.wait(), began)
        except BaseException as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(
                    f"safestage: raised {where}: the background commit of a checkpoint failed"
                )
            raise

    def _warn_rotation(self, limit: int) -> None:
        if limit == 1:
            what = ("save_total_limit=1 deletes the previous checkpoint before the new one is committed: "
                    "a job killed then leaves no complete checkpoint")  # fmt: skip
        else:
            what = (f"save_total_limit={limit} counts checkpoint-* directories whether committed or not, "
                    "so it can delete the newest complete checkpoint while a newer one is still being "
                    "written or committed (Megatron-Bridge#5184)")  # fmt: skip
        keep = (
            "" if self._retention is None else f" (keep={self._retention.keep} is set: both rotate)"
        )
        log.warning(
            "%s: the Trainer rotates before on_save, before the checkpoint it has just written is "
            "committed%s. Use save_total_limit=None and CommitCallback(keep=%d): safestage prunes "
            "after each commit has landed and counts only complete checkpoints",
            what, keep, limit if self._retention is None else self._retention.keep,
        )  # fmt: skip

    def _before_save(self, args: Any, state: Any) -> None:
        """The Trainer is about to write ``checkpoint-<step>``: a commit file already there
        (this step was committed by an earlier run) goes first, then every rank may write."""
        # The previous background commit lands first: the Trainer's writes, its rotation and
        # the removal below must not run under its read-back or its prune.
        self._wait_for_commit("before the Trainer saves again")
        self._started = time.time()  # the save's start: its place in the run's timeline (_timeline)
        if args.should_save:
            from .checkpoint._sequence import invalidate

            checkpoint = self._checkpoint(args, state)
            if checkpoint.is_dir() and invalidate(checkpoint, fsync=self._settings.fsync):
                log.info("%s is being rewritten: its commit file was removed first", checkpoint)
        _barrier()


def _link_tree(source: Path, local: Path) -> None:
    """The files of ``source`` into ``local`` (a staged_dir's local directory), as hard links
    (the Trainer never rewrites a file of a checkpoint it has written) or, across devices or
    where links are refused, copies."""
    for directory, _, files in os.walk(source):
        here = local / os.path.relpath(directory, source)
        here.mkdir(exist_ok=True)
        for name in sorted(files):
            try:
                os.link(os.path.join(directory, name), here / name)
            except OSError:  # EXDEV, EPERM: a copy
                shutil.copyfile(os.path.join(directory, name), here / name)


def _rotated(checkpoint: Path) -> bool:
    """Whether the Trainer's rotation has deleted ``checkpoint`` (or tried to): its
    trainer_state.json, the last file the saving process writes before it rotates, is gone.
    (On the other ranks it may not be written yet: asked only about a checkpoint one of
    whose files failed to publish because it was removed.)"""
    return not (checkpoint / _STATE).exists()


def _raise_unless_rotated(failures: list[BaseException], checkpoint: Path) -> None:
    """Raise the first of this rank's failed background publishes (each was logged when it
    failed), with a note naming the others, except those the rotation caused: ENOENT
    publishing a file of ``checkpoint`` after the Trainer deleted it. Those are a WARNING and
    their kept copies are discarded (the Trainer deleted what they were for). Any other
    ENOENT (a destination nobody removed) is still raised."""
    from ._kept import discard_for

    dropped = [
        error for error in failures
        if isinstance(error, PublishError) and error.errno == errno.ENOENT
        and _inside(error.filename, checkpoint)
    ]  # fmt: skip
    if dropped and _rotated(checkpoint):
        names = ", ".join(sorted(Path(error.filename).name for error in dropped))
        kept = [
            error.staged_path
            for error in dropped
            if error.staged_path and not discard_for(error.staged_path)
        ]
        log.warning(
            "%s: removed by save_total_limit while %s was still publishing (SAFESTAGE_BACKGROUND): "
            "not published, the Trainer deleted its checkpoint%s",
            checkpoint, names, f"; could not remove the staged copies {kept}" if kept else "",
        )  # fmt: skip
        failures = [error for error in failures if not any(error is d for d in dropped)]
    if not failures:
        return
    first = failures[0]
    if len(failures) > 1 and hasattr(first, "add_note"):  # Python 3.11+
        first.add_note(f"{len(failures) - 1} more background publish(es) failed too:")
        for error in failures[1:]:
            first.add_note(f"  {error}")
    raise first


def _inside(path: Optional[str], directory: Path) -> bool:
    return path is not None and Path(path).is_relative_to(directory)


def _many_ranks() -> bool:
    """Whether torch.distributed is up with more than one rank (the barrier is needed)."""
    import sys

    if "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _barrier() -> None:
    """Wait for every rank of the default group (gloo, nccl), if torch.distributed is up."""
    import sys

    if "torch" not in sys.modules:  # a process without torch has no process group
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
