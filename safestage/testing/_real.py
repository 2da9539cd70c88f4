"""Real third-party mounts: rclone and s3fs-fuse, over a local directory or a local S3 bucket.

The hostile modes of :mod:`safestage.testing` are models; these are the tools users really
mount checkpoints with, run unmodified::

    from safestage.testing import real_mount

    with real_mount("rclone-s3") as m:
        save_checkpoint(m.path / "model.safetensors")
        assert m.objects() == ["model.safetensors"]      # what the bucket really holds

Modes (``REAL_MODES``):

- ``rclone-local``: ``rclone mount <dir> <mnt> --vfs-cache-mode off``; ``backing`` is the dir.
- ``rclone-s3``: ``rclone mount`` of a bucket on the local S3 server, ``--vfs-cache-mode off``.
- ``s3fs``: s3fs-fuse on a bucket of the same server.

The S3 server is moto on 127.0.0.1, one per process, one bucket per mount (see ``_s3``). Each
tool runs in the foreground under a supervisor process of ours, in its own session, with a
scrubbed environment and a private config: nothing of the user's rclone or AWS set-up is read.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Optional

from ._mount import MOUNT_TIMEOUT, PathLike, RealMountUnavailable, fuse_device_problem, mount_fstype
from ._process import reap, spawn_supervised
from ._s3 import ACCESS_KEY, MOTO_HINT, REGION, SECRET_KEY, S3Server, shared_s3_server

log = logging.getLogger("safestage.testing")

REAL_MODES: tuple[str, ...] = ("rclone-local", "rclone-s3", "s3fs")

_FSTYPE = {"rclone-local": "fuse.rclone", "rclone-s3": "fuse.rclone", "s3fs": "fuse.s3fs"}
_TOOL = {"rclone-local": "rclone", "rclone-s3": "rclone", "s3fs": "s3fs"}
_INSTALL = {
    "rclone": "apt-get install rclone (Debian 12: rclone 1.60.1)",
    "s3fs": "apt-get install s3fs (Debian 12: s3fs-fuse 1.90)",
}
_REMOTE = "safestage"  # the rclone remote the environment defines (RCLONE_CONFIG_SAFESTAGE_*)
_UNMOUNT_WAIT = 10.0  # after a polite unmount the tool exits by itself (measured: < 0.5 s)


def real_available(mode: str) -> tuple[bool, str]:
    """Whether ``mode`` can be mounted here: ``(ok, reason)``, the reason naming what to install."""
    if mode not in REAL_MODES:
        raise ValueError(f"unknown real mode {mode!r}; choose one of {', '.join(REAL_MODES)}")
    problems = []
    device = fuse_device_problem()
    if device:
        problems.append(device)
    tool = _TOOL[mode]
    if shutil.which(tool) is None:
        problems.append(f"{tool} is not on PATH ({_INSTALL[tool]})")
    if mode != "rclone-local" and importlib.util.find_spec("moto") is None:
        problems.append(f"moto is not installed ({MOTO_HINT})")
    if problems:
        return False, "; ".join(problems)
    return True, f"{tool} at {shutil.which(tool)}" + ("" if mode == "rclone-local" else ", moto importable")


def tool_environment(extra: dict[str, str]) -> dict[str, str]:
    """The environment a mount tool runs with: ours, minus what would reach the user's set-up
    or break a plain-http endpoint, plus ``extra``.

    - AWS_*: rclone 1.60.1 fails to create any S3 remote when AWS_CA_BUNDLE is set ("Failed to
      create file system ...: LoadCustomCABundleError: unable to load custom CA bundle,
      HTTPClient's transport unsupported type"), even for an http:// endpoint; and a user's
      AWS_PROFILE / keys / AWS_ENDPOINT_URL must not redirect a test tool. s3fs 1.90 and the
      CURL_CA_BUNDLE/SSL_CERT_FILE/REQUESTS_CA_BUNDLE variables were measured harmless over
      http, so those stay.
    - RCLONE_*: a user's rclone flags and remotes (we define our own remote here).
    - NO_PROXY: the endpoint is 127.0.0.1; libcurl (s3fs) would send it to an http_proxy.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
    env["NO_PROXY"] = env["no_proxy"] = ",".join(filter(None, ["127.0.0.1", "localhost", env.get("NO_PROXY", "")]))
    env.update(extra)
    return env


class RealMount:
    """One real mount: an rclone or s3fs process serving ``path`` in ``mode``.

    ``options`` are appended to the tool's command line (see :func:`real_mount`).
    Attributes: ``path`` (the mountpoint), ``backing`` (the local directory holding the bytes,
    rclone-local only, else None), ``bucket`` and ``endpoint`` (S3 modes), ``mode``,
    ``command`` (the tool's argv), ``tool_pid`` (the supervisor; the tool is its child).
    :meth:`objects` lists what the backing store really holds, bypassing the mount.
    """

    def __init__(
        self,
        mode: str,
        path: Optional[PathLike] = None,
        *,
        backing: Optional[PathLike] = None,
        server: Optional[S3Server] = None,
        timeout: float = MOUNT_TIMEOUT,
        options: Sequence[str] = (),
    ) -> None:
        if mode not in REAL_MODES:
            raise ValueError(f"unknown real mode {mode!r}; choose one of {', '.join(REAL_MODES)}")
        if backing is not None and mode != "rclone-local":
            raise ValueError(f"backing= is for rclone-local; {mode} keeps its bytes in an S3 bucket")
        self.mode = mode
        self.timeout = timeout
        self.path = Path()
        self.backing: Optional[Path] = None
        self.bucket: Optional[str] = None
        self.endpoint: Optional[str] = None
        self.command: list[str] = []
        self._requested_path = path
        self._requested_backing = backing
        self._options = list(options)
        self._server = server
        self._env: dict[str, str] = {}
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._ctl: Optional[Path] = None
        self._owned_dirs: list[Path] = []
        self._last_log = ""

    # -- public ---------------------------------------------------------------------------

    @property
    def tool_pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def is_mounted(self) -> bool:
        return mount_fstype(self.path) == _FSTYPE[self.mode] if self.path != Path() else False

    def faults(self) -> dict[str, int]:
        """Always ``{}``: a real tool injects nothing (same shape as HostileMount.faults)."""
        return {}

    def server_log(self) -> str:
        """What the tool logged (rclone -vv, s3fs dbglevel=info), kept after stop()."""
        if self._ctl is not None:
            with contextlib.suppress(FileNotFoundError):
                self._last_log = (self._ctl / "tool.log").read_text(encoding="utf-8", errors="replace")
        return self._last_log

    def s3_log(self) -> str:
        """The S3 server's request lines for this mount's bucket ("" for rclone-local)."""
        if self._server is None or self.bucket is None:
            return ""
        marker = f"/{self.bucket}"
        return "".join(line for line in self._server.log().splitlines(keepends=True) if marker in line)

    def objects(self) -> list[str]:
        """What the store really holds, sorted, not through the mount: the bucket's keys, or
        the backing directory's files (relative paths, directories with a trailing /)."""
        if self.bucket is not None:
            assert self._server is not None
            return sorted(self._server.list_objects(self.bucket))
        assert self.backing is not None
        found = []
        for root, dirs, files in os.walk(self.backing):
            rel = Path(root).relative_to(self.backing)
            found += [f"{(rel / d).as_posix()}/" for d in dirs] + [(rel / f).as_posix() for f in files]
        return sorted(found)

    def start(self) -> RealMount:
        if self._proc is not None:
            raise RuntimeError("this RealMount is already started")
        ok, reason = real_available(self.mode)
        if not ok:
            raise RealMountUnavailable(f"cannot mount {self.mode} here: {reason}")
        try:
            self._prepare()
            self._mount()
        except BaseException:
            self.stop()
            raise
        return self

    def remount(self) -> None:
        """Unmount and mount the same store at the same path again: the tool's caches go, the
        bytes stay. What a "does it survive a remount" test needs."""
        if self._proc is None:
            raise RuntimeError("remount() of a RealMount that is not started")
        self._unmount()
        self._mount()

    def stop(self) -> None:
        """Unmount, stop the tool, delete the bucket, remove what we created. Idempotent, bounded."""
        try:
            self._unmount()
        finally:
            self.server_log()
            try:
                if self.bucket is not None and self._server is not None and self._server.is_running():
                    self._server.delete_bucket(self.bucket)
            except OSError as exc:
                log.warning("could not delete bucket %s: %s", self.bucket, exc)
            finally:
                self.bucket = None
                self._remove_owned_dirs()

    def __enter__(self) -> RealMount:
        return self.start()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        store = self.backing if self.backing is not None else f"s3://{self.bucket} at {self.endpoint}"
        state = "mounted" if self.is_mounted() else "not mounted"
        return f"<RealMount {self.mode} {self.path} over {store} ({state})>"

    # -- start ----------------------------------------------------------------------------

    def _prepare(self) -> None:
        self._ctl = Path(tempfile.mkdtemp(prefix="safestage-real-"))
        self._owned_dirs.append(self._ctl)
        self.path = self._make_mountpoint()
        if self.mode == "rclone-local":
            self.backing = self._make_backing()
        else:
            if self._server is None:
                self._server = shared_s3_server()
            self.endpoint = self._server.endpoint
            bucket = f"safestage-{os.getpid()}-{os.urandom(4).hex()}"
            self._server.create_bucket(bucket)
            self.bucket = bucket
        self.command, self._env = self._command()

    def _make_backing(self) -> Path:
        if self._requested_backing is None:
            backing = Path(tempfile.mkdtemp(prefix="safestage-backing-"))
            self._owned_dirs.append(backing)
            return backing
        backing = Path(os.path.realpath(self._requested_backing))
        backing.mkdir(parents=True, exist_ok=True)
        if backing == self.path or self.path in backing.parents or backing in self.path.parents:
            raise ValueError(f"mountpoint {self.path} and backing {backing} must not nest")
        return backing

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
        if mount_fstype(path) is not None:
            raise ValueError(f"{path} is already a mount point ({mount_fstype(path)})")
        if any(path.iterdir()):
            raise ValueError(f"mountpoint {path} is not empty (its contents would be hidden)")
        return path

    def _command(self) -> tuple[list[str], dict[str, str]]:
        assert self._ctl is not None
        if self.mode == "s3fs":
            return self._s3fs_command()
        config = self._ctl / "rclone.conf"
        config.touch()  # an empty private config: never the user's ~/.config/rclone
        extra = {"RCLONE_CONFIG": str(config), "RCLONE_CACHE_DIR": str(self._ctl / "cache")}
        if self.mode == "rclone-local":
            source = str(self.backing)
        else:
            prefix = f"RCLONE_CONFIG_{_REMOTE.upper()}_"
            extra.update({
                prefix + "TYPE": "s3",
                prefix + "PROVIDER": "Other",
                prefix + "ENDPOINT": str(self.endpoint),
                prefix + "ACCESS_KEY_ID": ACCESS_KEY,
                prefix + "SECRET_ACCESS_KEY": SECRET_KEY,
                prefix + "REGION": REGION,
            })  # fmt: skip
            source = f"{_REMOTE}:{self.bucket}"
        command = [
            "rclone", "mount", source, str(self.path),
            # No write cache: writes stream straight to the backend, as on a mount that was
            # set up without local disk to spare. This is the mode safetensors fails on.
            "--vfs-cache-mode", "off",
            # Every FUSE call and backend operation, with microseconds: the evidence tests and
            # people read in server_log().
            "-vv", "--log-format", "date,time,microseconds",
        ]  # fmt: skip
        return command + self._options, tool_environment(extra)

    def _s3fs_command(self) -> tuple[list[str], dict[str, str]]:
        assert self._ctl is not None
        passwd = self._ctl / "passwd"
        # s3fs refuses a credentials file that others can read.
        fd = os.open(passwd, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        tmp = self._ctl / "s3fs-tmp"
        tmp.mkdir()
        command = [
            "s3fs", str(self.bucket), str(self.path),
            "-f",  # foreground: the process we own is the mount
            "-o", f"passwd_file={passwd}",
            "-o", f"url={self.endpoint}",
            "-o", "use_path_request_style",  # a bucket named in the path, not a DNS name
            "-o", f"endpoint={REGION}",
            "-o", f"tmpdir={tmp}",  # its upload buffers, removed with the rest
            "-o", "dbglevel=info",
        ]  # fmt: skip
        return command + self._options, tool_environment({})

    def _mount(self) -> None:
        assert self._ctl is not None
        started = time.monotonic()
        self._proc = spawn_supervised(
            self.command,
            log_path=self._ctl / "tool.log",
            env=self._env,
            unmount=self.path,
            remove=list(self._owned_dirs),
        )
        deadline = started + self.timeout
        delay = 0.005
        while not self.is_mounted():
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise RuntimeError(
                    f"{self.command[0]} ({self.mode}) exited with status {code} before mounting "
                    f"{self.path}; its log:\n{self.server_log()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.command[0]} ({self.mode}) did not mount {self.path} within "
                    f"{self.timeout:.0f} s; its log:\n{self.server_log()[-4000:]}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        log.debug("mounted %s (%s) in %.2f s: %s", self.path, self.mode, time.monotonic() - started, " ".join(self.command))

    # -- stop -----------------------------------------------------------------------------

    def _unmount(self) -> None:
        """Unmount politely (the tool then exits by itself), else lazily; then reap the tool."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        politely = False
        try:
            politely = self._unmount_path()
        finally:
            reap(proc, grace=_UNMOUNT_WAIT if politely else 0.5)
            if self.is_mounted():  # the tool died without unmounting
                _run_quietly(["umount", "-l", str(self.path)])

    def _unmount_path(self) -> bool:
        path = str(self.path)
        if not self.is_mounted():
            return True
        for cmd in (["fusermount3", "-u", path], ["fusermount", "-u", path], ["umount", path]):
            _run_quietly(cmd)
            if not self.is_mounted():
                return True
        for cmd in (["fusermount3", "-u", "-z", path], ["umount", "-l", path]):
            _run_quietly(cmd)
            if not self.is_mounted():
                return False
        log.warning("could not unmount %s: %s", path, self.server_log()[-2000:])
        return False

    def _remove_owned_dirs(self) -> None:
        owned, self._owned_dirs = self._owned_dirs, []
        for directory in reversed(owned):
            if mount_fstype(directory) is not None:
                log.warning("not removing %s: still mounted", directory)
                continue
            shutil.rmtree(directory, ignore_errors=True)
        self._ctl = None


def _run_quietly(cmd: list[str]) -> None:
    if shutil.which(cmd[0]) is None:
        return
    try:
        subprocess.run(cmd, capture_output=True, timeout=10.0, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("%s failed: %s", cmd, exc)


@contextlib.contextmanager
def real_mount(
    mode: str,
    path: Optional[PathLike] = None,
    *,
    backing: Optional[PathLike] = None,
    server: Optional[S3Server] = None,
    options: Sequence[str] = (),
) -> Iterator[RealMount]:
    """Mount a real third-party filesystem for the duration of a ``with`` block.

    ``path``: the mountpoint (created if missing, must be empty; None: a fresh temp dir).
    ``backing``: rclone-local's directory (None: a fresh temp dir, removed afterwards).
    ``server``: the S3 server for the S3 modes (None: the process's shared one). Unmounts,
    ``options``: more arguments for the tool, after the kit's own (``["-o", "retries=1"]`` for
    s3fs, ``["--low-level-retries", "1"]`` for rclone). Unmounts, stops the tool and deletes
    the bucket even if the block raises.
    """
    mount = RealMount(mode, path, backing=backing, server=server, options=options)
    mount.start()
    try:
        yield mount
    finally:
        mount.stop()

