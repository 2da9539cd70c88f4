"""Fifth review: the free-space pre-check (StagingRoot.check_room) and follow mode's
small-save skip (FOLLOW_MIN_BYTES), each defect a failing test."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import safestage


@pytest.fixture(params=["tmpfs-size0", "ramfs"])
def unlimited_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A real local filesystem with no size limit of its own: a tmpfs mounted with size=0
    ("unlimited", tmpfs(5)) or a ramfs. Both report f_blocks = f_bfree = f_bavail = 0 in
    statvfs, while every write succeeds."""
    target = tmp_path / "unlimited"
    target.mkdir()
    if request.param == "ramfs":
        command = ["mount", "-t", "ramfs", "-o", "mode=0755", "ramfs", str(target)]
    else:
        command = ["mount", "-t", "tmpfs", "-o", "size=0,mode=0755", "tmpfs", str(target)]
    subprocess.run(command, check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_root_on_an_unlimited_tmpfs_or_ramfs_is_not_refused_as_full(unlimited_root, tmp_path):
    """A staging root on ramfs, or on a tmpfs mounted with size=0 (no limit; what some job
    schedulers and container setups give as RAM scratch), has room for anything memory
    holds, but statvfs reports 0 blocks free there: "no limit" is not "full". The pre-check
    reads that 0 as "full" and refuses every staged save, even 4 KiB, with a StagingError
    (ENOSPC) that tells the user the root is full and to move it. Before the pre-check these
    saves worked; the user loses every checkpoint written through such a root, and the message
    sends them to free space that is not missing."""
    info = os.statvfs(unlimited_root)
    assert (info.f_blocks, info.f_bavail) == (0, 0)  # the filesystem says "no size", not "full"
    probe = unlimited_root / "probe"
    probe.write_bytes(b"\1" * (8 << 20))  # ...and takes 8 MiB without complaint
    probe.unlink()
    tensors = {"w": torch.arange(1024, dtype=torch.float32), "b": torch.ones(3, 5)}
    dest = tmp_path / "model.safetensors"  # on the disk: another device, published by replace
    with safestage.staged(unlimited_root) as stage:
        save_file(tensors, str(dest))
    loaded = load_file(str(dest))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert [r.publish for r in stage.records] == ["replace"]
    assert os.listdir(unlimited_root) == []


def test_root_of_a_user_namespace_is_not_the_hosts_root():
    """ext4's reserved blocks are for the host's root only: uid 0 inside a user namespace
    (rootless podman, Kubernetes hostUsers: false) must be checked against f_bavail, or a
    save that does not fit passes the pre-check and fails half-written (review 5)."""
    import sys

    code = "from safestage._stage import _is_host_root; print(_is_host_root())"
    env = {**os.environ, "PYTHONPATH": str(Path(safestage.__file__).parent.parent)}
    host = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    inside = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", code],
        capture_output=True, text=True, env=env, check=True,
    )
    assert host.stdout.strip() == str(os.geteuid() == 0)
    assert inside.stdout.strip() == "False", inside.stderr


def test_background_waits_for_pending_publishes_before_calling_the_root_full(tmp_path):
    """background=2, a 24 MiB staging root and 9 MiB shards onto a slow
    mount: the third shard finds the root holding the two still being published, 6 MiB
    free. It fits once they land, so the save must wait for them, not fail with ENOSPC
    (review 5: it was refused at once, and the user's third shard lost, in a root big
    enough for every shard one after another)."""
    from safestage.testing import hostile_mount

    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(root)], check=True)
    shards = [{"w": torch.full(((9 << 20) // 4,), float(i))} for i in range(3)]
    try:
        with hostile_mount("slow", tmp_path / "mnt", mbps=20) as mount:
            dest = Path(mount.path)
            with safestage.staged(root, background=2) as stage:
                for i, shard in enumerate(shards):
                    save_file(shard, str(dest / f"shard-{i}.safetensors"))
                    if i == 1:
                        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
                        assert free < (9 << 20), "the root must be too full for shard 2 now"
            for i, shard in enumerate(shards):
                assert torch.equal(load_file(str(dest / f"shard-{i}.safetensors"))["w"], shard["w"])
            assert sorted(os.listdir(dest)) == [f"shard-{i}.safetensors" for i in range(3)]
            assert len(stage.records) == 3
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
