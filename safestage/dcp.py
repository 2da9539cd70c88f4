"""``safestage.dcp``: torch.distributed.checkpoint storage writers that stage locally, publish,
and commit last.

    import torch.distributed.checkpoint as dcp
    from safestage.dcp import StagedWriter

    dcp.save(state_dict, storage_writer=StagedWriter("/mnt/s3/run42/step-1000"))
    dcp.load(state_dict, checkpoint_id="/mnt/s3/run42/step-1000")   # stock DCP reads it

DCP's own ``FileSystemWriter`` writes its data files in place (a killed save leaves torn
``.distcp`` files under their final names), renames ``.metadata`` in last (mountpoint-s3 has
no rename: the save fails with EBADF/ENOSYS and leaves no ``.metadata``), and removes the old
``.metadata`` only at the end, so a half-overwritten directory still has an old ``.metadata``
vouching for new data files. Here, per save (DCP's StorageWriter protocol, storage.py):

1. ``set_up_storage_writer`` (every rank): a fresh local directory in a private save
   directory under this rank's own staging root (nodes never share one), and a stock
   ``FileSystemWriter`` pointed at it;
2. ``prepare_global_plan`` (the coordinator, before DCP scatters the plan, so before any rank
   writes): the destination is created, its commit file removed, DCP's old ``.metadata``
   removed, and the temp files of killed commits with them;
3. ``write_data`` (every rank): the inner writer writes the rank's files locally; each is then
   published (``_publish.publish_file``: replace, or direct where the destination cannot
   rename; size checked; CRC-32 computed while copying); the local copy goes once they
   landed, and is kept (``safestage-kept.json``) if a publish fails. The WriteResults carry
   each file's entry (path, size, CRC-32, global rank) to the coordinator;
4. ``finish`` (the coordinator): the entries are stripped off again, so that ``.metadata``
   holds only DCP's own classes (stock torch unpickles it); the inner writer writes
   ``.metadata`` locally, it is published, and the commit file ``_SAFESTAGE_COMMIT.json``,
   listing every file of every rank and ``.metadata``, is published last.

A failure on any rank raises on every rank (DCP gathers each step's exceptions into one
``CheckpointException``; ours is a ``safestage.PublishError`` naming the rank and the file),
``finish`` is not reached, and no commit file is written: ``safestage.verify(dest).complete``
is False and ``latest_complete`` skips the directory.

Importing this module imports torch; ``import safestage`` does not import this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import _config, _save
from ._clean import remove_dead_temps
from ._commit import (
    _discard,
    _local_name,
    _mark_disposable,
    destination_directory,
    invalidate,
    publish_manifest,
)
from ._config import PathArg, Publish, Settings
from ._errors import PublishError
from ._manifest import COMMIT_NAME, Crc32, FileEntry, new_manifest, unsafe_path
from ._names import DISPOSABLE_MARKER
from ._publish import Published, fsync_directory, publish_file
from ._stage import SaveDir, StagingRoot, record_kept

try:  # torch >= 2.4
    from torch.distributed.checkpoint.metadata import StorageMeta
except ImportError:  # pragma: no cover - older torch: no storage_meta at all
    StorageMeta = None  # type: ignore[assignment,misc]

try:  # torch >= 2.7: DCP's HuggingFace (safetensors shards) writer
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
except ImportError:  # pragma: no cover - older torch
    HuggingFaceStorageWriter = None  # type: ignore[assignment,misc]

__all__ = ["StagedHuggingFaceWriter", "StagedWriter"]

log = logging.getLogger("safestage")

METADATA_NAME = ".metadata"  # DCP's (filesystem._metadata_fn): what dcp.load opens first
HF_INDEX_NAME = "model.safetensors.index.json"  # the HuggingFace writer's (_hf_utils._metadata_fn)


@dataclass(frozen=True)
class _Landed:
    """A WriteResult's storage_data on its way to the coordinator: the inner writer's own
    (what ``.metadata`` keeps) and the commit-file entry of the file it is in. Stripped in
    ``finish`` before ``.metadata`` is pickled: a reader needs only stock torch."""

    info: Any
    entry: FileEntry


@dataclass
class _Save:
    """One save on this rank: where it goes, and its local copy while it has one (the data
    files until they landed; on the coordinator, ``.metadata`` in ``finish``)."""

    dest: Path
    rank: int
    inner: StorageWriter
    staging: StagingRoot
    private: Optional[SaveDir]
    local: Path


class _LocalFileSystemWriter(FileSystemWriter):
    """DCP's FileSystemWriter writing into a local directory, whose ``.metadata`` names the
    destination (``StorageMeta.checkpoint_id``), not the local directory that is gone."""

    def __init__(self, path: Path, public_meta: Any, **options: Any) -> None:
        super().__init__(path, **options)
        self._public_meta = public_meta

    def storage_meta(self) -> Any:
        return self._public_meta


class StagedWriter(StorageWriter):
    """A DCP ``StorageWriter`` for ``dest``, a directory on any destination safestage serves
    (HDFS FUSE, mountpoint-s3, s3fs, rclone, NFS, a local disk): every rank writes its files
    under its own staging root ``root`` (default SAFESTAGE_DIR, else $TMPDIR/safestage-<uid>)
    and publishes them (``publish``, ``fsync`` as for every save); the coordinator writes
    DCP's ``.metadata``, then safestage's commit file, last. ``dest`` is created if missing
    (its parent must exist). ``thread_count``, ``single_file_per_rank`` and
    ``per_thread_copy_ahead`` are passed to the inner ``FileSystemWriter``.

    One save at a time per writer (``dcp.save``, or ``dcp.async_save`` whose future was
    waited on); a fresh writer per checkpoint is the simple rule. Requires
    ``use_collectives=True`` (DCP's default)."""

    def __init__(
        self,
        dest: PathArg,
        root: Optional[PathArg] = None,
        *,
        publish: Optional[Publish] = None,
        fsync: bool = True,
        thread_count: int = 1,
        single_file_per_rank: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
    ) -> None:
        super().__init__()
        self.settings: Settings = _config.resolve(root=root, publish=publish, fsync=fsync)
        self.dest = Path(os.fspath(dest))
        self._options: dict[str, Any] = {
            "thread_count": thread_count,
            "single_file_per_rank": single_file_per_rank,
            "per_thread_copy_ahead": per_thread_copy_ahead,
            # The local copy is not the checkpoint: the publish syncs what lands at dest.
            "sync_files": False,
        }
        self.save_id = str(uuid.uuid4())
        self._save: Optional[_Save] = None

    # -- what DCP's process-based async_save pickles: the configuration, never a save's state

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_save"] = None
        return state

    def __repr__(self) -> str:
        return f"<safestage.dcp.{type(self).__name__} dest={str(self.dest)!r}>"

    # -- StorageWriter ---------------------------------------------------------------------

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike[str]]:
        return self.dest

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike[str]]) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: Union[str, os.PathLike[str], None] = None) -> None:
        if checkpoint_id:
            self.dest = Path(os.fspath(checkpoint_id))
        self.save_id = str(uuid.uuid4())

    def storage_meta(self) -> Any:
        if StorageMeta is None:  # pragma: no cover - torch < 2.4
            return None
        return StorageMeta(checkpoint_id=str(self.dest), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                f"safestage.dcp.{type(self).__name__} needs dcp.save(use_collectives=True) (the "
                "default): without collectives every rank would be its own coordinator and commit "
                f"{self.dest} alone"
            )
        self._abandon()  # an earlier save with this writer that DCP stopped half-way
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        dest = destination_directory(self.dest)
        staging, private, local = _local_copy(self.settings, dest)
        try:
            inner = self._inner(local)
        except BaseException:
            _discard(private, local)
            raise
        self._save = _Save(dest, rank, inner, staging, private, local)
        if "kwargs" in inspect.signature(inner.set_up_storage_writer).parameters:
            inner.set_up_storage_writer(is_coordinator, *args, **kwargs)
        else:  # pragma: no cover - torch < 2.6
            inner.set_up_storage_writer(is_coordinator)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self._current().inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator, before any rank writes: from here on the destination holds no
        commit file and no ``.metadata`` until this save's own land."""
        save = self._current()
        self._check_plans(plans)
        _prepare_destination(save.dest, self._vouching_files(), fsync=self.settings.fsync)
        return save.inner.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._current()
        started = time.perf_counter()
        written = save.inner.write_data(plan, planner)
        written.wait()
        results: list[WriteResult] = written.value()
        # Only files a WriteResult points into: an empty bucket's file holds nothing to read.
        paths = sorted({result.storage_data.relative_path for result in results})
        entries = self._publish(save, paths)
        self._close(save)  # landed: nothing of this rank's is left to keep
        log.debug(
            "%s: rank %d published %d files, %d bytes in %.3fs", save.dest, save.rank,
            len(paths), sum(entry.size for entry in entries.values()), time.perf_counter() - started,
        )  # fmt: skip
        future: Future[list[WriteResult]] = Future()
        future.set_result(
            [dataclasses.replace(r, storage_data=_Landed(r.storage_data, entries[r.storage_data.relative_path]))
             for r in results]
        )  # fmt: skip
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._current()
        entries: dict[str, FileEntry] = {}
        stripped = []
        for rank_results in results:
            plain = []
            for result in rank_results:
                landed: _Landed = result.storage_data
                other = entries.setdefault(landed.entry.path, landed.entry)
                if other.rank != landed.entry.rank:
                    raise PublishError(
                        errno.EEXIST,
                        f"safestage.dcp: ranks {other.rank} and {landed.entry.rank} both wrote "
                        f"{save.dest / landed.entry.path}: the checkpoint is not committed (no commit "
                        "file). Give each rank its own file names and save again.",
                        str(save.dest / landed.entry.path),
                    )
                plain.append(dataclasses.replace(result, storage_data=landed.info))
            stripped.append(plain)
        # DCP's own .metadata, written locally by the inner writer, in a fresh local directory
        save.staging, save.private, save.local = _local_copy(self.settings, save.dest)
        save.inner.reset(save.local)  # its storage_meta stays the destination's (_LocalFileSystemWriter)
        save.inner.finish(metadata, stripped)
        written = sorted(entry.name for entry in os.scandir(save.local) if entry.is_file(follow_symlinks=False))
        entries.update(self._publish(save, written, landed=sorted(entries)))
        manifest = new_manifest(list(entries.values()), [], _version())
        try:
            publish_manifest(manifest, save.private, save.dest, self.settings, save.staging.device)
        except OSError as exc:
            raise self._kept(
                save, exc, COMMIT_NAME, left=written, landed=sorted(entries),
                what=f"all {len(entries)} files landed, but the commit file {COMMIT_NAME} could not be written",
            ) from exc  # fmt: skip
        self._close(save)
        self._save = None
        log.debug("%s: committed %d files of %d ranks", save.dest, len(entries), len(results))

    # -- the per-writer variations (StagedHuggingFaceWriter) -------------------------------

    def _inner(self, local: Path) -> StorageWriter:
        return _LocalFileSystemWriter(local, self.storage_meta(), **self._options)

    def _vouching_files(self) -> tuple[str, ...]:
        """What, left from an earlier save at the destination, tells a stock reader that the
        checkpoint there is whole: removed before any rank writes."""
        return (METADATA_NAME,)

    def _check_plans(self, plans: list[SavePlan]) -> None:
        """Refuse, on the coordinator before anything is written, plans that would make two
        ranks write one file."""

    # -- helpers ---------------------------------------------------------------------------

    def _current(self) -> _Save:
        if self._save is None:
            raise RuntimeError(
                f"safestage.dcp.{type(self).__name__}: set_up_storage_writer was not called for this "
                "save (pass the writer to dcp.save / dcp.async_save, which call it)"
            )
        return self._save

    def _publish(self, save: _Save, paths: list[str], *, landed: Optional[list[str]] = None) -> dict[str, FileEntry]:
        """Publish ``paths`` (relative to the local directory) to the destination, one after
        the other; on a failure keep the local copy and raise a PublishError naming the rank."""
        entries: dict[str, FileEntry] = {}
        before = list(landed or [])
        assert save.private is not None, "publish without a local copy"
        for path in paths:
            problem = unsafe_path(path)
            if problem is not None or "/" in path:
                raise PublishError(
                    errno.EINVAL,
                    f"safestage.dcp: rank {save.rank} was asked to write {path!r}, which "
                    f"{problem or 'is in a subdirectory'}; nothing of it was published.",
                    str(save.local / path),
                )
        if paths:  # from now on the local copy may be needed: kept, not swept
            record_kept(save.private.path, save.dest, save.local, left=paths, landed=before, commit_file=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(save.private / DISPOSABLE_MARKER)
        for path in paths:
            try:
                result: Published = publish_file(
                    save.local / path,
                    save.dest / path,
                    publish=self.settings.publish,
                    fsync=self.settings.fsync,
                    staging_device=save.staging.device,
                    digest=Crc32,
                )
            except OSError as exc:
                left = [p for p in paths if p not in entries]
                raise self._kept(
                    save, exc, path, left=left, landed=before + sorted(entries),
                    what=f"{path} could not be published ({len(entries)} of its {len(paths)} files landed)",
                ) from exc  # fmt: skip
            entries[path] = FileEntry(path, result.nbytes, result.digest or "", save.rank)
        with contextlib.suppress(OSError):  # landed: a kill from here on leaves junk only
            _mark_disposable(save.private)
        return entries

    def _kept(
        self, save: _Save, exc: OSError, path: str, *, left: list[str], landed: list[str], what: str
    ) -> PublishError:
        """Keep this rank's local copy, with a record of what it is for, and say so."""
        assert save.private is not None
        record_kept(save.private.path, save.dest, save.local, left=left, landed=landed, commit_file=True, error=exc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(save.private / DISPOSABLE_MARKER)
        save.private.release()
        save.private = None  # kept: no longer this writer's to remove
        self._save = None
        code = exc.errno or errno.EIO
        return PublishError(
            code,
            f"safestage.dcp: rank {save.rank} could not save {save.dest}: {what}: "
            f"[Errno {code}] {os.strerror(code)} ({exc}). No commit file is written: {save.dest} "
            f"is not complete (verify and latest_complete say so). This rank's files are kept "
            f"in {save.local}; fix the destination and save the checkpoint again.",
            str(save.dest / path),
            staged_path=str(save.local),
            step=getattr(exc, "step", None),
            landed=tuple(sorted(landed)),
            not_landed=tuple(sorted(left)),
        )

    def _close(self, save: _Save) -> None:
        """Remove the local copy (its files landed)."""
        private, save.private = save.private, None
        if private is not None:
            with contextlib.suppress(OSError):
                _mark_disposable(private)
            _discard(private, save.local)

    def _abandon(self) -> None:
        """Remove what a save DCP stopped before this rank published (another rank's planning
        failed) left here: nothing of it is worth keeping (a copy whose own publish failed
        was kept already, and is no longer this writer's)."""
        save, self._save = self._save, None
        if save is not None:
            self._close(save)


class StagedHuggingFaceWriter(StagedWriter):
    """DCP's ``HuggingFaceStorageWriter`` (safetensors shards, ``model.safetensors.index.json``)
    through the same local staging, publish and commit as ``StagedWriter``.

    ``save_distributed=False`` (the writer's default): the coordinator holds the full state
    dict and writes the shards and the index; ``True``: every rank writes its own
    ``shard-<rank>-model-*.safetensors`` and no index. DCP's consolidation of sharded files
    (``enable_consolidation``) reads every rank's files from one directory, which the local
    staging does not have: not offered."""

    def __init__(
        self,
        dest: PathArg,
        root: Optional[PathArg] = None,
        *,
        publish: Optional[Publish] = None,
        fsync: bool = True,
        fqn_to_index_mapping: Optional[dict[str, int]] = None,
        save_distributed: bool = False,
        thread_count: int = 1,
    ) -> None:
        if HuggingFaceStorageWriter is None:  # pragma: no cover - torch < 2.7
            raise ImportError("safestage.dcp.StagedHuggingFaceWriter needs torch >= 2.7 (hf_storage)")
        super().__init__(dest, root, publish=publish, fsync=fsync)
        self._options = {
            "fqn_to_index_mapping": fqn_to_index_mapping,
            "save_distributed": save_distributed,
            "thread_count": thread_count,
        }

    def _inner(self, local: Path) -> StorageWriter:
        return HuggingFaceStorageWriter(str(local), **self._options)

    def _vouching_files(self) -> tuple[str, ...]:
        return (HF_INDEX_NAME, METADATA_NAME)

    def _check_plans(self, plans: list[SavePlan]) -> None:
        writing = [rank for rank, plan in enumerate(plans) if plan.items]
        if not self._options["save_distributed"] and len(writing) > 1:
            raise PublishError(
                errno.EINVAL,
                f"safestage.dcp.StagedHuggingFaceWriter: ranks {writing} all have data to write to "
                f"{self.dest}, and with save_distributed=False they would write the same shard files. "
                "Pass save_distributed=True, or save a full state dict from one rank. Nothing was "
                "written.",
                str(self.dest),
            )


def _local_copy(settings: Settings, dest: Path) -> tuple[StagingRoot, SaveDir, Path]:
    """A fresh local directory, named like ``dest``, in a private save directory under this
    rank's staging root; disposable (swept if the process dies) until its files are published."""
    staging, private = _save.save_dir(settings)
    local = private / _local_name(dest.name)
    try:
        _mark_disposable(private)
        os.mkdir(local)
    except BaseException:
        _discard(private, local)
        raise
    return staging, private, local


def _prepare_destination(dest: Path, vouching: tuple[str, ...], *, fsync: bool) -> None:
    """Create ``dest``; remove its commit file, then the files that make a stock reader trust
    it (DCP's ``.metadata``), then the temp files of killed commits."""
    step = "mkdir"
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(dest)
        step = "invalidate"
        invalidate(dest, fsync=fsync)
        removed = False
        for name in vouching:
            try:
                os.unlink(dest / name)
                removed = True
            except FileNotFoundError:
                pass
        if removed and fsync:
            fsync_directory(dest)
    except OSError as exc:
        raise PublishError(
            exc.errno,
            f"safestage.dcp could not prepare {dest} (step {step}): [Errno {exc.errno}] "
            f"{exc.strerror} ({exc.filename or dest}). No rank has written anything; fix the "
            "destination and save again.",
            str(exc.filename or dest),
            step=step,
        ) from exc
    remove_dead_temps(dest)


def _version() -> str:
    from . import __version__

    return __version__
