"""Publish failures are loud: a full, read-only or vanishing destination, EIO at close or fsync, S3 going away mid-upload; each a PublishError naming the file, the old file kept, the staged copy kept."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import wrapt
from _s3_link import S3Link
from _support import (
    BIG,
    SMALL,
    Snapshot,
    arange_tensors,
    assert_loads_equal,
    assert_one_line_message,
    changed,
    listing,
)
from safetensors import SafetensorError
from safetensors.torch import save_file

import safestage
from safestage import PublishError


@pytest.mark.parametrize("kit_dir", ["close-eio"], indirect=True)
def test_close_eio_is_a_loud_failure_that_keeps_everything(kit_dir, stage_root, tensors, kit_mounts):
    dest = kit_dir / "model.safetensors"
    faults_before = kit_mounts["close-eio"].faults()
    # The old file exists and must survive: written through the backing store (no fault).
    backing = Path(kit_mounts["close-eio"].backing) / kit_dir.name / "model.safetensors"
    save_file(tensors, str(backing))
    newer = changed(tensors)
    with pytest.raises(PublishError) as info, safestage.staged(stage_root):
        save_file(newer, str(dest))
    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.EIO
    assert error.filename == str(dest)
    assert str(dest) in str(error) and "EIO" in str(error)
    faults_after = kit_mounts["close-eio"].faults()
    assert sum(faults_after.values()) > sum(faults_before.values()), "the EIO fault never fired"
    assert_loads_equal(dest, tensors)  # the previous file is intact
    assert listing(kit_dir) == ["model.safetensors"]  # no temp file of ours
    kept = Path(error.staged_path)
    assert str(kept) in str(error)
    assert kept.is_relative_to(stage_root)
    assert_loads_equal(kept, newer)  # the complete new data is kept where the message says


def test_destination_full_is_enospc_with_old_file_intact(small_tmpfs, shm_root):
    small = {"w": torch.zeros(64 * 1024)}  # 256 KiB
    big = {"w": torch.zeros(700 * 1024)}  # 2.7 MiB > the 2 MiB tmpfs
    dest = small_tmpfs / "model.safetensors"
    save_file(small, str(dest))
    with pytest.raises(PublishError) as info, safestage.staged(shm_root):
        save_file(big, str(dest))
    assert info.value.errno == errno.ENOSPC
    assert "full" in str(info.value)
    assert_loads_equal(dest, small)
    assert listing(small_tmpfs) == ["model.safetensors"]
    assert_loads_equal(Path(info.value.staged_path), big)


def assert_kept_copy(error: PublishError, root: Path, expected: dict[str, torch.Tensor]) -> None:
    assert error.staged_path is not None, str(error)
    kept = Path(error.staged_path)
    assert kept.is_relative_to(root), kept
    assert str(kept) in str(error), "the message must say where the complete copy is"
    assert_loads_equal(kept, expected)


@pytest.mark.parametrize("publish", ["replace", "direct"])
def test_full_destination_is_a_publish_error_and_keeps_the_staged_copy(
    small_tmpfs, shm_root, publish
):
    dest = small_tmpfs / "model.safetensors"
    save_file(SMALL, str(dest))
    old = Snapshot(dest)
    with pytest.raises(PublishError) as info, safestage.staged(shm_root, publish=publish):
        save_file(BIG, str(dest))
    error = info.value
    assert error.errno == errno.ENOSPC and error.filename == str(dest)
    assert error.step in ("write", "fsync", "close"), error.step
    assert_one_line_message(error, str(dest), "ENOSPC", "full")
    assert_kept_copy(error, shm_root, BIG)
    if publish == "replace":
        old.assert_intact()  # the temp took the hit, not the final name
        assert listing(small_tmpfs) == ["model.safetensors"], "no temp file may be left"
    else:
        # direct truncated the final name (POSIX semantics, README): the torn file is removed,
        # never left for a loader to trip over, and the message says so.
        assert listing(small_tmpfs) == []
        assert "no incomplete file is left" in str(error).lower()


@pytest.mark.parametrize("publish", ["replace", "direct"])
@pytest.mark.parametrize("fsync", [True, False])
def test_eio_at_fsync_or_close_fails_loudly(kit_mounts, stage_root, fsync, publish):
    mount = kit_mounts["close-eio"]
    name = f"eio-{publish}-{fsync}-{os.urandom(3).hex()}"
    (Path(mount.backing) / name).mkdir()
    dest = Path(mount.path) / name / "model.safetensors"
    save_file(SMALL, str(Path(mount.backing) / name / "model.safetensors"))  # old, faultless
    before = mount.faults()
    with (
        pytest.raises(PublishError) as info,
        safestage.staged(stage_root, publish=publish, fsync=fsync),
    ):
        save_file(BIG, str(dest))
    error = info.value
    after = mount.faults()
    # fsync=True: the upload fails at fsync(2); fsync=False: at close(2), which safetensors
    # itself never checks (README: silent data loss without staging).
    expected_step, counter = ("fsync", "fsync") if fsync else ("close", "flush")
    assert error.step == expected_step, str(error)
    assert after[counter] > before[counter], (
        f"the kit's {counter} fault never fired: {before} -> {after}"
    )
    assert error.errno == errno.EIO and error.filename == str(dest)
    assert_one_line_message(error, str(dest), "EIO", "failed to store the data")
    assert_kept_copy(error, stage_root, BIG)
    leftovers = listing(dest.parent)
    if publish == "replace":
        assert_loads_equal(dest, SMALL)  # the old object is intact
        assert leftovers == ["model.safetensors"], "no temp of ours may be left"
    else:
        # The kit discards a failed upload together with the object it truncated: what must
        # never happen is a torn file left under the final name.
        assert leftovers == [], leftovers
        assert "no incomplete file is left" in str(error).lower()


# s3fs retries a failed request 5 times by default, sleeping between tries: a save onto a dead
# link took 260 s to fail here (42 s with retries=1). One retry keeps the test short; what is
# tested, the error reaching close() or fsync(), is the same.
S3_LINK_OPTIONS = {"rclone-s3": [], "s3fs": ["-o", "retries=1"]}


# What each tool logs when the upload failed (the fault reached it, not something else).
UPLOAD_FAILED = {"rclone-s3": "WriteFileHandle.Flush error", "s3fs": "Over retry count"}


# When the link comes back: rclone, once safestage removes its temp (rclone's unlink of a file
# whose upload failed sends no request); s3fs, once it gave up on the upload (its unlink needs
# the network: with the link still down it fails after a minute of retries, and safestage then
# says, wrongly but unavoidably, that a partial temp may be left: the bucket holds none).
RESTORE_WHEN = {"rclone-s3": 'Remove: name=".model.safetensors.safestage-', "s3fs": "Over retry count"}


@pytest.fixture(scope="module")
def linked_mounts() -> Iterator[tuple[S3Link, dict[str, Any]]]:
    """rclone-s3 and s3fs on a private S3 server, reached through a link a test can cut."""
    from safestage.testing import S3Server, real_available, real_mount

    for mode in S3_LINK_OPTIONS:
        ok, reason = real_available(mode)
        if not ok:
            pytest.fail(f"the real mount {mode!r} is required and unavailable: {reason}", pytrace=False)
    server = S3Server().start()
    link = S3Link(server).start()
    try:
        with contextlib.ExitStack() as stack:
            mounts = {
                mode: stack.enter_context(real_mount(mode, server=link, options=options))  # type: ignore[arg-type]
                for mode, options in S3_LINK_OPTIONS.items()
            }
            yield link, mounts
    finally:
        link.close()
        server.stop()


def restore_when_logged(link: S3Link, mount: Any, text: str, offset: int) -> threading.Thread:
    """Bring the link back once the tool's log shows ``text`` (after ``offset``)."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while text not in mount.server_log()[offset:] and time.monotonic() < deadline:
            time.sleep(0.05)
        link.restore()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.mounts
# rclone's fsync is a no-op: fsync=False would test the same path again.
@pytest.mark.parametrize(("mode", "fsync"), [("rclone-s3", True), ("s3fs", True), ("s3fs", False)])
def test_s3_going_away_mid_upload_is_a_publish_error_and_the_old_file_stays(
    linked_mounts, stage_root, mode, fsync
):
    """The link to S3 is reset 1 MiB into the upload of a 12 MiB file and refuses every new
    connection until the tool has given up (RESTORE_WHEN). rclone uploads while the file is
    written (its fsync is a no-op): the error comes at close; s3fs uploads at fsync, else at
    close."""
    link, mounts = linked_mounts
    mount = mounts[mode]
    directory = Path(mount.path) / f"link-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    dest = directory / "model.safetensors"
    with safestage.staged(stage_root):
        save_file(SMALL, str(dest))  # the previous checkpoint, complete in the bucket
    old = dest.read_bytes()
    big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: several upload parts
    offset, cuts = len(mount.server_log()), link.stats()["cuts"]
    link.cut_after(1 << 20)
    watcher = restore_when_logged(link, mount, RESTORE_WHEN[mode], offset)
    try:
        with pytest.raises(PublishError) as info, safestage.staged(stage_root, fsync=fsync):
            save_file(big, str(dest))
    finally:
        link.restore()
        watcher.join(10)
    error = info.value
    stats = link.stats()
    assert stats["cuts"] == cuts + 1 and stats["resets"], f"the link was never cut: {stats}"
    assert UPLOAD_FAILED[mode] in mount.server_log()[offset:], "the tool never saw the upload fail"
    assert error.errno == errno.EIO and error.filename == str(dest)
    assert error.step == ("fsync" if fsync and mode == "s3fs" else "close"), str(error)
    assert_one_line_message(error, str(dest), "EIO", "failed to store the data", "still holds its previous file")
    assert "partial temp file is left" not in str(error)
    assert_kept_copy(error, stage_root, big)
    assert dest.read_bytes() == old  # through the mount, the link back up
    assert_loads_equal(dest, SMALL)
    time.sleep(0.5)  # rclone: a name removed before the tool's RELEASE could come back
    assert listing(directory) == ["model.safetensors"]
    prefix = f"{directory.name}/"
    assert sorted(o for o in mount.objects() if o.startswith(prefix) and o != prefix) == [
        f"{prefix}model.safetensors"
    ], "the bucket must hold the old object only"


@pytest.mark.parametrize("publish", ["auto", "direct"])
def test_read_only_destination_is_erofs_with_advice(ro_tmpfs, shm_root, publish):
    dest = ro_tmpfs / "model.safetensors"
    old = Snapshot(dest)
    with pytest.raises(PublishError) as info, safestage.staged(shm_root, publish=publish):
        save_file(BIG, str(dest))
    error = info.value
    assert error.errno == errno.EROFS and error.filename == str(dest)
    assert error.step == "create", "nothing is written on a read-only mount"
    assert_one_line_message(error, str(dest), "EROFS", "read-only")
    assert "still holds its previous" in str(error)
    old.assert_intact()
    assert listing(ro_tmpfs) == ["model.safetensors"]
    assert_kept_copy(error, shm_root, BIG)


def _error_text(exc: BaseException) -> str:
    # safetensors names its own random .tmpXXXXXX after " at path": not part of the contract.
    return f"{type(exc).__name__}: {exc}".split(" at path")[0]


def test_missing_destination_directory_is_the_same_error_as_a_plain_save(tmp_path, shm_root):
    dest = tmp_path / "missing" / "model.safetensors"
    with pytest.raises(Exception) as plain:
        save_file(SMALL, str(dest))
    with safestage.staged(shm_root) as stage, pytest.raises(Exception) as staged:
        save_file(SMALL, str(dest))
    assert type(staged.value) is type(plain.value)
    assert _error_text(staged.value) == _error_text(plain.value)
    assert "os error 2" in str(staged.value)
    assert not (tmp_path / "missing").exists(), "nothing may create the directory"
    assert stage.records == [] and listing(shm_root) == []


@contextlib.contextmanager
def after_serializing(action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` right after the real writer finished the staged file, inside the save.

    A wrapt wrapper installed *before* activation sits under safestage's own, so it sees the
    staged path and can break the world between serialization and publish (another process
    removing a folder). The real writer and the real publish run; only the timing is chosen.
    """
    import safetensors.torch as st

    original = st.serialize_file

    def hook(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        action()
        return result

    st.serialize_file = wrapt.FunctionWrapper(original, hook)
    try:
        yield
    finally:
        st.serialize_file = original


@pytest.mark.parametrize("entry", ["save_file", "staged_file"])
def test_destination_directory_removed_during_the_save_is_a_publish_error(
    tmp_path, shm_root, entry
):
    """Another process deletes the checkpoint folder while the file is being written. The
    README promises a PublishError for every publish failure, and _publish has the advice
    ready ("the destination directory vanished during the save")."""
    dest_dir = tmp_path / "ckpt"
    dest_dir.mkdir()
    dest = dest_dir / "model.safetensors"
    with pytest.raises(OSError) as info:
        if entry == "save_file":
            with after_serializing(lambda: shutil.rmtree(dest_dir)), safestage.staged(shm_root):
                save_file(SMALL, str(dest))
        else:
            with safestage.staged_file(dest, shm_root) as local:
                save_file(SMALL, str(local))
                shutil.rmtree(dest_dir)
    error = info.value
    assert isinstance(error, PublishError), f"{type(error).__name__}: {error}"
    assert error.errno == errno.ENOENT and error.filename == str(dest)
    assert_one_line_message(error, str(dest), "ENOENT", "vanished")
    assert_kept_copy(error, shm_root, SMALL)


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): publish errors are safetensor errors too")
def test_publish_errors_are_safetensor_errors_too(mount_dir, stage_root):
    directory, _ = mount_dir("close-eio")
    try:
        with safestage.staged(stage_root):
            save_file(arange_tensors(1), str(directory / "model.safetensors"))
    except SafetensorError as exc:
        caught = exc
    else:
        pytest.fail("no error at all")
    assert isinstance(caught, PublishError) and isinstance(caught, OSError)
    assert caught.errno == errno.EIO
    import pickle

    again = pickle.loads(pickle.dumps(caught))
    assert isinstance(again, PublishError) and isinstance(again, SafetensorError)
    assert str(again) == str(caught) and again.staged_path == caught.staged_path
