"""torch.distributed.checkpoint (torch 2.13) on hostile mounts: what its own writers do, and a
recipe that publishes a DCP checkpoint through safestage (issue 12, part A).

Single process, no process group: ``dcp.save`` warns "torch.distributed is disabled,
unavailable or uninitialized, assuming the intent is to save in a single process" and saves.

What DCP's writers do (measured, asserted below):

- ``FileSystemWriter`` (``checkpoint_id=dir``): each rank's data file ``__<rank>_<n>.distcp`` is
  written in place through a buffered stream and fsync'ed; then ``.metadata.tmp`` (a pickle),
  fsync'ed, the old ``.metadata`` removed, and ``.metadata.tmp`` renamed to ``.metadata``,
  which is the commit marker (no ``.metadata``, no checkpoint).
  - kit hdfs, s3fs, rclone-s3: works, loads back.
  - kit mountpoint: ``CheckpointException`` (a BaseException, not an Exception) wrapping
    ``OSError: [Errno 9] Bad file descriptor``: ``os.fsync(stream.fileno())`` runs before the
    buffered pickle is flushed, the fsync completes the upload (mountpoint-s3 semantics) and
    ``close()`` then flushes into a finished object. Left behind: ``.metadata.tmp`` and the data
    file, no ``.metadata``. With ``sync_files=False`` it fails one step later: the rename to
    ``.metadata`` answers ENOSYS; the same files are left.
  - kit close-eio (an upload failing at close): ``CheckpointException`` wrapping EIO; nothing left.
- ``HuggingFaceStorageWriter``: hands each shard to the same code, which writes the bytes of
  ``safetensors.torch.save(...)`` into its own stream (never ``serialize_file``: a stage records
  nothing), then ``model.safetensors.index.json``. Works on hdfs, s3fs, rclone-s3 and, for shards
  larger than the stream buffer, on mountpoint; a small shard hits the same fsync-before-flush
  EBADF there and leaves the shard without its index. close-eio: EIO.

The recipe: ``dcp.save`` into a local directory made inside the staging root (the plain writer
works on local disk), then every file is moved into ``safestage.staged_file`` (a rename: same
filesystem) and published, the commit marker (``.metadata`` / the HF index) last, so a reader
never finds a marker whose data files are not all complete. The other engineer's
``safestage.staged_dir`` (issue 11) will replace the loop.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from _helpers import fresh_dir

import safestage

pytestmark = pytest.mark.integration

SMALL = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 4), "step": 7}
LARGE = {"a": torch.arange(1 << 18, dtype=torch.float32), "b": torch.ones(3, 4), "step": 7}
COMMIT_MARKERS = (".metadata", "model.safetensors.index.json")


def tensors_only(state: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def dcp_save(directory: Path, state: dict[str, object], writer: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        if writer == "fs":
            dcp.save(dict(state), checkpoint_id=str(directory))
        elif writer == "fs-nosync":
            dcp.save(dict(state), storage_writer=FileSystemWriter(str(directory), sync_files=False))
        else:
            dcp.save(tensors_only(state), storage_writer=HuggingFaceStorageWriter(str(directory)))


def dcp_load_equal(directory: Path, state: dict[str, object], writer: str) -> bool:
    import torch.distributed.checkpoint as dcp

    if writer == "hf":
        from safetensors.torch import load_file

        loaded = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        return loaded.keys() == tensors_only(state).keys() and all(torch.equal(loaded[k], v) for k, v in tensors_only(state).items())
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(directory))
    return all(torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v for k, v in state.items())


def inner_error(error: BaseException) -> BaseException:
    """The rank's own exception inside DCP's CheckpointException."""
    failures = getattr(error, "failures", None)
    if not failures:
        return error
    (first,) = failures.values()
    return first[0] if isinstance(first, tuple) else first


def test_single_process_needs_no_process_group(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.warns(UserWarning, match="assuming the intent is to save in a single process"):
        import torch.distributed.checkpoint as dcp

        dcp.save(dict(SMALL), checkpoint_id=str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp"]
    assert dcp_load_equal(tmp_path / "ckpt", SMALL, "fs")


DCP_FILES = [".metadata", "__0_0.distcp"]
HF_FILES = ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
# (mount, writer, state) -> None (works) or (errno of the rank's OSError, files left behind)
PLAIN = {
    ("hdfs", "fs", "small"): None,
    ("hdfs", "hf", "small"): None,
    ("mountpoint", "fs", "small"): (9, [".metadata.tmp", "__0_0.distcp"]),  # fsync before flush
    ("mountpoint", "fs", "large"): (9, [".metadata.tmp", "__0_0.distcp"]),  # .metadata is small
    ("mountpoint", "fs-nosync", "small"): (38, [".metadata.tmp", "__0_0.distcp"]),  # rename ENOSYS
    ("mountpoint", "hf", "small"): (9, ["model-00001-of-00001.safetensors"]),  # no index
    ("mountpoint", "hf", "large"): None,  # the shard outgrows the buffer: flushed before the fsync
    ("close-eio", "fs", "small"): (5, []),
    ("close-eio", "hf", "small"): (5, []),
}


@pytest.mark.parametrize(("mode", "writer", "size"), list(PLAIN))
def test_dcp_writers_plainly_on_the_kit(mode, writer, size, kit_mounts):
    from torch.distributed.checkpoint.api import CheckpointException

    state = SMALL if size == "small" else LARGE
    dest = fresh_dir(kit_mounts[mode], f"dcp-{writer}")
    expected = PLAIN[mode, writer, size]
    if expected is None:
        dcp_save(dest, state, writer)
        assert sorted(os.listdir(dest)) == (HF_FILES if writer == "hf" else DCP_FILES)
        assert dcp_load_equal(dest, state, writer)
        return
    code, left = expected
    with pytest.raises(CheckpointException) as info:
        dcp_save(dest, state, writer)
    assert not isinstance(info.value, Exception)  # `except Exception` does not catch a failed DCP save
    inner = inner_error(info.value)
    assert isinstance(inner, OSError) and inner.errno == code, repr(inner)
    assert sorted(os.listdir(dest)) == left
    assert ".metadata" not in left  # no commit marker: DCP will not load it


@pytest.mark.parametrize("real_dir", ["s3fs"], indirect=True)
@pytest.mark.parametrize("writer", ["fs", "hf"])
def test_dcp_writers_plainly_on_s3fs(writer, real_dir):
    dcp_save(real_dir, SMALL, writer)
    assert sorted(os.listdir(real_dir)) == (HF_FILES if writer == "hf" else DCP_FILES)
    assert dcp_load_equal(real_dir, SMALL, writer)


@pytest.mark.parametrize("writer", ["hf", "fs", "fs-nosync"])
def test_an_open_stage_commits_dcp_saves_of_dcps_own_writers(writer, kit_mounts, shm_root):
    """What serialize_file and torch.save never see (safetensors.torch.save() to bytes, torch.save
    into DCP's streams) is staged all the same: the switch wraps DCP's writer in a StagedWriter,
    on mountpoint too, where the plain writers fail (PLAIN above)."""
    dest = fresh_dir(kit_mounts["mountpoint"], f"dcp-{writer}") / "step-1"
    with safestage.staged(shm_root, torch_save=True) as stage:
        dcp_save(dest, SMALL, writer)
    assert stage.records == []  # the commit's files are the writer's, not the stage's records
    assert sorted(os.listdir(dest)) == sorted([*(HF_FILES if writer == "hf" else DCP_FILES), safestage.COMMIT_NAME])
    assert safestage.verify(dest, deep=True).complete
    assert dcp_load_equal(dest, SMALL, writer)
    assert os.listdir(shm_root) == []


# -- the recipe ------------------------------------------------------------------------------


def save_dcp_through_safestage(state: dict[str, object], dest: Path, root: Path, writer: str = "fs") -> None:
    """What a user writes today: DCP to local disk, then publish every file, marker last."""
    local = Path(tempfile.mkdtemp(prefix="dcp-", dir=root))  # inside the root: moves are renames
    try:
        dcp_save(local, state, writer)
        dest.mkdir(parents=True, exist_ok=True)
        files = sorted(p.name for p in local.iterdir())
        ordered = [n for n in files if n not in COMMIT_MARKERS] + [n for n in files if n in COMMIT_MARKERS]
        for name in ordered:
            with safestage.staged_file(dest / name, root) as staged:
                os.replace(local / name, staged)
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.parametrize("mode", ["mountpoint", "hdfs"])
@pytest.mark.parametrize("writer", ["fs", "hf"])
def test_recipe_publishes_every_file_on_the_kit(mode, writer, kit_mounts, shm_root):
    dest = fresh_dir(kit_mounts[mode], "recipe") / "step-100"
    save_dcp_through_safestage(SMALL, dest, shm_root, writer)  # SMALL: what fails plainly on mountpoint
    assert sorted(os.listdir(dest)) == (HF_FILES if writer == "hf" else DCP_FILES)
    assert dcp_load_equal(dest, SMALL, writer)
    assert {stat.S_IMODE(os.stat(dest / n).st_mode) for n in os.listdir(dest)} == {0o644}
    assert os.listdir(shm_root) == []


@pytest.mark.parametrize("real_dir", ["s3fs"], indirect=True)
def test_recipe_on_s3fs(real_dir, shm_root):
    save_dcp_through_safestage(LARGE, real_dir / "step-100", shm_root)
    assert sorted(os.listdir(real_dir / "step-100")) == DCP_FILES
    assert dcp_load_equal(real_dir / "step-100", LARGE, "fs")


def test_recipe_on_a_failing_upload_publishes_no_marker_and_keeps_the_copy(kit_mounts, shm_root):
    dest = fresh_dir(kit_mounts["close-eio"], "recipe") / "step-100"
    with pytest.raises(safestage.PublishError) as info:
        save_dcp_through_safestage(SMALL, dest, shm_root)
    error = info.value
    assert error.errno == 5 and error.filename == str(dest / "__0_0.distcp")  # data first
    assert Path(error.staged_path).is_file()  # the complete data file, kept
    assert os.listdir(dest) == []  # and never a .metadata announcing it
