"""Writers safestage cannot reach, shown for real: they never call serialize_file.

torch.distributed.checkpoint's HuggingFaceStorageWriter (torch 2.13) serializes each file to
bytes with ``safetensors.torch.save`` and writes them through its own stream
(filesystem.py ``_write_files_from_queue``), so a stage records nothing. On the kit it writes
sequentially and lands on hdfs, but on mountpoint it fails for small files: it calls
``os.fsync(stream.fileno())`` before the buffered stream is flushed, the fsync completes the
upload (mountpoint-s3 semantics) and close() then flushes into a finished object (EBADF).
What to do instead: save to local disk, publish each file with ``safestage.staged_file``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from _helpers import assert_tensors_match, fresh_dir
from safetensors.torch import load_file

import safestage

pytestmark = pytest.mark.integration

STATE = {"small.weight": torch.arange(10, dtype=torch.float32), "small.bias": torch.ones(3)}


def dcp_save(directory) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed ... assuming a single process"
        dcp.save(dict(STATE), storage_writer=HuggingFaceStorageWriter(str(directory)))


def assert_hf_checkpoint(directory) -> None:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    saved = {k: v for f in files for k, v in load_file(str(directory / f)).items()}
    assert_tensors_match(saved, STATE)


def test_dcp_hf_writer_is_not_staged_and_lands_on_hdfs(kit_mounts, shm_root):
    dest = fresh_dir(kit_mounts["hdfs"], "dcp")
    with safestage.staged(shm_root) as stage:
        dcp_save(dest)
    assert stage.records == []  # safestage never saw these files
    assert_hf_checkpoint(dest)


def test_dcp_hf_writer_fails_on_mountpoint_even_inside_a_stage(kit_mounts, shm_root, tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    dest = fresh_dir(kit_mounts["mountpoint"], "dcp")
    with pytest.raises(CheckpointException) as info, safestage.staged(shm_root) as stage:
        dcp_save(dest)
    assert "Bad file descriptor" in str(info.value)
    assert stage.records == []
    # Instead: DCP to local disk, then publish file by file.
    local = tmp_path / "dcp"
    dcp_save(local)
    published = fresh_dir(kit_mounts["mountpoint"], "dcp-published")
    for path in sorted(local.iterdir()):
        with safestage.staged_file(published / path.name, shm_root) as staged:
            shutil.copyfile(path, staged)
    assert_hf_checkpoint(published)
    assert sorted(os.listdir(published)) == sorted(os.listdir(local))
