"""Review 9: failing tests against the review-8 fixes (cbb24e4): the per-destination lock
file that direct writers take turns with (``_writer_locks.sole_writer``) and the identity
check of ``_unlink_torn``.

Every test here fails on the code under review; each docstring says what the user loses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(REPO)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _wait_for(path: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


# A direct save whose writer is slow: it holds the destination's writer lock for as long as
# its serialization runs (a followed direct save keeps the final name open throughout).
_SLOW_HOLDER = r'''
import logging, sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
import safestage
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
root, dest, seconds = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
def slow(path):
    with open(path, "wb") as f:
        deadline = time.monotonic() + seconds
        print("WRITING", flush=True)
        while time.monotonic() < deadline:
            f.write(b"h" * 1024)
            f.flush()
            time.sleep(0.05)
with safestage.staged(root, publish="direct", follow=True) as stage:
    stage._save(slow, dest)
print("HOLDER SAVED", flush=True)
'''

_FOLLOWED_VICTIM = r'''
import logging, sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
import safestage
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
root, dest, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
from safestage import _api
real = _api.write_following
def paused(*args, **kwargs):
    # Only a timing window: this save has seen no file at dest (so it follows), and the
    # other rank's save of the same new file starts now and takes the lock first.
    print("FOLLOWING", flush=True)
    while not go.exists():
        time.sleep(0.02)
    return real(*args, **kwargs)
_api.write_following = paused
def quick(path):
    with open(path, "wb") as f:
        f.write(b"v" * 4096)
try:
    with safestage.staged(root, publish="direct", follow=True) as stage:
        stage._save(quick, dest)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
    raise SystemExit(130)
print("VICTIM SAVED", flush=True)
'''


def test_ctrl_c_cannot_stop_a_followed_direct_save_waiting_for_another_writer(tmp_path, shm_root):
    """A followed direct save (``follow=True``, or any new file >= 64 MiB) waits for the
    destination's writer lock in its publisher thread. While another process of this host
    writes the file (a straggler of the same job, another rank, an export that takes an hour),
    the user presses Ctrl-C: the KeyboardInterrupt reaches the saving thread, which then waits
    (``follower.fail(); finished.wait()`` inside ``deferred()``) for the publisher thread, and
    that thread is polling ``_writer_locks._acquire`` with no way to learn that the save is
    abandoned. So Ctrl-C does nothing until the other writer finishes: forever if it is
    stopped (Ctrl-Z'd in another terminal) or hung on its mount. A second Ctrl-C is only noted
    by ``deferred()``. An unfollowed direct save waiting for the same lock stops at once.
    Promised: no hangs; Ctrl-C mid-save raises KeyboardInterrupt right after the clean-up."""
    dest = tmp_path / "model.safetensors"
    holder_script = tmp_path / "holder.py"
    holder_script.write_text(_SLOW_HOLDER.format(repo=str(REPO)))
    victim_script = tmp_path / "victim.py"
    victim_script.write_text(_FOLLOWED_VICTIM.format(repo=str(REPO)))
    holder_out, victim_err = tmp_path / "holder.out", tmp_path / "victim.err"
    holder_root = shm_root / "holder"
    holder_root.mkdir()
    victim_root = shm_root / "victim"
    victim_root.mkdir()
    go = tmp_path / "go"
    with open(victim_err, "w") as err:
        victim = subprocess.Popen(
            [sys.executable, str(victim_script), str(victim_root), str(dest), str(go)],
            stdout=err, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
    holder = None
    try:
        assert _wait_for(victim_err, "FOLLOWING", 60), victim_err.read_text()
        with open(holder_out, "w") as out:
            holder = subprocess.Popen(
                [sys.executable, str(holder_script), str(holder_root), str(dest), "60"],
                stdout=out, stderr=subprocess.STDOUT, env=_env(),
            )  # fmt: skip
        assert _wait_for(holder_out, "WRITING", 60), holder_out.read_text()
        time.sleep(0.5)  # the holder's publisher has the lock by now
        go.touch()
        assert _wait_for(victim_err, "waiting for another process", 60), victim_err.read_text()
        time.sleep(0.3)
        victim.send_signal(signal.SIGINT)
        try:
            victim.wait(8)
            stopped = True
        except subprocess.TimeoutExpired:
            stopped = False
        assert holder.poll() is None, "the other writer ended early: the test proves nothing"
        assert stopped, (
            "Ctrl-C did not stop a followed direct save in 8 s: it waits for another process's "
            "write of the same file to end (60 s here, forever if that writer is stopped)"
        )
    finally:
        _stop(victim)
        if holder is not None:
            _stop(holder)


_QUICK_DIRECT = r'''
import logging, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
import safestage
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
root, dest = sys.argv[1], Path(sys.argv[2])
def quick(path):
    with open(path, "wb") as f:
        f.write(b"v" * 4096)
with safestage.staged(root, publish="direct") as stage:
    stage._save(quick, dest)
print("VICTIM SAVED", flush=True)
'''

_SQUAT_DRIVER = r'''
import os, subprocess, sys, time
from pathlib import Path
squat, tmp = sys.argv[1] == "squat", Path(sys.argv[2])
# This mount namespace's own /dev/shm: the host's is not touched.
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=1777", "tmpfs", "/dev/shm"], check=True)
if squat:  # another local user got there first: /dev/shm is world-writable (sticky)
    os.mkdir(f"/dev/shm/safestage-locks-{{os.geteuid()}}", 0o755)
    os.chown(f"/dev/shm/safestage-locks-{{os.geteuid()}}", 12345, 12345)
dest = tmp / "model.safetensors"
for name in ("hroot", "vroot"):
    (tmp / name).mkdir()
out = open(tmp / "holder.out", "w")
holder = subprocess.Popen([sys.executable, str(tmp / "holder.py"), str(tmp / "hroot"), str(dest), "3"],
                          stdout=out, stderr=subprocess.STDOUT)
deadline = time.monotonic() + 60
while "WRITING" not in (tmp / "holder.out").read_text() and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
victim = subprocess.run([sys.executable, str(tmp / "victim.py"), str(tmp / "vroot"), str(dest)],
                        capture_output=True, text=True, timeout=120)
holder.wait(120)
print(victim.stdout, victim.stderr[-2000:], (tmp / "holder.out").read_text()[-2000:])
data = dest.read_bytes()
kind = "H" if data == data[:1] * len(data) and data[:1] == b"h" else "V" if data == b"v" * 4096 else "MIXED"
print("RESULT", kind, len(data), data.count(b"h"), data.count(b"v"), data.count(b"\0"))
'''


@pytest.mark.parametrize("squat", ["squat"])  # "control" (no squat) passes: V wins whole
def test_another_user_squatting_the_lock_directory_silently_unlocks_direct_writes(tmp_path, squat):
    """``/dev/shm`` is world-writable, so any local user can ``mkdir
    /dev/shm/safestage-locks-<your uid>`` before your first save (or a directory of that name
    was left by a container with another uid mapping). ``_lock_directory`` then sees a
    directory that is not ours and returns None: every direct write of this user on this host
    goes ahead unlocked, logged at DEBUG only, with no fall-back to the temp directory. Two
    direct writers of one file interleave again exactly as review 7 found: a followed write
    and an overwrite of the same checkpoint both report success and the file under the final
    name is neither of them. Promised: the two take turns, the last writer wins whole; never
    a wrong file after success; never a silent success."""
    (tmp_path / "holder.py").write_text(_SLOW_HOLDER.format(repo=str(REPO)))
    (tmp_path / "victim.py").write_text(_QUICK_DIRECT.format(repo=str(REPO)))
    driver = tmp_path / "driver.py"
    driver.write_text(_SQUAT_DRIVER.format())
    run = subprocess.run(
        ["unshare", "-m", sys.executable, str(driver), squat, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=_env(),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "VICTIM SAVED" in run.stdout and "HOLDER SAVED" in run.stdout, run.stdout + run.stderr
    result = run.stdout.split("RESULT", 1)[1].split()
    assert result[0] in ("H", "V"), (
        "both direct saves of one file reported success and the file under the final name is "
        f"a mix of the two (kind, size, h bytes, v bytes, zero bytes: {result}): the lock "
        "directory another user planted switched the direct-writer lock off silently"
    )
