"""Starting and stopping the third-party processes of the real mounts and local object stores.

Each runs under ``_supervise.py`` in a session of its own: a Ctrl-C aimed at the test run must
not kill a mount tool before our teardown unmounts it, and the supervisor cleans up if we die.
Stopping is bounded: polite wait, SIGTERM (forwarded to the tool), then SIGKILL to the
session's process group, which holds only the supervisor and the tool we started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Optional

log = logging.getLogger("safestage.testing")

SUPERVISOR = Path(__file__).with_name("_supervise.py")
_TERM_WAIT = 5.0  # after SIGTERM: rclone and s3fs unmount and exit well within this
_KILL_WAIT = 5.0


def spawn_supervised(
    command: list[str],
    *,
    log_path: Path,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Path] = None,
    unmount: Optional[Path] = None,
    remove: Iterable[Path] = (),
) -> subprocess.Popen[bytes]:
    """Run ``command`` under the supervisor, stdout and stderr appended to ``log_path``."""
    cmd = [sys.executable, str(SUPERVISOR), "--parent-pid", str(os.getpid())]
    if unmount is not None:
        cmd += ["--unmount", str(unmount)]
    for directory in remove:
        cmd += ["--remove", str(directory)]
    cmd += ["--", *command]
    # A file, not a pipe: a chatty tool (rclone -vv) must never block on a full pipe.
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )


def reap(proc: subprocess.Popen[bytes], *, grace: float) -> Optional[int]:
    """Wait ``grace`` s for ``proc`` to exit, then SIGTERM, then SIGKILL its process group.

    Returns the exit status (None only if even SIGKILL did not end it within the bound).
    """
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()  # the supervisor forwards it to the tool
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout=_TERM_WAIT)
    log.warning("pid %d ignored SIGTERM for %.0f s: killing its process group", proc.pid, _TERM_WAIT)
    # start_new_session=True made proc.pid the group id: the group is the supervisor and its tool.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout=_KILL_WAIT)
    return None
