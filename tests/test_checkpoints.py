"""Whole checkpoints (issue 11): staged_dir commits a directory with a commit file written
last; verify and latest_complete read it back.

Every test writes real files onto real destinations (disk, /dev/shm across devices, the
hostile FUSE kit, real rclone and s3fs mounts) and checks what a user would: the bytes at
the destination, the listing, the modes, the commit file against digests computed here
independently (zlib.crc32 of the bytes read back), what is left in the staging root.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _support import (
    _NESTED,
    _UNHASHABLE_DTYPE,
    PY,
    _env,
    assert_committed,
    files_at_once,
    seeded_tensors,
    write_checkpoint,
)
from safetensors.torch import load_file, save_file

import safestage
from safestage import COMMIT_NAME, PublishError
from safestage._names import DISPOSABLE_MARKER, HOST, KEPT_RECORD, parse_stage_dir, parse_temp_name

# -- a checkpoint, and what it must look like at the destination --------------------------------


def leftovers(root: Path) -> list[str]:
    return sorted(os.listdir(root))


# -- round trips --------------------------------------------------------------------------------


def test_round_trip_on_disk_same_filesystem_links_and_keeps_the_local_copy_whole_until_it_landed(tmp_path: Path, stage_root: Path) -> None:
    dest = tmp_path / "run" / "checkpoint-7"
    dest.parent.mkdir()
    commit = safestage.staged_dir(dest, stage_root)
    with commit as local:
        assert local.is_dir() and local.name == "checkpoint-7"
        assert local.is_relative_to(stage_root) and not dest.exists()
        expected = write_checkpoint(local, 7)
    document = assert_committed(dest, expected)
    assert document["directories"] == ["empty"] and (dest / "empty").is_dir()
    # The files are linked into place (the local copy stays whole until the commit landed);
    # the commit file, written for the occasion, is renamed.
    assert {record.publish for record in commit.records[:-1]} == {"link"}
    assert commit.records[-1].publish == "rename"
    assert commit.records[-1].destination == dest / COMMIT_NAME  # the commit file last
    assert commit.manifest is not None and len(commit.manifest.files) == len(expected)
    assert leftovers(stage_root) == []
    for name, tensor in seeded_tensors(7).items():
        assert torch.equal(load_file(str(dest / "model-00001-of-00002.safetensors"))[name], tensor)


def test_round_trip_across_devices_replaces(tmp_path: Path, shm_root: Path) -> None:
    dest = tmp_path / "checkpoint-1"
    with safestage.staged_dir(str(dest) + "/", shm_root) as local:  # str, trailing /
        expected = write_checkpoint(local, 1)
    assert_committed(dest, expected)
    assert leftovers(shm_root) == []


@pytest.mark.parametrize(
    ("kit_dir", "strategy"),
    [("hdfs", "replace"), ("mountpoint", "direct"), ("eopnotsupp", "replace"), ("objectstore", "replace")],
    indirect=["kit_dir"],
)
def test_round_trip_on_the_kit(kit_dir: Path, strategy: str, stage_root: Path) -> None:
    dest = kit_dir / "checkpoint-3"
    commit = safestage.staged_dir(dest, stage_root)
    with commit as local:
        expected = write_checkpoint(local, 3)
    assert_committed(dest, expected)
    assert {record.publish for record in commit.records} == {strategy}
    assert leftovers(stage_root) == []


# rclone holds an open for reading of a file being written for 5 s (then ENOENT), so every
# replace onto rclone stalls 5 s in _publish._TempLock.take (found by the real-matrix work,
# pinned there by a strict xfail). Until that is fixed, the rclone commits here publish all
# their files at once (files_at_once 8) to keep the suite's time down.
@pytest.mark.parametrize("real_dir", ["rclone-local", "rclone-s3", "s3fs"], indirect=True)
def test_round_trip_on_real_mounts(real_dir: Path, stage_root: Path) -> None:
    dest = real_dir / "checkpoint-5"
    with files_at_once(safestage.staged_dir(dest, stage_root), 8) as local:
        expected = write_checkpoint(local, 5, numel=1024, newline=False)
    document = assert_committed(dest, expected)
    assert document["directories"] == ["empty"]  # recreated; object stores may not keep it
    assert leftovers(stage_root) == []


@pytest.mark.parametrize("real_dir", ["rclone-s3", "s3fs"], indirect=True)
def test_a_name_the_destination_cannot_store_fails_loudly(real_dir: Path, stage_root: Path) -> None:
    """A newline in a file name: fine on POSIX (and rclone-local), refused by both S3 mounts
    here (found by this test: rclone-s3 fails the upload at close with EIO, s3fs at fsync
    with ENOENT). PublishError names it, the other file lands, no commit file is written."""
    dest = real_dir / "checkpoint-6"
    with pytest.raises(PublishError) as info, files_at_once(safestage.staged_dir(dest, stage_root), 8) as local:
        (local / "config.json").write_text("{}")
        (local / "notes\nwith newline.txt").write_text("x")
    error = info.value
    assert error.not_landed == ("notes\nwith newline.txt",) and error.landed == ("config.json",), error
    assert error.errno in (errno.EIO, errno.ENOENT)
    assert sorted(os.listdir(dest)) == ["config.json"]  # no commit file, no temp file
    assert not safestage.verify(dest).complete
    shutil.rmtree(Path(error.staged_path).parent)  # type: ignore[arg-type]


def test_recommit_replaces_files_and_commit(tmp_path: Path, shm_root: Path) -> None:
    dest = tmp_path / "checkpoint-2"
    with safestage.staged_dir(dest, shm_root) as local:
        write_checkpoint(local, 1)
        (local / "only-in-old.bin").write_bytes(b"old")
    with safestage.staged_dir(dest, shm_root) as local:
        expected = write_checkpoint(local, 2)
    # A file the new commit does not have stays (staged_dir never deletes user files), and is
    # not part of the checkpoint: verify reports it as extra, not as a problem.
    assert (dest / "only-in-old.bin").read_bytes() == b"old"
    (dest / "only-in-old.bin").unlink()
    assert_committed(dest, expected)


def test_existing_file_keeps_its_mode_new_files_follow_the_umask(tmp_path: Path, shm_root: Path) -> None:
    dest = tmp_path / "ckpt"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    os.chmod(dest / "config.json", 0o640)
    os.umask(0o027)
    with safestage.staged_dir(dest, shm_root) as local:
        (local / "config.json").write_text('{"a": 1}')
        (local / "new.bin").write_bytes(b"x")
        os.chmod(local / "new.bin", 0o600)  # the staged mode does not leak (atomicwrites' bug)
    assert stat.S_IMODE(os.stat(dest / "config.json").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(dest / "new.bin").st_mode) == 0o640


def test_empty_directories_are_recreated_but_not_required(tmp_path: Path, stage_root: Path) -> None:
    dest = tmp_path / "c"
    with safestage.staged_dir(dest, stage_root) as local:
        (local / "a" / "b").mkdir(parents=True)
        (local / "c").mkdir()
        (local / "c" / "f").write_bytes(b"f")
    assert (dest / "a" / "b").is_dir()
    manifest = json.loads((dest / COMMIT_NAME).read_text())
    assert manifest["directories"] == ["a/b"]
    shutil.rmtree(dest / "a")  # an object store keeps no empty directory
    assert safestage.verify(dest).complete


# -- safetensors saves inside the block: never staged twice ----------------------------------------


def test_saves_into_the_local_dir_are_not_staged_again_even_from_other_threads(
    tmp_path: Path, shm_root: Path, stage_root: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    with safestage.staged(shm_root) as stage, safestage.staged_dir(tmp_path / "c", stage_root) as local:
        save_file(seeded_tensors(0), str(local / "a.safetensors"))
        worker = threading.Thread(target=save_file, args=(seeded_tensors(1), str(local / "b.safetensors")))
        worker.start()
        worker.join()
        save_file(seeded_tensors(2), str(other / "elsewhere.safetensors"))  # still staged
        assert [record.destination for record in stage.records] == [other / "elsewhere.safetensors"]
    assert [record.destination for record in stage.records] == [other / "elsewhere.safetensors"]
    assert safestage.verify(tmp_path / "c", deep=True).complete
    # After the block the local directory is gone, and the exemption with it.
    from safestage import _patch

    assert _patch._unstaged_dirs == []


@pytest.mark.slow
def test_saves_into_the_local_dir_with_staging_from_the_environment(tmp_path: Path, shm_root: Path) -> None:
    script = (
        "import sys, torch, safestage\n"
        "from safetensors.torch import save_file\n"
        "assert safestage.is_active()\n"
        "with safestage.staged_dir(sys.argv[1], sys.argv[2]) as local:\n"
        "    save_file({'w': torch.ones(3)}, str(local / 'm.safetensors'))\n"
        "    assert sorted(p.name for p in local.iterdir()) == ['m.safetensors']\n"
        "assert safestage._autoload._stage.records == []\n"
    )
    env = {**os.environ, "SAFESTAGE_DIR": str(shm_root)}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c"), str(shm_root)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert safestage.verify(tmp_path / "c", deep=True).complete


# -- the block raises, the destination is bad -----------------------------------------------------


def test_a_block_that_raises_publishes_nothing_and_removes_the_local_dir(tmp_path: Path, stage_root: Path) -> None:
    dest = tmp_path / "c"
    with pytest.raises(ZeroDivisionError), safestage.staged_dir(dest, stage_root) as local:
        write_checkpoint(local)
        1 / 0  # noqa: B018
    assert not dest.exists() and leftovers(stage_root) == []


def test_a_block_that_raises_leaves_the_previous_commit_alone(tmp_path: Path, stage_root: Path) -> None:
    dest = tmp_path / "c"
    with safestage.staged_dir(dest, stage_root) as local:
        expected = write_checkpoint(local, 1)
    with pytest.raises(KeyboardInterrupt), safestage.staged_dir(dest, stage_root) as local:
        write_checkpoint(local, 2)
        raise KeyboardInterrupt
    assert_committed(dest, expected)
    assert leftovers(stage_root) == []


def test_destination_checks_before_the_block_runs(tmp_path: Path, stage_root: Path) -> None:
    (tmp_path / "file").write_text("x")
    ran = []
    with pytest.raises(PublishError) as info, safestage.staged_dir(tmp_path / "file", stage_root):
        ran.append(1)
    assert info.value.errno == errno.ENOTDIR and not ran
    with pytest.raises(PublishError) as info, safestage.staged_dir(tmp_path / "missing" / "c", stage_root):
        ran.append(1)
    assert info.value.errno == errno.ENOENT and "create it first" in str(info.value) and not ran
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(PublishError) as info, safestage.staged_dir(tmp_path / "dangling", stage_root):
        ran.append(1)
    assert info.value.errno == errno.ENOTDIR and not ran
    assert not (tmp_path / "missing").exists() and not (tmp_path / "nowhere").exists()
    assert leftovers(stage_root) == []


def test_a_destination_symlink_to_a_directory_is_followed(tmp_path: Path, stage_root: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "latest")
    with safestage.staged_dir(tmp_path / "latest", stage_root) as local:
        expected = write_checkpoint(local)
    assert (tmp_path / "latest").is_symlink()
    assert_committed(tmp_path / "real", expected)


def test_staged_dir_is_single_use(tmp_path: Path, stage_root: Path) -> None:
    commit = safestage.staged_dir(tmp_path / "c", stage_root)
    with commit as local:
        (local / "model.bin").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="already used"), commit:
        pass


# -- refused trees: nothing published, the previous commit untouched, the copy kept ---------------


REFUSED = {  # what the block leaves -> (errno, what the error must say)
    "symlink-file": (errno.EINVAL, "is a symlink: copy the file it points to instead"),
    "symlink-dir": (errno.EINVAL, "is a symlink: copy the file it points to instead"),
    "fifo": (errno.EINVAL, "is not a regular file or directory (a FIFO, socket or device)"),
    "commit-name": (errno.EINVAL, "that name is safestage's commit file, choose another"),
    "commit-name-dir": (errno.EINVAL, "that name is safestage's commit file, choose another"),
    "not-safetensors": (errno.EBADMSG, "empty.safetensors is not a complete safetensors file"),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
@pytest.mark.regression("issue 18 items 7, 9, 10, 11: a bad entry showed [Errno 22] Invalid argument, "
                        "a *.safetensors that is not one was committed, a directory named like the commit "
                        "file was accepted, and every refused commit piled up as a kept copy")
def test_a_refused_block_publishes_nothing_says_why_and_keeps_no_copy(tmp_path: Path, stage_root: Path, what: str) -> None:
    dest = tmp_path / "c"
    with safestage.staged_dir(dest, stage_root) as local:
        old = write_checkpoint(local, 1)
    with pytest.raises(PublishError) as info, safestage.staged_dir(dest, stage_root) as local:
        write_checkpoint(local, 2)
        if what == "symlink-file":
            os.symlink("/etc/passwd", local / "state" / "passwd")
        elif what == "symlink-dir":
            os.symlink("/etc", local / "etc")
        elif what == "fifo":
            os.mkfifo(local / "pipe")
        elif what == "commit-name":
            (local / COMMIT_NAME).write_text("{}")
        elif what == "commit-name-dir":
            (local / COMMIT_NAME).mkdir()
            (local / COMMIT_NAME / "x.bin").write_bytes(b"x")
        else:
            (local / "state" / "empty.safetensors").write_bytes(b"")
    error = info.value
    expected_errno, why = REFUSED[what]
    assert error.step == "scan" and error.landed == () and error.errno == expected_errno, error
    assert why in str(error) and "Errno 22" not in str(error), str(error)  # the real reason, not __cause__'s
    assert "Nothing was published" in str(error) and "previous commit" in str(error)
    assert_committed(dest, old)  # refused before the previous commit was touched
    # Refused as it is, it would be refused again: no kept copy piles up in the staging root.
    assert error.staged_path is None and leftovers(stage_root) == []
    assert "local copy was removed" in str(error), str(error)


def test_a_staged_dir_commit_of_a_safetensors_file_is_deep_verified(tmp_path: Path, stage_root: Path) -> None:
    """One rule for *.safetensors files: what staged_dir commits, verify --deep accepts."""
    with safestage.staged_dir(tmp_path / "checkpoint-1", stage_root) as local:
        write_checkpoint(local, 1)
    assert safestage.latest_complete(tmp_path, deep=True) == tmp_path / "checkpoint-1"


def _plant_file(dest: Path, relative: str, data: bytes = b"old") -> None:
    (dest / relative).parent.mkdir(parents=True, exist_ok=True)
    (dest / relative).write_bytes(data)


RECOMMIT_CONFLICTS = ["directory-where-a-file-is", "file-where-a-directory-is", "file-where-a-symlink-is",
                      "directory-where-a-symlink-is", "file-where-a-fifo-is"]  # fmt: skip


@pytest.mark.parametrize("what", RECOMMIT_CONFLICTS)
@pytest.mark.parametrize("publish", ["replace", "direct"])
@pytest.mark.regression("issue 18 item 4: a re-commit refused for a type conflict had already removed "
                        "the previous commit file (and overwritten files), and said 'Nothing was published'")
def test_a_recommit_refused_for_what_is_in_the_way_leaves_the_previous_commit_complete(
    tmp_path: Path, stage_root: Path, what: str, publish: str
) -> None:
    dest = tmp_path / "c"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.bin").write_bytes(b"keep")
    with safestage.staged_dir(dest, stage_root) as local:
        old = write_checkpoint(local, 1)
    if what == "directory-where-a-file-is":
        _plant_file(dest, "logs")
    elif what == "file-where-a-directory-is":
        _plant_file(dest, "logs/inner.txt")
    elif what == "file-where-a-symlink-is":
        os.symlink(outside / "victim.bin", dest / "logs")
    elif what == "directory-where-a-symlink-is":
        os.symlink(outside, dest / "logs")
    else:
        os.mkfifo(dest / "logs")
    with pytest.raises(PublishError) as info, safestage.staged_dir(dest, stage_root, publish=publish) as local:  # type: ignore[arg-type]
        write_checkpoint(local, 2)  # larger files than logs: published first, were it not refused
        if what.startswith("directory"):
            (local / "logs").mkdir()
            (local / "logs" / "run.txt").write_text("new")
        else:
            (local / "logs").write_text("new")
    error = info.value
    assert error.landed == () and str(dest / "logs") in str(error), str(error)
    assert "Nothing was published" in str(error) and "previous commit" in str(error) and "untouched" in str(error)
    assert (outside / "victim.bin").read_bytes() == b"keep" and os.listdir(outside) == ["victim.bin"]
    result = safestage.verify(dest, deep=True)
    assert result.complete, result.problems  # the previous commit still vouches for its files
    for relative, data in old.items():
        assert (dest / relative).read_bytes() == data, relative
    assert error.staged_path is None and leftovers(stage_root) == []


@pytest.mark.regression("issue 18 item 4: an error found after the previous commit file was removed "
                        "must say so")
def test_an_error_after_the_previous_commit_was_removed_says_so(tmp_path: Path, stage_root: Path) -> None:
    dest = tmp_path / "c"
    with safestage.staged_dir(dest, stage_root) as local:
        write_checkpoint(local, 1)
    subprocess.run(["chattr", "+i", str(dest / "state")], check=True)  # nothing can be made in it
    try:
        with pytest.raises(PublishError) as info, safestage.staged_dir(dest, stage_root) as local:
            write_checkpoint(local, 2)
            (local / "state" / "sub").mkdir()
    finally:
        subprocess.run(["chattr", "-i", str(dest / "state")], check=True)
    error = info.value
    assert error.step == "mkdir" and error.errno == errno.EPERM, error
    assert "previous commit file was removed" in str(error) and "not complete" in str(error), str(error)
    assert not safestage.verify(dest).complete
    shutil.rmtree(Path(error.staged_path).parent)  # type: ignore[arg-type]


def test_nested_commit_name_is_an_ordinary_file(tmp_path: Path, stage_root: Path) -> None:
    with safestage.staged_dir(tmp_path / "c", stage_root) as local:
        (local / "inner").mkdir()
        (local / "inner" / COMMIT_NAME).write_text("not ours")
        expected = {f"inner/{COMMIT_NAME}": b"not ours"}
    assert_committed(tmp_path / "c", expected)


def test_symlinks_at_the_destination_are_never_written_through(tmp_path: Path, stage_root: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.bin").write_bytes(b"keep")
    dest = tmp_path / "c"
    dest.mkdir()
    os.symlink(outside, dest / "sub")  # where the checkpoint has a directory
    with pytest.raises(PublishError) as info, safestage.staged_dir(dest, stage_root, publish="direct") as local:
        (local / "sub").mkdir()
        (local / "sub" / "victim.bin").write_bytes(b"overwrite")
    assert info.value.step == "inspect" and "symlink" in str(info.value)
    assert (outside / "victim.bin").read_bytes() == b"keep"
    os.unlink(dest / "sub")
    os.symlink(outside / "victim.bin", dest / "victim.bin")  # where the checkpoint has a file
    with pytest.raises(PublishError) as info, safestage.staged_dir(dest, stage_root, publish="direct") as local:
        (local / "victim.bin").write_bytes(b"overwrite")
        (local / "ok.bin").write_bytes(b"ok")
    assert info.value.step == "inspect" and info.value.landed == ()  # found before anything landed
    assert "victim.bin" in (info.value.not_landed or ())
    assert (outside / "victim.bin").read_bytes() == b"keep"
    assert not (dest / COMMIT_NAME).exists()


# -- publish failures: which files landed, no commit file, the copy kept ---------------------------


def test_a_failed_file_names_what_landed_and_keeps_the_rest(tmp_path: Path, shm_root: Path) -> None:
    dest = tmp_path / "c"
    with safestage.staged_dir(dest, shm_root) as local:
        write_checkpoint(local, 1)
    subprocess.run(["chattr", "+i", str(dest / "state")], check=True)  # its files cannot land
    try:
        with pytest.raises(PublishError) as info, files_at_once(safestage.staged_dir(dest, shm_root), 1) as local:
            expected = write_checkpoint(local, 2)
    finally:
        subprocess.run(["chattr", "-i", str(dest / "state")], check=True)
    error = info.value
    assert error.not_landed is not None and "state/optimizer.pt" in error.not_landed
    assert error.landed is not None and set(error.landed) | set(error.not_landed) == set(expected)
    assert error.errno == errno.EPERM
    assert f"{len(error.landed)} of {len(expected)} files landed" in str(error)
    assert "previous commit file was removed" in str(error)
    # The old commit file went first: the mix of old and new files is not "complete".
    assert not (dest / COMMIT_NAME).exists()
    result = safestage.verify(dest)
    assert not result.complete and result.problems[0].kind == "no-commit"
    kept = Path(error.staged_path)  # type: ignore[arg-type]
    for relative in error.not_landed:
        assert (kept / relative).read_bytes() == expected[relative]  # kept, complete
    for relative in error.landed:
        assert (dest / relative).read_bytes() == expected[relative]
    assert pickle.loads(pickle.dumps(error)).landed == error.landed
    # The kept copy says what it is for (`safestage recover` reads it), and clean shows it.
    record = json.loads((kept.parent / KEPT_RECORD).read_bytes())
    assert record["destination"] == str(dest) and record["local"] == kept.name
    assert record["left"] == sorted(error.not_landed) and record["landed"] == sorted(error.landed)
    assert record["commit_file"] is True
    # Kept while it holds the only copy: a sweep of the root leaves it alone.
    (entry,) = _clean_json(shm_root)["entries"]
    assert entry["action"] == "kept" and entry["destination"] == str(dest), entry
    done = cli("clean", str(shm_root))
    assert f"a copy for {dest}" in done.stdout, done.stdout


def test_upload_failing_at_close(kit_mounts: dict[str, Any], stage_root: Path) -> None:
    """close-eio: every upload fails at close(). Nothing lands, no commit file, all kept."""
    dest = Path(kit_mounts["close-eio"].path) / f"c-{uuid.uuid4().hex[:8]}"
    with pytest.raises(PublishError) as info, safestage.staged_dir(dest, stage_root) as local:
        expected = write_checkpoint(local)
    assert info.value.errno == errno.EIO and info.value.landed == ()
    assert sorted(info.value.not_landed or ()) == sorted(expected)
    assert kit_mounts["close-eio"].faults()["flush"] > 0  # the fault really fired
    assert sorted(os.listdir(dest)) == ["empty", "state"]
    kept = Path(info.value.staged_path)  # type: ignore[arg-type]
    assert {str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file()} == set(expected)
    shutil.rmtree(kept.parent)


def test_destination_full(small_tmpfs: Path, shm_root: Path) -> None:
    dest = small_tmpfs / "c"
    with pytest.raises(PublishError) as info, files_at_once(safestage.staged_dir(dest, shm_root), 1) as local:
        (local / "big.bin").write_bytes(os.urandom(3 << 20))  # largest: published first, fails
        (local / "small.bin").write_bytes(b"s")
    assert info.value.errno == errno.ENOSPC
    assert info.value.landed == () and info.value.not_landed == ("big.bin", "small.bin")
    assert sorted(os.listdir(dest)) == []  # after a failure no other file starts; no temp left
    shutil.rmtree(Path(info.value.staged_path).parent)  # type: ignore[arg-type]


def test_the_commit_file_itself_does_not_fit(small_tmpfs: Path, shm_root: Path) -> None:
    """Every data file lands and fills the destination to the last page: the commit file's
    write fails (ENOSPC). The checkpoint is not complete, the error says all files landed."""
    dest = small_tmpfs / "c"
    dest.mkdir()
    info = os.statvfs(dest)
    free = info.f_bavail * info.f_frsize
    with pytest.raises(PublishError) as error, safestage.staged_dir(dest, shm_root) as local:
        (local / "a.bin").write_bytes(os.urandom(free - 8192))
        (local / "b.bin").write_bytes(os.urandom(8192))
    assert error.value.step == "commit" and error.value.errno == errno.ENOSPC
    assert error.value.landed == ("a.bin", "b.bin") and error.value.not_landed == ()
    assert "all 2 files landed" in str(error.value)
    assert sorted(os.listdir(dest)) == ["a.bin", "b.bin"]  # no commit file, no temp
    assert not safestage.verify(dest).complete
    shutil.rmtree(Path(error.value.staged_path).parent)  # type: ignore[arg-type]


def test_read_only_destination(small_tmpfs: Path, shm_root: Path) -> None:
    (small_tmpfs / "c").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    for dest in (small_tmpfs / "c", small_tmpfs / "new"):
        with pytest.raises(PublishError) as info, safestage.staged_dir(dest, shm_root) as local:
            (local / "a.bin").write_bytes(b"a")
        assert info.value.errno == errno.EROFS, info.value
        assert info.value.landed == () and "a.bin" in (info.value.not_landed or ())
        shutil.rmtree(Path(info.value.staged_path).parent)  # type: ignore[arg-type]
    assert os.listdir(small_tmpfs) == ["c"] and os.listdir(small_tmpfs / "c") == []


def test_commit_file_cannot_be_removed(tmp_path: Path, shm_root: Path) -> None:
    dest = tmp_path / "c"
    with safestage.staged_dir(dest, shm_root) as local:
        old = write_checkpoint(local, 1)
    subprocess.run(["chattr", "+i", str(dest / COMMIT_NAME)], check=True)
    try:
        with pytest.raises(PublishError) as info, safestage.staged_dir(dest, shm_root) as local:
            write_checkpoint(local, 2)
        assert info.value.step == "invalidate" and info.value.landed == ()
        assert "could not remove the previous commit file" in str(info.value)
    finally:
        subprocess.run(["chattr", "-i", str(dest / COMMIT_NAME)], check=True)
    assert_committed(dest, old)
    shutil.rmtree(Path(info.value.staged_path).parent)  # type: ignore[arg-type]


# -- verify ---------------------------------------------------------------------------------------


@pytest.fixture
def committed(tmp_path: Path, stage_root: Path) -> tuple[Path, dict[str, bytes]]:
    dest = tmp_path / "checkpoint-1"
    with safestage.staged_dir(dest, stage_root) as local:
        expected = write_checkpoint(local, 1)
    return dest, expected


def kinds(path: Path, deep: bool = False) -> list[tuple[str, str]]:
    return [(problem.path, problem.kind) for problem in safestage.verify(path, deep=deep).problems]


def test_verify_finds_missing_and_resized_files(committed: tuple[Path, dict[str, bytes]]) -> None:
    dest, _ = committed
    os.unlink(dest / "state" / "optimizer.pt")
    with open(dest / "config.json", "a") as handle:
        handle.write(" ")
    assert kinds(dest) == [("config.json", "size"), ("state/optimizer.pt", "missing")]
    assert not safestage.verify(dest).complete


def test_deep_verify_finds_same_size_other_content(committed: tuple[Path, dict[str, bytes]]) -> None:
    dest, _ = committed
    shard = dest / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert kinds(dest) == []  # sizes match: the cheap check cannot see it
    assert kinds(dest, deep=True) == [("model-00002-of-00002.safetensors", "digest")]


def test_deep_verify_checks_safetensors_headers(tmp_path: Path, stage_root: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file(seeded_tensors(0), str(good))
    data = good.read_bytes()
    (length,) = __import__("struct").unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    cases = {
        "short.safetensors": data[:4],
        "truncated.safetensors": data[:-10],  # the tensors announce more data than there is
        "padded.safetensors": data + b"\0" * 8,
        "garbage.safetensors": data[:8] + b"x" * length + data[8 + length :],
    }
    header["w"]["data_offsets"][1] += 4  # overlaps the next tensor
    raw = json.dumps(header).encode().ljust(length)
    cases["overlap.safetensors"] = data[:8] + raw + data[8 + length :]
    # staged_dir and commit_in_place refuse such files: a commit file written here vouches for them.
    from safestage.checkpoint._manifest import FileEntry, new_manifest

    (tmp_path / "c").mkdir()
    cases_and_good = {**cases, "good.safetensors": data}
    for name, content in cases_and_good.items():
        (tmp_path / "c" / name).write_bytes(content)
    entries = [FileEntry(name, len(content), f"{zlib.crc32(content):08x}") for name, content in sorted(cases_and_good.items())]
    (tmp_path / "c" / COMMIT_NAME).write_bytes(new_manifest(entries, [], "test").encode())
    found = dict(kinds(tmp_path / "c", deep=True))
    assert found == dict.fromkeys(cases, "safetensors"), safestage.verify(tmp_path / "c", deep=True).problems


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32", "files": [', "not valid JSON"),
        (b"{}", "not a safestage commit file"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32", "files": [{"path": "../x", "size": 1, "digest": "00000000"}]}', "'..'"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32", "files": [{"path": "/etc/passwd", "size": 1, "digest": "00000000"}]}', "absolute"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32", "files": [{"path": "a//b", "size": 1, "digest": "00000000"}]}', "empty"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "sha1", "files": []}', "unknown digest"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32", "files": [{"path": "a", "size": -1, "digest": "00000000"}]}', "bad size"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32", "files": [{"path": "a", "size": 1, "digest": "00000000"}, {"path": "a", "size": 1, "digest": "00000000"}]}', "listed twice"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32", "files": [{"path": "_SAFESTAGE_COMMIT.json", "size": 1, "digest": "00000000"}]}', "commit file itself"),
        (b'{"format": "safestage.commit", "version": 1, "digest": "crc32"}', "not a list"),
    ],
)
def test_a_commit_file_that_cannot_be_trusted(tmp_path: Path, content: bytes, why: str) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / COMMIT_NAME).write_bytes(content)
    result = safestage.verify(tmp_path / "c", deep=True)
    assert not result.complete and [p.kind for p in result.problems] == ["bad-commit"]
    assert why in result.problems[0].message


def test_verify_never_follows_a_symlink_inside_the_checkpoint(committed: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    dest, _ = committed
    elsewhere = tmp_path / "elsewhere"
    os.replace(dest / "state", elsewhere)
    os.symlink(elsewhere, dest / "state")
    assert kinds(dest) == [("state/optimizer.pt", "unsafe-path"), ("state/scaler.pt", "unsafe-path")]
    shutil.copyfile(dest / "config.json", tmp_path / "config.json")
    os.unlink(dest / "config.json")
    os.symlink(tmp_path / "config.json", dest / "config.json")
    assert ("config.json", "not-a-file") in kinds(dest)
    os.unlink(dest / COMMIT_NAME)
    os.symlink(tmp_path / "config.json", dest / COMMIT_NAME)
    assert kinds(dest) == [(COMMIT_NAME, "bad-commit")]


def test_verify_of_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    assert kinds(tmp_path / "missing") == [("", "not-a-directory")]
    (tmp_path / "file").write_text("x")
    assert kinds(tmp_path / "file") == [("", "not-a-directory")]
    assert kinds(tmp_path) == [("", "no-commit")]


def test_deep_verify_reports_extra_files(committed: tuple[Path, dict[str, bytes]]) -> None:
    dest, _ = committed
    (dest / "model-00003-of-00003.safetensors").write_bytes(b"an older save's shard")
    result = safestage.verify(dest, deep=True)
    assert result.complete and result.extra == ["model-00003-of-00003.safetensors"]


# -- latest_complete -------------------------------------------------------------------------------


def commit_tiny(dest: Path, root: Path, content: bytes = b"x") -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_bytes(content)


def test_latest_complete_orders_by_step_number_then_commit_time_and_takes_step_numbered_names_only(tmp_path: Path, stage_root: Path) -> None:
    parent = tmp_path / "run"
    parent.mkdir()
    assert safestage.latest_complete(parent) is None
    for step in (9, 10, 100):
        commit_tiny(parent / f"checkpoint-{step}", stage_root)
    assert safestage.latest_complete(parent) == parent / "checkpoint-100"  # 100 > 10 > 9, not text order
    os.unlink(parent / "checkpoint-100" / "model.bin")  # incomplete now
    (parent / "checkpoint-200").mkdir()  # never committed
    (parent / "checkpoint-300").write_text("a file")
    (parent / "other-999").mkdir()
    assert safestage.latest_complete(str(parent)) == parent / "checkpoint-10"
    assert safestage.latest_complete(parent, "other-*") is None
    # The last * of the pattern is the step number: a merged export beside a training checkpoint
    # is no candidate of checkpoint-* (transformers' get_last_checkpoint rule), even committed last.
    commit_tiny(parent / "checkpoint-10-merged", stage_root)
    commit_tiny(parent / "checkpoint-final", stage_root)
    assert safestage.latest_complete(parent) == parent / "checkpoint-10"
    # Two names with the same step (a pattern whose first * takes any prefix): the later commit wins.
    commit_tiny(parent / "b-checkpoint-10", stage_root)
    os.utime(parent / "checkpoint-10" / COMMIT_NAME, (1, 1))
    assert safestage.latest_complete(parent, "*checkpoint-*") == parent / "b-checkpoint-10"
    os.utime(parent / "b-checkpoint-10" / COMMIT_NAME, (0, 0))
    assert safestage.latest_complete(parent, "*checkpoint-*") == parent / "checkpoint-10"
    # Deep rejects a same-size corruption.
    (parent / "checkpoint-10" / "model.bin").write_bytes(b"y")
    assert safestage.latest_complete(parent, "*checkpoint-*") == parent / "checkpoint-10"
    assert safestage.latest_complete(parent, "*checkpoint-*", deep=True) == parent / "b-checkpoint-10"
    assert safestage.latest_complete(parent, "step_*") is None
    with pytest.raises(FileNotFoundError):  # an unmounted run directory is not "no checkpoint"
        safestage.latest_complete(tmp_path / "not-mounted")


def _make_many(backing: Path, count: int, complete: set[int]) -> None:
    """``count`` checkpoint directories written straight into a mount's backing directory
    (fast), each with 4 files; only the steps in ``complete`` carry a commit file."""
    files = {f"model-0000{i}-of-00004.safetensors": b"s" * (100 + i) for i in range(1, 5)}
    manifest = {
        "format": "safestage.commit", "version": 1, "digest": "crc32", "directories": [],
        "files": [{"path": k, "size": len(v), "digest": f"{zlib.crc32(v):08x}"} for k, v in sorted(files.items())],
    }  # fmt: skip
    for step in range(count):
        directory = backing / f"checkpoint-{step * 50}"
        directory.mkdir()
        for name, data in files.items():
            (directory / name).write_bytes(data)
        if step in complete:
            (directory / COMMIT_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize("mode", ["hdfs", "rclone-local"])
def test_latest_complete_among_1000_on_fuse_is_fast(mode: str, kit_mounts: dict[str, Any], real_mounts: dict[str, Any]) -> None:
    """The newest 20 were never committed (a job preempted 20 times): latest_complete lists the
    parent once, opens 21 commit files and stats 4 files. The speed goal (< 1 s) is measured
    in benchmarks/checkpoint.py; here a generous bound catches a pathology (reading every
    checkpoint)."""
    mount = kit_mounts[mode] if mode in kit_mounts else real_mounts[mode]
    name = f"many-{uuid.uuid4().hex[:8]}"
    (Path(mount.path) / name).mkdir()  # through the mount (rclone caches listings it has made)
    backing = Path(mount.backing) / name
    try:
        _make_many(backing, 1000, complete=set(range(0, 980)))
        parent = Path(mount.path) / name
        started = time.perf_counter()
        found = safestage.latest_complete(parent)
        seconds = time.perf_counter() - started
        assert found == parent / "checkpoint-48950"
        assert seconds < 5, f"latest_complete took {seconds:.2f} s over 1000 checkpoints on {mode}"
    finally:
        shutil.rmtree(backing)


# -- the command line ------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "safestage", *args], capture_output=True, text=True, timeout=60)


def _clean_json(directory: Path) -> dict[str, Any]:
    done = cli("clean", "--json", str(directory))
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_cli_verify_and_latest(committed: tuple[Path, dict[str, bytes]]) -> None:
    dest, expected = committed
    done = cli("verify", str(dest))
    assert done.returncode == 0 and "complete: 8 files" in done.stdout, done
    done = cli("verify", "--deep", "--json", str(dest))
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["complete"] and report["bytes_read"] == sum(map(len, expected.values()))
    os.unlink(dest / "config.json")
    done = cli("verify", str(dest))
    assert done.returncode == 1 and "config.json: missing" in done.stdout
    done = cli("verify", "--json", str(dest.parent / "nope"))
    assert done.returncode == 1 and json.loads(done.stdout)["problems"][0]["kind"] == "not-a-directory"

    done = cli("latest", str(dest.parent))
    assert done.returncode == 1 and "no complete checkpoint" in done.stderr
    commit_tiny(dest.parent / "step_0005", dest.parent / "stage-root")
    done = cli("latest", str(dest.parent), "--pattern", "step_*")
    assert done.returncode == 0 and done.stdout == f"{dest.parent / 'step_0005'}\n"
    assert cli("latest", str(dest.parent / "nope")).returncode == 2


# -- the staging root: what sweeps and `safestage clean` do with a staged_dir ----------------------


_KILLED_WRITER = """
import os, signal, sys, safestage
with safestage.staged_dir(sys.argv[1], sys.argv[2]) as local:
    (local / "half-written.bin").write_bytes(b"x" * 100)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_in_the_block_leaves_a_disposable_directory(tmp_path: Path, stage_root: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "c"), str(stage_root)], timeout=60)
    assert done.returncode == -9
    (name,) = os.listdir(stage_root)
    assert parse_stage_dir(name) is not None
    assert (stage_root / name / DISPOSABLE_MARKER).exists()
    report = _clean_json(stage_root)
    assert [entry["action"] for entry in report["entries"]] == ["removed"], report
    assert leftovers(stage_root) == [] and not (tmp_path / "c").exists()


_KILLED_COMMIT = """
import os, sys, safestage
with safestage.staged_dir(sys.argv[1], sys.argv[2], publish="replace") as local:
    (local / "shards").mkdir()
    (local / "shards" / "s0.bin").write_bytes(os.urandom(12 << 20))
    (local / "top.bin").write_bytes(os.urandom(12 << 20))
"""


def _kill_while_publishing(dest: Path, root: Path) -> list[Path]:
    """SIGKILL a commit of ``dest`` once both of its files are publishing; their temps."""
    child = subprocess.Popen([sys.executable, "-c", _KILLED_COMMIT, str(dest), str(root)])
    temps: list[Path] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            temps = [
                directory / name
                for directory in (dest, dest / "shards")
                if directory.is_dir()
                for name in os.listdir(directory)
                if parse_temp_name(name) is not None
            ]
            if len(temps) == 2:
                child.kill()
                break
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -9 and len(temps) == 2, (child.returncode, temps)
    assert {temp.parent for temp in temps} == {dest, dest / "shards"}
    return temps


@pytest.mark.mounts
@pytest.mark.regression("issue 18 item 6: a SIGKILLed commit's temp files in subdirectories were never "
                        "removed, and a later successful re-commit left its top-level temp too")
def test_a_killed_commits_temps_go_with_clean_the_next_commit_and_commit_in_place(tmp_path: Path, caplog: Any) -> None:
    from safestage.testing import hostile_mount

    root = tmp_path / "root"
    root.mkdir()
    with hostile_mount("slow", tmp_path / "mnt", mbps=20) as mount:
        run = Path(mount.path) / "run"
        run.mkdir()
        dest = run / "checkpoint-1"
        live = run / f".notes.safestage-{HOST}-{os.getpid()}-0123abcd.tmp"  # a live writer's: stays
        live.write_bytes(b"partial")
        # `safestage clean` on the run directory: into every checkpoint, temps of dead owners only.
        temps = _kill_while_publishing(dest, root)
        report = _clean_json(run)
        removed = sorted(entry["name"] for entry in report["entries"] if entry["action"] == "removed")
        assert removed == sorted(str(temp.relative_to(run)) for temp in temps), report
        assert [e["name"] for e in report["entries"] if e["action"] == "kept"] == [live.name], report
        assert not any(temp.exists() for temp in temps) and live.exists()
        # On the checkpoint directory itself, likewise.
        temps = _kill_while_publishing(dest, root)
        removed = [e["name"] for e in _clean_json(dest)["entries"] if e["action"] == "removed"]
        assert sorted(removed) == sorted(str(temp.relative_to(dest)) for temp in temps)
        # The next successful commit of that destination removes them too.
        temps = _kill_while_publishing(dest, root)
        with safestage.staged_dir(dest, root) as local:
            (local / "shards").mkdir()
            (local / "shards" / "s0.bin").write_bytes(b"new")
        assert not any(temp.exists() for temp in temps)
        assert safestage.verify(dest, deep=True).complete
        # And commit_in_place, which knows their owner is dead (no "may still run").
        temps = _kill_while_publishing(dest, root)
        with caplog.at_level("DEBUG", logger="safestage"):
            safestage.commit_in_place(dest, root)
        assert not any(temp.exists() for temp in temps)
        assert not [r for r in caplog.records if "may still run" in r.getMessage()], caplog.text
        assert safestage.verify(dest, deep=True).complete and live.exists()
    # The killed commits' complete local copies are kept, each naming its destination.
    kept = [json.loads((root / name / KEPT_RECORD).read_bytes()) for name in os.listdir(root)]
    assert len(kept) == 4 and {record["destination"] for record in kept} == {str(dest)}, kept
    entries = _clean_json(root)["entries"]
    assert [entry["action"] for entry in entries] == ["kept"] * 4, entries
    assert all(entry["destination"] == str(dest) and f"for {dest}" in entry["reason"] for entry in entries)


@pytest.mark.mounts
@pytest.mark.regression("v0.2 hostile review: a background save of ckpt/model.safetensors still "
                        "publishing landed after staged_dir(ckpt) had committed a new one, over it")
def test_a_commit_lands_after_pending_background_publishes_under_its_destination(tmp_path: Path) -> None:
    from safestage.testing import hostile_mount

    root = tmp_path / "root"
    root.mkdir()
    old = {"w": torch.full((6 * 1024 * 1024,), 1.0)}  # 24 MiB: about 1.2 s at 20 MB/s
    new = {"w": torch.full((1024 * 1024,), 2.0)}  # 4 MiB: lands well before the old one would
    with hostile_mount("slow", tmp_path / "mnt", mbps=20) as mount:
        for commit in ("staged_dir", "commit_in_place"):
            ckpt = Path(mount.path) / commit / "ckpt"
            ckpt.mkdir(parents=True)
            with safestage.staged(root, background=True):
                save_file(old, str(ckpt / "model.safetensors"))
                if commit == "staged_dir":
                    with safestage.staged_dir(ckpt, root=root) as local:
                        save_file(new, str(local / "model.safetensors"))
                else:  # the Trainer's way: written in place (here by the pending save), committed
                    manifest = safestage.commit_in_place(ckpt, root)
                    assert [entry.path for entry in manifest.files] == ["model.safetensors"]
            expected = new if commit == "staged_dir" else old
            assert torch.equal(load_file(str(ckpt / "model.safetensors"))["w"], expected["w"]), commit
            result = safestage.verify(ckpt, deep=True)
            assert result.complete, (commit, result.problems)


_CLEANER = """
import json, sys, time
from pathlib import Path
from safestage._clean import clean
stop, directories = Path(sys.argv[1]), sys.argv[2:]
while not stop.exists():
    for directory in directories:
        for path in [Path(directory), *Path(directory).glob("checkpoint-*")]:
            try:
                entries = clean(path)
            except OSError:
                continue
            for entry in entries:
                print(json.dumps(entry.to_json()), flush=True)
"""


def test_concurrent_clean_never_takes_a_live_commit(kit_mounts: dict[str, Any], stage_root: Path, tmp_path: Path) -> None:
    """`safestage clean`'s code in a loop, in another process, on the staging root and on the
    destinations, while commits run onto the throttled kit mount: every commit completes and
    nothing of theirs is removed (their locks say they are alive)."""
    parent = Path(kit_mounts["slow"].path) / f"run-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    stop = tmp_path / "stop"
    cleaner = subprocess.Popen(
        [sys.executable, "-c", _CLEANER, str(stop), str(stage_root), str(parent)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(1)  # the cleaner is looping
        for step in range(4):
            with safestage.staged_dir(parent / f"checkpoint-{step}", stage_root) as local:
                expected = write_checkpoint(local, step, numel=2 << 20)  # ~12 MiB: ~30 ms
            assert_committed(parent / f"checkpoint-{step}", expected)
    finally:
        stop.touch()
        out, _ = cleaner.communicate(timeout=60)
    entries = [json.loads(line) for line in out.splitlines()]
    assert entries, "the cleaner never saw a live commit: the test proved nothing"
    assert all(entry["action"] == "kept" for entry in entries), entries
    assert safestage.latest_complete(parent) == parent / "checkpoint-3"


# -- interrupts and concurrency --------------------------------------------------------------------


def test_keyboard_interrupt_at_random_moments_of_a_commit(kit_mounts: dict[str, Any], stage_root: Path) -> None:
    """A real SIGINT (Python's KeyboardInterrupt) delivered to the main thread at moments spread
    over a commit onto the throttled kit mount. After each: no publishing thread left, no temp
    file of ours, and either the commit file landed (complete, digests match, nothing kept) or
    it did not and every file either landed (equal) or is kept locally (equal), the note
    saying where; interrupted inside the block, nothing is kept."""
    import random
    import signal

    parent = Path(kit_mounts["slow"].path) / f"int-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    source = stage_root.parent / "source"
    source.mkdir()
    expected = write_checkpoint(source, 3, numel=512 * 1024)  # ~3 MiB: ~10 ms at 400 MB/s
    rng = random.Random(11)

    block_end: list[float] = []

    def commit(dest: Path) -> None:
        with safestage.staged_dir(dest, stage_root) as local:
            shutil.copytree(source, local, dirs_exist_ok=True)
            block_end.append(time.perf_counter())

    started = time.perf_counter()
    commit(parent / "calibration")
    duration, block = time.perf_counter() - started, block_end[-1] - started
    outcomes = {"in-block": 0, "during-commit": 0, "after-commit": 0}
    # 30 trials spread over the whole commit, then (a loaded machine stretches one phase) up to
    # 30 more aimed at a phase not yet hit: the block, or the commit after it.
    for trial in range(60):
        if trial < 30:
            delay = rng.uniform(0, duration * 1.2)
        elif outcomes["in-block"] < 1:
            delay = rng.uniform(0, block * 0.8)
        elif outcomes["during-commit"] < 3:
            delay = rng.uniform(block, duration)
        else:
            break
        dest = parent / f"checkpoint-{trial}"
        timer = threading.Timer(delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        try:
            timer.start()  # inside: a signal may land before start() returns
            commit(dest)
            timer.join()  # the signal arrives here at the latest
            time.sleep(1)
            raise AssertionError("the SIGINT never arrived")
        except KeyboardInterrupt as exc:
            timer.join()
            notes = getattr(exc, "__notes__", [])
        # No copy goes on once the interrupt has propagated: the destination stays as it is.
        # (A worker whose Thread.start() the interrupt cut short may still be starting: it
        # finds its work cancelled and ends.)
        snapshot = _snapshot(dest)
        deadline = time.monotonic() + 2
        while any(t.name.startswith("safestage-commit") for t in threading.enumerate()):
            assert time.monotonic() < deadline, threading.enumerate()
            time.sleep(0.01)
        assert _snapshot(dest) == snapshot
        strays = [name for name in snapshot if parse_temp_name(Path(name).name)]
        assert not strays, strays
        kept_dirs = []
        for directory in stage_root.iterdir():
            content = set(os.listdir(directory)) - {DISPOSABLE_MARKER}
            if content and not (directory / DISPOSABLE_MARKER).exists():
                kept_dirs.append(directory)
            else:  # disposable: a sweep removes it once we are gone (it holds nothing needed)
                shutil.rmtree(directory)
        if (dest / COMMIT_NAME).exists():
            outcomes["after-commit"] += 1
            assert_committed(dest, expected)
            assert kept_dirs == [], "the checkpoint is complete: nothing to keep"
        elif notes:
            outcomes["during-commit"] += 1
            (kept,) = kept_dirs
            assert str(kept) in notes[0] and "no commit file was written" in notes[0]
            for relative, data in expected.items():
                landed, local = dest / relative, kept / dest.name / relative
                assert (landed.exists() and landed.read_bytes() == data) or local.read_bytes() == data
            shutil.rmtree(kept)
        else:
            outcomes["in-block"] += 1
            assert kept_dirs == [], "interrupted in the block: nothing may be kept"
    print(outcomes)
    assert outcomes["during-commit"] >= 3 and outcomes["in-block"] >= 1, outcomes


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    if not directory.exists():
        return {}
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in directory.rglob("*")
        if path.is_file()
    }


def test_a_commit_publishes_at_most_two_files_at_once(kit_mounts: dict[str, Any], stage_root: Path) -> None:
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(sum(t.name.startswith("safestage-commit") for t in threading.enumerate()))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with safestage.staged_dir(Path(kit_mounts["slow"].path) / f"c-{uuid.uuid4().hex[:8]}", stage_root) as local:
            for index in range(8):
                (local / f"shard-{index}.bin").write_bytes(os.urandom(2 << 20))
    finally:
        stop.set()
        watcher.join()
    assert max(seen) == 2, max(seen)


_CONCURRENT_COMMITTER = """
import os, sys, time, safestage
dest, root, tag, go = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
while not os.path.exists(go):
    time.sleep(0.0005)
with safestage.staged_dir(dest, root) as local:
    for i in range(6):
        (local / f"shard-{i}.bin").write_bytes(tag.encode() * (1 << 20))
"""


@pytest.mark.slow
def test_concurrent_commits_to_one_destination_are_caught_by_deep_verify(tmp_path: Path, shm_root: Path) -> None:
    """Two processes commit different contents of the same sizes to one destination at once.
    The last commit file wins and the files may be a mix of both writers: sizes cannot tell,
    digests can. Oracle: deep verify says complete exactly when every file is the commit
    writer's (known by its pid)."""
    dest = tmp_path / "checkpoint-1"
    mixed = 0
    for round_ in range(8):
        go = tmp_path / f"go-{round_}"
        procs = {
            tag: subprocess.Popen([sys.executable, "-c", _CONCURRENT_COMMITTER, str(dest), str(shm_root), tag, str(go)])
            for tag in ("A", "B")
        }
        time.sleep(0.5)  # both started and waiting
        go.touch()
        assert [p.wait(timeout=60) for p in procs.values()] == [0, 0]
        writer = json.loads((dest / COMMIT_NAME).read_bytes())["writer"]["pid"]
        tag = next(t for t, p in procs.items() if p.pid == writer)
        tags = {(dest / f"shard-{i}.bin").read_bytes()[:1].decode() for i in range(6)}
        mixed += tags != {tag}
        assert safestage.verify(dest).complete  # sizes always match
        assert safestage.verify(dest, deep=True).complete == (tags == {tag}), (tag, tags)
    print(f"{mixed} of 8 concurrent rounds ended with a mix that deep verify caught")


def _commit_one(dest: Path, root: Path, data: bytes = b"weights") -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_bytes(data)


@pytest.mark.regression("0.1 hostile review 2: verify and latest do not hang on a fifo commit file")
def test_verify_and_latest_do_not_hang_on_a_fifo_commit_file(tmp_path: Path) -> None:
    """read_commit opens _SAFESTAGE_COMMIT.json with O_RDONLY and no O_NONBLOCK: a FIFO of
    that name (a hostile or broken directory) blocks open() forever. verify "never raises for
    what it finds" and should say bad-commit; `safestage latest` must not hang a resume script."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-7").mkdir()
    os.mkfifo(run / "checkpoint-7" / COMMIT_NAME)
    code = (
        "import sys, safestage\n"
        "r = safestage.verify(sys.argv[1] + '/checkpoint-7')\n"
        "print(r.complete, [p.kind for p in r.problems])\n"
        "print(safestage.latest_complete(sys.argv[1]))\n"
    )
    try:
        done = subprocess.run(
            [PY, "-c", code, str(run)], env=_env(), capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        pytest.fail("safestage.verify() hung opening a FIFO named _SAFESTAGE_COMMIT.json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False ['bad-commit']", "None"]


@pytest.mark.regression("0.1 hostile review 2: a deeply nested commit file is bad commit not recursion error")
def test_a_deeply_nested_commit_file_is_bad_commit_not_recursion_error(tmp_path: Path, stage_root: Path) -> None:
    """parse() catches ValueError only; json.loads of 200 kB of '[' raises RecursionError,
    which escapes verify (documented: never raises for what it finds) and latest_complete,
    so one garbage commit file in a run directory hides every complete checkpoint."""
    run = tmp_path / "run"
    run.mkdir()
    _commit_one(run / "checkpoint-1", stage_root)
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / COMMIT_NAME).write_bytes(b"[" * 200_000)
    result = safestage.verify(run / "checkpoint-2")
    assert not result.complete
    assert [p.kind for p in result.problems] == ["bad-commit"]
    assert safestage.latest_complete(run) == run / "checkpoint-1"
    cli = subprocess.run(
        [PY, "-m", "safestage", "latest", str(run)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == str(run / "checkpoint-1")


@pytest.mark.regression("0.1 hostile review 2: a commit file with unsafe directories is bad commit")
def test_a_commit_file_with_unsafe_directories_is_bad_commit(tmp_path: Path, stage_root: Path) -> None:
    """docs/checkpoints.md: paths in the commit file are relative, never '..', absolute or
    empty, and "a commit file that breaks this is bad-commit as a whole". parse() checks the
    "files" paths only; "directories" may say anything and verify calls it complete."""
    dest = tmp_path / "checkpoint-1"
    _commit_one(dest, stage_root)
    document = json.loads((dest / COMMIT_NAME).read_bytes())
    document["directories"] = ["../../etc", "/abs", ""]
    (dest / COMMIT_NAME).write_text(json.dumps(document))
    result = safestage.verify(dest)
    assert not result.complete
    assert [p.kind for p in result.problems] == ["bad-commit"]


@pytest.fixture
def tiny_root(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "tiny-root"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(target)], check=True)
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.mark.regression("0.1 hostile review 2: a full staging root when the commit file is written names the checkpoint")
def test_a_full_staging_root_when_the_commit_file_is_written_names_the_checkpoint(
    tmp_path: Path, tiny_root: Path
) -> None:
    """_publish_commit_file writes the staged commit file (os.open/os.write) outside its
    try: a staging root that filled up raises a bare OSError(ENOSPC) with no filename, not a
    PublishError naming the checkpoint, saying every file landed and where the copy is kept;
    and an empty safestage-commit.json is left in the private directory."""
    dest = tmp_path / "checkpoint-1"
    with pytest.raises(OSError) as caught:
        with safestage.staged_dir(dest, tiny_root) as local:
            fd = os.open(local / "fill.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                while True:
                    os.write(fd, b"x" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
            finally:
                os.close(fd)
    error = caught.value
    assert error.errno == errno.ENOSPC
    assert isinstance(error, PublishError), repr(error)
    assert error.filename and str(dest) in str(error.filename), error.filename
    assert error.staged_path is not None and Path(error.staged_path).is_dir()
    assert error.landed == ("fill.bin",)
    assert not safestage.verify(dest).complete


def _committed_pair(parent: Path, root: Path) -> tuple[Path, Path]:
    """checkpoint-1 and checkpoint-2, each a committed model.safetensors of 4,000+ bytes."""
    made = []
    for step in (1, 2):
        directory = parent / f"checkpoint-{step}"
        directory.mkdir()
        save_file({"w": torch.full((1000,), float(step))}, str(directory / "model.safetensors"))
        (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        safestage.commit_in_place(directory, root)
        made.append(directory)
    return made[0], made[1]


def _same_size_shard(path: Path, header: bytes) -> None:
    """Overwrite ``path`` with a file of the same size whose header is ``header`` (padded
    with JSON whitespace): what bit rot, a foreign writer or a torn object can leave."""
    size = path.stat().st_size
    assert len(header) <= size - 8
    header = header + b" " * (size - 8 - len(header))
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert path.stat().st_size == size


@pytest.mark.regression("0.1 hostile review 3: deep latest complete falls back past a same size shard with a hostile header")
@pytest.mark.parametrize("header", [_UNHASHABLE_DTYPE, _NESTED], ids=["list-dtype", "nested-header"])
def test_deep_latest_complete_falls_back_past_a_same_size_shard_with_a_hostile_header(
    tmp_path: Path, root: Path, header: bytes
) -> None:
    """README: verify "never raises for what it finds"; latest_complete(deep=True) names the
    newest checkpoint whose bytes match. A same-size shard whose header is valid JSON but
    not a safetensors header (a dtype that is a list, or nesting deeper than the recursion
    limit) makes verify(deep=True) raise TypeError / RecursionError, and latest_complete
    with it: a resumer crashes instead of falling back to checkpoint-1."""
    first, second = _committed_pair(tmp_path, root)
    _same_size_shard(second / "model.safetensors", header)
    result = safestage.verify(second, deep=True)  # raises today
    assert not result.complete
    assert {p.path for p in result.problems} == {"model.safetensors"}
    assert safestage.latest_complete(tmp_path, deep=True) == first
