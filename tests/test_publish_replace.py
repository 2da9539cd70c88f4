"""publish="replace": a staged file lands by os.replace of a sibling temp (or by rename from a staging root on the same filesystem); what a plain save would do otherwise, and what it says when the mount cannot rename."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from _support import _roundtrip, assert_loads_equal, listing, run_code
from safetensors.torch import save_file

import safestage
from safestage import PublishError


def test_plain_disk_same_filesystem_publishes_by_rename(tmp_path, stage_root, tensors):
    dest_dir = tmp_path / "ckpt"
    dest_dir.mkdir()
    assert _roundtrip(dest_dir, stage_root, tensors) == ["rename"] * 3


def test_cross_device_staging_copies_then_replaces(tmp_path, shm_root, tensors):
    dest_dir = tmp_path / "ckpt"
    dest_dir.mkdir()
    assert os.stat(shm_root).st_dev != os.stat(dest_dir).st_dev, "needs /dev/shm on another device"
    assert _roundtrip(dest_dir, shm_root, tensors) == ["replace"] * 3


def test_publish_replace_on_a_mount_that_cannot_rename_says_what_to_do(kit_mounts, stage_root, tensors):
    directory = Path(kit_mounts["mountpoint"].path) / f"r-{os.getpid()}"
    directory.mkdir()
    with pytest.raises(PublishError) as info, safestage.staged(stage_root, publish="replace"):
        save_file(tensors, str(directory / "model.safetensors"))
    message = str(info.value)
    assert "publish='direct'" in message and "rename" in message
    assert info.value.errno in (errno.ENOSYS, errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP)
    assert listing(directory) == []
    assert_loads_equal(Path(info.value.staged_path), tensors)


WRITE_ONLY_DEST = """
    import os, sys, torch, safestage
    from safetensors.torch import save_file
    dest, root = sys.argv[1:3]
    save_file({"w": torch.zeros(4)}, dest)
    os.chmod(dest, 0o200)                       # an existing write-only file (a drop box)
    save_file({"w": torch.zeros(4)}, dest)      # a plain safetensors save works here
    os.chmod(dest, 0o200)
    with safestage.staged(root):
        save_file({"w": torch.ones(4)}, dest)
    print("staged ok")
"""


@pytest.mark.slow
@pytest.mark.regression("0.1 hostile review 1: rename fails over a write only file a plain save replaces")
def test_rename_publishes_over_a_write_only_file_like_a_plain_save(tmp_path):
    """With the staging root on the destination's filesystem (`rename`), _rename_into_place
    chmods the staged file to the destination's mode (0200 here) and THEN opens it O_RDONLY
    to fsync it: EACCES for any user but root. The save fails with "This process may not
    write in the destination directory: fix its permissions" - wrong: the directory is
    writable and a plain save of the same file works. What the user loses: the save, with
    advice that sends them to the wrong place. (fsync before chmod, or fsync the fd the
    writer's copy had, fixes it.)"""
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="safestage-review-"))  # pytest's tmp is 0700 root
    try:
        work.chmod(0o755)
        (work / "root").mkdir()
        (work / "dst").mkdir()
        subprocess.run(["chown", "-R", "65534:65534", str(work)], check=True)
        done = run_code(WRITE_ONLY_DEST, str(work / "dst" / "model.safetensors"), str(work / "root"),
                          prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "staged ok" in done.stdout, done.stderr[-500:]
