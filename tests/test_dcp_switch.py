"""DCP's own writers under the switch, in one process (no FUSE: the fast tier): what is staged
and committed, what is left alone and said so, and that the wrappers go when staging ends.
Many ranks on hostile mounts: test_dcp_staged_writer.py; Lightning: integration/test_lightning_sharded.py.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    FileSystemWriter,
    HuggingFaceStorageWriter,
    state_dict_saver,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import safestage
from safestage import COMMIT_NAME
from safestage.dcp import unstaged

STATE = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 4), "step": 7}
ORIGINAL = state_dict_saver._save_state_dict


@pytest.fixture(autouse=True)
def _single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        yield
    assert state_dict_saver._save_state_dict is ORIGINAL and not safestage.is_active()


def load(dest: Path) -> dict[str, Any]:
    back: dict[str, Any] = {"a": torch.zeros(10), "b": torch.zeros(3, 4), "step": 0}
    dcp.load(back, checkpoint_id=dest)
    return back


def committed(dest: Path, files: list[str]) -> None:
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted([*files, COMMIT_NAME])
    result = safestage.verify(dest, deep=True)
    assert result.complete, result.problems
    assert result.manifest is not None and sorted(e.path for e in result.manifest.files) == sorted(files)


DCP = [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("how", ["checkpoint_id", "writer", "async-thread", "save_state_dict"])
def test_a_stage_commits_every_save_of_dcps_own_writer(how: str, tmp_path: Path, stage_root: Path) -> None:
    dest = tmp_path / "run" / "step-7"  # its parent made too, as DCP's writer does
    with safestage.staged(stage_root):
        if how == "checkpoint_id":
            dcp.save(dict(STATE), checkpoint_id=dest)
        elif how == "writer":
            dcp.save(dict(STATE), storage_writer=FileSystemWriter(dest, thread_count=2, single_file_per_rank=False))
        elif how == "async-thread":
            dcp.async_save(dict(STATE), checkpoint_id=dest, async_checkpointer_type=AsyncCheckpointerType.THREAD).result()
        else:
            dcp.save_state_dict(dict(STATE), storage_writer=FileSystemWriter(dest), no_dist=True)
    files = [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"] if how == "writer" else DCP
    committed(dest, files)
    back = load(dest)
    assert back["step"] == 7 and torch.equal(back["a"], STATE["a"]) and torch.equal(back["b"], STATE["b"])
    assert safestage.latest_complete(dest.parent, "step-*") == dest
    assert os.listdir(stage_root) == []  # every local copy went once its files landed


def test_the_huggingface_writer_and_its_consolidation_are_one_commit(tmp_path: Path, stage_root: Path) -> None:
    tensors = {"a": STATE["a"], "b": STATE["b"]}
    with safestage.staged(stage_root):
        dcp.save(dict(tensors), storage_writer=HuggingFaceStorageWriter(str(tmp_path / "plain")))
        dcp.save(dict(tensors), storage_writer=HuggingFaceStorageWriter(
            str(tmp_path / "consolidated"), save_distributed=True, enable_consolidation=True))  # fmt: skip
    committed(tmp_path / "plain", ["model-00001-of-00001.safetensors", "model.safetensors.index.json"])
    committed(tmp_path / "consolidated", ["model-00001-of-00001.safetensors", "model.safetensors.index.json",
                                          "sharded/shard-00001-model-00001-of-00001.safetensors"])  # fmt: skip
    for name in ("plain", "consolidated"):
        back = {"a": torch.zeros(10), "b": torch.zeros(3, 4)}
        dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp_path / name)))
        assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])


class MyWriter(FileSystemWriter):
    pass


def test_what_the_switch_leaves_alone_is_written_in_place_and_said_once(
    tmp_path: Path, stage_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="safestage")
    with safestage.staged(stage_root):
        dcp.save(dict(STATE), storage_writer=unstaged(FileSystemWriter(tmp_path / "off")))  # the off switch
        dcp.save(dict(STATE), storage_writer=MyWriter(tmp_path / "subclass"))
        dcp.save(dict(STATE), storage_writer=MyWriter(tmp_path / "subclass-again"))
        dcp.save(dict(STATE), storage_writer=FileSystemWriter(tmp_path / "no-collectives"), use_collectives=False)
        with safestage.staged_dir(tmp_path / "whole", stage_root) as local:  # staging already: its commit publishes
            dcp.save(dict(STATE), checkpoint_id=local / "dcp")
    for name in ("off", "subclass", "subclass-again"):
        assert sorted(os.listdir(tmp_path / name)) == DCP, name  # no commit file: DCP's writer, in place
        assert load(tmp_path / name)["step"] == 7
    assert COMMIT_NAME not in os.listdir(tmp_path / "no-collectives")
    committed(tmp_path / "whole", [f"dcp/{name}" for name in DCP])
    said = [record.getMessage() for record in caplog.records]
    assert sum("MyWriter, a subclass of DCP's FileSystemWriter, is not staged" in text for text in said) == 1
    assert sum("use_collectives=False) is not staged" in text for text in said) == 1


def test_skip_local_disk_leaves_a_local_disk_to_dcps_writer(tmp_path: Path, stage_root: Path) -> None:
    with safestage.staged(stage_root, skip_local_disk=True):
        dcp.save(dict(STATE), checkpoint_id=tmp_path / "step-1")
    assert sorted(os.listdir(tmp_path / "step-1")) == DCP


def test_overwrite_false_refuses_an_existing_checkpoint_as_dcp_does(tmp_path: Path, stage_root: Path) -> None:
    dest = tmp_path / "step-1"
    with safestage.staged(stage_root):
        dcp.save(dict(STATE), checkpoint_id=dest)
        with pytest.raises(CheckpointException, match=r"Checkpoint already exists and self.overwrite=False"):
            dcp.save(dict(STATE), storage_writer=FileSystemWriter(dest, overwrite=False))
    committed(dest, DCP)  # the first save, untouched


def test_a_save_after_staging_ended_is_dcps_own_again(tmp_path: Path, stage_root: Path) -> None:
    with safestage.staged(stage_root):
        pass
    dcp.save(dict(STATE), checkpoint_id=tmp_path / "step-1")
    assert sorted(os.listdir(tmp_path / "step-1")) == DCP
