"""The mount table lookup that decides a destination's filesystem: never stale after a mount is made or gone."""

from __future__ import annotations

import subprocess

import pytest


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): the mount table cache never hides a mount made or gone")
def test_the_mount_table_cache_never_hides_a_mount_made_or_gone(tmp_path):
    """read_mounts parses /proc/self/mountinfo only when its text changed (a 0.35 ms saving
    per replace save): a tmpfs mounted over a directory after a lookup, and unmounted again,
    must be seen by the very next lookup, or a save would publish with another filesystem's
    cached verdict."""
    from safestage._mounts import mount_of

    target = tmp_path / "mnt"
    target.mkdir()
    before = mount_of(target)
    assert before is not None and before.fs_type != "tmpfs"
    assert mount_of(target) == before  # the cached parse gives the same answer
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], check=True)
    try:
        during = mount_of(target)
        assert during is not None and during.fs_type == "tmpfs" and during.mount_point == str(target)
    finally:
        subprocess.run(["umount", str(target)], check=True)
    assert mount_of(target) == before
