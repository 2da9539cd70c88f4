"""skip_local_disk=True: local-disk destinations use the original writer unstaged (then the file mode fixed); everything else is staged."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from _support import filled_tensors, loads_as, shard
from safetensors.torch import load_file, save_file

import safestage
from safestage.testing import hostile_mount


def test_skip_local_disk_writes_local_disk_directly_and_fixes_the_mode(tmp_path, shm_root, kit_mounts):
    hdfs = Path(kit_mounts["hdfs"].path) / f"when-{os.getpid()}"
    hdfs.mkdir()
    with safestage.staged(shm_root, skip_local_disk=True) as stage:
        save_file(shard(0), str(tmp_path / "local.safetensors"))
        save_file(shard(0), str(hdfs / "remote.safetensors"))
    assert [r.publish for r in stage.records] == ["unstaged", "replace"]
    assert stat.S_IMODE(os.stat(tmp_path / "local.safetensors").st_mode) == 0o644  # not 0600 (#782)
    assert torch.equal(load_file(str(tmp_path / "local.safetensors"))["w"], shard(0)["w"])
    assert torch.equal(load_file(str(hdfs / "remote.safetensors"))["w"], shard(0)["w"])


@pytest.mark.mounts
@pytest.mark.regression("0.1 hostile review 1: when auto writes a fuse mount unstaged after a tmpfs had its device number")
def test_skip_local_disk_never_writes_a_fuse_mount_unstaged_after_a_tmpfs_had_its_device_number(shm_root, tmp_path):
    """skip_local_disk=True writes local-disk destinations with the original writer, unstaged, and
    caches that verdict per st_dev (_mounts.is_local_disk). Anonymous device numbers (tmpfs,
    FUSE, overlay, btrfs subvolumes) are reused as soon as a mount goes - README says so
    itself ("FUSE reuses device numbers") and keys the rename verdict per mount, but not this
    one. Save once to a tmpfs, unmount it, mount an object store (here the kit's close-eio:
    an upload that fails at close) that gets the same number: the save goes straight to the
    plain safetensors writer. What the user loses: the previous checkpoint is replaced by a
    discarded upload (the file is gone) and the error is a bare FileNotFoundError from a
    chmod, not a PublishError keeping the staged copy."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stage = safestage.activate(shm_root, skip_local_disk=True)
    try:
        for _attempt in range(5):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
            try:
                local_device = os.stat(mnt).st_dev
                save_file(filled_tensors(0), str(mnt / "scratch.safetensors"))  # "local": cached
            finally:
                subprocess.run(["umount", str(mnt)], check=True)
            with hostile_mount("close-eio", mnt) as mount:
                if os.stat(mount.path).st_dev != local_device and _attempt < 4:
                    continue  # another mount took the number meanwhile: try again
                # (On the last attempt the check runs anyway: without the reuse it still
                # proves the object store is staged, and nothing is ever skipped.)
                from safetensors.torch import save as to_bytes

                previous = Path(mount.backing) / "model.safetensors"
                previous.write_bytes(to_bytes(filled_tensors(1)))  # the previous checkpoint
                error: BaseException | None = None
                try:
                    save_file(filled_tensors(2), str(Path(mount.path) / "model.safetensors"))
                except Exception as exc:
                    error = exc
                assert loads_as(previous, 1.0) or loads_as(previous, 2.0), (
                    f"the previous checkpoint is gone and the new one is not there: the save went "
                    f"unstaged onto the object store (error: {error!r})"
                )
                return
    finally:
        stage.close()
