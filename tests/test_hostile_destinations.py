"""The core promise on every hostile destination: a plain save fails on the kit's mounts and the real rclone/s3fs mounts, the same save staged lands."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from _support import TMP_NAME, _roundtrip, assert_loads_equal, listing, mode_of
from safetensors.torch import save_file

from safestage.testing import REAL_MODES

HOSTILE = ["hdfs", "eopnotsupp", "objectstore", "mountpoint"]


KIT_OK = ["hdfs", "eopnotsupp", "objectstore", "mountpoint", "slow", "passthrough"]


@pytest.mark.parametrize("kit_dir", KIT_OK, indirect=True)
def test_every_kit_mode_saves_through_staging(kit_dir, stage_root, tensors, request):
    strategies = _roundtrip(kit_dir, stage_root, tensors)
    mode = request.node.callspec.params["kit_dir"]
    assert set(strategies) == ({"direct"} if mode == "mountpoint" else {"replace"})


@pytest.mark.parametrize("kit_dir", HOSTILE, indirect=True)
def test_kit_modes_really_break_a_plain_save(kit_dir, tensors):
    """Without safestage the same save fails: the kit is really hostile."""
    with pytest.raises(Exception) as info:
        save_file(tensors, str(kit_dir / "model.safetensors"))
    assert "os error" in str(info.value) or isinstance(info.value, OSError)


def stored(mount, directory: Path) -> list[str]:
    """What the real mount's store holds under ``directory``, not through the mount."""
    prefix = directory.relative_to(mount.path).as_posix() + "/"
    return sorted(o[len(prefix) :] for o in mount.objects() if o.startswith(prefix) and o != prefix)


@pytest.mark.parametrize("real_dir", REAL_MODES, indirect=True)
def test_every_real_mount_saves_through_staging(real_dir, real_mounts, stage_root, tensors, request):
    """rclone (no write cache) and s3fs can rename: auto's probe says so, and every file goes
    through a sibling temp and os.replace, like on the kit's hdfs."""
    assert _roundtrip(real_dir, stage_root, tensors) == ["replace"] * 3
    # rclone applies some unlinks and renames only when the kernel's FUSE RELEASE arrives,
    # after close() returned (test_real_mounts): a name that comes back would show by now.
    time.sleep(1.0)
    expected = ["model.safetensors", "tiny.safetensors"]
    assert listing(real_dir) == expected
    assert stored(real_mounts[request.node.callspec.params["real_dir"]], real_dir) == expected


@pytest.mark.parametrize("real_dir", REAL_MODES, indirect=True)
def test_plain_save_on_the_real_mounts(real_dir, tensors, request):
    """Without safestage: rclone refuses safetensors 0.8's ftruncate and keeps its empty temp
    file (deleted while open: rclone uploads it at close anyway); s3fs takes the save, with the
    temp file's mode 0600 (#782)."""
    dest = real_dir / "model.safetensors"
    if request.node.callspec.params["real_dir"].startswith("rclone"):
        with pytest.raises(Exception, match=re.escape("Operation not permitted (os error 1)")):
            save_file(tensors, str(dest))
        deadline = time.monotonic() + 5
        while not os.listdir(real_dir) and time.monotonic() < deadline:
            time.sleep(0.05)  # the upload happens at FUSE RELEASE, after close() returned
        left = listing(real_dir)
        assert len(left) == 1 and TMP_NAME.match(left[0]), left
        assert os.stat(real_dir / left[0]).st_size == 0
    else:
        save_file(tensors, str(dest))
        assert listing(real_dir) == ["model.safetensors"]
        assert mode_of(dest) == 0o600
        assert_loads_equal(dest, tensors)


def test_a_plain_save_onto_close_eio_loses_the_file_silently(kit_mounts, tmp_path, tensors):
    """Why the close() check matters: safetensors reports success, the file is gone."""
    directory = Path(kit_mounts["close-eio"].path) / f"loss-{os.getpid()}"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))  # no exception
    assert not (directory / "model.safetensors").exists()
