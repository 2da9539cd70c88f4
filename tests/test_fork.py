"""fork(): children forked during saves and publishes (DataLoader workers, Pool) save on their own, never hang on a lock, and close our destination descriptors."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from _support import (
    REPO,
    _env,
    _save_in_thread,
    _write_file,
    arange_tensors,
    filled_tensors,
    listing,
    loads_equal,
)
from safetensors.torch import save_file

import safestage


def _pool_save(dest: str) -> int:
    save_file(arange_tensors(3), dest)
    return os.getpid()


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a fork pool worker saving in the background lands")
def test_a_fork_pool_worker_saving_in_the_background_lands(tmp_path, shm_root):
    dests = [str(tmp_path / f"shard-{i}.safetensors") for i in range(4)]
    stage = safestage.activate(shm_root, background=True)
    try:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            pids = pool.map(_pool_save, dests)
    finally:
        stage.close()
    assert os.getpid() not in pids
    for dest in dests:
        assert loads_equal(Path(dest), arange_tensors(3)), f"{dest} never reached the destination"
    assert listing(tmp_path) == sorted(Path(d).name for d in dests)


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a child forked mid publish neither hangs nor waits for the parent")
@pytest.mark.parametrize("at_once", [1, 2])
def test_a_child_forked_mid_publish_neither_hangs_nor_waits_for_the_parent(mount_dir, stage_root, at_once):
    directory, _ = mount_dir("slow")  # 400 MB/s: a 64 MiB publish takes ~0.2 s
    stage = safestage.activate(stage_root, background=at_once)
    try:
        save_file(arange_tensors(1, numel=16 << 20), str(directory / "parent.safetensors"))
        assert safestage._work.running_count(stage), "the parent's publish should still be pending"
        pid = os.fork()
        if pid == 0:  # the child: its own save must land, its close must not wait for ours
            code = 1
            try:
                save_file(arange_tensors(2), str(directory / "child.safetensors"))
                stage.close()
                code = 0 if loads_equal(directory / "child.safetensors", arange_tensors(2)) else 2
            finally:
                os._exit(code)
        status = _status_of_child(pid, 30, "the forked child hung (waiting on the parent's publish)")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        stage.close()
    assert loads_equal(directory / "parent.safetensors", arange_tensors(1, numel=16 << 20))
    assert loads_equal(directory / "child.safetensors", arange_tensors(2))


def _write_descriptors_of(pid: int, path: Path) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != str(path):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as info:
                flags = int(info.read().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError, ValueError):
            continue
        if flags & os.O_ACCMODE != os.O_RDONLY:
            found.append(fd)
    return found


@pytest.mark.regression("0.1 hostile review 10: a child forked during a background direct publish kept its write descriptor, so mountpoint kept the upload open")
@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors (deleted)"])
def test_a_child_forked_during_a_background_direct_publish_does_not_keep_the_upload_open(
    kit_mounts, shm_root, name
):
    """A DataLoader worker forked while a background publish writes the final name on an
    object-store mount: a write descriptor left open in the worker keeps the upload open
    (mountpoint-s3 then can neither finish nor remove the file). The worker closes its
    copy at once; the publish lands whole."""
    import safestage

    mount = kit_mounts["mountpoint"]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    dest = directory / name
    data = os.urandom(1 << 20) * 96  # 96 MiB: the publish takes a while on the kit
    child = 0
    try:
        with safestage.staged(shm_root, background=True) as stage:

            def write(path: str) -> None:
                with open(path, "wb") as handle:
                    handle.write(data)

            stage._save(write, dest)
            deadline = time.monotonic() + 30
            while not _write_descriptors_of(os.getpid(), dest) and time.monotonic() < deadline:
                time.sleep(0.001)
            child = os.fork()  # a DataLoader worker started while the publish writes
            if child == 0:
                code = 2  # the parent no longer held a writer: the scenario did not run
                try:
                    if _write_descriptors_of(os.getppid(), dest):
                        code = 1 if _write_descriptors_of(os.getpid(), dest) else 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(child, 0)
            child = 0
        assert [r.publish for r in stage.records] == ["direct"]
        assert dest.read_bytes() == data
        assert os.listdir(directory) == [name]
    finally:
        if child:
            os.waitpid(child, 0)
        shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)  # type: ignore[attr-defined]
    code = os.waitstatus_to_exitcode(status)
    assert code != 2, "the fork did not come while the publish was writing the final name"
    assert code == 0, f"the forked child kept a write descriptor of {dest}"


@pytest.mark.regression("0.1 hostile review 8: fork during a direct overwrite makes every later direct save of that file hang")
def test_a_fork_during_a_direct_overwrite_never_hangs_later_direct_saves_of_that_file(
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


@pytest.mark.regression("0.1 hostile review 8: forked worker saving the same file waits forever on its own inherited lock")
def test_a_forked_worker_saving_the_same_file_never_waits_on_its_own_inherited_lock(
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


@pytest.mark.regression("0.1 hostile review 9: forked children kept destination descriptors of direct saves")
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


@pytest.mark.regression("0.1 hostile review 1: a child forked while a thread holds a safestage lock hangs in its first save")
@pytest.mark.parametrize("lock", ["capabilities", "local-devices"])
def test_a_child_forked_while_a_thread_holds_a_safestage_lock_saves_without_hanging(shm_root, tmp_path, lock):
    """_patch and _background re-create their locks in a forked child, but the per-mount
    verdict cache (_mounts.capabilities._lock) and the local-disk cache (_mounts._local_lock)
    are plain threading.Locks that every publish takes (background publisher threads
    included). A fork() at the moment another thread holds one (a DataLoader or
    multiprocessing fork worker started while a background publish runs) copies it locked,
    with no thread to release it: the child's first staged save blocks forever. The holder
    here is a thread that takes the real lock, standing in for a publisher inside
    strategy_for() - the window is short, the hang permanent. What the user loses: a worker
    that never finishes (no error, no timeout)."""
    from safestage import _mounts

    held_lock = _mounts.capabilities._lock if lock == "capabilities" else _mounts._local_lock
    stage = safestage.activate(shm_root, skip_local_disk=lock == "local-devices")
    held, release = threading.Event(), threading.Event()

    def publisher_inside_the_cache() -> None:
        with held_lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=publisher_inside_the_cache, daemon=True)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            save_file(filled_tensors(5), str(tmp_path / "child.safetensors"))
            code = 0
        finally:
            os._exit(code)
    release.set()
    holder.join()
    try:
        # a staged save of 16 KiB takes milliseconds
        status = _status_of_child(pid, 5, "the forked child hung in its first save (a lock copied while held)")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        stage.close()


@pytest.mark.regression("0.1 hostile review 1: a child forked during a deferred clean up never sees ctrl c")
def test_a_child_forked_during_a_deferred_clean_up_still_sees_ctrl_c(shm_root, tmp_path):
    """_interrupts.deferred() swaps SIGINT's handler for one that only notes the signal while
    a clean-up runs in the main thread. A fork() from another thread at that moment
    (multiprocessing's Pool re-forks workers from its handler thread; test_invariant_walk forks the
    same way) copies that handler into the child, whose forking thread becomes its main
    thread; nothing ever restores it there. What the user loses: Ctrl-C in that worker is
    noted into a list nobody reads - the worker never stops. (The fork is timed with
    tests/_tap.py at the clean-up's rmtree, the step test_invariant_walk forks at.)"""
    sys.path.insert(0, str(Path(__file__).parent))
    from _tap import Tap

    def save(name: str, tap: Tap) -> None:
        with safestage.staged(shm_root), tap:
            save_file(filled_tensors(1), str(tmp_path / name))

    save("warm.safetensors", Tap())  # the rename probe runs once per filesystem
    dry = Tap()
    save("dry.safetensors", dry)
    at = next(s.index for s in dry.steps if s.name == "rmtree" and s.thread == "MainThread")
    tap = Tap(at=at, action="fork")
    tap.child = lambda: 0 if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 3
    save("model.safetensors", tap)
    assert tap.forked is not None, "the fork did not happen"
    _, status = os.waitpid(tap.forked, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        "the forked child's SIGINT handler is safestage's deferral note, not KeyboardInterrupt"
    )


def _status_of_child(pid: int, seconds: float, why_if_hung: str) -> int:
    """The wait status of the forked child ``pid``; a child still running after ``seconds`` is
    killed and the test fails with ``why_if_hung``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(why_if_hung)
