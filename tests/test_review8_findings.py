"""Review 8: failing tests against the review-7 fixes (7f736a7): the flock that direct
writers take turns with, forked children closing our descriptors, the held-back chunk of a
followed copy.

Every test here fails on the code under review; each docstring says what the user loses.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _save_in_thread(save, timeout: float) -> tuple[threading.Thread, list[object]]:
    """Run ``save()`` in a daemon thread; return it (alive = still hanging) and its outcome."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(save())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, outcome


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def test_fork_during_a_direct_overwrite_makes_every_later_direct_save_of_that_file_hang(
    tmp_path, shm_root
):
    """A direct overwrite opens the old file read-only and flocks it for the whole write
    (``_other_writers_done``). That descriptor is not in ``_outputs``, so a process forked
    meanwhile (a DataLoader worker, a multiprocessing Pool started while a background publish
    runs) keeps it, and with it the lock (flock belongs to the open file description, which
    the child shares). Once the save is done, the next ``direct`` save of the same file, in
    the parent, waits for that lock as long as the worker lives: forever for a Pool or a
    persistent DataLoader worker. The user's training loop hangs at its next checkpoint with
    nothing above INFO in the log. Promised: no hangs."""
    import safestage
    from safestage import _publish

    directory = tmp_path / "dest"
    directory.mkdir()
    dest = directory / "model.bin"
    dest.write_bytes(b"old" * 1000)

    inside, go = threading.Event(), threading.Event()
    real = _publish._direct_locked
    calls = []

    def paused(*args, **kwargs):  # only to hold the window open while the worker is forked
        calls.append(1)
        if len(calls) == 1:
            inside.set()
            assert go.wait(30)
        return real(*args, **kwargs)

    _publish._direct_locked = paused
    child = 0
    try:
        with safestage.staged(shm_root, publish="direct", background=True) as stage:
            stage._save(lambda p: _write_file(p, b"first" * 1000), dest)
            assert inside.wait(30), "the background direct publish never started"
            child = os.fork()  # the DataLoader worker / Pool process, started mid-publish
            if child == 0:
                time.sleep(60)  # a long-lived worker
                os._exit(0)
            go.set()
        assert dest.read_bytes() == b"first" * 1000

        def second() -> object:
            with safestage.staged(shm_root, publish="direct") as again:
                again._save(lambda p: _write_file(p, b"second" * 1000), dest)
            return "saved"

        thread, outcome = _save_in_thread(second, timeout=10)
        hung = thread.is_alive()
    finally:
        _publish._direct_locked = real
        if child:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    thread.join(30)
    assert calls, "the publish did not run"
    assert not hung, (
        "a direct save of a file hung for 10 s: a worker forked during the previous save of "
        "that file holds the flock of _other_writers_done's descriptor for as long as it lives"
    )


_SELF_HANG_CHILD = r'''
import os, sys, threading, time
sys.path.insert(0, {repo!r})
from pathlib import Path
import safestage
from safestage import _publish

root, dest = sys.argv[1], Path(sys.argv[2])
dest.write_bytes(b"old" * 1000)
inside, go = threading.Event(), threading.Event()
real = _publish._direct_locked
def paused(*args, **kwargs):
    if not inside.is_set():
        inside.set()
        go.wait(30)
    return real(*args, **kwargs)
_publish._direct_locked = paused

def write(data):
    def w(p):
        with open(p, "wb") as f:
            f.write(data)
    return w

with safestage.staged(root, publish="direct", background=True) as stage:
    stage._save(write(b"parent" * 1000), dest)
    inside.wait(30)
    child = os.fork()
    if child == 0:
        # the forked worker saves the same file once the parent's save is done
        time.sleep(1.0)
        with safestage.staged(root, publish="direct") as mine:
            mine._save(write(b"child" * 1000), dest)
        print("CHILD SAVED", flush=True)
        os._exit(0)
    go.set()
print("PARENT SAVED", flush=True)
deadline = time.monotonic() + 15
while time.monotonic() < deadline:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
        print("CHILD EXITED", status, flush=True)
        break
    time.sleep(0.1)
else:
    print("CHILD HUNG", flush=True)
    os.kill(child, 9)
    os.waitpid(child, 0)
'''


def test_forked_worker_saving_the_same_file_waits_forever_on_its_own_inherited_lock(
    tmp_path, shm_root
):
    """The forked worker itself: it inherited the parent's ``_other_writers_done``
    descriptor (locked), and when it later saves the same file with ``direct`` (the worker
    of a retried job re-saving a shard) its own ``_other_writers_done`` waits for a lock that
    only its own inherited descriptor holds. The parent's save finished long ago; the worker
    hangs forever, waiting for itself. Promised: no hangs; after fork() "the child starts
    with none of the parent's publishes, locks or counters"."""
    directory = tmp_path / "dest"
    directory.mkdir()
    dest = directory / "model.bin"
    script = tmp_path / "child.py"
    script.write_text(_SELF_HANG_CHILD.format(repo=str(REPO)))
    run = subprocess.run(
        [sys.executable, str(script), str(shm_root), str(dest)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert "PARENT SAVED" in run.stdout, run.stdout + run.stderr
    assert "CHILD HUNG" not in run.stdout, (
        "the forked child's direct save of the file hung for 15 s on the lock it inherited "
        f"from the parent's finished publish: {run.stdout}{run.stderr}"
    )
    assert "CHILD SAVED" in run.stdout, run.stdout + run.stderr


_LOCK_HOLDER = r'''
import fcntl, sys, time
f = open(sys.argv[1], "rb")
fcntl.flock(f, fcntl.LOCK_SH)
print("LOCKED", flush=True)
time.sleep(120)
'''


def test_a_reader_holding_a_shared_flock_on_the_destination_hangs_a_direct_save_forever(
    tmp_path, shm_root
):
    """A process that holds an ordinary ``flock(LOCK_SH)`` on the checkpoint while it uses it
    (an evaluator or serving process guarding the file it loads, a sync tool) is not a
    safestage direct write, yet ``_other_writers_done`` takes any lock for one and polls,
    with no limit, every 50 ms, for as long as that process holds it. Before 7f736a7 the
    same save completed (direct, on POSIX, readers "may see a partial file"); now the
    saving program hangs, logging only at INFO. Promised: no hangs."""
    import safestage

    directory = tmp_path / "dest"
    directory.mkdir()
    dest = directory / "model.bin"
    dest.write_bytes(b"old" * 1000)
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(dest)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "LOCKED"

        def save() -> object:
            with safestage.staged(shm_root, publish="direct") as stage:
                stage._save(lambda p: _write_file(p, b"new" * 1000), dest)
            return "saved"

        thread, outcome = _save_in_thread(save, timeout=10)
        hung = thread.is_alive()
    finally:
        holder.kill()
        holder.wait()
    thread.join(30)
    assert not hung, "a direct save hung for 10 s behind a reader's shared flock on the file"
    assert outcome == ["saved"]


_FIFO_WRITER = r'''
import sys, signal
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
with open(sys.argv[1], "wb") as f:   # blocks until a reader opens the FIFO
    print("OPENED", flush=True)
    f.write(b"x" * 100000)
'''


def test_direct_save_onto_a_fifo_opens_it_waking_its_blocked_writer(tmp_path, shm_root):
    """README: a FIFO at the final name is "refused with a PublishError under direct, which
    never opens one". ``_other_writers_done`` now opens the final name read-only before
    anything checks what it is: on a FIFO that open is a reader arriving, so a process
    blocked opening the FIFO for writing (a logger, a pipeline stage) is released, and once
    safestage closes it again that process's write dies of SIGPIPE. The save raises the
    promised PublishError, but it has already broken somebody else's pipe."""
    import safestage
    from safestage import PublishError

    directory = tmp_path / "dest"
    directory.mkdir()
    dest = directory / "model.bin"
    os.mkfifo(dest)
    writer = subprocess.Popen(
        [sys.executable, "-c", _FIFO_WRITER, str(dest)], stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(1.0)  # the writer is blocked in open()
        assert writer.poll() is None
        with pytest.raises(PublishError):
            with safestage.staged(shm_root, publish="direct") as stage:
                stage._save(lambda p: _write_file(p, b"new" * 1000), dest)
        time.sleep(1.0)
        still_blocked = writer.poll() is None
    finally:
        writer.kill()
        out, _ = writer.communicate()
    assert still_blocked, (
        f"the FIFO's blocked writer was released by safestage opening the FIFO (it printed "
        f"{out!r}, exit status {writer.returncode}): direct 'never opens one'"
    )


def _descriptors_on(path_fd: int) -> list[int]:
    """Access modes of this process's other descriptors open on the file ``path_fd`` is."""
    mine = os.readlink(f"/proc/self/fd/{path_fd}")
    modes = []
    for name in os.listdir("/proc/self/fd"):
        if int(name) == path_fd:
            continue
        try:
            if os.readlink(f"/proc/self/fd/{name}") != mine:
                continue
            with open(f"/proc/self/fdinfo/{name}", encoding="ascii") as info:
                flags = int(info.read().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError, ValueError):
            continue
        modes.append(flags & os.O_ACCMODE)
    return modes


def test_direct_overwrite_on_mountpoint_keeps_a_reader_open_while_opening_the_writer(
    kit_mounts, shm_root
):
    """mountpoint-s3 (doc/SEMANTICS.md, "Open"): "A file can not have a reader and a writer
    file handle open at the same time, and attempting to do so will result in an EPERM error
    for the second open request"; "You cannot overwrite files that are currently being
    read" (gVisor hit exactly this, awslabs/mountpoint-s3#862). ``_other_writers_done`` opens
    the old object O_RDONLY and keeps that reader open while ``_direct_locked`` opens the
    same name O_WRONLY|O_TRUNC: on a real mountpoint-s3 mount (--allow-overwrite) every
    direct overwrite, the one strategy that mount gets, now fails with EPERM where it used
    to succeed: a run that re-saves ``model.safetensors`` loses every save after the first.
    The kit's mountpoint model does not enforce this rule, so the test looks at what the real
    mount would be asked: the descriptors open on the file when the writer is opened."""
    import uuid

    import torch
    from safetensors.torch import load_file, save_file

    import safestage
    from safestage import _publish

    mount = kit_mounts["mountpoint"]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    dest = directory / "model.safetensors"
    seen: list[list[int]] = []
    real = _publish._regular_and_blocking

    def observed(fd: int) -> None:  # observation only: what is open when the writer opens
        seen.append(_descriptors_on(fd))
        real(fd)

    try:
        with safestage.staged(shm_root):
            save_file({"w": torch.ones(1000)}, str(dest))  # the first save: a new object
        _publish._regular_and_blocking = observed
        try:
            with safestage.staged(shm_root) as stage:
                save_file({"w": torch.full((1000,), 2.0)}, str(dest))  # the overwrite
        finally:
            _publish._regular_and_blocking = real
        assert [r.strategy for r in stage.records] == ["direct"]
        assert load_file(str(dest))["w"].eq(2.0).all()
    finally:
        import shutil

        shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)
    assert seen, "the direct write was never opened"
    assert os.O_RDONLY not in seen[0], (
        f"a read-only descriptor of {dest} was open while its writer was opened ({seen}): "
        "mountpoint-s3 refuses that open with EPERM"
    )


def test_retried_unlink_of_a_torn_followed_file_deletes_the_save_that_landed_meanwhile(
    tmp_path, shm_root
):
    """A followed ``direct`` write of a new file whose writer fails is cleaned up by
    ``_remove_if_ours``: it checks once that the name is still our inode, then
    ``_unlink_torn`` retries the unlink for a whole second without looking again. The retry
    exists for a refused unlink (mountpoint answers EPERM while a forked child still holds
    our descriptor); during that second the name may be published by another save (another
    process's plain or staged save renames its complete file over it), and the retry
    deletes that complete file. The other save returned success; its file is gone. Promised:
    "never deleting or corrupting a file another save published". The refusal is injected
    (once, for this name only); the other save is real and runs in another process."""
    import errno

    import safestage

    directory = tmp_path / "dest"
    directory.mkdir()
    dest = directory / "model.bin"
    other = r'''
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
import safestage
with safestage.staged({root!r}, publish="replace") as stage:
    stage._save(lambda p: open(p, "wb").write(b"OTHER" * 1000), Path({dest!r}))
'''.format(repo=str(REPO), root=str(shm_root), dest=str(dest))
    fired: list[int] = []
    real_unlink = os.unlink

    def refused_once(path, *args, **kwargs):
        if os.fspath(path) == str(dest) and not fired:
            fired.append(1)
            # meanwhile another process's save publishes the name
            subprocess.run([sys.executable, "-c", other], check=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    def write(path: str) -> None:
        target = os.path.join(os.path.dirname(path), ".tmpXyZ123")
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\x01" * (1 << 20))
            deadline = time.monotonic() + 10
            while not os.path.lexists(dest) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert os.path.lexists(dest), "the followed copy never created the final name"
            raise ValueError("writer failed")
        finally:
            os.close(fd)

    os.unlink = refused_once
    try:
        with pytest.raises(ValueError):
            with safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage:
                stage._save(write, dest)
    finally:
        os.unlink = real_unlink
    assert fired, "the unlink of the torn file was never refused: the scenario did not run"
    assert dest.exists(), (
        "the other process's save published its complete file under the name and returned "
        "success; the failed followed save's retried unlink then deleted it"
    )
    assert dest.read_bytes() == b"OTHER" * 1000
