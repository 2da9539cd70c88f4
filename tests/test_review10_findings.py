"""A child forked while a background ``direct`` publish writes onto the kit's mountpoint
closes its copy of the destination descriptor at once, whatever the file is named (found
with a name ending in " (deleted)", which /proc/self/fd also shows for removed files)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest


def _write_descriptors_of(pid: int, path: Path) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != str(path):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as info:
                flags = int(info.read().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError, ValueError):
            continue
        if flags & os.O_ACCMODE != os.O_RDONLY:
            found.append(fd)
    return found


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors (deleted)"])
def test_a_child_forked_during_a_background_direct_publish_does_not_keep_the_upload_open(
    kit_mounts, shm_root, name
):
    """A DataLoader worker forked while a background publish writes the final name on an
    object-store mount: a write descriptor left open in the worker keeps the upload open
    (mountpoint-s3 then can neither finish nor remove the file). The worker closes its
    copy at once; the publish lands whole."""
    import safestage

    mount = kit_mounts["mountpoint"]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    dest = directory / name
    data = os.urandom(1 << 20) * 96  # 96 MiB: the publish takes a while on the kit
    child = 0
    try:
        with safestage.staged(shm_root, background=True) as stage:

            def write(path: str) -> None:
                with open(path, "wb") as handle:
                    handle.write(data)

            stage._save(write, dest)
            deadline = time.monotonic() + 30
            while not _write_descriptors_of(os.getpid(), dest) and time.monotonic() < deadline:
                time.sleep(0.001)
            child = os.fork()  # a DataLoader worker started while the publish writes
            if child == 0:
                code = 2  # the parent no longer held a writer: the scenario did not run
                try:
                    if _write_descriptors_of(os.getppid(), dest):
                        code = 1 if _write_descriptors_of(os.getpid(), dest) else 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(child, 0)
            child = 0
        assert [r.publish for r in stage.records] == ["direct"]
        assert dest.read_bytes() == data
        assert os.listdir(directory) == [name]
    finally:
        if child:
            os.waitpid(child, 0)
        shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)  # type: ignore[attr-defined]
    code = os.waitstatus_to_exitcode(status)
    assert code != 2, "the fork did not come while the publish was writing the final name"
    assert code == 0, f"the forked child kept a write descriptor of {dest}"
