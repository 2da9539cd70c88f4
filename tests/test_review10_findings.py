"""Review 10: failing tests against the review-9 fixes (3f46592): descriptors a forked child
closes, found by path in /proc/self/fd (``_fork_fds``), and the direct-writer lock files
(``_writer_locks``: stale while waiting, sweep at activation and by ``safestage clean``).

Every test here fails on the code under review; each docstring says what the user loses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(REPO)
    env["HF_HUB_OFFLINE"] = "1"
    return env


# -- 1. a destination whose real name ends in " (deleted)" -------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors (deleted)"])
def test_a_child_forked_while_direct_writes_a_name_ending_in_deleted_keeps_the_writer(
    kit_mounts, shm_root, name
):
    """``_fork_fds`` strips " (deleted)" from every /proc/self/fd link before comparing it
    with the registered path. A file whose real name ends in " (deleted)" (any name a plain
    save accepts: test_hardening's hostile names include stranger ones) is never matched
    while it exists: the link text is the name itself, the stripped text is not. So a child
    forked while the followed ``direct`` copy writes that final name keeps the writer
    descriptor, exactly the review-7 case ``_fork_fds`` exists for: on mountpoint the upload
    stays open in the child, the writer then raises, the clean-up's unlink is refused, and a
    torn object is left under the final name of a save that raised. Promised: a writer that
    raises leaves the destination untouched; a forked child closes its copies of our
    destination descriptors at once. (``model.safetensors``: the control, passes.)"""
    import time

    import safestage

    mount = kit_mounts["mountpoint"]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    dest = directory / name
    children: list[int] = []
    existed: list[bool] = []

    def write(path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\x01" * (2 << 20))
            deadline = time.monotonic() + 5
            while not os.path.lexists(dest) and time.monotonic() < deadline:
                time.sleep(0.005)
            existed.append(os.path.lexists(dest))
            pid = os.fork()  # a DataLoader worker started while the save runs
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            children.append(pid)
            raise ValueError("writer failed")
        finally:
            os.close(fd)

    try:
        with (
            safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage,
            pytest.raises(ValueError),
        ):
            stage._save(write, dest)
        left = sorted(os.listdir(directory))
    finally:
        for pid in children:
            os.waitpid(pid, 0)
        shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)  # type: ignore[attr-defined]
    assert children and existed == [True], "the fork did not come while the final name was written"
    assert left == [], (
        f"the save raised, yet {left} is left under the destination: the forked child kept "
        "its copy of the writer descriptor (its /proc link text ends in ' (deleted)' and is "
        "stripped before the comparison), so mountpoint refused the clean-up's unlink"
    )


# -- 2. a waiter gives up a lock its holder still holds ----------------------------------------

_SLOW_HOLDER = r"""
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
with safestage._api.force_follow(safestage.staged(root, publish="direct")) as stage:
    stage._save(slow, dest)
print("HOLDER SAVED", flush=True)
"""

_QUICK_DIRECT = r"""
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
"""

# Runs in its own mount namespace with its own /dev/shm: the host's lock directory (and a CI
# run using it) is never touched.
_CLEANER_DRIVER = r"""
import os, shutil, subprocess, sys, time
from pathlib import Path
tmp = Path(sys.argv[1])
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=1777", "tmpfs", "/dev/shm"], check=True)
dest = tmp / "model.safetensors"
for name in ("hroot", "vroot"):
    (tmp / name).mkdir()
def wait_for(path, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False
hout, vout = open(tmp / "holder.out", "w"), open(tmp / "victim.out", "w")
holder = subprocess.Popen([sys.executable, str(tmp / "holder.py"), str(tmp / "hroot"), str(dest), "4"],
                          stdout=hout, stderr=subprocess.STDOUT)
assert wait_for(tmp / "holder.out", "WRITING"), (tmp / "holder.out").read_text()
time.sleep(0.5)
victim = subprocess.Popen([sys.executable, str(tmp / "victim.py"), str(tmp / "vroot"), str(dest)],
                          stdout=vout, stderr=subprocess.STDOUT)
assert wait_for(tmp / "victim.out", "waiting for another process"), (tmp / "victim.out").read_text()
# What a logout does to this user's /dev/shm (systemd-logind RemoveIPC=yes, the default for
# regular users), or a batch system's job epilog cleaning /dev/shm on a shared node.
lockdir = Path("/dev/shm/safestage-locks-%d" % os.geteuid())
shutil.rmtree(lockdir)
print("LOCKDIR REMOVED, holder still running:", holder.poll() is None, flush=True)
victim.wait(120)
holder.wait(120)
print((tmp / "victim.out").read_text()[-1500:], (tmp / "holder.out").read_text()[-1500:])
data = dest.read_bytes()
kind = "H" if data[:1] == b"h" and data.count(b"h") == len(data) else "V" if data == b"v" * 4096 else "MIXED"
print("RESULT", kind, len(data), data.count(b"h"), data.count(b"v"), data.count(b"\0"))
"""


def test_removing_the_lock_directory_lets_a_waiting_direct_writer_in_beside_its_holder(tmp_path):
    """Review 9 made a waiting writer give up its lock file as soon as the name no longer
    names it (``_stale`` checked while waiting), on the theory that only a holder removes its
    lock file. Others do: systemd-logind removes a regular user's files and directories in
    /dev/shm when their last session ends (RemoveIPC=yes, the default), and batch systems'
    job epilogs wipe /dev/shm on shared nodes. Rank A's direct save of ``model.safetensors``
    is writing; rank B's direct save of the same file waits (INFO "waiting for another
    process's direct write"); the user logs out (the job runs under nohup). B sees its lock
    file gone and writes at once, beside A: both report success and the file under the final
    name is a mix of the two. Before review 9 B went on waiting on the flock A still holds,
    and the last writer won whole. Promised: two direct writers of one file on one host take
    turns; never a wrong file after success; never a silent success."""
    (tmp_path / "holder.py").write_text(_SLOW_HOLDER.format(repo=str(REPO)))
    (tmp_path / "victim.py").write_text(_QUICK_DIRECT.format(repo=str(REPO)))
    driver = tmp_path / "driver.py"
    driver.write_text(_CLEANER_DRIVER)
    run = subprocess.run(
        ["unshare", "-m", sys.executable, str(driver), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=_env(),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "holder still running: True" in run.stdout, run.stdout  # the fault came mid-write
    assert "VICTIM SAVED" in run.stdout and "HOLDER SAVED" in run.stdout, run.stdout + run.stderr
    result = run.stdout.split("RESULT", 1)[1].split()
    assert result[0] in ("H", "V"), (
        "both direct saves of one file reported success and the file under the final name is "
        f"a mix of the two (kind, size, h bytes, v bytes, zero bytes: {result}): the waiting "
        "writer gave up a lock its holder still held once the lock file's name was removed"
    )
