"""What do real third-party mounts do with the syscalls a checkpoint save makes?

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/real_mounts.py [--mb 256] [--json out.json]
        [--only rclone-s3 ...] [--probe-trials 5]

Mounts each of ``safestage.testing.REAL_MODES`` (rclone-local, rclone-s3, s3fs; S3 = moto on
127.0.0.1), runs every operation below in a fresh directory on it, and prints one table:
operation -> result (``ok``, an errno name, or what was observed). Then the rename-probe study
(which probe sequence leaves nothing behind, checked again after waiting and after a remount),
a plain ``safetensors.torch.save_file``, and a timed sequential copy of ``--mb`` MiB (MB/s).
tests/test_real_mounts.py asserts the same facts; this script is for reading them all at once.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import mmap
import os
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from safestage.testing import REAL_MODES, RealMount, real_mount

Result = str
DELAYS = (0.1, 1.0, 3.0)  # listing checks after unlink/rename: does a name reappear?


def err(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def attempt(fn: Callable[[], Any]) -> str:
    """``ok`` (or the value), or the errno name the call failed with."""
    try:
        value = fn()
    except OSError as exc:
        return err(exc)
    return "ok" if value is None else str(value)


def write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def fresh(mount: RealMount) -> Path:
    directory = mount.path / f"c-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    return directory


# -- operations: each gets a fresh directory and returns what happened ------------------------


def op_create_write_close(d: Path) -> Result:
    data = os.urandom(1 << 20)
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    for i in range(0, len(data), 65536):
        os.write(fd, data[i : i + 65536])
    closed = attempt(lambda: os.close(fd))
    size = os.stat(d / "f").st_size
    same = (d / "f").read_bytes() == data
    return f"close {closed}, size after close {size}/{len(data)}, read back {'equal' if same else 'DIFFERENT'}"


def op_ftruncate_grow(d: Path) -> Result:
    fd = os.open(d / "f", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        return attempt(lambda: os.ftruncate(fd, 4096))  # what safetensors' set_len does
    finally:
        os.close(fd)


def op_ftruncate_shrink(d: Path) -> Result:
    fd = os.open(d / "f", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"0123456789")
        return attempt(lambda: os.ftruncate(fd, 5))
    finally:
        os.close(fd)


def op_truncate_path_zero(d: Path) -> Result:
    write_file(d / "f", b"old content")
    text = attempt(lambda: os.truncate(d / "f", 0))
    return f"{text}, size {os.stat(d / 'f').st_size}"


def op_otrunc_overwrite(d: Path) -> Result:
    write_file(d / "f", b"old content, long")

    def overwrite() -> None:
        fd = os.open(d / "f", os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, b"new")
        finally:
            os.close(fd)

    text = attempt(overwrite)
    return f"{text}, content {(d / 'f').read_bytes()!r}"


def op_replace_new_name(d: Path) -> Result:
    write_file(d / "a", b"A")
    text = attempt(lambda: os.replace(d / "a", d / "b"))
    return f"{text}, listing {sorted(os.listdir(d))}"


def op_replace_over_existing(d: Path) -> Result:
    write_file(d / "a", b"new")
    write_file(d / "b", b"old!")
    text = attempt(lambda: os.replace(d / "a", d / "b"))
    return f"{text}, listing {sorted(os.listdir(d))}, b={(d / 'b').read_bytes()!r}"


def op_rename_open_for_write(d: Path) -> Result:
    fd = os.open(d / "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"first")
    text = attempt(lambda: os.replace(d / "a", d / "b"))
    text2 = attempt(lambda: os.write(fd, b"+second"))
    text3 = attempt(lambda: os.close(fd))
    time.sleep(1.0)
    content = {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}
    return f"rename {text}, write after {text2}, close {text3}; after 1 s: {content}"


def op_chmod(d: Path) -> Result:
    write_file(d / "f", b"x", 0o644)
    text = attempt(lambda: os.chmod(d / "f", 0o640))
    return f"{text}, mode now {oct(stat.S_IMODE(os.stat(d / 'f').st_mode))}"


def op_fchmod(d: Path) -> Result:
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"x")
        text = attempt(lambda: os.fchmod(fd, 0o644))
    finally:
        os.close(fd)
    return f"{text}, mode after close {oct(stat.S_IMODE(os.stat(d / 'f').st_mode))}"


def op_fsync(d: Path) -> Result:
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"x" * 1000)
        return attempt(lambda: os.fsync(fd))
    finally:
        os.close(fd)


def op_pwrite_earlier(d: Path) -> Result:
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"0123456789")
    text = attempt(lambda: os.pwrite(fd, b"X", 0))
    closed = attempt(lambda: os.close(fd))
    got = attempt(lambda: (d / "f").read_bytes())
    return f"pwrite {text}, close {closed}, content {got}"


def op_unlink(d: Path) -> Result:
    write_file(d / "f", b"x")
    return attempt(lambda: os.unlink(d / "f"))


def op_new_file_mode(d: Path) -> Result:
    previous = os.umask(0o022)
    try:
        write_file(d / "a", b"x", 0o666)
        write_file(d / "b", b"x", 0o600)
    finally:
        os.umask(previous)
    modes = [oct(stat.S_IMODE(os.stat(d / n).st_mode)) for n in ("a", "b")]
    return f"0o666&~022 -> {modes[0]}, 0o600 -> {modes[1]}"


_LOCK_CHILD = """
import errno, fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("acquired")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


def op_flock_file(d: Path) -> Result:
    write_file(d / "f", b"x")
    fd = os.open(d / "f", os.O_RDONLY)
    try:
        text = attempt(lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))
        other = subprocess.run([sys.executable, "-c", _LOCK_CHILD, str(d / "f")], capture_output=True, text=True, timeout=30)
        return f"{text}; another process: {other.stdout.strip() or other.stderr.strip()[-200:]}"
    finally:
        os.close(fd)


def op_flock_dir(d: Path) -> Result:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return attempt(lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))
    finally:
        os.close(fd)


def op_mmap_read(d: Path) -> Result:
    data = os.urandom(100_000)
    write_file(d / "f", data)

    def read() -> str:
        with open(d / "f", "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return "equal" if view[:] == data else "DIFFERENT"

    return attempt(read)


def op_excl_existing(d: Path) -> Result:
    write_file(d / "f", b"x")
    return attempt(lambda: os.close(os.open(d / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)))


def op_mkdir_rmdir(d: Path) -> Result:
    made = attempt(lambda: os.mkdir(d / "sub"))
    removed = attempt(lambda: os.rmdir(d / "sub"))
    return f"mkdir {made}, rmdir {removed}, listing {sorted(os.listdir(d))}"


def op_mtime(d: Path) -> Result:
    before = time.time()
    write_file(d / "f", b"x")
    first = os.stat(d / "f").st_mtime
    text = attempt(lambda: os.utime(d / "f", (1_000_000_000, 1_000_000_000)))
    after = os.stat(d / "f").st_mtime
    return f"new file mtime - now = {first - before:+.2f} s; utime {text}, mtime then {after:.0f}"


def op_write_in_place(d: Path) -> Result:
    results = []
    for flags in (0, os.O_APPEND):
        write_file(d / f"f{flags}", b"existing")

        def write(flags: int = flags) -> None:
            fd = os.open(d / f"f{flags}", os.O_WRONLY | flags)
            try:
                os.write(fd, b"N")
            finally:
                os.close(fd)

        results.append(f"{'O_APPEND' if flags else 'plain'} {attempt(write)} -> {(d / f'f{flags}').read_bytes()!r}")
    return ", ".join(results)


def op_unlink_open_for_write(d: Path) -> Result:
    for data in (b"", b"written"):
        fd = os.open(d / f"open-{len(data)}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.unlink(d / f"open-{len(data)}")
        os.close(fd)
    time.sleep(1.0)
    return f"listing 1 s after close: {sorted(os.listdir(d))}"


def op_read_while_written(d: Path) -> Result:
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"x" * 100_000)
        size = os.stat(d / "f").st_size
        return f"stat size {size}; read by another fd: {attempt(lambda: len((d / 'f').read_bytes()))}"
    finally:
        os.close(fd)


def op_reader_of_replaced(d: Path) -> Result:
    write_file(d / "t", b"old")
    with open(d / "t", "rb") as reader:
        write_file(d / "t2", b"new")
        os.replace(d / "t2", d / "t")
        return f"an open reader then reads {reader.read()!r}"


def op_links_fallocate_tmpfile(d: Path) -> Result:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    write_file(d / "t", b"x")
    fd = os.open(d / "fa", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        falloc = "ok" if libc.fallocate(fd, 0, 0, 4096) == 0 else errno.errorcode[ctypes.get_errno()]
    finally:
        os.close(fd)
    return (
        f"link {attempt(lambda: os.link(d / 't', d / 'l'))}, symlink {attempt(lambda: os.symlink('t', d / 's'))}, "
        f"fallocate {falloc}, O_TMPFILE {attempt(lambda: os.close(os.open(d, os.O_TMPFILE | os.O_WRONLY, 0o600)))}"
    )


def op_statvfs(d: Path) -> Result:
    st = os.statvfs(d)
    return f"free {st.f_bavail * st.f_frsize / 2**40:.3g} TiB"


OPERATIONS: dict[str, Callable[[Path], Result]] = {
    "create + sequential write + close": op_create_write_close,
    "ftruncate(fd, 4096) on a new file": op_ftruncate_grow,
    "ftruncate(fd, 5) after writing 10": op_ftruncate_shrink,
    "truncate(path, 0) of a closed file": op_truncate_path_zero,
    "O_TRUNC overwrite of a closed file": op_otrunc_overwrite,
    "os.replace closed file -> new name": op_replace_new_name,
    "os.replace closed file -> existing name": op_replace_over_existing,
    "rename of a file open for writing": op_rename_open_for_write,
    "write into an existing file (no O_TRUNC)": op_write_in_place,
    "unlink while open for writing, then close": op_unlink_open_for_write,
    "stat / read of a file being written": op_read_while_written,
    "reader open while the file is replaced": op_reader_of_replaced,
    "link, symlink, fallocate, O_TMPFILE": op_links_fallocate_tmpfile,
    "statvfs": op_statvfs,
    "chmod 0644 -> 0640": op_chmod,
    "fchmod on the write fd": op_fchmod,
    "fsync of a written fd": op_fsync,
    "pwrite at an earlier offset": op_pwrite_earlier,
    "unlink": op_unlink,
    "mode of a new file (umask 022)": op_new_file_mode,
    "flock(LOCK_EX|LOCK_NB) on a file": op_flock_file,
    "flock on a directory fd": op_flock_dir,
    "mmap read": op_mmap_read,
    "O_EXCL create of an existing name": op_excl_existing,
    "mkdir + rmdir": op_mkdir_rmdir,
    "mtime / utime": op_mtime,
}


# -- listings after unlink / rename, and the rename probe --------------------------------------


def probe_empty(d: Path, tag: str) -> None:
    """safestage 0.x's probe (_publish._can_rename): empty O_EXCL file, close, replace, unlink."""
    source, target = d / f".probe-{tag}-a.tmp", d / f".probe-{tag}-b.tmp"
    os.close(os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    os.replace(source, target)
    os.unlink(target)


def probe_one_byte(d: Path, tag: str) -> None:
    """The recommended probe: the same, but one byte is written before close."""
    source, target = d / f".probe-{tag}-a.tmp", d / f".probe-{tag}-b.tmp"
    fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"\0")
    finally:
        os.close(fd)
    os.replace(source, target)
    os.unlink(target)


def listings_after(mount: RealMount, trials: int) -> dict[str, Any]:
    d = fresh(mount)
    rel = d.relative_to(mount.path).as_posix()
    write_file(d / "unlinked", b"x")
    os.unlink(d / "unlinked")
    write_file(d / "renamed", b"x")
    os.replace(d / "renamed", d / "renamed-to")
    for i in range(trials):
        probe_empty(d, f"empty{i}")
        probe_one_byte(d, f"byte{i}")
    seen: dict[str, Any] = {"0 s": sorted(os.listdir(d))}
    waited = 0.0
    for delay in DELAYS:
        time.sleep(delay - waited)
        waited = delay
        seen[f"{delay:g} s"] = sorted(os.listdir(d))
    mount.remount()
    seen["after remount"] = sorted(os.listdir(d))
    seen["store"] = [o for o in mount.objects() if o.startswith(rel + "/")]
    return seen


def safetensors_plain(mount: RealMount) -> Result:
    import torch
    from safetensors.torch import save_file

    d = fresh(mount)
    tensors = {"w": torch.randn(256, 256)}
    start = time.monotonic()
    try:
        save_file(tensors, str(d / "model.safetensors"))
        outcome = f"ok in {time.monotonic() - start:.2f} s"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    time.sleep(1.0)
    files = {n: (os.stat(d / n).st_size, oct(stat.S_IMODE(os.stat(d / n).st_mode))) for n in sorted(os.listdir(d))}
    return f"{outcome}; after 1 s: {files}"


def sequential_copy(mount: RealMount, mib: int) -> Result:
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as src:
        block = os.urandom(1 << 20)
        for _ in range(mib):
            src.write(block)
        src.flush()
        d = fresh(mount)
        start = time.monotonic()
        with open(src.name, "rb", buffering=0) as inp:
            fd = os.open(d / "big", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            buffer = bytearray(4 << 20)
            while count := inp.readinto(buffer):
                view = memoryview(buffer)[:count]
                while view:
                    view = view[os.write(fd, view) :]
            os.close(fd)
        seconds = time.monotonic() - start
        size = os.stat(d / "big").st_size
        os.unlink(d / "big")
    return f"{mib * 1.048576 / seconds:.0f} MB/s ({mib} MiB in {seconds:.2f} s, size {size})"


@contextlib.contextmanager
def timed_mount(mode: str, timings: dict[str, float]) -> Iterator[RealMount]:
    start = time.monotonic()
    with real_mount(mode) as mount:
        timings["mount s"] = round(time.monotonic() - start, 3)
        yield mount
        start = time.monotonic()
        mount.remount()
        timings["remount s"] = round(time.monotonic() - start, 3)
        start = time.monotonic()
    timings["unmount s"] = round(time.monotonic() - start, 3)


def characterize(mode: str, mib: int, trials: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    timings: dict[str, float] = {}
    with timed_mount(mode, timings) as mount:
        for name, op in OPERATIONS.items():
            try:
                results[name] = op(fresh(mount))
            except Exception as exc:  # the table must show surprises, not stop at them
                results[name] = f"raised {type(exc).__name__}: {exc}"
        results["plain safetensors save_file"] = safetensors_plain(mount)
        results[f"sequential copy {mib} MiB"] = sequential_copy(mount, mib)
        results["listings (unlink, rename, probes)"] = listings_after(mount, trials)
    results["timings"] = timings
    return results


def versions() -> dict[str, str]:
    def first_line(cmd: list[str]) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return (out.stdout or out.stderr).splitlines()[0].strip()

    import importlib.metadata as md

    return {"rclone": first_line(["rclone", "version"]), "s3fs": first_line(["s3fs", "--version"]), "moto": md.version("moto")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB for the timed sequential copy")
    parser.add_argument("--probe-trials", type=int, default=5, help="probes of each kind per mode")
    parser.add_argument("--only", nargs="*", default=list(REAL_MODES), choices=REAL_MODES)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.umask(0o022)
    report = {"versions": versions(), "modes": {m: characterize(m, args.mb, args.probe_trials) for m in args.only}}
    print(f"versions: {report['versions']}\n")
    for mode, results in report["modes"].items():
        print(f"## {mode}")
        for name, value in results.items():
            if isinstance(value, dict):
                print(f"- {name}:")
                for key, item in value.items():
                    print(f"    {key}: {item}")
            else:
                print(f"- {name}: {value}")
        print()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
