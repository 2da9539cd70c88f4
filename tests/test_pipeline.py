"""Background publishing, skip_local_disk=True, and staged_file() for writers other than safetensors."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import safestage
from safestage import PublishError, StagingError
from safestage._background import publisher
from safestage.testing import hostile_mount


@pytest.fixture(scope="module")
def slow_mount(tmp_path_factory):
    """20 MB/s: an 8 MB shard takes ~0.4 s to publish, long enough to observe the pipeline."""
    with hostile_mount("slow", tmp_path_factory.mktemp("slow20") / "mnt", mbps=20) as mount:
        yield mount


def shard(index: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2 * 1024 * 1024,), float(index))}  # 8 MiB


def test_background_returns_before_publish_and_block_end_waits(slow_mount, stage_root):
    directory = Path(slow_mount.path) / f"bg-{os.getpid()}"
    directory.mkdir()
    with safestage.staged(stage_root, background=2) as stage:
        save_file(shard(0), str(directory / "s0.safetensors"))
        assert not (directory / "s0.safetensors").exists(), "save_file waited for the publish"
        for index in (1, 2, 3):
            save_file(shard(index), str(directory / f"s{index}.safetensors"))
            assert publisher().pending() <= 2
    assert publisher().pending() == 0
    assert sorted(os.listdir(directory)) == [f"s{i}.safetensors" for i in range(4)]
    for index in range(4):
        assert torch.equal(load_file(str(directory / f"s{index}.safetensors"))["w"], shard(index)["w"])
    assert sorted(r.destination.name for r in stage.records) == [f"s{i}.safetensors" for i in range(4)]
    assert os.listdir(stage_root) == []


def test_background_same_destination_keeps_order(tmp_path, shm_root):
    dest = tmp_path / "same.safetensors"
    with safestage.staged(shm_root, background=4):
        for index in range(5):
            save_file(shard(index), str(dest))
    assert torch.equal(load_file(str(dest))["w"], shard(4)["w"])
    assert os.listdir(tmp_path) == ["same.safetensors"]


def test_background_failure_raises_at_block_end_and_is_logged(kit_mounts, stage_root, caplog):
    directory = Path(kit_mounts["close-eio"].path) / f"bgerr-{os.getpid()}"
    directory.mkdir()
    with caplog.at_level(logging.ERROR, logger="safestage"):
        with pytest.raises(PublishError) as info, safestage.staged(stage_root, background=True):
            save_file(shard(1), str(directory / "bad.safetensors"))
    assert info.value.errno == errno.EIO
    assert any("background publish" in r.getMessage() for r in caplog.records)
    assert torch.equal(load_file(info.value.staged_path)["w"], shard(1)["w"])


def test_wait_raises_the_first_error(kit_mounts, stage_root):
    directory = Path(kit_mounts["close-eio"].path) / f"wait-{os.getpid()}"
    directory.mkdir()
    handle = safestage.activate(stage_root, background=True)
    try:
        save_file(shard(2), str(directory / "bad.safetensors"))
        with pytest.raises(PublishError):
            safestage.wait()
    finally:
        handle.close()  # already observed by wait(): nothing more to raise


def test_background_from_the_environment(tmp_path, shm_root):
    import subprocess
    import sys

    code = (
        "import torch; from safetensors.torch import save_file, load_file\n"
        f"save_file({{'w': torch.ones(1000)}}, {str(tmp_path / 'env.safetensors')!r})\n"
        "# interpreter exit must complete the pending publish\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env.update(SAFESTAGE_DIR=str(shm_root), SAFESTAGE_BACKGROUND="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert torch.equal(load_file(str(tmp_path / "env.safetensors"))["w"], torch.ones(1000))


SAVES_IN_A_LATE_ATEXIT_HANDLER = """
import atexit, sys, torch
from safetensors.torch import save_file

def last_checkpoint():  # registered before import safestage: runs after safestage's exit wait
    save_file({"w": torch.full((4 << 20,), 3.0)}, sys.argv[1])  # 16 MiB: ~0.8 s at 20 MB/s

atexit.register(last_checkpoint)
import safestage
safestage.activate(sys.argv[2], background=True)
"""


def test_a_background_save_made_after_the_exit_wait_publishes_before_it_returns(slow_mount, shm_root):
    """At interpreter exit pending publishes are completed: a save from an atexit handler
    that runs after safestage's own exit wait (one registered before ``import safestage``)
    has nobody left to wait for a worker, so it publishes in the saving thread."""
    import subprocess
    import sys

    dest = Path(slow_mount.path) / f"late-{os.getpid()}.safetensors"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    result = subprocess.run([sys.executable, "-c", SAVES_IN_A_LATE_ATEXIT_HANDLER, str(dest), str(shm_root)],
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert torch.equal(load_file(str(dest))["w"], torch.full((4 << 20,), 3.0))


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


def test_staged_file_torch_save_onto_mountpoint(kit_mounts, stage_root):
    directory = Path(kit_mounts["mountpoint"].path) / f"sf-{os.getpid()}"
    directory.mkdir()
    state = {"step": 7, "momentum": torch.randn(100)}
    with safestage.staged_file(directory / "optimizer.pt", stage_root) as local:
        assert local.parent.parent == stage_root
        torch.save(state, local)
    back = torch.load(directory / "optimizer.pt")
    assert back["step"] == 7 and torch.equal(back["momentum"], state["momentum"])
    assert "optimizer.pt" in os.listdir(directory)
    assert os.listdir(stage_root) == []


def test_staged_file_across_devices(tmp_path, shm_root):
    dest = tmp_path / "tokenizer.json"
    with safestage.staged_file(dest, shm_root) as local:
        local.write_text('{"vocab": 3}')
    assert dest.read_text() == '{"vocab": 3}'
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o644
    assert os.listdir(shm_root) == []


def test_staged_file_failure_publishes_nothing(tmp_path, shm_root):
    dest = tmp_path / "x.bin"
    with pytest.raises(ZeroDivisionError), safestage.staged_file(dest, shm_root) as local:
        local.write_bytes(b"partial")
        1 / 0  # noqa: B018
    assert not dest.exists() and os.listdir(shm_root) == []
    with pytest.raises(StagingError, match="nothing was written"), safestage.staged_file(dest, shm_root):
        pass
    with pytest.raises(PublishError, match="does not exist"), safestage.staged_file(tmp_path / "no" / "x", shm_root):
        pass
