"""Mounting machinery: start the hostile FUSE server in its own process, wait, tear down.

The server never runs in the caller's process: a FUSE server that shares a GIL (or a fork) with
the process doing I/O on its mountpoint can deadlock. This module imports only the standard
library; mfusepy is imported by the server process alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Optional, Union

log = logging.getLogger("safestage.testing")

MODES: tuple[str, ...] = (
    "hdfs",
    "eopnotsupp",
    "objectstore",
    "mountpoint",
    "close-eio",
    "slow",
    "passthrough",
)
DEFAULT_SLOW_MBPS = 200.0
MOUNT_TIMEOUT = 15.0
_COMMAND_TIMEOUT = 10.0
_SERVER_SCRIPT = Path(__file__).with_name("_server.py")
_EXIT_NO_FUSE = 3  # keep in sync with _server.EXIT_NO_FUSE
_DEV_FUSE = "/dev/fuse"

PathLike = Union[str, "os.PathLike[str]"]

_INSTALL_HINT = (
    "To fix: install libfuse3 and fusermount3 (`apt-get install fuse3`), the Python binding "
    "(`pip install 'safestage[testing]'`, which brings mfusepy), make sure /dev/fuse exists "
    "(in a container: `--device /dev/fuse --cap-add SYS_ADMIN`), and run as root or with "
    "fusermount3 on PATH."
)


class FuseUnavailable(RuntimeError):
    """This machine cannot mount the hostile filesystems; the message says what is missing."""


class RealMountUnavailable(FuseUnavailable):
    """A real third-party mount (rclone, s3fs, the moto S3 server) cannot be made here: the
    message names the missing tool and how to install it. A FuseUnavailable, so callers that
    already handle a missing FUSE handle this too."""


def fuse_available() -> tuple[bool, str]:
    """Probe whether a hostile mount can be made here: ``(ok, reason)``.

    Checks what the machine can do, not what it is called: /dev/fuse opens read-write, a way to
    mount exists (root, or fusermount3 on PATH), libfuse 3 loads, mfusepy is importable (it is
    looked up, not imported: importing it is the server process's job).
    """
    problems = [p for p in (_probe_dev_fuse(), _probe_mounter(), _probe_libfuse(), _probe_mfusepy()) if p]
    if problems:
        return False, "; ".join(problems)
    return True, f"{_DEV_FUSE} opens, libfuse3 loads, mfusepy found, {_mounter_description()}"


def fuse_device_problem() -> Optional[str]:
    """What stops any FUSE mount here, whatever the server (no /dev/fuse, no way to mount), or None."""
    problems = [p for p in (_probe_dev_fuse(), _probe_mounter()) if p]
    return "; ".join(problems) or None


def _probe_dev_fuse() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return f"FUSE kit needs Linux, this is {sys.platform}"
    if not os.path.exists(_DEV_FUSE):
        return f"{_DEV_FUSE} is missing (no fuse kernel module, or a container without the device)"
    try:
        os.close(os.open(_DEV_FUSE, os.O_RDWR))
    except OSError as exc:
        return f"{_DEV_FUSE} cannot be opened read-write: {exc.strerror}"
    return None


def _probe_mounter() -> Optional[str]:
    if os.geteuid() == 0 or shutil.which("fusermount3"):
        return None
    return "not root and no fusermount3 on PATH (apt-get install fuse3)"


def _mounter_description() -> str:
    return "running as root" if os.geteuid() == 0 else "fusermount3 on PATH"


def _probe_libfuse() -> Optional[str]:
    name = ctypes.util.find_library("fuse3")
    if name is None:
        return "libfuse3 not found (apt-get install fuse3, or libfuse3-3)"
    try:
        version = int(ctypes.CDLL(name).fuse_version())
    except (OSError, AttributeError) as exc:
        return f"libfuse3 ({name}) does not load: {exc}"
    if version < 30:
        return f"{name} reports FUSE API {version}, need 3.x"
    return None


def _probe_mfusepy() -> Optional[str]:
    if importlib.util.find_spec("mfusepy") is None:
        return "Python package mfusepy is not installed (pip install 'safestage[testing]')"
    return None


def _unescape_mountinfo(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_fstype(path: PathLike) -> Optional[str]:
    """The filesystem type mounted exactly at ``path`` (per /proc/self/mountinfo), or None."""
    target = os.path.realpath(path)
    found: Optional[str] = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
            for line in info:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) >= 5 and _unescape_mountinfo(fields[4]) == target:
                    found = right.split()[0] if right else "?"  # the last one stacked wins
    except FileNotFoundError:
        return None
    return found


def _is_our_mount(path: PathLike) -> bool:
    fstype = mount_fstype(path)
    return fstype is not None and fstype.startswith("fuse")


class HostileMount:
    """One hostile FUSE mount: a server process serving ``backing`` at ``path`` in ``mode``.

    Use :func:`hostile_mount` or this class as a context manager. Attributes: ``path`` (the
    mountpoint), ``backing`` (the directory really holding the bytes), ``mode``, ``mbps``
    (write throttle or None), ``lookup_errors``, ``server_pid``. :meth:`faults` returns how often each fault fired.
    """

    def __init__(
        self,
        mode: str,
        path: Optional[PathLike] = None,
        *,
        mbps: Optional[float] = None,
        backing: Optional[PathLike] = None,
        timeout: float = MOUNT_TIMEOUT,
        lookup_errors: Optional[dict[str, int]] = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown hostile mode {mode!r}; choose one of {', '.join(MODES)}")
        if mbps is not None and mbps <= 0:
            raise ValueError(f"mbps must be positive, got {mbps!r}")
        self.mode = mode
        # The throttle applies to any mode given mbps; "slow" defaults it to 200 MB/s.
        self.mbps: Optional[float] = mbps if mbps is not None else (DEFAULT_SLOW_MBPS if mode == "slow" else None)
        self.timeout = timeout
        self.lookup_errors = dict(lookup_errors or {})
        self._requested_path = path
        self._requested_backing = backing
        self.path = Path()
        self.backing = Path()
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._ctl: Optional[Path] = None
        self._owned_dirs: list[Path] = []  # removed on stop, in reverse order
        self._last_faults: dict[str, int] = {}
        self._last_log = ""

    # -- public ---------------------------------------------------------------------------

    @property
    def server_pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def is_mounted(self) -> bool:
        return self._proc is not None and _is_our_mount(self.path)

    def faults(self) -> dict[str, int]:
        """How many times each fault fired so far, e.g. ``{"ftruncate": 1, "truncate": 0}``.

        Every fault the mode can fire is listed, zero or not. Still readable after unmount
        (the last counts are kept).
        """
        if self._ctl is not None:
            try:
                text = (self._ctl / "faults.json").read_text(encoding="utf-8")
                self._last_faults = {str(k): int(v) for k, v in json.loads(text).items()}
            except (FileNotFoundError, ValueError):
                pass  # not written yet, or the server is gone: keep the last good counts
        return dict(self._last_faults)

    def server_log(self) -> str:
        """What the server wrote to stderr (its logging), for debugging a failing test."""
        if self._ctl is not None:
            with contextlib.suppress(FileNotFoundError):
                self._last_log = (self._ctl / "server.log").read_text(encoding="utf-8", errors="replace")
        return self._last_log

    def start(self) -> HostileMount:
        if self._proc is not None:
            raise RuntimeError("this HostileMount is already started")
        ok, reason = fuse_available()
        if not ok:
            raise FuseUnavailable(f"cannot mount a FUSE filesystem here: {reason}. {_INSTALL_HINT}")
        try:
            self._prepare_dirs()
            self._spawn()
            self._wait_mounted()
        except BaseException:
            self.stop()
            raise
        log.debug("mounted %s (%s) over %s, server pid %s", self.path, self.mode, self.backing, self.server_pid)
        return self

    def stop(self) -> None:
        """Unmount, stop the server, remove the directories we created. Idempotent, bounded."""
        try:
            if self._proc is not None:
                politely = False
                try:
                    politely = self._unmount()
                finally:
                    # After a polite unmount the server exits within milliseconds. After a lazy
                    # one it keeps serving the files the caller still holds open: stop it now.
                    self._reap(grace=5.0 if politely else 0.2)
                    if _is_our_mount(self.path):  # the server died without unmounting
                        self._run_quietly(["umount", "-l", str(self.path)])
        finally:
            self.faults()
            self.server_log()
            self._remove_owned_dirs()

    def __enter__(self) -> HostileMount:
        return self.start()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "mounted" if self.is_mounted() else "not mounted"
        return f"<HostileMount {self.mode} {self.path} over {self.backing} ({state})>"

    # -- start ----------------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        self._ctl = Path(tempfile.mkdtemp(prefix="safestage-ctl-"))
        self._owned_dirs.append(self._ctl)
        self.backing = self._make_backing()
        self.path = self._make_mountpoint()
        if self.path == self.backing or self.backing in self.path.parents or self.path in self.backing.parents:
            # A mountpoint inside its own backing dir makes the server call into itself.
            raise ValueError(f"mountpoint {self.path} and backing {self.backing} must not nest")

    def _make_backing(self) -> Path:
        if self._requested_backing is None:
            backing = Path(tempfile.mkdtemp(prefix="safestage-backing-"))
            self._owned_dirs.append(backing)
            return backing
        backing = Path(self._requested_backing)
        backing.mkdir(parents=True, exist_ok=True)
        return Path(os.path.realpath(backing))

    def _make_mountpoint(self) -> Path:
        if self._requested_path is None:
            path = Path(tempfile.mkdtemp(prefix="safestage-mnt-"))
            self._owned_dirs.append(path)
            return path
        path = Path(self._requested_path)
        if not path.exists():
            path.mkdir(parents=True)
            self._owned_dirs.append(Path(os.path.realpath(path)))
        path = Path(os.path.realpath(path))
        if not path.is_dir():
            raise ValueError(f"mountpoint {path} is not a directory")
        if mount_fstype(path) is not None:
            raise ValueError(f"{path} is already a mount point ({mount_fstype(path)})")
        if any(path.iterdir()):
            raise ValueError(f"mountpoint {path} is not empty (its contents would be hidden)")
        return path

    def _server_command(self) -> list[str]:
        assert self._ctl is not None
        cmd = [
            sys.executable,
            str(_SERVER_SCRIPT),
            "--mode", self.mode,
            "--backing", str(self.backing),
            "--mountpoint", str(self.path),
            "--faults-file", str(self._ctl / "faults.json"),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        if self.mbps is not None:
            cmd += ["--mbps", repr(float(self.mbps))]
        for name, err in self.lookup_errors.items():
            cmd += ["--lookup-error", f"{name}={int(err)}"]
        for directory in self._owned_dirs:
            cmd += ["--orphan-cleanup", str(directory)]
        return cmd

    def _spawn(self) -> None:
        assert self._ctl is not None
        cmd = self._server_command()
        # stderr to a file, not a pipe: a chatty server must never block on a full pipe.
        with open(self._ctl / "server.log", "wb") as log_file:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C aimed at the test run must not kill the server before
                # our teardown unmounts it.
                start_new_session=True,
                close_fds=True,
            )

    def _wait_mounted(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        while not _is_our_mount(self.path):
            code = self._proc.poll()
            if code is not None:
                self._raise_server_died(code)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"hostile FUSE server ({self.mode}) did not mount {self.path} within "
                    f"{self.timeout:.0f} s; its log:\n{self.server_log()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _raise_server_died(self, code: int) -> None:
        text = self.server_log()
        if code == _EXIT_NO_FUSE:
            raise FuseUnavailable(f"the FUSE server cannot load libfuse/mfusepy:\n{text}\n{_INSTALL_HINT}")
        raise RuntimeError(
            f"hostile FUSE server ({self.mode}) exited with status {code} before mounting "
            f"{self.path}; its log:\n{text}"
        )

    # -- stop -----------------------------------------------------------------------------

    def _unmount(self) -> bool:
        """Unmount; True if a polite (non-lazy) unmount did it.

        Polite first (the server's loop ends and it exits by itself), then lazy: a lazy unmount
        succeeds even if the caller still holds files open on the mount (EBUSY otherwise).
        """
        path = str(self.path)
        polite = (["fusermount3", "-u", path], ["umount", path])
        lazy = (["fusermount3", "-u", "-z", path], ["umount", "-l", path])
        if not _is_our_mount(self.path):
            return True  # the server is gone already (and took its mount with it)
        for cmd in polite:
            self._run_quietly(cmd)
            if not _is_our_mount(self.path):
                return True
        for cmd in lazy:
            self._run_quietly(cmd)
            if not _is_our_mount(self.path):
                return False
        log.warning("could not unmount %s: %s", path, self.server_log()[-2000:])
        return False

    def _reap(self, grace: float) -> None:
        proc = self._proc
        if proc is None:
            return
        for action, wait in ((None, grace), (proc.terminate, 3.0), (proc.kill, 5.0)):
            if action is not None:
                with contextlib.suppress(ProcessLookupError):
                    action()
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if proc.returncode not in (0, None):
            log.debug("hostile FUSE server exited with %s", proc.returncode)

    def _remove_owned_dirs(self) -> None:
        owned, self._owned_dirs = self._owned_dirs, []
        for directory in reversed(owned):
            if _is_our_mount(directory):
                log.warning("not removing %s: still mounted", directory)
                continue
            shutil.rmtree(directory, ignore_errors=True)
        self._ctl = None

    @staticmethod
    def _run_quietly(cmd: list[str]) -> None:
        if shutil.which(cmd[0]) is None:
            return
        try:
            subprocess.run(cmd, capture_output=True, timeout=_COMMAND_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("%s failed: %s", cmd, exc)


class KeptMount(HostileMount):
    """A hostile mount that outlives the process that made it (``safestage kit up``): the
    server does not watch its parent, and the mountpoint, the backing directory and the
    server's log stay until :func:`unmount_kept` (``safestage kit down``)."""

    def _server_command(self) -> list[str]:
        cmd = super()._server_command()
        at = cmd.index("--parent-pid")
        del cmd[at : at + 2]
        while "--orphan-cleanup" in cmd:
            at = cmd.index("--orphan-cleanup")
            del cmd[at : at + 2]
        return cmd

    def start(self) -> KeptMount:
        super().start()
        self._owned_dirs = []  # kept: the caller unmounts with unmount_kept()
        return self

    @property
    def log_path(self) -> Path:
        assert self._ctl is not None
        return self._ctl / "server.log"


def is_kit_mount(path: PathLike) -> bool:
    """Whether a hostile mount of this kit is mounted exactly at ``path``."""
    return mount_fstype(path) == "fuse.safestage"


def unmount_kept(path: PathLike) -> bool:
    """Unmount the kit mount at ``path``; its server then exits. True if no process held a
    file open on it; False if it was busy and was unmounted lazily (the server serves those
    files until they are closed). ValueError if no kit mount is there."""
    if not is_kit_mount(path):
        raise ValueError(f"{path} is not a mount of the safestage kit (mounted: {mount_fstype(path)})")
    target = os.path.realpath(path)
    for lazy, cmds in ((False, (["fusermount3", "-u", target], ["umount", target])),
                       (True, (["fusermount3", "-u", "-z", target], ["umount", "-l", target]))):  # fmt: skip
        for cmd in cmds:
            HostileMount._run_quietly(cmd)
            if not is_kit_mount(target):
                return not lazy
    raise RuntimeError(f"could not unmount {target}: try `umount -l {target}` as root")


@contextlib.contextmanager
def hostile_mount(
    mode: str,
    path: Optional[PathLike] = None,
    mbps: Optional[float] = None,
    backing: Optional[PathLike] = None,
    lookup_errors: Optional[dict[str, int]] = None,
) -> Iterator[HostileMount]:
    """Mount a hostile filesystem for the duration of a ``with`` block.

    ``path``: the mountpoint (created if missing, must be empty; None: a fresh temp dir).
    ``backing``: where the bytes really go (None: a fresh temp dir under the system temp dir,
    removed afterwards; a given directory is kept). ``mbps``: throttle writes to that many MB/s
    (mode ``slow`` defaults to 200). ``lookup_errors``: {name or path: errno}, a lookup of that
    path (relative to the mountpoint), or of an entry of that name in any directory, fails with
    that errno (counted as the fault ``lookup``), whether or not it exists. Unmounts even if the block raises.
    """
    mount = HostileMount(mode, path, mbps=mbps, backing=backing, lookup_errors=lookup_errors)
    mount.start()
    try:
        yield mount
    finally:
        mount.stop()
