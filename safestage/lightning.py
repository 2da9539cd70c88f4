"""Lightning: a ``CheckpointIO`` plugin that stages every checkpoint and publishes it.

    import lightning as L
    from safestage.lightning import StagedCheckpointIO

    trainer = L.Trainer(plugins=[StagedCheckpointIO("/local/nvme/scratch")])
    fabric = L.Fabric(plugins=[StagedCheckpointIO("/local/nvme/scratch")])
    trainer = L.Trainer(plugins=[AsyncCheckpointIO(StagedCheckpointIO("/local/nvme/scratch"))])

Why a plugin: Lightning's own ``TorchCheckpointIO`` saves through ``_atomic_save``
(lightning/fabric/utilities/cloud_io.py), which ``torch.save``s into a BytesIO and writes it
through an fsspec transaction: a temp file from ``tempfile.mkstemp()`` under $TMPDIR, then
``shutil.move`` to the checkpoint. Across devices that move is a copy plus copystat: onto a
mount that refuses chmod (mountpoint-s3) copystat raises and the full-size temp is never
removed (Lightning#21253); with fsspec < 2025.5 Lightning turns that into "Upgrade fsspec to
enable cross-device local checkpoints"; on local disk the copied 0600 mode of the temp sticks.
This plugin serializes each checkpoint into a private staging directory under the staging
root instead (never $TMPDIR, unless that is the root) and publishes it with safestage's one
publisher (rename / replace / direct, checked close, kept copy on failure).

What it holds is glue only: which paths are staged (local ones, and URLs of the object stores
safestage serves, ``s3://``, ``gs://``, ``az://``, uploaded from the staged copy with no
fsspec; other fsspec URLs go to the wrapped plugin untouched), the parent directory Lightning
expects to be made,
and delegation of loading and removing. The staging and publishing are the core's
(``safestage._save.run``, the pipeline of every save). Lightning is imported when this module is.

Two questions ModelCheckpoint asks the filesystem itself, not the CheckpointIO, so this
module wraps them in ModelCheckpoint (both packages, when imported): ``file_exists`` (its
version counter) first waits for a pending background publish of that name, and
``_link_checkpoint`` (``save_last="link"``), when the Trainer's checkpoint IO is this plugin,
waits for the pending publishes of the checkpoint and the link, and where symlinks fail (rclone,
S3 mounts, mountpoint-s3) copies the checkpoint through the plugin instead of
``shutil.copy`` (whose chmod mountpoint-s3 refuses).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Union

from . import _config, _object_store, _patch, _save, _work, _writers
from ._config import PathArg, Publish, Settings
from ._destination import Destination, ObjectURL, file_url
from ._errors import ConfigError
from ._mounts import is_local_disk
from ._paths import resolve_destination
from ._snapshot import Held, copy_state
from ._stage import PublishRecord
from .checkpoint._sequence import destination_directory
from .checkpoint._staged_dir import staged_dir

try:  # the unified package first: ``import lightning as L``
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

    _OTHER_BASE = "lightning_fabric.plugins.io.checkpoint_io"
except ImportError:  # only the standalone packages (pytorch-lightning / lightning-fabric)
    from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO

    _OTHER_BASE = ""

__all__ = ["StagedCheckpointIO"]

log = logging.getLogger("safestage")


class StagedCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Save each checkpoint into a private local staging directory, then publish it.

    ``root``, ``publish``, ``fsync`` and ``background`` mean what they mean
    for ``safestage.staged()`` (argument > SAFESTAGE_* variable > default); the root is checked
    here (StagingError). ``checkpoint_io`` (default: Lightning's ``TorchCheckpointIO``) loads
    and removes checkpoints, and saves those that are not local paths. With the default, a
    checkpoint is ``torch.save``d into the staging file exactly as ``TorchCheckpointIO``
    serializes it (same bytes); another ``checkpoint_io`` is asked to save into the staging
    file itself.

    ``background=True``: ``save_checkpoint`` returns once the checkpoint's tensors are
    copied into host buffers safestage owns (``SAFESTAGE_SNAPSHOT_BUDGET`` bounds them), then
    serializes and publishes it on safestage's background publisher (2 at once;
    ``background=N``: at most N). A checkpoint still publishing exists for whoever asks:
    removing or loading it, and ModelCheckpoint's version counter and ``save_last="link"``,
    first wait for its publish, so ModelCheckpoint keeps what it keeps synchronously. A failed
    publish is raised by the next ``save_checkpoint``, by ``teardown()`` (the Trainer calls it
    when fit ends; it also ends the publishing threads) or by ``safestage.wait()`` (with
    Fabric, which has no teardown). A forked child's saves publish before they return.

    ``records`` lists every published checkpoint (``safestage.PublishRecord``). A failed
    publish raises ``safestage.PublishError`` (an OSError) naming the checkpoint and keeping
    the complete staged copy. Under ``AsyncCheckpointIO`` Lightning raises it at the next save
    or at teardown, and the order of removals and saves is Lightning's: a save still queued
    on its thread is not seen (use ``background=True``). ``checkpoint_io`` must not be an
    ``AsyncCheckpointIO`` (ConfigError): that wraps this plugin, not the other way round.
    """

    def __init__(
        self,
        root: Optional[PathArg] = None,
        *,
        publish: Optional[Publish] = None,
        fsync: bool = True,
        background: Union[bool, int, None] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        **removed: NoReturn,
    ) -> None:
        super().__init__()
        _config.reject_removed(removed, "StagedCheckpointIO")
        if _is_async(checkpoint_io):
            # Its thread would save into our staging file after we had published and removed
            # it (issue 18): every save fails, and the checkpoint lands in a removed directory.
            raise ConfigError(
                "StagedCheckpointIO(checkpoint_io=AsyncCheckpointIO(...)) is the composition inverted:"
                " write AsyncCheckpointIO(StagedCheckpointIO(...)), or better"
                " StagedCheckpointIO(..., background=True) (serialized on the training thread,"
                " published in the background, top-k removal in order)."
            )
        self.settings = _config.resolve(
            root=root, publish=publish, fsync=fsync, background=background
        )
        _save.staging_root(
            self.settings, opening=True
        )  # a bad root fails here; checked once per process
        self.checkpoint_io: CheckpointIO = (
            checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        )
        self.records: list[PublishRecord] = []
        _work.adopt(self)  # its saves may publish in the background in this process

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None
    ) -> None:
        _work.wait(self, finished_only=True)  # a failed background publish, raised here
        url = _store_url(path)
        local = _local_path(path) if url is None else None
        if url is None and local is None:  # hdfs://, memory://, ...: the wrapped plugin's business
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        default = type(self.checkpoint_io) is TorchCheckpointIO
        if default and storage_options is not None:
            raise TypeError(  # what TorchCheckpointIO says
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{type(self).__name__}` with the default TorchCheckpointIO."
                " Pass a custom `checkpoint_io` that handles `storage_options`."
            )
        dest: Destination
        if url is not None:
            dest = url
        else:
            assert local is not None
            # TorchCheckpointIO makes the checkpoint's directory (ModelCheckpoint relies on it).
            os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
            _say_if_reversioned(local)
            dest = _save.destination(local)

        def write(state: dict[str, Any], staged: str) -> None:
            with _patch.bypass():  # torch_save staging must not stage our staging file again
                if default:
                    with open(staged, "wb") as stream:  # a stream, as _atomic_save's BytesIO
                        _writers.run_torch_writer(lambda: _torch_save(state, stream), staged)
                else:
                    self.checkpoint_io.save_checkpoint(
                        state, staged, storage_options=storage_options
                    )

        def snapshot(budget: int) -> Optional[tuple[Callable[[str], None], Held]]:
            # background: save_checkpoint returns once the checkpoint's tensors are copied.
            copied = copy_state(checkpoint, budget)
            return None if copied is None else (functools.partial(write, copied[0]), copied[1])

        _save.run(functools.partial(write, checkpoint), dest, self.settings, owner=self,
                  record=self._record, snapshot=snapshot)  # fmt: skip

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's own load, after this path's pending background publish: a load right
        after a save must read that save, never the file it replaces (a failed publish is
        raised here instead)."""
        path = args[0] if args else kwargs.get("path")
        url = _store_url(path) if path is not None else None
        local = _local_path(path) if path is not None and url is None else None
        if url is not None or local is not None:
            _work.settle(url if url is not None else _key(local or ""))
            _work.wait(self, finished_only=True)  # raises the PublishError
        result: dict[str, Any] = self.checkpoint_io.load_checkpoint(*args, **kwargs)
        return result

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint, once this plugin's pending background publishes (the newer
        checkpoints) have landed and after its own pending publish. One whose save is
        running in another thread (AsyncCheckpointIO's) is removed by that thread once it is
        published; one still queued there is not seen, and stays (Lightning's order). A
        failed publish is raised by teardown or the next save."""
        # ModelCheckpoint removes the checkpoint a new one replaces right after saving the new
        # one: never before the new one has landed (Megatron-Bridge#5184, for one file), and
        # not at all if it failed (raised here, the old one stays).
        _work.settle(owner=self)
        _work.wait(self, finished_only=True)
        url = _store_url(path)
        if url is not None:  # one object: removed as the wrapped plugin would, with no fsspec
            _work.when_idle(url, lambda: _object_store.delete([url]))
            return
        local = _local_path(path)
        if local is None:
            self.checkpoint_io.remove_checkpoint(path)
            return
        _work.when_idle(_key(local), lambda: self.checkpoint_io.remove_checkpoint(path))

    def teardown(self) -> None:
        """Wait for this plugin's background publishes, raising the first error, and end the
        publishing threads if nothing else is publishing (the Trainer calls it when fit ends;
        with Fabric, call ``safestage.wait()``)."""
        try:
            _work.wait(self)
        finally:
            _work.end_threads()
            self.checkpoint_io.teardown()

    def _link(self, trainer: Any, filepath: str, linkpath: str) -> None:
        """ModelCheckpoint's ``_link_checkpoint`` (Lightning 2.6) with the checkpoint and the
        link published first, and a copy published by this plugin where symlinks fail."""
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            _settle(filepath)  # the checkpoint is there before it is linked or copied,
            _settle(linkpath)  # and an earlier publish of the link cannot land over it
            _work.wait(self, finished_only=True)  # a failed one: raised, never copied
            if os.path.islink(linkpath) or os.path.isfile(linkpath):
                os.remove(linkpath)
            elif os.path.isdir(linkpath):
                shutil.rmtree(linkpath)
            try:
                os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), linkpath)
            except OSError:  # rclone, S3 mounts, mountpoint-s3: no symlinks; a copy, no chmod
                local = _local_path(linkpath)
                if local is None:
                    raise

                def copy(staged: str) -> None:
                    shutil.copyfile(filepath, staged)

                _save.run(copy, _save.destination(local), self.settings, owner=self, record=self._record)
        trainer.strategy.barrier()

    def _record(self, record: PublishRecord) -> None:
        self.records.append(record)  # list.append is atomic: publish workers call it too

    def __setstate__(
        self, state: dict[str, Any]
    ) -> None:  # Lightning's spawn strategies pickle plugins
        self.__dict__.update(state)
        _work.adopt(self)

    def __repr__(self) -> str:
        return (
            f"StagedCheckpointIO(root={str(self.settings.staging_root())!r}, "
            f"publish={self.settings.publish!r}, fsync={self.settings.fsync}, "
            f"background={self.settings.background}, "
            f"checkpoint_io={type(self.checkpoint_io).__name__}, records={len(self.records)})"
        )


# -- sharded checkpoints under the switch ----------------------------------------------------------


def sharded_save(
    wrapped: Any, strategy: Any, args: tuple[Any, ...], kwargs: dict[str, Any], settings: Settings
) -> Any:
    """``save_checkpoint`` of Lightning's FSDP and ModelParallel strategies (Trainer and
    Fabric) while staging is on: a sharded checkpoint is one collective commit.

    Lightning's sharded save bypasses the CheckpointIO: every rank ``dcp.save``s its shards
    into the checkpoint directory, then rank 0 ``torch.save``s ``meta.pt``, whose presence is
    what makes the directory a checkpoint to Lightning (``_is_sharded_checkpoint``). Here the
    strategy's own save writes into each rank's local directory of one
    ``staged_dir(dest, group=WORLD)`` (DCP's writer, there, writes locally: a directory that is
    staging already), so that the ``.distcp`` files, ``.metadata`` and ``meta.pt`` land
    together, under one commit file written last; the previous commit file, ``.metadata`` and
    ``meta.pt`` are removed before any of them is published. Full checkpoints (Lightning saves
    them through its CheckpointIO) and saves inside a directory that is staging already pass
    through. Rank 0 decides, for every rank: the strategy broadcasts the path first anyway."""
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    name = "filepath" if "filepath" in bound.arguments else "path"  # the Trainer's, Fabric's
    sharded = getattr(strategy, "_state_dict_type", None) == "sharded" or getattr(
        strategy, "_save_distributed_checkpoint", False
    )
    if not sharded or bound.arguments.get("storage_options") is not None:
        return wrapped(*args, **kwargs)  # full: its CheckpointIO; storage_options: Lightning refuses
    target = bound.arguments[name]
    path: Optional[Union[str, ObjectURL]] = _store_url(target) or _local_path(target)
    dest, staged = strategy.broadcast((path, path is not None and _commits(path, settings)))
    if isinstance(dest, str) and getattr(strategy, "is_global_zero", True):
        _say_if_reversioned(dest)
    if not staged:
        return wrapped(*args, **kwargs)
    import torch.distributed as dist

    world = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    with staged_dir(dest, settings.root, publish=settings.publish, fsync=settings.fsync,
                    group=dist.group.WORLD if world else None) as local:  # fmt: skip
        bound.arguments[name] = local
        broadcast = strategy.broadcast

        def own(obj: Any, src: int = 0) -> Any:
            # The strategy broadcasts rank 0's path to every rank first: each rank writes into
            # its own local directory instead (they differ, on one node too).
            return obj if obj is local else broadcast(obj, src)

        strategy.broadcast = own
        try:
            return wrapped(*bound.args, **bound.kwargs)
        finally:
            del strategy.broadcast  # the class's method again


def _commits(local: Union[str, ObjectURL], settings: Settings) -> bool:
    """Whether a sharded save to the local path ``local`` is committed (rank 0's verdict is
    every rank's): not inside a directory that is staging already, not a local disk with
    ``skip_local_disk``. As Lightning's save does, its parents are made and a file there is
    replaced by the checkpoint directory. An object-store URL is always committed."""
    if isinstance(local, ObjectURL):
        return True
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        if os.path.isfile(local) and not os.path.islink(local):
            os.unlink(local)  # a full checkpoint saved there before: Lightning unlinks it too
    try:
        real = destination_directory(local)
    except OSError:
        return False  # Lightning's own save then fails as it would
    assert isinstance(real, Path)  # a path's (a URL's: committed above)
    if _patch.in_unstaged_dir(real):
        return False
    return not (settings.skip_local_disk and is_local_disk(real.parent))


# ModelCheckpoint's name for a checkpoint whose name is taken: ``<name>-v<N><ext>``
# (``CHECKPOINT_JOIN_CHAR``, ``"v"``, the version, ``FILE_EXTENSION``).
_VERSIONED = re.compile(r"^(?P<base>.+)-v[0-9]+(?P<ext>\.ckpt)$")
_said_reversioned: set[str] = set()


def _say_if_reversioned(local: str) -> None:
    """A WARNING, once per run directory and process, when ModelCheckpoint named a checkpoint
    ``...-v<N>.ckpt`` because its name was taken: a run resumed from an older checkpoint reached
    the same step again. A step pattern (``epoch=*-step=*.ckpt``) never takes that name
    (docs/retention.md), so ``latest_complete`` and ``keep=`` would pass over the newest
    checkpoint without a word."""
    match = _VERSIONED.match(os.path.basename(local.rstrip("/")))
    if match is None or not any(char in "0123456789" for char in match["base"]):
        return  # no step in the name (last-v1.ckpt: two callbacks, one directory): not a rollback
    taken = os.path.join(os.path.dirname(local), match["base"] + match["ext"])
    parent = os.path.dirname(os.path.abspath(local))
    if not os.path.lexists(taken) or parent in _said_reversioned:
        return
    _said_reversioned.add(parent)
    log.warning(
        "safestage: Lightning saves %s under a '-vN' name because %s exists (the run reached that step again, "
        "resumed from an older checkpoint). A step pattern such as 'epoch=*-step=*.ckpt' never takes a "
        "'-vN' name: latest_complete and keep= do not see it, and name or keep an older checkpoint "
        "instead. Resume from it by path (ckpt_path=), or remove %s before the step is saved again. "
        "Said once per directory.",
        local, os.path.basename(taken), taken,
    )  # fmt: skip


def _torch_save(checkpoint: dict[str, Any], stream: Any) -> None:
    import torch

    torch.save(checkpoint, stream)


def _key(local: str) -> Path:
    """The kernel's path of a checkpoint, so that every spelling of it (a symlinked
    directory, ``..``) finds the same pending save and publish, as the pipeline keys them."""
    resolved = resolve_destination(local)
    return resolved if resolved is not None else Path(os.path.abspath(local))


def _store_url(path: Any) -> Optional[ObjectURL]:
    """The object a checkpoint path names in a store safestage serves (``s3://``, ``gs://``,
    ``az://``), else None: a path, or a URL of another scheme, fsspec's, which the wrapped
    plugin saves as it always did (never refused here: it worked before)."""
    try:
        return file_url(os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path))
    except ConfigError:
        return None


def _local_path(path: Any) -> Optional[str]:
    """The local filesystem path of a checkpoint path or ``file://`` URL, else None."""
    from fsspec.utils import get_protocol

    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
    if get_protocol(text) != "file":
        return None
    return text[len("file://") :] if text.startswith("file://") else text


def _settle(path: Any) -> None:
    """Wait for a pending background publish of the checkpoint ``path`` (none: at once)."""
    url = _store_url(path)
    if url is not None:
        _work.settle(url)
        return
    local = _local_path(path)
    if local is not None:
        _work.settle(_key(local))


def _is_async(checkpoint_io: Optional[CheckpointIO]) -> bool:
    for name in (
        "lightning.pytorch.plugins.io.async_plugin",
        "pytorch_lightning.plugins.io.async_plugin",
    ):
        module = sys.modules.get(name)  # not imported: nobody made one
        if module is not None and isinstance(checkpoint_io, module.AsyncCheckpointIO):
            return True
    return False


def _file_exists(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # ModelCheckpoint's version counter asks the filesystem whether a name is taken: a
    # checkpoint still publishing must count, or the next save gets its name (issue 18).
    _settle(args[0] if args else kwargs["filepath"])
    return wrapped(*args, **kwargs)


def _link_checkpoint(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    def parts(trainer: Any, filepath: str, linkpath: str) -> tuple[Any, str, str]:
        return trainer, filepath, linkpath

    trainer, filepath, linkpath = parts(*args, **kwargs)
    io = getattr(trainer.strategy, "checkpoint_io", None)
    plugin = io if isinstance(io, StagedCheckpointIO) else getattr(io, "checkpoint_io", None)
    if not isinstance(plugin, StagedCheckpointIO):
        return wrapped(*args, **kwargs)
    plugin._link(trainer, filepath, linkpath)


def _wrap_model_checkpoint(module: Any) -> None:
    with contextlib.suppress(Exception):  # a hook that raises breaks the user's import (wrapt)
        wrapt.wrap_function_wrapper(module, "ModelCheckpoint.file_exists", _file_exists)
    with contextlib.suppress(Exception):
        wrapt.wrap_function_wrapper(module, "ModelCheckpoint._link_checkpoint", _link_checkpoint)


def _register_with_other_base(module: Any) -> None:
    # `pip install lightning` also installs pytorch-lightning: a `pytorch_lightning.Trainer`
    # checks plugins against lightning_fabric's CheckpointIO, a different class than
    # lightning.fabric's. Registered when (and if) that module is imported.
    with contextlib.suppress(Exception):  # a hook that raises breaks the user's import (wrapt)
        module.CheckpointIO.register(StagedCheckpointIO)


import wrapt  # noqa: E402 - after the names its hooks use

for _name in (
    "lightning.pytorch.callbacks.model_checkpoint",
    "pytorch_lightning.callbacks.model_checkpoint",
):
    wrapt.register_post_import_hook(_wrap_model_checkpoint, _name)
if _OTHER_BASE:
    wrapt.register_post_import_hook(_register_with_other_base, _OTHER_BASE)
