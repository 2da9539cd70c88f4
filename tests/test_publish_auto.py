"""publish="auto": the per-destination choice between replace and direct (the rename probe, its warning), and that probing leaves nothing behind."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _support import arange_tensors, listing, loads_equal
from safetensors.torch import save_file

import safestage
from safestage import PublishError


def test_auto_downgrade_warns_once_per_device(kit_mounts, stage_root, tensors, caplog):
    from safestage._mounts import capabilities

    capabilities.clear()
    directory = Path(kit_mounts["mountpoint"].path) / f"w-{os.getpid()}"
    directory.mkdir()
    with caplog.at_level(logging.WARNING, logger="safestage"), safestage.staged(stage_root) as stage:
        for index in range(3):
            save_file(tensors, str(directory / f"s{index}.safetensors"))
    warnings = [r for r in caplog.records if "cannot rename" in r.getMessage()]
    assert len(warnings) == 1
    assert [r.publish for r in stage.records] == ["direct"] * 3
    assert listing(directory) == ["s0.safetensors", "s1.safetensors", "s2.safetensors"]


STICKY = """
    import json, logging, sys, torch, safestage
    from safetensors.torch import save_file
    theirs, mine, root = sys.argv[1], sys.argv[2], sys.argv[3]
    records = []
    logging.basicConfig(level=logging.WARNING)
    with safestage.staged(root) as stage:
        try:
            save_file({"w": torch.zeros(8)}, theirs)
            first = "saved"
        except OSError as exc:
            first = exc.errno
        save_file({"w": torch.ones(8)}, mine)
    print(json.dumps({"first": first, "strategies": [r.publish for r in stage.records]}))
"""


@pytest.mark.slow
@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a colleagues file in a sticky directory does not make the disk direct")
def test_a_colleagues_file_in_a_sticky_directory_does_not_make_the_disk_direct(tmp_path, shm_root):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    os.chmod(shared, 0o1777)
    os.chown(shared, 4243, 4243)  # a shared directory (/tmp-like) that is not ours
    theirs = shared / "colleague.safetensors"
    save_file(arange_tensors(9), str(theirs))
    os.chmod(theirs, 0o666)  # writable by all: only the sticky bit stops a rename over it
    os.chown(theirs, 4242, 4242)
    mine = tmp_path / "mine"
    mine.mkdir()
    # Root ignores the sticky bit (CAP_FOWNER): drop that capability, as a normal user lacks it.
    done = subprocess.run(
        ["setpriv", "--bounding-set=-fowner", "--inh-caps=-fowner", sys.executable, "-c",
         textwrap.dedent(STICKY), str(theirs), str(mine / "own.safetensors"), str(shm_root)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["first"] == errno.EPERM, "a plain save fails EPERM here: so must a staged one"
    assert loads_equal(theirs, arange_tensors(9)), "the colleague's file was overwritten in place"
    assert report["strategies"] == ["replace"], report
    assert "cannot rename" not in done.stderr


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): the rename probe leaves nothing")
@pytest.mark.parametrize("mode", ["close-eio", "mountpoint", "hdfs"])
def test_the_rename_probe_leaves_nothing(mount_dir, stage_root, mode):
    from safestage._mounts import capabilities

    capabilities.clear()
    directory, _ = mount_dir(mode)
    for index in range(3):
        try:
            with safestage.staged(stage_root):
                save_file(arange_tensors(index), str(directory / f"m{index}.safetensors"))
        except PublishError:
            assert mode == "close-eio"
    expected = [] if mode == "close-eio" else [f"m{i}.safetensors" for i in range(3)]
    assert listing(directory) == expected
