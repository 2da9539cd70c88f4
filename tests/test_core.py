"""The core promise, against the real safetensors writer and real filesystems.

Destinations: the local disk (staging on the same filesystem: publish by rename), the disk
with staging on /dev/shm (another device: a rename would be EXDEV), every hostile FUSE mode of
safestage.testing, and its real third-party mounts (rclone over a directory and over S3, s3fs).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

import safestage
from safestage import PublishError
from safestage.testing import REAL_MODES

HOSTILE = ["hdfs", "eopnotsupp", "objectstore", "mountpoint"]
KIT_OK = ["hdfs", "eopnotsupp", "objectstore", "mountpoint", "slow", "passthrough"]
TMP_NAME = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")  # the tempfile crate's names, as safetensors uses


def assert_loads_equal(path: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded = load_file(str(path))
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def changed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor + 1 if tensor.numel() else tensor for name, tensor in tensors.items()}


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)
        self.tied = self.proj  # shared weights: save_model must dedupe them


def _roundtrip(directory: Path, root: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    dest = directory / "model.safetensors"
    with safestage.staged(root) as stage:
        save_file(tensors, dest)  # new file
        assert_loads_equal(dest, tensors)
        newer = changed(tensors)
        save_file(newer, str(dest), metadata={"format": "pt"})  # over an existing one
        model = TinyModel()
        save_model(model, str(directory / "tiny.safetensors"))
    assert_loads_equal(dest, newer)
    loaded = load_file(str(directory / "tiny.safetensors"))
    assert torch.equal(loaded["proj.weight"], model.proj.weight.detach())
    assert mode_of(dest) == 0o644
    assert mode_of(directory / "tiny.safetensors") == 0o644
    assert listing(directory) == ["model.safetensors", "tiny.safetensors"]
    assert listing(root) == [], "staging root must be empty after the saves"
    assert [r.destination for r in stage.records] == [dest, dest, directory / "tiny.safetensors"]
    assert all(r.bytes == os.stat(r.destination).st_size for r in stage.records[1:])
    return [r.publish for r in stage.records]


def test_plain_disk_same_filesystem_publishes_by_rename(tmp_path, stage_root, tensors):
    dest_dir = tmp_path / "ckpt"
    dest_dir.mkdir()
    assert _roundtrip(dest_dir, stage_root, tensors) == ["rename"] * 3


def test_cross_device_staging_copies_then_replaces(tmp_path, shm_root, tensors):
    dest_dir = tmp_path / "ckpt"
    dest_dir.mkdir()
    assert os.stat(shm_root).st_dev != os.stat(dest_dir).st_dev, "needs /dev/shm on another device"
    assert _roundtrip(dest_dir, shm_root, tensors) == ["replace"] * 3


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


def test_without_safestage_close_eio_is_silent_data_loss(kit_mounts, tmp_path, tensors):
    """Why the close() check matters: safetensors reports success, the file is gone."""
    directory = Path(kit_mounts["close-eio"].path) / f"loss-{os.getpid()}"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))  # no exception
    assert not (directory / "model.safetensors").exists()


def test_existing_mode_is_kept(tmp_path, shm_root, tensors):
    dest = tmp_path / "model.safetensors"
    save_file(tensors, str(dest))
    os.chmod(dest, 0o640)
    with safestage.staged(shm_root):
        save_file(changed(tensors), str(dest))
    assert mode_of(dest) == 0o640
    os.chmod(dest, 0o666)  # wider than the umask allows at create: still kept
    with safestage.staged(shm_root):
        save_file(tensors, str(dest))
    assert mode_of(dest) == 0o666


def test_new_file_mode_follows_umask(tmp_path, shm_root, tensors):
    os.umask(0o027)
    with safestage.staged(shm_root):
        save_file(tensors, str(tmp_path / "a.safetensors"))
    with safestage.staged(tmp_path.parent):
        save_file(tensors, str(tmp_path / "b.safetensors"))  # rename path
    assert mode_of(tmp_path / "a.safetensors") == 0o640
    assert mode_of(tmp_path / "b.safetensors") == 0o640


def test_module_that_bound_save_file_before_activation_is_staged(tmp_path, shm_root, tensors):
    namespace: dict[str, object] = {}
    exec("from safetensors.torch import save_file as bound_save", namespace)  # like megatron-bridge
    with safestage.staged(shm_root) as stage:
        namespace["bound_save"](tensors, str(tmp_path / "m.safetensors"))  # type: ignore[operator]
    assert [r.destination for r in stage.records] == [tmp_path / "m.safetensors"]
    assert_loads_equal(tmp_path / "m.safetensors", tensors)


def test_numpy_and_package_level_serialize_file_are_staged(tmp_path, shm_root):
    import numpy as np
    import safetensors
    import safetensors.numpy

    arrays = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    with safestage.staged(shm_root) as stage:
        safetensors.numpy.save_file(arrays, tmp_path / "n.safetensors")
        spec = {"y": safetensors.TensorSpec(dtype="float32", shape=[3, 4], data_ptr=arrays["x"].ctypes.data, data_len=48)} if hasattr(safetensors, "TensorSpec") else None
        if spec is not None:
            safetensors.serialize_file(spec, str(tmp_path / "p.safetensors"))
    assert [r.destination.name for r in stage.records][0] == "n.safetensors"
    np.testing.assert_array_equal(safetensors.numpy.load_file(str(tmp_path / "n.safetensors"))["x"], arrays["x"])
    if spec is not None:
        assert len(stage.records) == 2
        np.testing.assert_array_equal(safetensors.numpy.load_file(str(tmp_path / "p.safetensors"))["y"], arrays["x"])


def _originals() -> dict[str, object]:
    import safetensors
    import safetensors.numpy
    import safetensors.torch

    return {
        "safetensors": safetensors.serialize_file,
        "torch": safetensors.torch.serialize_file,
        "numpy": safetensors.numpy.serialize_file,
    }


def test_original_restored_after_exception_and_nesting(tmp_path, shm_root, tensors):
    before = _originals()
    with pytest.raises(KeyError):
        with safestage.staged(shm_root):
            assert safestage.is_active()
            assert _originals()["torch"] is not before["torch"]
            with safestage.staged(shm_root) as inner:
                save_file(tensors, str(tmp_path / "inner.safetensors"))
            assert safestage.is_active()
            raise KeyError("boom")
    assert not safestage.is_active()
    assert inner.records and inner.records[0].destination == tmp_path / "inner.safetensors"
    after = _originals()
    assert all(after[name] is before[name] for name in before)


def test_activations_from_two_threads_overlapping(tmp_path, shm_root, tensors):
    before = _originals()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with safestage.staged(shm_root) as stage:
                first_in.set()
                second_in.wait(5)
                save_file(tensors, str(tmp_path / "first.safetensors"))
            assert len(stage.records) == 1
            first_out.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def second() -> None:
        try:
            first_in.wait(5)
            with safestage.staged(shm_root):
                second_in.set()
                first_out.wait(5)  # the first activation ended while this one is open
                save_file(tensors, str(tmp_path / "second.safetensors"))
                assert safestage.is_active()
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert not safestage.is_active()
    after = _originals()
    assert all(after[name] is before[name] for name in before)
    assert_loads_equal(tmp_path / "second.safetensors", tensors)


def test_saves_from_other_threads_are_staged(tmp_path, shm_root, tensors):
    with safestage.staged(shm_root) as stage:
        workers = [
            threading.Thread(target=save_file, args=(tensors, str(tmp_path / f"t{i}.safetensors")))
            for i in range(4)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert sorted(r.destination.name for r in stage.records) == [f"t{i}.safetensors" for i in range(4)]


def test_someone_wrapping_on_top_is_left_intact(tmp_path, shm_root, tensors):
    import safetensors.torch as st
    import wrapt

    original = st.serialize_file
    calls: list[str] = []

    def theirs(wrapped, instance, args, kwargs):
        calls.append(str(args[1]))
        return wrapped(*args, **kwargs)

    try:
        with safestage.staged(shm_root):
            wrapt.wrap_function_wrapper(st, "serialize_file", theirs)
            on_top = st.serialize_file
        assert st.serialize_file is on_top, "safestage must not remove a wrapper it does not own"
        save_file(tensors, str(tmp_path / "after.safetensors"))  # our inner wrapper passes through
        assert calls == [str(tmp_path / "after.safetensors")]
        assert_loads_equal(tmp_path / "after.safetensors", tensors)
    finally:
        st.serialize_file = original


def test_decorator_and_activate_handle(tmp_path, shm_root, tensors):
    @safestage.staged(shm_root)
    def export(name: str) -> bool:
        save_file(tensors, str(tmp_path / name))
        return safestage.is_active()

    assert export("a.safetensors") and export("b.safetensors")
    assert not safestage.is_active()
    handle = safestage.activate(shm_root, fsync=False)
    try:
        save_file(tensors, str(tmp_path / "c.safetensors"))
    finally:
        handle.close()
        handle.close()  # idempotent
    assert not safestage.is_active()
    assert [r.destination.name for r in handle.records] == ["c.safetensors"]
    assert listing(tmp_path) == ["a.safetensors", "b.safetensors", "c.safetensors"]


def test_symlink_destination_is_replaced_like_safetensors_08(tmp_path, shm_root, tensors):
    target = tmp_path / "target.safetensors"
    save_file(tensors, str(target))
    link = tmp_path / "link.safetensors"
    link.symlink_to(target.name)
    with safestage.staged(shm_root):
        save_file(changed(tensors), str(link))
    assert not link.is_symlink()
    assert_loads_equal(link, changed(tensors))
    assert_loads_equal(target, tensors)


def test_bad_destinations_fail_exactly_like_a_plain_save(tmp_path, shm_root, tensors):
    plain: list[str] = []
    for dest in (tmp_path / "missing" / "x.safetensors", tmp_path):
        with pytest.raises(Exception) as info:
            save_file(tensors, str(dest))
        plain.append(f"{type(info.value).__name__}: {info.value}".split(" at path")[0])
    staged: list[str] = []
    with safestage.staged(shm_root) as stage:
        for dest in (tmp_path / "missing" / "x.safetensors", tmp_path):
            with pytest.raises(Exception) as info:
                save_file(tensors, str(dest))
            staged.append(f"{type(info.value).__name__}: {info.value}".split(" at path")[0])
        with pytest.raises(ValueError, match="non contiguous"):
            save_file({"t": torch.arange(10)[::2]}, str(tmp_path / "nc.safetensors"))
    assert staged == plain
    assert stage.records == []
    assert listing(shm_root) == []


def test_publish_replace_on_a_mount_that_cannot_rename_says_what_to_do(kit_mounts, stage_root, tensors):
    directory = Path(kit_mounts["mountpoint"].path) / f"r-{os.getpid()}"
    directory.mkdir()
    with pytest.raises(PublishError) as info, safestage.staged(stage_root, publish="replace"):
        save_file(tensors, str(directory / "model.safetensors"))
    message = str(info.value)
    assert "publish='direct'" in message and "rename" in message
    assert info.value.errno in (errno.ENOSYS, errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP)
    assert listing(directory) == []
    assert_loads_equal(Path(info.value.staged_path), tensors)


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


def test_staging_root_full_is_a_staging_error(small_tmpfs, tmp_path):
    from safestage import StagingError

    big = {"w": torch.zeros(700 * 1024)}
    with pytest.raises(StagingError) as info, safestage.staged(small_tmpfs):
        save_file(big, str(tmp_path / "model.safetensors"))
    assert info.value.errno == errno.ENOSPC
    assert str(small_tmpfs) in str(info.value)
    assert listing(tmp_path) == ["tiny"]
    assert listing(small_tmpfs) == []
