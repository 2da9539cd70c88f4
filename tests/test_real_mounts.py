"""Real third-party mounts: the kit's rclone and s3fs mounts, and what they do to the syscalls a
checkpoint save makes. Real tools, a real (local) S3 server, real syscalls; no mocks.

Measured with rclone 1.60.1 (Debian 12), s3fs-fuse 1.90 and moto 5.2.5 (.ci/apt-real.txt,
.ci/constraints-real.txt); benchmarks/real_mounts.py prints the same facts as one table.
Nothing here skips: a missing rclone, s3fs or moto fails every test with what to install.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
from _support import RCLONE, TMP_NAME

from safestage._names import temp_name
from safestage._publish import RENAME_PROBE
from safestage.testing import (
    REAL_MODES,
    FuseUnavailable,
    RealMount,
    RealMountUnavailable,
    real_available,
    real_mount,
    shared_s3_server,
)
from safestage.testing._s3 import ACCESS_KEY, REGION, SECRET_KEY, S3Error

REPO = Path(__file__).resolve().parents[1]
DELAYS = (0.1, 1.0, 3.0)  # when a listing is checked again: does a removed name come back?
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]

each_mode = pytest.mark.parametrize("real_dir", REAL_MODES, indirect=True)


@pytest.fixture(autouse=True)
def _real_tools_required() -> None:
    for mode in REAL_MODES:
        ok, reason = real_available(mode)
        if not ok:
            pytest.fail(f"real mount {mode!r} unavailable: {reason}", pytrace=False)


# -- helpers -----------------------------------------------------------------------------------


def mode_of(directory: Path) -> str:
    """Which real mode a real_dir lives on (from its mount's fstype and source)."""
    path = os.path.realpath(directory) + "/"
    best = ("", "", "")
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            left, _, right = line.partition(" - ")
            point = left.split()[4].rstrip("/") + "/"
            if path.startswith(point) and len(point) > len(best[0]):
                best = (point, *right.split()[:2])
    _, fstype, source = best
    if fstype == "fuse.s3fs":
        return "s3fs"
    assert fstype == "fuse.rclone", f"{directory} is on no real mount ({fstype})"
    return "rclone-local" if source.startswith("/") else "rclone-s3"


def expect_errno(err: int, fn: Callable[..., Any], *args: Any) -> None:
    with pytest.raises(OSError) as info:
        fn(*args)
    got = info.value.errno or 0
    assert got == err, f"{fn.__name__}{args}: expected {errno.errorcode[err]}, got {errno.errorcode.get(got, got)}"


def write_new(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def perm(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def process_state(pid: int) -> str:
    """R, S, D (uninterruptible: waiting on the kernel, e.g. on a FUSE request), Z, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions ``text`` (the tool of a mount names its mountpoint)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def mounted(path: Path) -> bool:
    target = os.path.realpath(path).replace(" ", "\\040")
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        return any(line.split()[4] == target for line in info)


def empty_probe(directory: Path, source: Path, target: Path) -> None:
    """The rename probe of safestage 0.1: an empty file, close, replace, unlink. rclone
    (--vfs-cache-mode off) uploads a never-written file only in FUSE RELEASE, which the kernel
    sends after close(2) has returned: the rename and unlink that follow reach rclone's
    directory cache only ("File is currently open, delaying rename"), then the upload lands
    and is renamed into the unlinked name. (fsync does not help: rclone's Sync is a no-op.)"""
    os.close(os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    os.replace(source, target)
    os.unlink(target)


def relative_objects(mount: RealMount, directory: Path) -> list[str]:
    """What the store holds under ``directory`` (not through the mount), minus the dir itself."""
    prefix = directory.relative_to(mount.path).as_posix() + "/"
    return [o[len(prefix) :] for o in mount.objects() if o.startswith(prefix) and o != prefix]


# -- the kit itself ----------------------------------------------------------------------------


@pytest.mark.mounts
def test_public_api() -> None:
    import safestage.testing as kit

    assert REAL_MODES == ("rclone-local", "rclone-s3", "s3fs")
    assert {"REAL_MODES", "RealMount", "RealMountUnavailable", "real_available", "real_mount"} <= set(kit.__all__)
    assert issubclass(RealMountUnavailable, FuseUnavailable) and issubclass(RealMountUnavailable, RuntimeError)
    for mode in REAL_MODES:
        ok, reason = real_available(mode)
        assert ok is True and reason
    with pytest.raises(ValueError, match="unknown real mode"):
        RealMount("nfs")
    with pytest.raises(ValueError, match="backing= is for rclone-local"):
        RealMount("s3fs", backing="/tmp")


@pytest.mark.mounts
def test_missing_tools_are_loud_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    for mode, hint in (("rclone-local", "apt-get install rclone"), ("rclone-s3", "apt-get install rclone"), ("s3fs", "apt-get install s3fs")):
        ok, reason = real_available(mode)
        assert not ok and hint in reason
        with pytest.raises(RealMountUnavailable, match=re.escape(hint)):
            RealMount(mode).start()
    monkeypatch.undo()

    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "moto" else real_find_spec(name, *a))
    ok, reason = real_available("rclone-s3")
    assert not ok and "pip install 'moto[server]'" in reason
    assert real_available("rclone-local")[0]  # needs no S3 server


@pytest.mark.mounts
@pytest.mark.parametrize("mode", REAL_MODES)
def test_teardown_even_after_an_exception_with_open_files(mode: str) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="test body failed"), real_mount(mode) as m:
        path, pid, bucket = m.path, m.tool_pid, m.bucket
        assert pid is not None and mounted(path) and m.is_mounted()
        assert m.faults() == {}
        write_new(path / "f", b"data")
        held = os.open(path / "f", os.O_RDONLY)  # makes a polite umount EBUSY
        raise RuntimeError("test body failed")
    assert time.monotonic() - start < 15
    assert not mounted(path) and not path.exists()
    assert processes_mentioning(str(path)) == [], "the tool (or its supervisor) survived"
    if bucket is not None:
        with pytest.raises(S3Error, match="404"):
            shared_s3_server().list_objects(bucket)  # the bucket went with the mount
    else:
        assert m.backing is not None and not m.backing.exists()
    assert "mount" in m.server_log() or "s3fs" in m.server_log()  # kept after stop
    with contextlib.suppress(OSError):
        os.close(held)
    m.stop()  # idempotent


@pytest.mark.mounts
def test_remount_keeps_the_bytes(tmp_path: Path) -> None:
    with real_mount("rclone-local", tmp_path / "mnt", backing=tmp_path / "store") as m:
        write_new(m.path / "kept", b"bytes")
        m.remount()
        assert m.is_mounted() and (m.path / "kept").read_bytes() == b"bytes"
        assert m.objects() == ["kept"]
    assert (tmp_path / "store" / "kept").read_bytes() == b"bytes"  # a given backing dir is kept
    assert not (tmp_path / "mnt").exists()


@pytest.mark.mounts
def test_a_killed_parent_leaves_no_mount_tool_or_server() -> None:
    code = textwrap.dedent(
        """
        import json, os
        from safestage.testing import RealMount
        m = RealMount("rclone-s3").start()
        print(json.dumps({"path": str(m.path), "endpoint": m.endpoint}), flush=True)
        os._exit(0)  # no teardown at all: the supervisors must clean up
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    info = json.loads(out.stdout)
    path, port = Path(info["path"]), int(info["endpoint"].rsplit(":", 1)[1])

    def server_answers() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    deadline = time.monotonic() + 15
    while (mounted(path) or processes_mentioning(str(path)) or server_answers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mounted(path), "orphaned rclone left its mount behind"
    assert processes_mentioning(str(path)) == [], "orphaned rclone still running"
    assert not server_answers(), "orphaned S3 server still listening"
    assert not path.exists()


@pytest.mark.mounts
def test_a_parent_killed_while_blocked_in_the_mount_is_cleaned_up_too() -> None:
    """The parent is SIGKILLed while a read of it waits on rclone, which waits on a stalled S3
    server: the kernel cannot finish killing it until the request is answered, so it never
    exits by itself (found when a fault test hung). The supervisors see the pending SIGKILL,
    unmount and stop the tools: the read fails, the parent dies, nothing is left."""
    code = textwrap.dedent(
        """
        import json, os, signal, sys
        from pathlib import Path
        from safestage.testing import RealMount, shared_s3_server
        m = RealMount("rclone-s3").start()
        (m.path / "f").write_bytes(b"x" * 100_000)
        supervisor = shared_s3_server().pid
        moto = int(Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()[0])
        os.kill(moto, signal.SIGSTOP)  # the S3 server hangs: rclone's GET will never return
        print(json.dumps({"path": str(m.path), "moto": moto}), flush=True)
        (m.path / "f").read_bytes()  # blocks in the kernel, waiting for rclone
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        info = json.loads(child.stdout.readline())
        path, moto = Path(info["path"]), int(info["moto"])
        deadline = time.monotonic() + 30
        while process_state(child.pid) != "D" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(child.pid) == "D", "the read never blocked in the mount"
        child.kill()
        child.wait(timeout=30)  # before the fix: never (the supervisor waited for a new ppid)
        deadline = time.monotonic() + 15
        while (mounted(path) or processes_mentioning(str(path))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not mounted(path) and processes_mentioning(str(path)) == []
        deadline = time.monotonic() + 15
        while Path(f"/proc/{moto}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{moto}").exists(), "the stopped S3 server survived"
    finally:
        if child.poll() is None:
            child.kill()


def rclone_env(endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
    env.update(
        RCLONE_CONFIG="/dev/null",
        RCLONE_CONFIG_T_TYPE="s3",
        RCLONE_CONFIG_T_PROVIDER="Other",
        RCLONE_CONFIG_T_ENDPOINT=endpoint,
        RCLONE_CONFIG_T_ACCESS_KEY_ID=ACCESS_KEY,
        RCLONE_CONFIG_T_SECRET_ACCESS_KEY=SECRET_KEY,
        RCLONE_CONFIG_T_REGION=REGION,
    )
    env.update(extra)
    return env


def test_aws_ca_bundle_breaks_rclone_so_the_kit_clears_it(real_mounts: dict[str, Any]) -> None:
    m = real_mounts["rclone-s3"]
    listing = ["rclone", "lsf", f"t:{m.bucket}"]
    ok = subprocess.run(listing, env=rclone_env(m.endpoint), capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    bundle = rclone_env(m.endpoint, AWS_CA_BUNDLE="/etc/ssl/certs/ca-certificates.crt")
    broken = subprocess.run(listing, env=bundle, capture_output=True, text=True, timeout=30)
    assert broken.returncode != 0 and "LoadCustomCABundleError" in broken.stderr, broken.stderr
    assert not any(k.startswith("AWS_") for k in m._env)  # what the kit runs rclone with


def test_multipart_uploads_need_the_moto_header_fix(real_mounts: dict[str, Any], tmp_path: Path) -> None:
    data = os.urandom(12 << 20)  # > rclone's 5 MiB chunk: a multipart upload
    m = real_mounts["rclone-s3"]
    target = m.path / f"big-{uuid.uuid4().hex[:8]}"
    write_new(target, data)
    assert target.read_bytes() == data
    assert f"dropped x-amz-version-id: null from POST /{m.bucket}/{target.name}" in m.s3_log()
    os.unlink(target)

    # The same upload against an unmodified moto server: close() fails with EIO.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    raw = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    mnt = tmp_path / "raw"
    mnt.mkdir()
    rclone = None
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for _ in range(300):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(urllib.request.Request(f"{endpoint}/raw", method="PUT"), timeout=5).close()
                break
            time.sleep(0.05)
        rclone = subprocess.Popen(["rclone", "mount", "t:raw", str(mnt), "--vfs-cache-mode", "off"], env=rclone_env(endpoint), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        for _ in range(200):
            if mounted(mnt):
                break
            time.sleep(0.05)
        fd = os.open(mnt / "big", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        expect_errno(errno.EIO, os.close, fd)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, capture_output=True)
        for proc in (rclone, raw):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
    assert rclone is not None and rclone.stderr is not None
    assert "BadRequest" in rclone.stderr.read().decode()


# -- what each mount does with each syscall ------------------------------------------------------


@each_mode
def test_sequential_write_close_and_read_back(real_dir: Path) -> None:
    data = os.urandom(3 << 20)
    fd = os.open(real_dir / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    for i in range(0, len(data), 1 << 20):
        assert os.write(fd, data[i : i + (1 << 20)]) == 1 << 20
    assert os.fstat(fd).st_size == len(data)
    os.fsync(fd)  # accepted everywhere (rclone: a no-op; the upload happens at close)
    os.close(fd)  # the upload; no error
    assert os.stat(real_dir / "f").st_size == len(data)  # no size lag after close
    assert (real_dir / "f").read_bytes() == data  # readable at once
    with open(real_dir / "f", "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        assert view[:] == data


@each_mode
def test_resizing_and_overwriting(real_dir: Path) -> None:
    rclone = mode_of(real_dir) in RCLONE
    fd = os.open(real_dir / "new", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, 0)  # to the current size: fine everywhere
        if rclone:  # "Can't change size without --vfs-cache-mode >= writes": safetensors' set_len
            expect_errno(errno.EPERM, os.ftruncate, fd, 4096)
            os.write(fd, b"0123456789")
            expect_errno(errno.EPERM, os.ftruncate, fd, 5)
        else:
            os.ftruncate(fd, 4096)
            os.ftruncate(fd, 5)
    finally:
        os.close(fd)

    write_new(real_dir / "old", b"old content")
    os.truncate(real_dir / "old", 0)  # truncate(path, 0): fine everywhere
    assert os.stat(real_dir / "old").st_size == 0
    write_new(real_dir / "over", b"old content")
    with open(real_dir / "over", "wb") as handle:  # O_TRUNC overwrite: fine everywhere
        handle.write(b"new")
    assert (real_dir / "over").read_bytes() == b"new"

    def write_in_place(flags: int) -> None:
        fd = os.open(real_dir / "over", os.O_WRONLY | flags)
        try:
            os.write(fd, b"N")
        finally:
            os.close(fd)

    if rclone:  # an existing file can only be replaced whole
        expect_errno(errno.EPERM, write_in_place, 0)
        expect_errno(errno.EPERM, write_in_place, os.O_APPEND)
        assert (real_dir / "over").read_bytes() == b"new"
    else:
        write_in_place(0)
        write_in_place(os.O_APPEND)
        assert (real_dir / "over").read_bytes() == b"NewN"


@each_mode
def test_out_of_order_write(real_dir: Path) -> None:
    fd = os.open(real_dir / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"0123456789")
        if mode_of(real_dir) in RCLONE:
            start = time.monotonic()  # rclone waits --vfs-write-wait (1 s) for the gap to fill
            expect_errno(errno.ESPIPE, os.pwrite, fd, b"X", 0)
            assert time.monotonic() - start >= 0.9
        else:
            assert os.pwrite(fd, b"X", 0) == 1
    finally:
        os.close(fd)
    expected = b"0123456789" if mode_of(real_dir) in RCLONE else b"X123456789"
    assert (real_dir / "f").read_bytes() == expected


@each_mode
def test_rename_closed_files(real_dir: Path) -> None:
    write_new(real_dir / "a", b"A")
    os.replace(real_dir / "a", real_dir / "b")
    expect_errno(errno.ENOENT, os.stat, real_dir / "a")
    assert sorted(os.listdir(real_dir)) == ["b"] and (real_dir / "b").read_bytes() == b"A"
    write_new(real_dir / "c", b"new")
    os.replace(real_dir / "c", real_dir / "b")  # over an existing name
    assert sorted(os.listdir(real_dir)) == ["b"] and (real_dir / "b").read_bytes() == b"new"


@each_mode
def test_rename_while_open_for_writing(real_dir: Path) -> None:
    fd = os.open(real_dir / "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"first")
        os.replace(real_dir / "a", real_dir / "b")  # rclone: delayed until the upload ends
        os.write(fd, b"+second")
    finally:
        os.close(fd)
    assert sorted(os.listdir(real_dir)) == ["b"]
    assert (real_dir / "b").read_bytes() == b"first+second"


@each_mode
def test_reader_of_a_file_replaced_underneath(real_dir: Path) -> None:
    write_new(real_dir / "t", b"old")
    with open(real_dir / "t", "rb") as reader:
        write_new(real_dir / "t2", b"new")
        os.replace(real_dir / "t2", real_dir / "t")
        # rclone reads by name: an open reader sees the new object. s3fs read the old one
        # into its local cache at open.
        assert reader.read() == (b"new" if mode_of(real_dir) in RCLONE else b"old")


@each_mode
def test_file_modes_chmod_and_fchmod(real_dir: Path) -> None:
    rclone = mode_of(real_dir) in RCLONE
    write_new(real_dir / "a", b"x", 0o666)
    write_new(real_dir / "b", b"x", 0o600)
    assert perm(real_dir / "a") == 0o644  # umask 022 (conftest)
    # rclone: every file is --file-perms (0666) & ~umask, whatever open() asked; s3fs stores it.
    assert perm(real_dir / "b") == (0o644 if rclone else 0o600)
    os.chmod(real_dir / "a", 0o640)  # accepted everywhere, ignored by rclone
    assert perm(real_dir / "a") == (0o644 if rclone else 0o640)
    fd = os.open(real_dir / "c", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"x")
        os.fchmod(fd, 0o644)  # accepted everywhere, and s3fs too forgets it: the upload at
    finally:  # close sends the mode the file was created with
        os.close(fd)
    assert perm(real_dir / "c") == (0o644 if rclone else 0o600)


@each_mode
def test_create_unlink_and_directories(real_dir: Path) -> None:
    write_new(real_dir / "f", b"x")
    expect_errno(errno.EEXIST, write_new, real_dir / "f", b"y")
    os.unlink(real_dir / "f")
    expect_errno(errno.ENOENT, os.stat, real_dir / "f")
    os.mkdir(real_dir / "sub")
    os.rmdir(real_dir / "sub")
    assert os.listdir(real_dir) == []


@each_mode
def test_links_fallocate_and_o_tmpfile(real_dir: Path) -> None:
    mode = mode_of(real_dir)
    write_new(real_dir / "t", b"x")
    expect_errno(errno.EIO if mode in RCLONE else errno.EOPNOTSUPP, os.link, real_dir / "t", real_dir / "l")
    if mode in RCLONE:
        expect_errno(errno.EIO, os.symlink, "t", real_dir / "s")
    else:
        os.symlink("t", real_dir / "s")
    fd = os.open(real_dir / "fa", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert _libc.fallocate(fd, 0, 0, 4096) != 0 and ctypes.get_errno() == errno.EOPNOTSUPP
    finally:
        os.close(fd)
    expect_errno(errno.EOPNOTSUPP, os.open, real_dir, os.O_TMPFILE | os.O_WRONLY, 0o600)


_OTHER_PROCESS_LOCK = """
import errno, fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("acquired")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@each_mode
def test_flock_is_enforced_between_processes(real_dir: Path) -> None:
    # Neither tool implements flock: the kernel keeps the locks itself. They exclude each other
    # on this machine, and only here (not between two machines mounting the same bucket).
    write_new(real_dir / "lock", b"")
    fd = os.open(real_dir / "lock", os.O_RDONLY)
    dir_fd = os.open(real_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other = subprocess.run([sys.executable, "-c", _OTHER_PROCESS_LOCK, str(real_dir / "lock")], capture_output=True, text=True, timeout=30)
        assert other.stdout.strip() == "EAGAIN", other.stderr  # EWOULDBLOCK
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        os.close(dir_fd)


@each_mode
def test_unlink_while_open_for_writing(real_dir: Path) -> None:
    for data in (b"", b"written"):
        name = f"open-{len(data)}"
        fd = os.open(real_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.unlink(real_dir / name)
        os.close(fd)
    time.sleep(0.5)
    if mode_of(real_dir) in RCLONE:
        # The unlink only dropped rclone's directory entry; close then uploaded the file anyway.
        # This is how a failed plain safetensors save leaves its 0-byte .tmpXXXXXX behind.
        assert sorted(os.listdir(real_dir)) == ["open-0", "open-7"]
        assert (real_dir / "open-7").read_bytes() == b"written"
    else:
        assert os.listdir(real_dir) == []


@each_mode
def test_a_reader_of_a_file_being_written(real_dir: Path) -> None:
    """rclone makes any open(2) for reading wait until the file being written has been
    uploaded (vfs File.waitForValidObject: 50 x 100 ms), then fails it with ENOENT; s3fs reads
    its local copy at once."""
    data = os.urandom(100_000)
    fd = os.open(real_dir / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        start = time.monotonic()
        if mode_of(real_dir) in RCLONE:
            expect_errno(errno.ENOENT, os.open, real_dir / "f", os.O_RDONLY | os.O_NONBLOCK)
            assert time.monotonic() - start >= 4.5
        else:
            with open(real_dir / "f", "rb") as reader:
                assert reader.read() == data
            assert time.monotonic() - start < 2
    finally:
        os.close(fd)
    assert (real_dir / "f").read_bytes() == data


def test_replace_onto_rclone_does_not_stall(real_mounts: dict[str, RealMount], stage_root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import safestage

    directory = real_mounts["rclone-s3"].path / f"stall-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    with safestage.staged(stage_root) as stage:
        save_file({"w": torch.zeros(1024)}, str(directory / "model.safetensors"))
    (record,) = stage.records
    assert record.publish == "replace"
    assert record.publish_seconds < 2.0, f"4 KiB published in {record.publish_seconds:.1f} s"


def test_s3fs_uploads_a_file_again_when_it_is_renamed_while_open(real_mounts: dict[str, RealMount]) -> None:
    """s3fs 1.90 renames a file that another descriptor still holds open by uploading it all
    again first, then copying it server-side: three transfers of the bytes instead of two."""
    m = real_mounts["s3fs"]
    directory = m.path / f"reup-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    data = os.urandom(1 << 20)
    uploads = {}
    for held in (False, True):
        source, target = directory / f"src-{held}", directory / f"dst-{held}"
        fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        reader = os.open(source, os.O_RDONLY) if held else None
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.replace(source, target)
        if reader is not None:
            os.close(reader)
        assert target.read_bytes() == data
        uploads[held] = m.s3_log().count(f'"PUT /{m.bucket}/{directory.name}/{source.name} ')
    assert uploads == {False: 1, True: 2}, uploads


def test_replace_onto_s3fs_uploads_the_temp_once(real_mounts: dict[str, RealMount], stage_root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import safestage

    m = real_mounts["s3fs"]
    directory = m.path / f"once-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    with safestage.staged(stage_root) as stage:
        save_file({"w": torch.zeros(1 << 18)}, str(directory / "model.safetensors"))  # 1 MiB
    assert stage.records[0].publish == "replace"
    temp_puts = re.findall(rf'"PUT /{m.bucket}/{directory.name}/\.model\.safetensors\.safestage-\S+ ', m.s3_log())
    assert len(temp_puts) == 1, temp_puts


def test_s3fs_rename_is_not_atomic_for_a_reader(real_mounts: dict[str, RealMount]) -> None:
    """s3fs 1.90: os.replace over a file while another thread reads it in a loop: some opens
    answer ENOENT and some reads see an empty file (the rename is a server-side copy and a
    delete), never part of a version. A reader racing a save on s3fs must retry ENOENT and an
    empty file, with or without safestage."""
    m = real_mounts["s3fs"]
    directory = m.path / f"ren-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    target = directory / "model"
    target.write_bytes(b"\xff" * 100_000)
    stop = threading.Event()
    missing, empty, torn, reads = [], [], [], []

    def reader() -> None:
        while not stop.is_set():
            try:
                data = target.read_bytes()
            except FileNotFoundError:
                missing.append(1)
                continue
            reads.append(1)
            if not data:
                empty.append(1)
            elif len(data) != 100_000 or len(set(data)) != 1:
                torn.append(data[:8])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(200):  # ~1 in 6 opens misses here; stop at the first after 20 renames
            if missing and i >= 20:
                break
            temp = directory / f".tmp{i}"
            temp.write_bytes(bytes([i % 255]) * 100_000)
            os.replace(temp, target)
    finally:
        stop.set()
        thread.join(60)
    assert not torn, torn
    assert reads and missing, f"{len(reads)} reads, {len(missing)} ENOENT: s3fs's rename changed"
    print(f"\n{len(reads)} reads ({len(empty)} empty), {len(missing)} ENOENT")


@each_mode
def test_mtime(real_dir: Path) -> None:
    before = time.time()
    write_new(real_dir / "f", b"x")
    mtime = os.stat(real_dir / "f").st_mtime
    if mode_of(real_dir) == "s3fs":  # stored in whole seconds (x-amz-meta-mtime)
        assert mtime == int(mtime) and before - 1 <= mtime <= time.time()
    else:
        assert before - 0.01 <= mtime <= time.time() + 0.01
    os.utime(real_dir / "f", (1_000_000_000, 1_000_000_000))
    assert os.stat(real_dir / "f").st_mtime == 1_000_000_000


@each_mode
def test_plain_safetensors_save(real_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {"w": torch.arange(4096, dtype=torch.float32)}
    target = real_dir / "model.safetensors"
    if mode_of(real_dir) in RCLONE:
        # safetensors 0.8 sizes its temp file with set_len (ftruncate, EPERM), then deletes it
        # while still open: rclone uploads the empty file at close anyway.
        with pytest.raises(Exception, match="Operation not permitted"):
            save_file(tensors, str(target))
        time.sleep(0.5)
        listing = os.listdir(real_dir)
        assert len(listing) == 1 and TMP_NAME.match(listing[0]), listing
        assert os.stat(real_dir / listing[0]).st_size == 0
    else:
        save_file(tensors, str(target))
        assert os.listdir(real_dir) == ["model.safetensors"]
        assert perm(target) == 0o600  # the tempfile crate's mode, kept by the rename (#782)
        assert torch.equal(load_file(str(target))["w"], tensors["w"])


@each_mode
def test_safestage_saves_onto_each_mount(real_dir: Path, stage_root: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    import safestage
    from safestage._mounts import capabilities

    capabilities.clear()  # probe this mount afresh, whatever earlier tests learnt
    tensors = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    target = real_dir / "model.safetensors"
    with safestage.staged(stage_root):
        save_file(tensors, str(target))
    loaded = load_file(str(target))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert perm(target) == 0o644
    time.sleep(0.5)
    # Besides the final file, only today's rename-probe leftover may be there (rclone only:
    # test_todays_rename_probe_leaves_its_file_on_rclone_s3).
    stray = [n for n in os.listdir(real_dir) if n != "model.safetensors"]
    assert all(RENAME_PROBE in n for n in stray), stray
    if mode_of(real_dir) == "s3fs":
        assert stray == []


# -- names that come back: unlink, rename and the rename probe -----------------------------------


def test_closed_files_stay_unlinked_and_renamed(real_mounts: dict[str, RealMount]) -> None:
    dirs = {}
    for mode, m in real_mounts.items():
        d = m.path / f"gone-{uuid.uuid4().hex[:8]}"
        d.mkdir()
        write_new(d / "unlinked", b"x")
        os.unlink(d / "unlinked")
        write_new(d / "renamed", b"x")
        os.replace(d / "renamed", d / "renamed-to")
        dirs[mode] = d
    waited = 0.0
    for delay in (0.0, *DELAYS):
        time.sleep(delay - waited)
        waited = delay
        for mode, d in dirs.items():
            assert sorted(os.listdir(d)) == ["renamed-to"], f"{mode} after {delay} s"
    for mode, d in dirs.items():
        assert relative_objects(real_mounts[mode], d) == ["renamed-to"], mode


@pytest.mark.mounts
@pytest.mark.parametrize("mode", RCLONE)
def test_rclone_applies_rename_and_unlink_of_an_unreleased_empty_file_to_its_cache_only(mode: str) -> None:
    """The mechanism, made deterministic: a second descriptor (dup) keeps the write handle
    unreleased, as the kernel's asynchronous FUSE RELEASE does for a moment after close()."""
    with real_mount(mode) as m:
        for data in (b"", b"x"):
            source, target = m.path / f"a{len(data)}", m.path / f"b{len(data)}"
            fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            held = os.dup(fd)
            os.close(fd)  # FUSE FLUSH: uploads only if something was written
            os.replace(source, target)
            os.unlink(target)
            assert not {source.name, target.name} & set(os.listdir(m.path))  # all calls succeeded
            os.close(held)  # FUSE RELEASE: the empty file is uploaded now, then renamed
            time.sleep(0.5)
        assert sorted(os.listdir(m.path)) == ["b0"] and m.objects() == ["b0"]
        log = m.server_log()
        assert "b0: Running delayed rename now" in log and "File is currently open, delaying rename" in log


@pytest.mark.mounts
def test_an_empty_rename_probe_leaves_its_file_on_rclone_s3() -> None:
    """Why safestage's probe writes one byte: the probe of safestage 0.1 (an empty file
    created, closed, renamed, unlinked), as plain syscalls. On rclone-s3 about 3 in 4 such
    probes leave their renamed file (1 in 14 on rclone-local; none on s3fs)."""
    with real_mount("rclone-s3") as m:
        names = []
        for _ in range(10):
            source, target = m.path / temp_name(RENAME_PROBE), m.path / temp_name(RENAME_PROBE)
            empty_probe(m.path, source, target)
            names.append(target.name)
            time.sleep(0.05)
        time.sleep(1.0)
        left = m.objects()
        assert left and set(left) <= set(names), left
        assert sorted(os.listdir(m.path)) == left
        # Evidence: the unlink reached only rclone's cache (no DELETE of the name), and the
        # upload landed at close's RELEASE, after the rename had been delayed.
        requests = m.s3_log()
        assert f"DELETE /{m.bucket}/{left[0]} " not in requests
        assert f"{left[0]}: Running delayed rename now" in m.server_log()


@pytest.mark.mounts
def test_staged_saves_leave_no_probe_file_on_rclone_s3(stage_root: Path) -> None:
    """Ten staged saves onto rclone-s3, each probing a fresh directory as a fresh filesystem
    would (the empty probe of safestage 0.1 left its file in about 3 of 4): exactly the saved
    file is listed afterwards, and stored."""
    import torch
    from safetensors.torch import load_file, save_file

    import safestage
    from safestage._mounts import capabilities

    tensors = {"w": torch.arange(1024, dtype=torch.float32)}
    with real_mount("rclone-s3") as m:
        for i in range(10):
            capabilities.clear()
            directory = m.path / f"save-{i}"
            directory.mkdir()
            with safestage.staged(stage_root) as stage:
                save_file(tensors, str(directory / "model.safetensors"))
            assert stage.records[-1].publish == "replace"
            assert torch.equal(load_file(str(directory / "model.safetensors"))["w"], tensors["w"])
            time.sleep(0.05)
        time.sleep(1.0)
        for i in range(10):
            assert os.listdir(m.path / f"save-{i}") == ["model.safetensors"]
        assert sorted(m.objects()) == sorted(f"save-{i}/model.safetensors" for i in range(10))


@pytest.mark.mounts
def test_the_rename_probe_leaves_nothing_anywhere() -> None:
    """safestage's own probe (_publish._can_rename), five times per mode: nothing listed
    right after, after 0.1, 1 and 3 s, after a remount, nor in the store itself."""
    from safestage._mounts import capabilities
    from safestage._publish import _can_rename

    with contextlib.ExitStack() as stack:
        mounts = {mode: stack.enter_context(real_mount(mode)) for mode in REAL_MODES}
        dirs = {}
        for mode, m in mounts.items():
            dirs[mode] = m.path / "probe-here"
            dirs[mode].mkdir()
            write_new(dirs[mode] / "keep", b"k")  # keeps the directory real on S3 after remount
            for _ in range(5):
                capabilities.clear()
                assert _can_rename(dirs[mode], os.stat(dirs[mode]).st_dev) is True
        waited = 0.0
        for delay in (0.0, *DELAYS):
            time.sleep(delay - waited)
            waited = delay
            for mode, d in dirs.items():
                assert os.listdir(d) == ["keep"], f"{mode} after {delay} s"
        for mode, m in mounts.items():
            m.remount()
            assert os.listdir(dirs[mode]) == ["keep"], f"{mode} after remount"
            assert relative_objects(m, dirs[mode]) == ["keep"], mode
