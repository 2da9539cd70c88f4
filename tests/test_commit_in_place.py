"""safestage.commit_in_place (issue 12, the Trainer callback's core): a directory that other
writers already filled at its destination is read back and committed with a commit file
written last. Real files on disk and on the kit's hdfs and mountpoint mounts; the commit
file is checked against CRC-32s computed here from the bytes written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _support import _NESTED, _UNHASHABLE_DTYPE, assert_committed, write_checkpoint
from safetensors.torch import save_file

import safestage
from safestage import COMMIT_NAME, PublishError
from safestage._names import HOST


@pytest.mark.parametrize("kit_dir", ["hdfs", "mountpoint"], indirect=True)
def test_round_trip_on_the_kit(kit_dir: Path, root: Path) -> None:
    dest = kit_dir / "checkpoint-3"
    dest.mkdir()
    with safestage.staged(root):  # written in place, as the Trainer does with SAFESTAGE_DIR set
        expected = write_checkpoint(dest, 3, newline=False)
    manifest = safestage.commit_in_place(dest, root)
    assert_committed(dest, expected)  # digests = zlib.crc32 of the bytes written, no temp file
    assert [entry.path for entry in manifest.files] == sorted(expected)
    assert manifest.directories == ("empty",)
    assert os.listdir(root) == []  # the staged commit file is gone too
    assert safestage.latest_complete(kit_dir) == dest


def test_a_recommit_vouches_for_the_files_as_they_are_now(tmp_path: Path, root: Path) -> None:
    dest = tmp_path / "checkpoint-1"
    dest.mkdir()
    write_checkpoint(dest, 1)
    safestage.commit_in_place(dest, root)
    local = tmp_path / "local"
    local.mkdir()
    with safestage.staged(root):  # 0644, not plain safetensors 0.8's 0600 (#782)
        expected = write_checkpoint(local, 2)
    shutil.copytree(local, dest, dirs_exist_ok=True)  # rewritten in place: same names and sizes
    assert not safestage.verify(dest, deep=True).complete  # the old commit no longer matches
    safestage.commit_in_place(dest, root)
    assert_committed(dest, expected)


def _refused(dest: Path, root: Path, *fragments: str) -> PublishError:
    with pytest.raises(PublishError) as caught:
        safestage.commit_in_place(dest, root)
    error = caught.value
    for fragment in fragments:
        assert fragment in str(error), str(error)
    assert not (dest / COMMIT_NAME).exists()  # the old commit file went first
    assert [p.kind for p in safestage.verify(dest).problems] == ["no-commit"]
    assert os.listdir(root) == []
    return error


@pytest.mark.parametrize("what", ["torn-safetensors", "empty-safetensors", "torn-json", "index-names-a-missing-shard"])
def test_a_bad_file_at_the_destination_is_never_committed(tmp_path: Path, root: Path, what: str) -> None:
    dest = tmp_path / "checkpoint-1"
    dest.mkdir()
    write_checkpoint(dest, 1)
    save_file({"w": torch.ones(1000)}, str(dest / "model.safetensors"))
    safestage.commit_in_place(dest, root)  # a previous commit of the directory
    if what == "torn-safetensors":  # what a killed direct upload leaves on an object store
        os.truncate(dest / "model.safetensors", 300)
        fragment = "model.safetensors: not a complete safetensors file"
    elif what == "empty-safetensors":  # the rule staged_dir follows too (issue 18 item 7)
        os.truncate(dest / "model.safetensors", 0)
        fragment = "model.safetensors: not a complete safetensors file"
    elif what == "torn-json":  # trainer_state.json is a plain open() write
        (dest / "trainer_state.json").write_text('{"global_step": 1')
        fragment = "trainer_state.json: not valid JSON"
    else:
        index = {"metadata": {}, "weight_map": {"w": "model.safetensors", "v": "model-2.safetensors"}}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index))
        fragment = "names files that are not there: model-2.safetensors"
    error = _refused(dest, root, fragment, "No commit file was written")
    assert error.errno == errno.EBADMSG and error.step == "verify"


def test_symlinks_are_refused(tmp_path: Path, root: Path) -> None:
    dest = tmp_path / "checkpoint-1"
    dest.mkdir()
    write_checkpoint(dest, 1)
    (dest / "link.pt").symlink_to(dest / "config.json")
    assert _refused(dest, root, "is a symlink").errno == errno.EINVAL


def test_a_missing_directory_is_a_publish_error_enoent(tmp_path: Path, root: Path) -> None:
    with pytest.raises(PublishError) as caught:
        safestage.commit_in_place(tmp_path / "nope", root)
    assert caught.value.errno == errno.ENOENT


@pytest.mark.regression("issue 18 item 6: commit_in_place left a killed writer's temps in "
                        "subdirectories and logged that the dead writer may still run")
def test_temp_files_of_dead_writers_go_live_ones_stay_outside_the_commit(
    tmp_path: Path, root: Path, caplog: Any
) -> None:
    dest = tmp_path / "checkpoint-1"
    dest.mkdir()
    expected = write_checkpoint(dest, 1)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = dest / f".optimizer.pt.safestage-{HOST}-{int(gone.stdout)}-0123abcd.tmp"  # a killed rank's
    dead_below = dest / "state" / f".optimizer.pt.safestage-{HOST}-{int(gone.stdout)}-89abcdef.tmp"
    live = dest / f".model.safetensors.safestage-{HOST}-{os.getpid()}-4567cdef.tmp"  # ours: alive
    writer = dest / ".tmpAb12Cd"  # safetensors 0.8's own temp (Rust tempfile)
    for temp in (dead, dead_below, live, writer):
        temp.write_bytes(b"partial")
    with caplog.at_level("WARNING", logger="safestage"):
        manifest = safestage.commit_in_place(dest, root)
    assert not dead.exists() and not dead_below.exists() and live.exists() and writer.exists()
    assert [entry.path for entry in manifest.files] == sorted(expected)
    assert {live.name, writer.name} <= {r.getMessage().split(": ")[1].split(" is a temp")[0] for r in caplog.records}
    live_line = next(r.getMessage() for r in caplog.records if live.name in r.getMessage())
    assert f"pid {os.getpid()}, is running" in live_line, live_line  # why it stays, as clean says
    assert safestage.verify(dest, deep=True).complete


def test_import_safestage_stays_light() -> None:
    code = (
        "import sys, safestage; safestage.commit_in_place; "
        "assert not {'transformers', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "SAFESTAGE": "0"})


@pytest.mark.regression("0.1 hostile review 3: commit in place refuses a hostile file with publish error naming it")
@pytest.mark.parametrize(
    "name, payload",
    [
        ("model.safetensors", struct.pack("<Q", len(_UNHASHABLE_DTYPE)) + _UNHASHABLE_DTYPE + b"\0" * 4000),
        ("model.safetensors", struct.pack("<Q", len(_NESTED)) + _NESTED),
        ("trainer_state.json", b"[" * 5000 + b"]" * 5000),
    ],
    ids=["shard-list-dtype", "shard-nested-header", "nested-json"],
)
def test_commit_in_place_refuses_a_hostile_file_with_publish_error_naming_it(
    tmp_path: Path, root: Path, name: str, payload: bytes
) -> None:
    """README: "A checkpoint whose read-back finds a problem raises PublishError (EBADMSG,
    step="verify")" naming it. These files raise TypeError / RecursionError out of
    commit_in_place (and so out of CommitCallback.on_save): no errno, no path, and a
    caller that catches PublishError (OSError) to retry the save does not catch it."""
    directory = tmp_path / "checkpoint-1"
    directory.mkdir()
    save_file({"v": torch.ones(8)}, str(directory / "other.safetensors"))
    (directory / name).write_bytes(payload)
    with pytest.raises(PublishError) as caught:
        safestage.commit_in_place(directory, root)
    assert caught.value.errno == errno.EBADMSG and caught.value.step == "verify"
    assert name in str(caught.value)
    assert not (directory / COMMIT_NAME).exists()
    assert os.listdir(root) == []


@pytest.mark.regression("issue 30 review: commit_in_place of a directory holding no file (none, or only empty "
                        "subdirectories) committed an empty checkpoint, which latest_complete named as the newest")
@pytest.mark.parametrize("what", ["nothing", "an-empty-directory", "files-gone-since-its-last-commit"])
def test_a_directory_holding_no_file_is_never_committed_in_place(tmp_path: Path, root: Path, what: str) -> None:
    run = tmp_path / "run"
    (run / "checkpoint-1").mkdir(parents=True)
    write_checkpoint(run / "checkpoint-1", 1)
    safestage.commit_in_place(run / "checkpoint-1", root)
    dest = run / "checkpoint-2"
    dest.mkdir()
    if what == "an-empty-directory":
        (dest / "optimizer").mkdir()
    elif what == "files-gone-since-its-last-commit":
        (dest / "model.bin").write_bytes(b"2")
        safestage.commit_in_place(dest, root)
        (dest / "model.bin").unlink()

    error = _refused(dest, root, f"{dest} holds no file", "No commit file was written")
    assert error.errno == errno.ENOENT and error.step == "verify"
    assert safestage.latest_complete(run) == run / "checkpoint-1"
