"""A save the switch leaves alone (``safestage.dcp.unstaged(writer)``, a subclass of DCP's
writer, skip_local_disk) writes in place. Into a directory safestage committed, it must never
write under the old commit file: a re-save killed half-way would leave new files that the old
commit file vouches for (a shallow ``verify`` checks names and sizes, which a re-save of the
same shapes keeps). Where safestage sees such a save begin (the switch is on), the commit file
is removed before DCP writes anything (docs/dcp.md).

Real ``dcp.save`` calls in one process on the local disk: a committed checkpoint (through
``StagedWriter``), then a re-save of other values by a writer the switch leaves alone."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import safestage
from safestage import COMMIT_NAME


class MyWriter(FileSystemWriter):
    """A subclass of DCP's writer (what torchtitan-like code does to add its own hooks)."""


def _writer(kind: str, dest: Path) -> Any:
    from safestage.dcp import unstaged

    if kind == "unstaged":
        return unstaged(FileSystemWriter(dest))
    return MyWriter(dest)


@pytest.mark.regression("issue 30 item 12: a writer the switch leaves alone re-saved into a committed directory "
                        "under the old commit file, which a shallow verify then passed")
@pytest.mark.parametrize("kind", ["unstaged", "subclass"])
def test_a_resave_by_a_writer_the_switch_leaves_alone_is_never_vouched_for_by_the_old_commit_file(
    tmp_path: Path, stage_root: Path, kind: str
) -> None:
    from safestage.dcp import StagedWriter

    dest = tmp_path / "step-100"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process
        dcp.save({"w": torch.ones(1024)}, storage_writer=StagedWriter(dest, stage_root))
        assert safestage.verify(dest, deep=True).complete
        with safestage.staged(stage_root):  # the switch is on, and leaves this writer alone
            dcp.save({"w": torch.full((1024,), 2.0)}, storage_writer=_writer(kind, dest))
    loaded = {"w": torch.zeros(1024)}
    dcp.load(loaded, checkpoint_id=str(dest))
    assert loaded["w"][0].item() == 2.0  # the re-save landed, in place
    assert not (dest / COMMIT_NAME).exists(), "the old commit file still vouches for the re-saved files"
    assert not safestage.verify(dest).complete


@pytest.mark.regression("issue 30 review: a writer left alone saving into a directory safestage never committed, on a "
                        "read-only mount, got a PublishError saying safestage had committed it, instead of its own error")
def test_a_writer_left_alone_on_a_read_only_mount_gets_its_own_error_where_no_commit_file_is(
    small_tmpfs: Path, stage_root: Path
) -> None:
    import subprocess

    from torch.distributed.checkpoint.api import CheckpointException

    from safestage.dcp import unstaged

    dest = small_tmpfs / "step-100"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(8)}, storage_writer=FileSystemWriter(dest))  # DCP's own: no commit file
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
        with safestage.staged(stage_root), pytest.raises(CheckpointException) as raised:
            dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=unstaged(FileSystemWriter(dest)))
    assert "Read-only file system" in str(raised.value), raised.value  # DCP's own error: the fault fired
    assert sorted(os.listdir(dest)) == [".metadata", "__0_0.distcp"]


@pytest.mark.mounts
@pytest.mark.regression("issue 30 review: where the commit file cannot be told (EACCES from a FUSE lookup) a writer "
                        "left alone is refused, never let write under it")
def test_a_writer_left_alone_is_refused_where_the_commit_file_cannot_be_removed_nor_told(
    tmp_path: Path, stage_root: Path
) -> None:
    import errno

    from safestage import PublishError
    from safestage.dcp import StagedWriter, unstaged
    from safestage.testing import hostile_mount

    backing = tmp_path / "backing"
    backing.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(8)}, storage_writer=StagedWriter(backing / "step-100", stage_root))
        with hostile_mount("passthrough", tmp_path / "mnt", backing=backing,
                           lookup_errors={COMMIT_NAME: errno.EACCES}) as mount:  # fmt: skip
            with safestage.staged(stage_root), pytest.raises(PublishError) as raised:
                dest = Path(mount.path) / "step-100"
                dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=unstaged(FileSystemWriter(dest)))
            assert mount.faults()["lookup"] >= 1, "the EACCES never fired"
    assert raised.value.errno == errno.EACCES and "Nothing was written" in str(raised.value)
    loaded = {"w": torch.zeros(8)}
    dcp.load(loaded, checkpoint_id=str(backing / "step-100"))
    assert loaded["w"][0].item() == 1.0 and safestage.verify(backing / "step-100", deep=True).complete
