"""Entry point of the hostile FUSE server process.

Started by ``_mount.HostileMount`` as ``python <this file> --mode ... --backing ... --mountpoint ...``
(running the file, not ``-m safestage.testing._server``, keeps ``safestage/__init__`` and whatever
it imports out of the server: faster start-up, no torch threads next to a FUSE loop). Also works
as ``python -m safestage.testing._server``.

The FUSE loop runs in the foreground of this process until the mountpoint is unmounted or the
process gets SIGTERM/SIGINT (libfuse's own handlers unmount cleanly). A watchdog thread unmounts
lazily and exits if the parent process dies, so a killed test run leaks no mount.
"""

from __future__ import annotations

import argparse
import ctypes.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import Optional

log = logging.getLogger("safestage.testing")

# Exit status meaning "this machine cannot run a FUSE server" (the parent maps it to
# FuseUnavailable rather than a generic crash).
EXIT_NO_FUSE = 3


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="safestage hostile FUSE server")
    parser.add_argument("--mode", required=True)
    parser.add_argument("--backing", required=True, help="directory whose contents are served")
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--faults-file", default=None, help="JSON file the fault counts go to")
    parser.add_argument("--mbps", type=float, default=None, help="write throttle, MB/s (10**6 B/s)")
    parser.add_argument("--parent-pid", type=int, default=None, help="unmount when this pid dies")
    parser.add_argument(
        "--orphan-cleanup",
        action="append",
        default=[],
        metavar="DIR",
        help="directory the parent would have removed; removed here if the parent dies first",
    )
    parser.add_argument(
        "--lookup-error",
        action="append",
        default=[],
        metavar="NAME=ERRNO",
        help="a lookup of an entry called NAME, in any directory, fails with ERRNO",
    )
    parser.add_argument("--debug", action="store_true", help="log every FUSE request (libfuse -d)")
    return parser.parse_args(argv)


def _prefer_libfuse3() -> None:
    # mfusepy looks for libfuse 2 first; our callbacks (truncate with a handle, rename flags,
    # atomic O_TRUNC) are written against libfuse 3.
    if not os.environ.get("FUSE_LIBRARY_PATH"):
        lib = ctypes.util.find_library("fuse3")
        if lib:
            os.environ["FUSE_LIBRARY_PATH"] = lib


def _lazy_unmount(mountpoint: str) -> None:
    for cmd in (["fusermount3", "-u", "-z", mountpoint], ["umount", "-l", mountpoint]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            if subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            continue


def _watch_parent(
    parent_pid: int, mountpoint: str, orphaned: threading.Event, loop_done: threading.Event
) -> None:
    # Polling getppid() rather than PR_SET_PDEATHSIG: the latter fires when the parent *thread*
    # exits, which would kill mounts made from a short-lived worker thread.
    while not loop_done.wait(0.5):
        if os.getppid() != parent_pid:
            log.warning("parent %d died: unmounting %s", parent_pid, mountpoint)
            orphaned.set()
            _lazy_unmount(mountpoint)  # ends the FUSE loop; main() then cleans up
            if not loop_done.wait(2.0):
                # Only now: once the loop is over, libfuse's handlers are gone and SIGTERM
                # would kill us before main() removes the directories.
                os.kill(os.getpid(), signal.SIGTERM)
            return


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    # The kernel already applied the caller's umask to the modes it sends (we do not ask for
    # FUSE_CAP_DONT_MASK); our own umask must not remove more bits.
    os.umask(0)
    _prefer_libfuse3()
    try:
        if __package__:
            from ._hostile_fs import POLICIES, FaultCounter, HostileFS, HostileFUSE
        else:  # run as a script: the sibling module is importable directly
            from _hostile_fs import (  # type: ignore[no-redef]
                POLICIES,
                FaultCounter,
                HostileFS,
                HostileFUSE,
            )
    except (ImportError, OSError, AttributeError) as exc:
        # mfusepy missing, or libfuse not found / wrong version (mfusepy raises these at import).
        log.error("cannot load mfusepy/libfuse: %s: %s", type(exc).__name__, exc)
        return EXIT_NO_FUSE

    policy = POLICIES.get(args.mode)
    if policy is None:
        log.error("unknown mode %r; known: %s", args.mode, ", ".join(sorted(POLICIES)))
        return 2
    mbps = args.mbps if args.mbps is not None else policy.default_mbps
    lookup_errors = {name: int(err) for name, _, err in (item.rpartition("=") for item in args.lookup_error)}
    names = policy.fault_names() + (("lookup",) if lookup_errors else ())
    counter = FaultCounter(args.faults_file, names)
    operations = HostileFS(args.backing, policy, counter, mbps=mbps, lookup_errors=lookup_errors)

    orphaned, loop_done = threading.Event(), threading.Event()
    if args.parent_pid is not None:
        threading.Thread(
            target=_watch_parent,
            args=(args.parent_pid, args.mountpoint, orphaned, loop_done),
            daemon=True,
        ).start()

    HostileFUSE(
        operations,
        args.mountpoint,
        foreground=True,
        debug=args.debug,
        fsname=f"safestage-{args.mode}",
        subtype="safestage",
        # Unlinking an open file removes it at once: no .fuse_hiddenXXXX in listings, which tests
        # of "what did the save leave behind" depend on. I/O on the still-open fd keeps working
        # (the backing fd stays valid); only fstat() of it fails (ESTALE: the kernel asks by
        # inode, and libfuse has no name left to ask us with).
        hard_remove=True,
        # The backing directory changes behind the kernel's back (close-eio discards files, tests
        # poke the backing dir): never serve a cached name or attribute.
        entry_timeout=0,
        attr_timeout=0,
        negative_timeout=0,
        # libfuse 3.14 defaults this to UINT_MAX and then logs "Ignoring invalid max threads
        # value 4294967295" on every mount.
        max_idle_threads=8,
    )
    loop_done.set()
    if orphaned.is_set():
        # Here, not in the watchdog thread: the process may exit as soon as the loop ends.
        for directory in args.orphan_cleanup:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
