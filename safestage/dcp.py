"""``safestage.dcp``: torch.distributed.checkpoint storage writers that stage locally, publish,
and commit last; and the same for DCP's own writers when staging is on (the switch).

    import torch.distributed.checkpoint as dcp
    from safestage.dcp import StagedWriter

    dcp.save(state_dict, storage_writer=StagedWriter("/mnt/s3/run42/step-1000"))
    dcp.load(state_dict, checkpoint_id="/mnt/s3/run42/step-1000")   # stock DCP reads it

DCP's own ``FileSystemWriter`` writes its data files in place (a killed save leaves torn
``.distcp`` files under their final names), renames ``.metadata`` in last (mountpoint-s3 has
no rename: the save fails with EBADF/ENOSYS and leaves no ``.metadata``), and removes the old
``.metadata`` only at the end, so a half-overwritten directory still has an old ``.metadata``
vouching for new data files. Here DCP's StorageWriter hooks (storage.py) are the agreement
points of the one commit sequence (``safestage.checkpoint._sequence``), DCP's own collectives
carrying what the ranks tell each other:

1. ``set_up_storage_writer`` (every rank): a copy of DCP's writer, which plans (its overwrite
   check included) against the destination as DCP's own writer does; nothing is opened yet: a
   save refused while planning (``overwrite=False``, a planner's error on any rank, which DCP
   never tells the writer) leaves no local directory and no work in flight behind;
2. ``prepare_global_plan`` (the coordinator, before DCP scatters the plan, so before any rank
   writes): the save is work in flight of this process from here on (retention spares the
   checkpoint), and prepare, once: this process's background saves under the destination
   land, the destination is created, its commit file and the files that make a stock reader
   trust it (``meta.pt``, the HuggingFace index, DCP's ``.metadata``) removed, with the temp
   files of killed commits; a refusal here ends the work at once;
3. ``write_data`` (every rank): open, a fresh local directory under this rank's own staging
   root (nodes never share one), the inner writer pointed at it writes the rank's files there;
   check, hand off (the copy's record says it is this rank's files of a DCP save: never a
   checkpoint on its own), publish with CRC-32; the local copy goes once they landed, and is
   kept if a publish fails. The WriteResults carry each file's entry (path, size, CRC-32,
   global rank) to the coordinator;
4. ``finish`` (the coordinator): the entries are stripped off again, so that ``.metadata``
   holds only DCP's own classes (stock torch unpickles it); the inner writer writes
   ``.metadata`` (the HuggingFace writer: its index, or the consolidated files) locally, they
   are published, and the commit file ``_SAFESTAGE_COMMIT.json``, listing every file of every
   rank, is published last.

A ``StagedWriter`` holds a configured DCP writer (a ``FileSystemWriter`` or a
``HuggingFaceStorageWriter``) and, for each save, writes with a copy of it pointed at the
local directory. ``StagedWriter(dest, ...)`` configures one itself; the switch (staging on:
``SAFESTAGE_DIR``, ``safestage.staged()``) wraps the writer a ``dcp.save`` was about to use,
so that a save with DCP's own writer runs these very steps (``under_switch``).

A failure on any rank raises on every rank (DCP gathers each step's exceptions into one
``CheckpointException``; ours is a ``safestage.PublishError`` naming the rank and the file),
``finish`` is not reached, and no commit file is written: ``safestage.verify(dest).complete``
is False and ``latest_complete`` skips the directory. Each rank's save is a job of this
process while it runs (``_work``): retention never removes the checkpoint meanwhile.

Importing this module imports torch; ``import safestage`` does not import this module.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import functools
import inspect
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import _config, _loud, _object_store, _patch, _work
from ._config import PathArg, Publish, Settings
from ._destination import Destination, ObjectURL, url_of
from ._errors import ConfigError, PublishError
from ._kept import Part
from ._mounts import is_local_disk
from ._publish import Published
from .checkpoint._manifest import COMMIT_NAME, FileEntry, unsafe_path
from .checkpoint._sequence import (
    VOUCHING,
    Commit,
    Tree,
    destination_directory,
    invalidate,
    refused,
)

try:  # torch >= 2.4
    from torch.distributed.checkpoint.metadata import StorageMeta
except ImportError:  # pragma: no cover - older torch: no storage_meta at all
    StorageMeta = None  # type: ignore[assignment,misc]

try:  # torch >= 2.7: DCP's HuggingFace (safetensors shards) writer
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
except ImportError:  # pragma: no cover - older torch
    HuggingFaceStorageWriter = None  # type: ignore[assignment,misc]

__all__ = ["StagedHuggingFaceWriter", "StagedWriter", "unstaged"]

log = logging.getLogger("safestage")

METADATA_NAME = ".metadata"  # DCP's (filesystem._metadata_fn): what dcp.load opens first
HF_INDEX_NAME = "model.safetensors.index.json"  # the HuggingFace writer's (_hf_utils._metadata_fn)
# An attribute of a DCP writer that ``unstaged`` sets: it pickles with the writer (the process
# checkpointer of async_save) and is read by ``under_switch`` in whichever process saves.
_UNSTAGED = "_safestage_unstaged"

W = TypeVar("W", bound=StorageWriter)


@dataclass(frozen=True)
class _Landed:
    """A WriteResult's storage_data on its way to the coordinator: the inner writer's own
    (what ``.metadata`` keeps) and the commit-file entry of the file it is in. Stripped in
    ``finish`` before ``.metadata`` is pickled: a reader needs only stock torch."""

    info: Any
    entry: FileEntry


@dataclass
class _Save:
    """One save on this rank: its commit (the data files until they landed; on the
    coordinator, ``.metadata`` in ``finish``), the inner writer, and its job (none while it
    plans: see the module docstring)."""

    commit: Commit
    inner: Any  # a copy of the StagedWriter's DCP writer; from write_data on, at the local directory
    job: Optional[_work.Job] = None

    @property
    def dest(self) -> Destination:
        assert self.commit.dest is not None
        return self.commit.dest

    @property
    def rank(self) -> int:
        return self.commit.part.rank


class StagedWriter(StorageWriter):
    """A DCP ``StorageWriter`` for ``dest``, a directory on any destination safestage serves
    (HDFS FUSE, mountpoint-s3, s3fs, rclone, NFS, a local disk), or a prefix in an object
    store (``s3://bucket/run/step-100``, ``gs://``, ``az://``: uploaded from the local copy,
    the commit object created last; no fsspec): every rank writes its files
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
        url = url_of(dest)
        writer = FileSystemWriter(
            _writer_path(dest, url), single_file_per_rank=single_file_per_rank, thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
        )  # fmt: skip
        self._adopt(writer, _config.resolve(root=root, publish=publish, fsync=fsync), url)

    def _adopt(self, writer: Any, settings: Settings, url: Optional[ObjectURL] = None) -> None:
        """Stage every save ``writer`` (DCP's FileSystemWriter or HuggingFaceStorageWriter,
        configured) would make; to ``url`` if given (the writer's own path then only lays out
        the local copy: DCP's writers write files, never objects)."""
        self.settings: Settings = settings
        self._writer = writer
        self.dest: Destination = url if url is not None else _destination_of(writer)
        self.save_id: str = getattr(writer, "save_id", None) or str(uuid.uuid4())
        self._save: Optional[_Save] = None
        self._switched = False  # made by the switch: it ends what DCP left open (under_switch)

    @classmethod
    def _wrapping(cls, writer: Any, settings: Settings, url: Optional[ObjectURL] = None) -> StagedWriter:
        """The StagedWriter the switch puts in place of DCP's own ``writer`` (to ``url``: the
        writer DCP would have chosen for a path, saving to the object store)."""
        staged = cls.__new__(cls)
        StorageWriter.__init__(staged)
        staged._adopt(writer, settings, url)
        staged._switched = True
        return staged

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
        # A URL as its text: DCP's process-based async_save hands it back to reset().
        return str(self.dest) if isinstance(self.dest, ObjectURL) else self.dest

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike[str]]) -> bool:
        return url_of(checkpoint_id) is not None or FileSystemWriter.validate_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: Union[str, os.PathLike[str], None] = None) -> None:
        url = url_of(checkpoint_id)
        if checkpoint_id:
            _refuse_consolidating(self._writer, url)
        self._writer.reset(_writer_path(checkpoint_id, url) if checkpoint_id else None)
        if checkpoint_id:
            self.dest = url if url is not None else _destination_of(self._writer)
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
        commit = Commit(self.dest, self.settings, part=_part())
        # The destination is checked now (its parent must exist); the local directory is opened
        # in write_data, once planning succeeded on every rank (1. open).
        commit.dest = destination_directory(self.dest)
        self._save = _Save(commit, self._inner())
        inner = self._save.inner
        if "kwargs" in inspect.signature(inner.set_up_storage_writer).parameters:
            inner.set_up_storage_writer(is_coordinator, *args, **kwargs)
        else:  # pragma: no cover - torch < 2.6
            inner.set_up_storage_writer(is_coordinator)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._current()
        if isinstance(save.dest, ObjectURL):
            # No directory to make in a bucket; DCP's overwrite check, asked of the store (a
            # plan with collectives is DCP's writer's plan as it is).
            if not getattr(save.inner, "overwrite", True) and _object_store.head(save.dest / METADATA_NAME):
                raise RuntimeError(f"Checkpoint already exists at {save.dest} and self.overwrite=False.")
            return plan
        # The inner writer still points at the destination: DCP's own overwrite check.
        result: SavePlan = save.inner.prepare_local_plan(plan)
        return result

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator, before any rank writes: from here on the destination holds no
        commit file and no ``.metadata`` until this save's own land."""
        save = self._current()
        save.job = _work.start("commit", save.dest, self)
        try:
            self._check_plans(plans)
            layout = Tree(directories=[self._data_dir] if self._data_dir else [])
            save.commit.prepare(layout, vouching=VOUCHING)  # 4. prepare, once
            result: list[SavePlan] = save.inner.prepare_global_plan(plans)
        except BaseException as exc:  # refused: DCP raises it on every rank, no write_data
            self._end(save, exc)
            raise
        return result

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._current()
        started = time.perf_counter()
        if save.job is None:
            save.job = _work.start("commit", save.dest, self)
        try:
            local = save.commit.open()  # 1. open: planning succeeded on every rank
            self._point(save.inner, local)
            written = save.inner.write_data(plan, planner)
            written.wait()
            results: list[WriteResult] = written.value()
        except BaseException as exc:  # nothing of it was published: nothing worth keeping
            save.commit.discard()
            self._end(save, exc)
            raise
        # Only files a WriteResult points into: an empty bucket's file holds nothing to read.
        names = sorted({result.storage_data.relative_path for result in results})
        entries = self._land(save, [self._in_data_dir(save, name) for name in names])
        # This rank's part ends here (DCP never tells a rank how the save ended: a job left
        # running would claim the checkpoint for ever); the coordinator's finish is a job too.
        _work.finish(save.job)
        log.debug(
            "%s: rank %d published %d files, %d bytes in %.3fs", save.dest, save.rank,
            len(names), sum(entry.size for entry in entries.values()), time.perf_counter() - started,
        )  # fmt: skip
        future: Future[list[WriteResult]] = Future()
        future.set_result(
            [dataclasses.replace(r, storage_data=_Landed(r.storage_data, entries[self._in_data_dir(save, r.storage_data.relative_path)]))
             for r in results]
        )  # fmt: skip
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._current()
        save.job = _work.start("commit", save.dest, self)
        entries: dict[str, FileEntry] = {}
        stripped = []
        for rank_results in results:
            plain = []
            for result in rank_results:
                landed: _Landed = result.storage_data
                other = entries.setdefault(landed.entry.path, landed.entry)
                if other.rank != landed.entry.rank:
                    error = PublishError(
                        errno.EEXIST,
                        f"safestage.dcp: ranks {other.rank} and {landed.entry.rank} both wrote "
                        f"{save.dest / landed.entry.path}: the checkpoint is not committed (no commit "
                        "file). Give each rank its own file names and save again.",
                        str(save.dest / landed.entry.path),
                    )
                    self._end(save, error)
                    raise error
                plain.append(dataclasses.replace(result, storage_data=landed.info))
            stripped.append(plain)
        # What the coordinator writes last (DCP's .metadata; the HuggingFace writer's index or
        # its consolidated files), written locally by the inner writer in a fresh local
        # directory of the same commit, then published like the ranks' files; the commit file
        # last.
        try:
            local = save.commit.open()
            # Consolidation reads the shards where they landed: never at a URL (refused there).
            self._point(save.inner, local, reading=save.dest if isinstance(save.dest, Path) else None)
            save.inner.finish(metadata, stripped)
            written = save.commit.check().paths
        except BaseException as exc:  # nothing of it was published: nothing worth keeping
            save.commit.discard()
            self._end(save, exc)
            raise
        entries.update(self._land(save, written, landed=tuple(sorted(entries)), finish=False))
        try:
            save.commit.commit_file(list(entries.values()), [])  # 6. the commit file, last
        except BaseException as exc:
            save.commit.keep(exc, entries)
            self._end(save, exc)
            raise
        save.commit.finish()
        self._end(save)
        log.debug("%s: committed %d files of %d ranks", save.dest, len(entries), len(results))

    # -- the writer's layout ---------------------------------------------------------------

    @property
    def _consolidating(self) -> bool:
        """The HuggingFace writer's ``enable_consolidation``: the ranks' shards in
        ``dest/sharded``, the coordinator's consolidated files and index in ``dest``."""
        return bool(getattr(self._writer, "enable_consolidation", False))

    @property
    def _data_dir(self) -> str:
        """Where the ranks' data files go, relative to ``dest`` ("" for ``dest`` itself)."""
        relative = os.path.relpath(os.fspath(self._writer.path), _destination_of(self._writer))
        return "" if relative == "." else relative.replace(os.sep, "/")

    def _in_data_dir(self, save: _Save, name: str) -> str:
        """A data file's path in the checkpoint: ``name``, as DCP's writer names it (never a
        path: refused otherwise, before anything of it is published), in the data directory."""
        problem = unsafe_path(name)
        if problem is not None or "/" in name:
            error = PublishError(
                errno.EINVAL,
                f"safestage.dcp: rank {save.rank} was asked to write {name!r}, which "
                f"{problem or 'is in a subdirectory'}; nothing of it was published.",
                str(save.dest / name),
            )
            save.commit.discard()
            self._end(save, error)
            raise error
        return f"{self._data_dir}/{name}" if self._data_dir else name

    def _inner(self) -> Any:
        """A copy of the configured writer, which plans against the destination as it would
        and writes (``_point``) into the local directory; its ``.metadata`` names the
        destination, not the local directory that is gone."""
        inner = copy.copy(self._writer)
        inner.sync_files = False  # the local copy is not the checkpoint: the publish syncs what lands
        meta = self.storage_meta()
        inner.storage_meta = lambda: meta
        return inner

    def _point(self, inner: Any, local: Path, *, reading: Optional[Path] = None) -> None:
        """Point ``inner`` at ``local``, laid out as ``dest`` (``reading``: in ``finish``,
        consolidation reads the ranks' shards where they landed, at the destination)."""
        data = local / self._data_dir if self._data_dir else local
        if self._consolidating:
            inner.consolidated_output_path = str(local)
            if reading is not None and getattr(self._writer, "save_distributed", False):
                data = reading / self._data_dir
        os.makedirs(data, exist_ok=True)
        inner.path = inner.fs.init_path(data)

    def _check_plans(self, plans: list[SavePlan]) -> None:
        """Refuse, on the coordinator before anything is written, plans that would make two
        ranks write one file: the HuggingFace writer's rank-0 checkpointing
        (``save_distributed=False``) names its files the same on every rank."""
        if HuggingFaceStorageWriter is None or not isinstance(self._writer, HuggingFaceStorageWriter):
            return
        writing = [rank for rank, plan in enumerate(plans) if plan.items]
        if not self._writer.save_distributed and len(writing) > 1:
            raise PublishError(
                errno.EINVAL,
                f"safestage.dcp: ranks {writing} all have data to write to {self.dest} with DCP's "
                "HuggingFace writer, and with save_distributed=False they would write the same shard "
                "files. Pass save_distributed=True, or save a full state dict from one rank. "
                "Nothing was written.",
                str(self.dest),
            )

    # -- helpers ---------------------------------------------------------------------------

    def _current(self) -> _Save:
        if self._save is None:
            raise RuntimeError(
                f"safestage.dcp.{type(self).__name__}: set_up_storage_writer was not called for this "
                "save (pass the writer to dcp.save / dcp.async_save, which call it)"
            )
        return self._save

    def _land(
        self, save: _Save, paths: list[str], *, landed: tuple[str, ...] = (), finish: bool = True
    ) -> dict[str, FileEntry]:
        """Steps 2, 3, 5 and 7 for ``paths`` (relative to the local directory): checked, handed
        off, published, and the local copy removed (``finish``) or kept with a PublishError
        naming the rank."""
        commit = save.commit
        published: dict[str, Published] = {}
        tree: Optional[Tree] = None
        try:
            tree = commit.check(paths)
            commit.hand_off(tree, landed=landed)  # from now on the local copy may be needed: kept
            failed = commit.publish(tree, published)
        except BaseException as exc:
            if tree is None or refused(exc):  # refused before anything was published: not worth keeping
                commit.discard()
            else:
                commit.keep(exc, published, tree)
            if isinstance(exc, PublishError) and refused(exc):
                code = exc.errno or errno.EINVAL
                exc = PublishError(
                    code, f"safestage.dcp: rank {save.rank} could not save {save.dest}: [Errno {code}] "
                    f"{os.strerror(code)}: {exc}", exc.filename, step=exc.step, landed=(),
                )  # fmt: skip
                self._end(save, exc)
                raise exc from None
            self._end(save, exc)
            raise
        if failed is not None:
            commit.keep(failed, published, tree)
            error = self._kept_error(save, failed, landed)
            self._end(save, error)
            raise error from failed
        if finish:
            commit.finish()
        return {
            path: FileEntry(path, result.nbytes, result.digest or "", save.rank, result.etag)
            for path, result in published.items()
        }

    def _kept_error(
        self, save: _Save, failed: BaseException, landed: tuple[str, ...]
    ) -> PublishError:
        code = getattr(failed, "errno", None) or errno.EIO
        local = save.commit.local
        # ``failed`` is the commit's own error (_sequence), which says what landed and what
        # becomes of this rank's files.
        return PublishError(
            code,
            f"safestage.dcp: rank {save.rank} could not save {save.dest}: {failed}",
            str(save.dest),
            staged_path=None if local is None else str(local),
            step=getattr(failed, "step", None),
            landed=tuple(sorted({*landed, *(getattr(failed, "landed", None) or ())})),
            not_landed=getattr(failed, "not_landed", None),
        )

    def _end(self, save: _Save, error: Optional[BaseException] = None) -> None:
        """This rank's part of the save is over: landed, or failed (raised to DCP)."""
        if save.job is not None and not save.job.finished:
            _work.finish(save.job, error=error, seen=True)
        self._save = None

    def _abandon(self) -> None:
        """End what a save with this writer that DCP stopped half-way left open: the
        coordinator's work from prepare_global_plan, if DCP stopped before write_data (a
        planner's finish_plan, the scatter of the plan). The switch calls this once the save is
        over; a writer of the user's own, at its next save. Nothing of it is worth keeping (a
        copy whose own publish failed was kept already, and is no longer this writer's)."""
        save, self._save = self._save, None
        if save is not None:
            save.commit.discard()
            if save.job is not None and not save.job.finished:
                _work.finish(save.job, seen=True)


def _part() -> Part:
    """This rank's files of a DCP save: never a checkpoint on their own."""
    if dist.is_available() and dist.is_initialized():
        return Part("dcp", dist.get_rank(), dist.get_world_size())
    return Part("dcp", 0, 1)


def _destination_of(writer: Any) -> Path:
    """The checkpoint directory a DCP writer writes: its ``path``, or, for the HuggingFace
    writer consolidating, the directory of the consolidated files (the shards go below it)."""
    if getattr(writer, "enable_consolidation", False) and getattr(writer, "consolidated_output_path", None):
        return Path(writer.consolidated_output_path)
    return Path(os.fspath(writer.path))


def _writer_path(dest: Any, url: Optional[ObjectURL]) -> str:
    """The path a DCP writer of ``dest`` is made with. For a URL, only a name its
    ``write_data`` and ``finish`` never see (they write into the local directory, ``_point``)
    and that lays out the checkpoint as DCP's writer would (``sharded`` below it, say)."""
    return os.fspath(dest) if url is None else f"{url.bucket}/{url.key}"


def _refuse_consolidating(writer: Any, url: Optional[ObjectURL]) -> None:
    """Consolidation reads the ranks' shards where they landed: files, not objects."""
    if url is not None and getattr(writer, "enable_consolidation", False):
        raise ConfigError(
            f"safestage.dcp: the HuggingFace writer cannot consolidate at {url}: consolidation reads "
            "the ranks' shards back where they landed, and DCP reads files, not objects. Save with "
            "enable_consolidation=False (the shards land, committed), or consolidate into a path."
        )


class StagedHuggingFaceWriter(StagedWriter):
    """DCP's ``HuggingFaceStorageWriter`` (safetensors shards, ``model.safetensors.index.json``)
    through the same local staging, publish and commit as ``StagedWriter``.

    ``save_distributed=False`` (the writer's default): the coordinator holds the full state
    dict and writes the shards and the index; ``True``: every rank writes its own
    ``shard-<rank>-model-*.safetensors`` and no index. ``enable_consolidation=True`` (with
    ``save_distributed=True``): the ranks' shards go to ``dest/sharded`` and, once they have
    all landed, the coordinator consolidates them, reading them at the destination, into
    full ``model-*.safetensors`` files and their index in ``dest``, published before the
    commit file."""

    def __init__(
        self,
        dest: PathArg,
        root: Optional[PathArg] = None,
        *,
        publish: Optional[Publish] = None,
        fsync: bool = True,
        fqn_to_index_mapping: Optional[dict[str, int]] = None,
        save_distributed: bool = False,
        enable_consolidation: bool = False,
        thread_count: int = 1,
    ) -> None:
        if HuggingFaceStorageWriter is None:  # pragma: no cover - torch < 2.7
            raise ImportError(
                "safestage.dcp.StagedHuggingFaceWriter needs torch >= 2.7 (hf_storage)"
            )
        StorageWriter.__init__(self)
        url = url_of(dest)
        writer = HuggingFaceStorageWriter(
            _writer_path(dest, url), fqn_to_index_mapping=fqn_to_index_mapping, thread_count=thread_count,
            save_distributed=save_distributed, enable_consolidation=enable_consolidation,
        )  # fmt: skip
        _refuse_consolidating(writer, url)
        self._adopt(writer, _config.resolve(root=root, publish=publish, fsync=fsync), url)


def unstaged(writer: W) -> W:
    """``writer`` (DCP's ``FileSystemWriter`` or ``HuggingFaceStorageWriter``), marked to write
    in place, as DCP's own writer does, even while staging is on: the switch leaves the saves
    it makes alone. Returns the same writer:

        dcp.save(state, storage_writer=safestage.dcp.unstaged(FileSystemWriter("/local/ckpt")))

    The mark travels with the writer (``async_save``'s checkpoint process unpickles it)."""
    setattr(writer, _UNSTAGED, True)
    return writer


# -- the switch: DCP's own writers, staged ---------------------------------------------------------

_warned: set[str] = set()
_warned_lock = threading.Lock()


def under_switch(
    save_state_dict: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], settings: Settings
) -> Any:
    """DCP's ``_save_state_dict`` (what ``dcp.save``, ``dcp.async_save``'s save in its thread
    or process and ``torch_save_to_dcp`` call, with the writer ``dcp.save`` chose or was
    given) while staging is on: a writer ``staged_for`` takes is replaced by a StagedWriter
    wrapping it, with the open stage's settings; any other passes through."""
    bound = _signature(save_state_dict).bind(*args, **kwargs)
    writer = bound.arguments.get("storage_writer")
    if isinstance(writer, StagedWriter) and writer._switched:  # a URL's (writer_under_switch)
        staged: Optional[StagedWriter] = writer
    else:
        staged = staged_for(writer, settings, use_collectives=bound.arguments.get("use_collectives", True))
    if staged is None:
        _unvouch(writer, settings)
        return save_state_dict(*args, **kwargs)
    bound.arguments["storage_writer"] = staged
    log.debug("dcp.save of %s: staged (%s)", staged.dest, type(writer).__name__)
    try:
        return save_state_dict(*bound.args, **bound.kwargs)
    finally:
        # The save is over: what DCP stopped between its hooks (a planner's finish_plan raising
        # after the coordinator prepared) ends now, not at a next save with this writer, which
        # the switch never makes.
        staged._abandon()


def writer_under_switch(
    storage_setup: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], settings: Settings
) -> Any:
    """DCP's ``_storage_setup`` of a save (the writer ``dcp.save`` and ``async_save``'s save,
    in its thread or its checkpoint process, pick for a ``checkpoint_id``) while staging is
    on. A URL of an object store safestage serves (``s3://``, ``gs://``, ``az://``) gets a
    StagedWriter to it, around DCP's own writer (``storage_writer=`` that writer, or none
    given): DCP's ``FsspecWriter`` needs fsspec and the store's package, and writes each file
    in place (a failed save leaves truncated shards: s3fs#154). Anything else is DCP's choice
    (a path's writer is then staged by ``under_switch``; a scheme safestage does not serve
    stays fsspec's, said once as for any writer the switch leaves alone)."""
    bound = _signature(storage_setup).bind(*args, **kwargs)
    storage, checkpoint_id = bound.arguments.get("storage"), bound.arguments.get("checkpoint_id")
    try:
        url = None if bound.arguments.get("reader", False) else url_of(checkpoint_id)
    except ConfigError:  # not ours to serve: fsspec's, if it can (unstaged, as before)
        url = None
    if url is None or (storage is not None and (type(storage) not in _covered() or storage.__dict__.get(_UNSTAGED, False))):
        return storage_setup(*args, **kwargs)
    if storage is None:
        storage = FileSystemWriter(_writer_path(checkpoint_id, url))
    else:
        _refuse_consolidating(storage, url)
        storage.reset(_writer_path(checkpoint_id, url))
    log.debug("dcp.save of %s: staged to the object store (%s)", url, type(storage).__name__)
    return StagedWriter._wrapping(storage, settings, url)


@functools.cache
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)


def _covered() -> tuple[type, ...]:
    return (FileSystemWriter,) if HuggingFaceStorageWriter is None else (FileSystemWriter, HuggingFaceStorageWriter)


def staged_for(writer: Any, settings: Settings, *, use_collectives: bool = True) -> Optional[StagedWriter]:
    """The StagedWriter that saves what ``writer`` would, or None where the switch leaves the
    save to ``writer``: a writer other than DCP's own two (a subclass may write anywhere:
    WARNING once per class), one marked ``unstaged``, ``use_collectives=False`` (every rank its
    own coordinator: WARNING once), a destination inside a directory that is staging already
    (``staged_dir``'s local directory), a local disk with ``skip_local_disk``, or a path whose
    parents cannot be made (DCP then raises its own error)."""
    if type(writer) not in _covered():
        if isinstance(writer, FileSystemWriter):
            _warn_once(
                f"class:{type(writer).__module__}.{type(writer).__qualname__}",
                f"dcp.save with {type(writer).__qualname__}, a subclass of DCP's FileSystemWriter, "
                "is not staged (its overrides may write outside its directory): it writes in place. "
                "Stage it by saving with DCP's own FileSystemWriter, or into safestage.staged_dir",
            )
        return None
    if writer.__dict__.get(_UNSTAGED, False):
        return None
    if not use_collectives:
        _warn_once(
            "use_collectives",
            "dcp.save(use_collectives=False) is not staged (every rank is its own coordinator and "
            "writes its own .metadata): it writes in place",
        )
        return None
    dest = _destination_of(writer)
    try:
        # DCP's writer makes the checkpoint's parents itself (prepare_local_plan); so does the switch.
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        real = destination_directory(dest)
    except OSError:
        return None  # DCP's writer then fails as it would have
    assert isinstance(real, Path)  # DCP's writers write paths (a URL's: writer_under_switch)
    if _patch.in_unstaged_dir(real):
        return None  # staged_dir's (or staged_file's) local directory: its owner commits it
    if settings.skip_local_disk and is_local_disk(real.parent):
        return None
    return StagedWriter._wrapping(writer, settings)


def _unvouch(writer: Any, settings: Settings) -> None:
    """A save the switch leaves to ``writer`` writes in place: if its directory holds a commit
    file (safestage committed it), that file goes first (with its set-aside marker), before DCP
    writes anything, as every commit removes it before publishing: a re-save killed half-way
    must never pass ``verify`` under the old commit file. The directory is then not complete to
    safestage until committed again (``safestage.commit_in_place`` once the save landed)."""
    path = getattr(writer, "path", None)
    if path is None:
        return  # a writer of another kind: where it writes is its own business
    dest = _destination_of(writer)
    try:
        removed = invalidate(dest, fsync=settings.fsync)
    except (FileNotFoundError, NotADirectoryError):
        return  # no such directory yet (or not one): nothing to vouch for
    except OSError as exc:
        # A read-only mount refuses unlink whether or not the file is there (EROFS before the
        # lookup): where no commit file is, nothing vouches for the directory, and the save
        # meets the mount's refusal itself. Any other answer (EIO, EACCES) may hide one.
        try:
            os.lstat(dest / COMMIT_NAME)
        except FileNotFoundError:
            return
        except OSError:
            pass
        raise PublishError(
            exc.errno,
            f"safestage: dcp.save with {type(writer).__qualname__} (left to write in place) would rewrite "
            f"{dest}, which safestage committed, but its commit file could not be removed first: "
            f"[Errno {exc.errno}] {exc.strerror}. Nothing was written; remove {dest / COMMIT_NAME} or save "
            "elsewhere.",
            str(dest / COMMIT_NAME),
        ) from exc
    if removed:
        log.warning(
            "safestage: %s is rewritten in place by %s, which staging leaves alone: its commit file was "
            "removed first, so it is not complete to safestage (verify, latest_complete) until "
            "committed again (safestage.commit_in_place once the save has landed)",
            dest, type(writer).__qualname__,
        )  # fmt: skip


def _warn_once(key: str, message: str) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.log(_loud.level(_loud.speaks_for_job()), "%s", message)  # every rank saves: rank 0 says it
