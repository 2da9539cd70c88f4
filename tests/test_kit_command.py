"""`safestage kit up MODE PATH` keeps a hostile mount for a shell session; `kit down` ends it."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import safestage
from safestage.testing._mount import is_kit_mount


def kit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "safestage", "kit", *args], capture_output=True, text=True, timeout=60
    )


def server_pids(mountpoint: Path) -> list[int]:
    """Processes whose command line names the mountpoint (the kit's FUSE server)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if os.fsencode(str(mountpoint)) in argv:
                found.append(int(entry))
    return found


def test_kit_up_keeps_a_hostile_mount_after_the_command_exits_and_kit_down_ends_it(
    tmp_path: Path, stage_root: Path
) -> None:
    mountpoint, backing = tmp_path / "hdfs", tmp_path / "backing"
    up = kit("up", "hdfs", str(mountpoint), "--backing", str(backing))
    try:
        assert up.returncode == 0, up
        assert f"mounted hdfs at {mountpoint}" in up.stdout and f"safestage kit down {mountpoint}" in up.stdout
        assert is_kit_mount(mountpoint)  # still mounted: the command has exited
        assert len(server_pids(mountpoint)) == 1
        tensors = {"w": torch.arange(12.0)}
        with pytest.raises(Exception) as plain:  # the real hostile answer: ftruncate ENOSYS
            save_file(tensors, str(mountpoint / "plain.safetensors"))
        assert os.strerror(errno.ENOSYS) in str(plain.value), plain.value
        with safestage.staged(stage_root):
            save_file(tensors, str(mountpoint / "model.safetensors"))
        assert torch.equal(load_file(str(mountpoint / "model.safetensors"))["w"], tensors["w"])
    finally:
        down = kit("down", str(mountpoint))
    assert down.returncode == 0, down
    assert down.stdout.strip() == f"unmounted {mountpoint}"
    assert not is_kit_mount(mountpoint)
    assert _server_exits(mountpoint)
    assert sorted(os.listdir(backing)) == ["model.safetensors"]  # the bytes stay in the backing dir


def _server_exits(mountpoint: Path) -> bool:
    import time

    deadline = time.monotonic() + 10
    while server_pids(mountpoint) and time.monotonic() < deadline:
        time.sleep(0.05)
    return server_pids(mountpoint) == []


def test_kit_down_of_a_directory_that_is_no_kit_mount_is_a_usage_error(tmp_path: Path) -> None:
    down = kit("down", str(tmp_path))
    assert down.returncode == 2
    assert down.stderr.startswith(f"safestage kit down: error: {tmp_path} is not a mount of the safestage kit")


def test_kit_up_of_an_unknown_mode_names_the_modes(tmp_path: Path) -> None:
    up = kit("up", "ntfs", str(tmp_path / "m"))
    assert up.returncode == 2
    assert "unknown mode 'ntfs'" in up.stderr and "hdfs" in up.stderr and "mountpoint" in up.stderr
    assert not (tmp_path / "m").exists()
