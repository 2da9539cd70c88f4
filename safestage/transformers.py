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

What it holds is glue only: when to commit (the Trainer's events, the barrier) and where
(``checkpoint-<global_step>`` under ``output_dir``). Reading back and committing are the core's.
transformers is imported when this module is.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback

from ._config import PathArg, Publish
from ._errors import PublishError
from ._manifest import Manifest

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
    """

    def __init__(
        self,
        root: Optional[PathArg] = None,
        *,
        publish: Optional[Publish] = None,
        fsync: bool = True,
    ) -> None:
        from . import _config

        _config.resolve(root=root, publish=publish, fsync=fsync)  # ConfigError now, not at step N
        self._root = root
        self._publish = publish
        self._fsync = fsync
        self.committed: list[tuple[Path, Manifest, float]] = []

    # -- the Trainer's events -------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.should_save and args.save_total_limit == 1:
            log.warning(
                "save_total_limit=1 deletes the previous checkpoint before the new "
                "one is committed (the Trainer rotates before on_save): a job killed then "
                "leaves no complete checkpoint. Use save_total_limit >= 2."
            )
        if state.global_step > 0 and args.should_save:
            resumed = self._checkpoint(args, state)
            from ._verify import verify

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

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from . import _background
        from ._in_place import commit_in_place

        checkpoint = self._checkpoint(args, state)
        # This rank's background publishes (SAFESTAGE_BACKGROUND) have landed or failed; a
        # failure is raised unless it is a file of a checkpoint the rotation deleted.
        _raise_unless_rotated(_background.failures(), checkpoint)
        _barrier()  # every rank has written its files
        if not args.should_save:
            return
        if not checkpoint.is_dir():
            # The Trainer's own rotation (save_total_limit) runs before on_save and can delete the
            # checkpoint it has just written: it keeps the highest step numbers when directory
            # mtimes are less than 1 s apart, and a run resumed from an older checkpoint writes
            # lower ones. Nothing to commit; the Trainer decided.
            log.warning("%s: not there any more (removed by save_total_limit?): not committed", checkpoint)
            return
        if _rotated(checkpoint):
            # The rotation deleted it while files of it were still publishing in the background:
            # rmtree (ignore_errors) could not remove the directory they landed in after its
            # listing. What is left is a fragment, never a checkpoint to commit.
            log.warning(
                "%s: removed by save_total_limit while files of it were still publishing "
                "(SAFESTAGE_BACKGROUND); not committed: what is left (%s) is not a checkpoint",
                checkpoint, ", ".join(sorted(p.name for p in checkpoint.iterdir())) or "nothing",
            )  # fmt: skip
            return
        started = time.perf_counter()
        manifest = commit_in_place(checkpoint, self._root, publish=self._publish, fsync=self._fsync)
        seconds = time.perf_counter() - started
        self.committed.append((checkpoint, manifest, seconds))
        log.info(
            "%s: committed (%d files, %d bytes) in %.3fs",
            checkpoint, len(manifest.files), manifest.total_bytes, seconds,
        )  # fmt: skip

    # -- glue -----------------------------------------------------------------------------------

    def _checkpoint(self, args: Any, state: Any) -> Path:
        return Path(args.output_dir) / f"{_PREFIX}-{state.global_step}"

    def _before_save(self, args: Any, state: Any) -> None:
        """The Trainer is about to write ``checkpoint-<step>``: a commit file already there
        (this step was committed by an earlier run) goes first, then every rank may write."""
        if args.should_save:
            from ._commit import invalidate

            checkpoint = self._checkpoint(args, state)
            if checkpoint.is_dir() and invalidate(checkpoint, fsync=self._fsync):
                log.info("%s is being rewritten: its commit file was removed first", checkpoint)
        _barrier()


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
    from ._stage import discard_kept

    dropped = [
        error for error in failures
        if isinstance(error, PublishError) and error.errno == errno.ENOENT
        and _inside(error.filename, checkpoint)
    ]  # fmt: skip
    if dropped and _rotated(checkpoint):
        names = ", ".join(sorted(Path(error.filename).name for error in dropped))
        kept = [error.staged_path for error in dropped if error.staged_path and not discard_kept(error)]
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


def _barrier() -> None:
    """Wait for every rank of the default group (gloo, nccl), if torch.distributed is up."""
    import sys

    if "torch" not in sys.modules:  # a process without torch has no process group
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
