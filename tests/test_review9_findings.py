"""A child forked while direct saves run keeps none of our destination write descriptors
(found against the host-wide writer lock files, which are gone: across processes, one
writer per destination file is the caller's contract under ``direct``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(REPO)
    env["HF_HUB_OFFLINE"] = "1"
    return env


_FORK_STRESS = r'''
import os, sys, threading, time, warnings
sys.path.insert(0, {repo!r})
warnings.simplefilter("ignore")  # fork() with threads (3.12+)
from pathlib import Path
import safestage
tmp = Path(sys.argv[1])
dest = tmp / "model.safetensors"
root = tmp / "root"
root.mkdir()
stop = time.monotonic() + float(sys.argv[2])
found = threading.Event()
def saver():  # a training loop saving its checkpoint with publish="direct"
    with safestage.staged(str(root), publish="direct") as stage:
        while time.monotonic() < stop and not found.is_set():
            stage._save(lambda p: open(p, "wb").write(b"x" * (1 << 20)), dest)
thread = threading.Thread(target=saver)
thread.start()
forks = leaks = 0
while thread.is_alive():  # DataLoader workers / Pool processes started meanwhile
    pid = os.fork()
    if pid == 0:  # after the fork handlers: does the child still hold a write descriptor?
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink("/proc/self/fd/" + fd) == str(dest):
                    with open("/proc/self/fdinfo/" + fd) as info:
                        flags = int(info.read().split("flags:")[1].split()[0], 8)
                    if flags & os.O_ACCMODE != os.O_RDONLY:
                        held.append(fd)
            except (OSError, IndexError, ValueError):
                pass
        os._exit(1 if held else 0)
    _, status = os.waitpid(pid, 0)
    forks += 1
    if os.waitstatus_to_exitcode(status) == 1:
        leaks += 1
        found.set()
thread.join()
print("FORKS", forks, "LEAKS", leaks, flush=True)
'''


def test_a_child_forked_while_direct_saves_run_keeps_no_destination_descriptor(tmp_path):
    """A process forked while a direct publish writes (a DataLoader worker) closes its
    inherited copy of our destination write descriptor at once (on mountpoint-s3 a copy
    kept open keeps the upload open). Real saves, real forks, no patching: a fork may land
    anywhere in the open/write/close of the final name."""
    script = tmp_path / "stress.py"
    script.write_text(_FORK_STRESS.format(repo=str(REPO)))
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "10"],
        capture_output=True, text=True, timeout=300, env=_env(),
    )  # fmt: skip
    assert "FORKS" in run.stdout, run.stdout + run.stderr
    forks, leaks = int(run.stdout.split()[1]), int(run.stdout.split()[3])
    assert forks > 0
    assert leaks == 0, (
        f"{leaks} of {forks} children forked while direct saves ran still held a write "
        "descriptor of the destination after the fork handlers had run"
    )
