"""Tests of the hostile-filesystem kit itself: real FUSE mounts, real syscalls, no mocks.

Nothing here skips: on a machine without FUSE every test fails with the reason.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from _support import TMP_NAME

from safestage.testing import (
    MODES,
    FuseUnavailable,
    HostileMount,
    _mount,
    fuse_available,
    hostile_mount,
)

REPO = Path(__file__).resolve().parents[1]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
RENAME_NOREPLACE = 1
AT_FDCWD = -100


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fuse_required() -> None:
    ok, reason = fuse_available()
    if not ok:
        pytest.fail(f"FUSE is required by the kit tests and is unavailable: {reason}", pytrace=False)


@pytest.fixture
def umask022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mounted(path: Path) -> bool:
    """Is anything mounted exactly at ``path`` (independent of the kit's own parser)?"""
    target = os.path.realpath(path).replace(" ", "\\040")
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        return any(line.split()[4] == target for line in info)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def expect_errno(err: int, fn: Callable[..., Any], *args: Any) -> None:
    with pytest.raises(OSError) as info:
        fn(*args)
    got = info.value.errno
    assert got == err, f"{fn.__name__}{args}: expected {errno.errorcode[err]}, got {errno.errorcode.get(got or 0, got)}"


def raw_fallocate(fd: int, offset: int, length: int) -> None:
    # Not os.posix_fallocate: glibc emulates it with writes when fallocate says EOPNOTSUPP.
    if _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def renameat2(old: Path, new: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def write_new(path: Path, data: bytes, mode: int = 0o666) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def nonzero(faults: dict[str, int]) -> dict[str, int]:
    return {name: count for name, count in faults.items() if count}


# -- the public surface ------------------------------------------------------------------


@pytest.mark.mounts
def test_public_api() -> None:
    import safestage.testing as kit

    assert kit.__all__ == [
        "MODES",
        "REAL_MODES",
        "STORE_KINDS",
        "FaultProxy",
        "FuseUnavailable",
        "HostileMount",
        "ObjectStoreServer",
        "ObjectStoreUnavailable",
        "RealMount",
        "RealMountUnavailable",
        "S3Server",
        "StoreBucket",
        "fuse_available",
        "hostile_mount",
        "new_bucket",
        "real_available",
        "real_mount",
        "shared_object_store",
        "shared_s3_server",
        "stop_shared_object_stores",
        "stop_shared_s3_server",
    ]  # the real mounts: tests/test_real_mounts.py; the object stores: tests/test_kit_stores.py
    assert MODES == ("hdfs", "eopnotsupp", "objectstore", "mountpoint", "close-eio", "slow", "passthrough")
    assert issubclass(FuseUnavailable, RuntimeError)
    ok, reason = fuse_available()
    assert ok is True and isinstance(reason, str) and reason
    assert HostileMount("slow").mbps == 200.0
    assert HostileMount("slow", mbps=50).mbps == 50
    assert HostileMount("hdfs").mbps is None


def test_modes_match_server_policies() -> None:
    sys.path.insert(0, str(REPO / "safestage" / "testing"))
    try:
        from safestage.testing._hostile_fs import POLICIES
    finally:
        sys.path.pop(0)
    assert set(POLICIES) == set(MODES)


def test_import_pulls_no_heavy_modules() -> None:
    # Measured relative to `import safestage`: the kit must add neither torch, safetensors,
    # numpy nor mfusepy (mfusepy is loaded only by the server process).
    code = textwrap.dedent(
        """
        import sys, safestage
        before = set(sys.modules)
        import safestage.testing
        added = {m.split(".")[0] for m in set(sys.modules) - before}
        print(sorted(added & {"torch", "safetensors", "numpy", "mfusepy"}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.mounts
def test_unknown_mode_and_bad_mountpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown hostile mode"):
        HostileMount("nfs")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match="not empty"), hostile_mount("passthrough", busy):
        pass
    assert (busy / "file").read_bytes() == b"x"


@pytest.mark.mounts
def test_missing_fuse_is_a_loud_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_mount, "_DEV_FUSE", "/nonexistent/fuse")
    ok, reason = fuse_available()
    assert not ok and "/nonexistent/fuse is missing" in reason
    with pytest.raises(FuseUnavailable) as info, hostile_mount("hdfs"):
        pass
    message = str(info.value)
    for hint in ("apt-get install fuse3", "pip install 'safestage[testing]'", "/dev/fuse", "fusermount3"):
        assert hint in message


@pytest.mark.mounts
@pytest.mark.parametrize(
    ("exit_code", "error"), [(1, RuntimeError), (_mount._EXIT_NO_FUSE, FuseUnavailable)]
)
def test_server_dying_before_mount_reports_its_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exit_code: int, error: type[Exception]
) -> None:
    fake = tmp_path / "fake_server.py"
    fake.write_text(f"import sys\nsys.stderr.write('boom: no luck today\\n')\nsys.exit({exit_code})\n")
    monkeypatch.setattr(_mount, "_SERVER_SCRIPT", fake)
    mountpoint = tmp_path / "mnt"
    with pytest.raises(error, match="boom: no luck today"), hostile_mount("passthrough", mountpoint):
        pass
    assert not mountpoint.exists()  # we created it, we removed it


# -- every mode: the passthrough part is correct -------------------------------------------


@pytest.mark.mounts
@pytest.mark.parametrize("mode", [m for m in MODES if m != "close-eio"])
def test_roundtrip_and_listing(mode: str) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)  # several 1 MiB FUSE writes, ragged end
    with hostile_mount(mode) as m:
        (m.backing / "pre.bin").write_bytes(b"from the backing dir")
        (m.path / "sub").mkdir()
        with open(m.path / "sub" / "data.bin", "wb") as handle:
            handle.write(payload)
        assert (m.path / "sub" / "data.bin").read_bytes() == payload
        assert (m.backing / "sub" / "data.bin").read_bytes() == payload
        assert (m.path / "pre.bin").read_bytes() == b"from the backing dir"
        assert sorted(os.listdir(m.path)) == ["pre.bin", "sub"]
        assert os.listdir(m.path / "sub") == ["data.bin"]
        assert (m.path / "sub" / "data.bin").stat().st_size == len(payload)
        assert (m.path / "sub").is_dir()
        assert m.mode == mode and m.is_mounted()
        assert nonzero(m.faults()) == {}  # plain create/write/read/close trips nothing


@pytest.mark.mounts
@pytest.mark.parametrize("mode", MODES)
def test_created_file_mode_follows_umask(mode: str, umask022: None) -> None:
    with hostile_mount(mode) as m:
        fd = os.open(m.path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.mkdir(m.path / "d", 0o777)
        assert (m.path / "f").stat().st_mode & 0o7777 == 0o644
        assert (m.backing / "f").stat().st_mode & 0o7777 == 0o644
        assert (m.path / "d").stat().st_mode & 0o7777 == 0o755
        if mode == "close-eio":  # creating an object is an upload, and this store's uploads fail
            with pytest.raises(OSError) as info:
                os.close(fd)
            assert info.value.errno == errno.EIO and m.faults()["flush"] == 1
            assert sorted(os.listdir(m.path)) == ["d"]
            return
        os.close(fd)
        assert sorted(os.listdir(m.path)) == ["d", "f"]


@pytest.mark.mounts
def test_passthrough_supports_the_rest_of_posix(umask022: None) -> None:
    with hostile_mount("passthrough") as m:
        f = m.path / "f"
        f.write_bytes(b"0123456789")
        os.symlink("f", m.path / "sym")
        assert os.readlink(m.path / "sym") == "f" and (m.path / "sym").read_bytes() == b"0123456789"
        os.link(f, m.path / "hard")
        assert f.stat().st_nlink == 2
        os.chmod(f, 0o600)
        assert (m.backing / "f").stat().st_mode & 0o7777 == 0o600
        os.chown(f, 1234, 5678)
        assert ((m.backing / "f").stat().st_uid, (m.backing / "f").stat().st_gid) == (1234, 5678)
        os.utime(f, ns=(1_000_000_123, 2_000_000_456))
        assert f.stat().st_mtime_ns == 2_000_000_456
        os.utime(f, ns=(3_000_000_000, 2_000_000_456))  # atime only changes
        assert f.stat().st_atime_ns == 3_000_000_000
        os.truncate(f, 4)
        fd = os.open(f, os.O_RDWR)
        os.ftruncate(fd, 6)
        raw_fallocate(fd, 0, 8192)
        os.pwrite(fd, b"Z", 0)  # random access is fine here
        os.fsync(fd)
        os.close(fd)
        assert (m.backing / "f").read_bytes()[:6] == b"Z123\0\0"
        (m.path / "g").write_bytes(b"g")
        expect_errno(errno.EEXIST, renameat2, m.path / "g", f, RENAME_NOREPLACE)
        os.replace(m.path / "g", m.path / "h")
        fd = os.open(m.path / "h", os.O_RDONLY)
        os.unlink(m.path / "h")
        # Unlinked but open: I/O through the fd still works. (fstat would say ESTALE: the kernel
        # asks by inode only, and hard_remove left libfuse no name for it; see _server.py.)
        assert os.read(fd, 10) == b"g"
        os.close(fd)
        assert os.statvfs(m.path).f_bsize > 0
        assert os.access(f, os.R_OK | os.W_OK)
        assert sorted(os.listdir(m.path)) == ["f", "hard", "sym"]
        assert m.faults() == {}


# -- each hostile mode's faults ------------------------------------------------------------


@pytest.mark.mounts
@pytest.mark.parametrize(("mode", "err"), [("hdfs", errno.ENOSYS), ("eopnotsupp", errno.EOPNOTSUPP)])
def test_hdfs_like_modes_refuse_resizing(mode: str, err: int) -> None:
    with hostile_mount(mode) as m:
        f = m.path / "f"
        f.write_bytes(b"hello world")
        fd = os.open(f, os.O_RDWR)
        expect_errno(err, os.ftruncate, fd, 100)  # safetensors' set_len preallocation
        expect_errno(err, os.ftruncate, fd, 0)  # any size, through a handle
        expect_errno(errno.EOPNOTSUPP, raw_fallocate, fd, 0, 4096)
        os.close(fd)
        expect_errno(err, os.truncate, f, 5)
        assert f.read_bytes() == b"hello world"
        os.truncate(f, 0)  # truncating a path to zero is how HDFS FUSE overwrites: allowed
        assert f.stat().st_size == 0
        f.write_bytes(b"first version")
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # overwrite-by-O_TRUNC works
        os.write(fd, b"second")
        os.close(fd)
        assert (m.backing / "f").read_bytes() == b"second"
        os.replace(f, m.path / "g")  # rename works
        assert os.listdir(m.path) == ["g"]
        assert m.faults() == {"ftruncate": 2, "truncate": 1, "fallocate": 1}


@pytest.mark.mounts
def test_objectstore_allows_only_appends() -> None:
    with hostile_mount("objectstore") as m:
        f = m.path / "f"
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"abc")
        expect_errno(errno.EPERM, os.pwrite, fd, b"X", 0)  # seek back
        expect_errno(errno.EPERM, os.pwrite, fd, b"Y", 10)  # hole
        os.write(fd, b"def")  # at the end: fine
        os.lseek(fd, 1, os.SEEK_SET)
        expect_errno(errno.EPERM, os.write, fd, b"Q")
        expect_errno(errno.EPERM, os.ftruncate, fd, 6)
        expect_errno(errno.EOPNOTSUPP, raw_fallocate, fd, 0, 4096)
        os.close(fd)
        assert (m.backing / "f").read_bytes() == b"abcdef"
        assert f.read_bytes() == b"abcdef"
        expect_errno(errno.EPERM, os.truncate, f, 0)
        expect_errno(errno.EPERM, os.truncate, f, 2)
        with open(f, "wb") as handle:  # O_TRUNC on open still replaces the object
            handle.write(b"new")
        with open(f, "ab") as handle:  # appending is writing at the end
            handle.write(b"+tail")
        assert f.read_bytes() == b"new+tail"
        os.replace(f, m.path / "g")
        assert os.listdir(m.path) == ["g"]
        assert nonzero(m.faults()) == {"write": 3, "ftruncate": 1, "truncate": 2, "fallocate": 1}


@pytest.mark.mounts
def test_mountpoint_s3_semantics() -> None:
    with hostile_mount("mountpoint") as m:
        f = m.path / "obj"
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"abc")
        # While it is being written: listed, but not readable, not deletable, no 2nd writer.
        assert os.listdir(m.path) == ["obj"]
        expect_errno(errno.EPERM, os.open, f, os.O_RDONLY)
        expect_errno(errno.EPERM, os.open, f, os.O_WRONLY | os.O_TRUNC)
        expect_errno(errno.EPERM, os.unlink, f)
        expect_errno(errno.EINVAL, os.pwrite, fd, b"X", 0)
        expect_errno(errno.EINVAL, os.pwrite, fd, b"X", 100)
        expect_errno(errno.EPERM, os.ftruncate, fd, 3)
        expect_errno(errno.EOPNOTSUPP, raw_fallocate, fd, 0, 4096)
        os.utime(f, ns=(5, 5))  # times may change only while writing
        os.write(fd, b"def")
        os.fsync(fd)  # completes the upload
        expect_errno(errno.EBADF, os.write, fd, b"late")
        os.close(fd)
        assert f.read_bytes() == b"abcdef"
        # An existing object can be replaced only with O_TRUNC.
        expect_errno(errno.EPERM, os.open, f, os.O_WRONLY)
        expect_errno(errno.EPERM, os.open, f, os.O_RDWR)
        expect_errno(errno.EPERM, os.open, f, os.O_WRONLY | os.O_APPEND)
        with open(f, "wb") as handle:
            handle.write(b"replaced")
        assert f.read_bytes() == b"replaced"
        expect_errno(errno.ENOSYS, os.rename, f, m.path / "other")
        expect_errno(errno.EPERM, os.chmod, f, 0o600)
        expect_errno(errno.EPERM, os.chown, f, 1, 1)
        expect_errno(errno.ENOSYS, os.symlink, "obj", m.path / "sym")
        expect_errno(errno.EPERM, os.link, f, m.path / "hard")
        expect_errno(errno.EPERM, os.truncate, f, 0)
        expect_errno(errno.EPERM, os.utime, f, None)
        os.mkdir(m.path / "dir")
        os.unlink(f)  # committed objects can be deleted
        os.rmdir(m.path / "dir")
        assert os.listdir(m.path) == []
        assert nonzero(m.faults()) == {
            "open": 5,
            "unlink": 1,
            "write": 3,
            "ftruncate": 1,
            "fallocate": 1,
            "rename": 1,
            "chmod": 1,
            "chown": 1,
            "symlink": 1,
            "link": 1,
            "truncate": 1,
            "utimens": 1,
        }


@pytest.mark.mounts
def test_close_eio_discards_written_files_only() -> None:
    with hostile_mount("close-eio") as m:
        (m.backing / "keep.bin").write_bytes(b"precious")
        with open(m.path / "keep.bin", "rb") as handle:  # read-only: closes fine
            assert handle.read() == b"precious"
        os.close(os.open(m.path / "keep.bin", os.O_RDWR))  # opened for writing, not written
        assert (m.backing / "keep.bin").read_bytes() == b"precious"

        fd = os.open(m.path / "lost.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"data")
        assert (m.backing / "lost.bin").read_bytes() == b"data"  # there until the "upload"
        expect_errno(errno.EIO, os.close, fd)
        assert not (m.path / "lost.bin").exists() and not (m.backing / "lost.bin").exists()

        with pytest.raises(OSError) as info, open(m.path / "py.bin", "wb") as handle:
            handle.write(b"data")
        assert info.value.errno == errno.EIO

        # The safetensors pattern: write a temp, rename it over the target, close.
        fd = os.open(m.path / ".tmp", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"weights")
        os.replace(m.path / ".tmp", m.path / "model.bin")
        expect_errno(errno.EIO, os.close, fd)
        assert not (m.path / "model.bin").exists()

        fd = os.open(m.path / "synced.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"data")
        expect_errno(errno.EIO, os.fsync, fd)
        assert not (m.backing / "synced.bin").exists()
        expect_errno(errno.EIO, os.write, fd, b"more")  # the upload failed for good
        expect_errno(errno.EIO, os.close, fd)

        assert os.listdir(m.path) == ["keep.bin"]
        assert m.faults() == {"flush": 4, "fsync": 1, "write": 1}


@pytest.mark.mounts
def test_slow_mode_throttles_writes() -> None:
    chunk = os.urandom(1_000_000)
    with hostile_mount("slow", mbps=100) as m:
        assert m.mbps == 100
        fd = os.open(m.path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        start = time.perf_counter()
        for _ in range(20):
            os.write(fd, chunk)
        elapsed = time.perf_counter() - start
        os.close(fd)
        assert elapsed >= 0.18, f"20 MB at 100 MB/s took only {elapsed:.3f} s"
        assert (m.backing / "f").stat().st_size == 20_000_000


# -- real safetensors 0.8 saves ------------------------------------------------------------

# mode -> (errno the save fails with or None, fault that must fire, leftovers in the listing)
SAFETENSORS_OUTCOME: dict[str, tuple[int | None, str | None, str]] = {
    # ftruncate (File::set_len) fails; the tempfile crate unlinks its .tmp on drop: no leftover.
    "hdfs": (errno.ENOSYS, "ftruncate", "nothing"),
    "eopnotsupp": (errno.EOPNOTSUPP, "ftruncate", "nothing"),
    "objectstore": (errno.EPERM, "ftruncate", "nothing"),
    # Same failure, but the cleanup unlink hits a file still open for writing (EPERM), so a
    # stray empty .tmpXXXXXX stays behind.
    "mountpoint": (errno.EPERM, "ftruncate", "stray tmp"),
    # "Succeeds": the rename happens before close, close() says EIO, nobody checks, data gone.
    "close-eio": (None, "flush", "nothing"),
    "slow": (None, None, "target"),
    "passthrough": (None, None, "target"),
}


@pytest.mark.mounts
@pytest.mark.parametrize("mode", MODES)
def test_safetensors_save_outcome(mode: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    err, fault, leftovers = SAFETENSORS_OUTCOME[mode]
    tensors = {"a": torch.arange(10)}
    with hostile_mount(mode) as m:
        target = m.path / "x.safetensors"
        if err is not None:
            with pytest.raises(Exception, match=rf"os error {err}\b"):
                save_file(tensors, target)
        else:
            save_file(tensors, target)  # no error reported, whatever happened to the bytes
        listing = sorted(os.listdir(m.path))
        if leftovers == "nothing":
            assert listing == []
        elif leftovers == "stray tmp":
            assert len(listing) == 1 and TMP_NAME.match(listing[0]), listing
            assert (m.path / listing[0]).stat().st_size == 0
        else:
            assert listing == ["x.safetensors"]
            assert torch.equal(load_file(target)["a"], tensors["a"])
        if fault is not None:
            assert m.faults()[fault] == 1, m.faults()
        else:
            assert nonzero(m.faults()) == {}


# -- lifecycle: nothing leaks ----------------------------------------------------------------


@pytest.mark.mounts
def test_teardown_unmounts_reaps_and_cleans() -> None:
    with hostile_mount("hdfs") as m:
        pid, path, backing = m.server_pid, m.path, m.backing
        assert pid is not None and mounted(path) and not process_gone(pid)
        fd = os.open(path / "f", os.O_RDWR | os.O_CREAT, 0o644)
        expect_errno(errno.ENOSYS, os.ftruncate, fd, 1)
        os.close(fd)
    assert not mounted(path)
    assert process_gone(pid)
    assert not path.exists() and not backing.exists()  # both were temp dirs of ours
    assert m.faults()["ftruncate"] == 1  # counts survive the unmount
    assert not m.is_mounted()


@pytest.mark.mounts
def test_exception_in_block_still_unmounts_even_with_open_files() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="test body failed"), hostile_mount("passthrough") as m:
        pid, path = m.server_pid, m.path
        held = os.open(path / "held", os.O_RDWR | os.O_CREAT, 0o644)  # makes umount EBUSY
        raise RuntimeError("test body failed")
    assert pid is not None
    assert not mounted(path) and process_gone(pid)
    assert time.monotonic() - start < 8
    try:
        os.close(held)
    except OSError:
        pass  # the connection is gone: ENOTCONN is fine


@pytest.mark.mounts
def test_given_mountpoint_and_backing(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    (backing / "existing").write_bytes(b"old")
    mountpoint = tmp_path / "deep" / "mnt"  # created for us, removed afterwards
    with hostile_mount("passthrough", mountpoint, backing=backing) as m:
        assert m.path == mountpoint.resolve() and m.backing == backing.resolve()
        assert (m.path / "existing").read_bytes() == b"old"
        (m.path / "new").write_bytes(b"new")
    assert not mountpoint.exists() and (tmp_path / "deep").exists()
    assert sorted(os.listdir(backing)) == ["existing", "new"]  # a given backing dir is kept

    empty = tmp_path / "empty"
    empty.mkdir()
    with hostile_mount("passthrough", str(empty), backing=str(backing)) as m:
        assert sorted(os.listdir(m.path)) == ["existing", "new"]
    assert empty.is_dir() and not mounted(empty)  # an existing mountpoint dir is kept


@pytest.mark.mounts
def test_server_unmounts_itself_when_the_parent_dies(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import json, os, sys
        from safestage.testing import HostileMount
        m = HostileMount("passthrough").start()
        print(json.dumps({"pid": m.server_pid, "path": str(m.path), "backing": str(m.backing)}), flush=True)
        os._exit(0)  # no teardown at all
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=30)
    info = json.loads(out.stdout)
    deadline = time.monotonic() + 10
    while (mounted(Path(info["path"])) or not process_gone(info["pid"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mounted(Path(info["path"])), "orphaned server left its mount behind"
    assert process_gone(info["pid"]), "orphaned server still running"
    assert not Path(info["path"]).exists() and not Path(info["backing"]).exists()


@pytest.mark.mounts
def test_mountpoint_commits_only_on_the_openers_close() -> None:
    """mountpoint-s3 SEMANTICS.md: a close by another process than the opener (a forked
    child's copy of the descriptor) does not complete the upload; the opener's close does."""
    with hostile_mount("mountpoint") as m:
        fd = os.open(m.path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"a" * 100)
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # closes the child's copy: FUSE FLUSH from another pid
        os.waitpid(pid, 0)
        os.write(fd, b"b" * 100)  # still the uncommitted upload: allowed
        os.close(fd)
        assert (m.path / "f").read_bytes() == b"a" * 100 + b"b" * 100
        assert nonzero(m.faults()) == {}
        fd = os.open(m.path / "g", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"c")
        os.close(fd)  # the opener's close commits: no more writes, a reader may open it
        assert (m.path / "g").read_bytes() == b"c"
