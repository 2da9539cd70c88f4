"""Entry point of the supervisor that runs a third-party mount tool (or the S3 server).

Started by ``_real`` as ``python <this file> --parent-pid P [--unmount DIR] [--remove PATH]... --
tool args...``. It runs the tool as its child, passes SIGTERM/SIGINT on to it and exits with its
status. Its one extra job: if the process that asked for the mount dies without tearing it down
(a test run killed with SIGKILL), unmount lazily, stop the tool and remove the kit's directories,
so that a killed run leaks no mount, no rclone/s3fs process and no S3 server.

Why a supervisor: rclone, s3fs and moto cannot be told to watch their parent, and
PR_SET_PDEATHSIG fires when the parent *thread* exits (a mount made from a worker thread would
die with it). Standard library only, run as a file: nothing of safestage is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from types import FrameType
from typing import Optional

_POLL = 0.5  # how often the parent is checked, seconds
_TOOL_GRACE = 3.0  # after SIGTERM, before SIGKILL


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="safestage mount-tool supervisor")
    parser.add_argument("--parent-pid", type=int, required=True, help="clean up when this pid dies")
    parser.add_argument("--unmount", default=None, metavar="DIR", help="mountpoint to unmount then")
    parser.add_argument("--remove", action="append", default=[], metavar="DIR", help="remove then (a directory or a file)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the tool and its arguments")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given after --")
    return args


def _lazy_unmount(mountpoint: str) -> None:
    for cmd in (["fusermount3", "-u", "-z", mountpoint], ["umount", "-l", mountpoint]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            if subprocess.run(cmd, capture_output=True, timeout=10, check=False).returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            continue


def _stop(child: subprocess.Popen[bytes]) -> None:
    for action, wait in ((child.terminate, _TOOL_GRACE), (child.kill, 5.0)):
        if child.poll() is not None:
            return
        action()
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _parent_gone(parent: int) -> bool:
    """The parent exited, or is dying but cannot finish: SIGKILLed (or its main thread a
    zombie) while a thread of it is blocked in a request to the very mount this supervisor
    serves, e.g. a test killed while it read from a stalled mount. The kernel waits for the
    tool's answer, the tool for its S3 server: without this the parent never exits and the
    mount is never cleaned up. Unmounting answers the request and lets the parent die."""
    if os.getppid() != parent:
        return True
    try:
        with open(f"/proc/{parent}/status", encoding="ascii", errors="replace") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        if fields.get("State", "").split()[:1] == ["Z"]:
            return True
        pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
    except (OSError, ValueError):
        return False
    return bool(pending & _SIGKILL_BIT)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    try:
        child = subprocess.Popen(args.command, stdin=subprocess.DEVNULL, close_fds=True)
    except OSError as exc:
        sys.stderr.write(f"supervisor: cannot run {args.command[0]}: {exc}\n")
        return 127

    def forward(signum: int, frame: Optional[FrameType]) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)

    while True:
        try:
            code: Optional[int] = child.wait(timeout=_POLL)
        except subprocess.TimeoutExpired:
            code = None
        # Polling getppid() and not PR_SET_PDEATHSIG, for the thread reason in the docstring.
        # Checked after the tool exits too: a tool killed while its parent dies leaves its
        # mount in the table, and nobody else is left to remove it.
        if _parent_gone(args.parent_pid):
            sys.stderr.write(f"supervisor: parent {args.parent_pid} died, cleaning up\n")
            if args.unmount:
                _lazy_unmount(args.unmount)
            _stop(child)
            for directory in args.remove:
                if os.path.isdir(directory) and not os.path.islink(directory):
                    shutil.rmtree(directory, ignore_errors=True)
                else:  # a server's socket file
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(directory)
            return 0
        if code is not None:
            return code


if __name__ == "__main__":
    sys.exit(main())
