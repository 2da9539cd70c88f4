"""A hostile review of the hardened safestage: one failing test per defect found.

Every test reproduces the defect for real (real safetensors 0.8 writer, real FUSE mounts of
the kit, real tmpfs mounts, real processes, signals and PID namespaces); the few that need a
fault no real filesystem gives on demand use tests/_tap.py and say so. Each asserts what a
user checks afterwards: the bytes at the destination, the directory listing, the staging
root, the exit status and stderr. Each test FAILS against the code it was written for.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import safestage
from safestage.testing import hostile_mount

PY = sys.executable
SHM = Path("/dev/shm")


def tensors(tag: float = 0.0, numel: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.full((numel,), float(tag))}


def loads_as(path: Path, tag: float) -> bool:
    """The file loads, and every value is ``tag`` (no mix of two saves)."""
    try:
        values = torch.unique(load_file(str(path))["w"]).tolist()
    except Exception:
        return False
    return values == [float(tag)]


def entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def run_python(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
               prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    base.update(env or {})
    return subprocess.run(
        [*(prefix or []), PY, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=base,
    )  # fmt: skip


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A private staging root on /dev/shm (another device than tmp_path: publish copies)."""
    import uuid

    path = SHM / f"safestage-review-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def slow_mount() -> Iterator[Any]:
    """A kit `slow` mount at 20 MB/s: a 4 MiB publish takes ~0.2 s."""
    with hostile_mount("slow", mbps=20) as mount:
        yield mount


@pytest.fixture
def eio_mount() -> Iterator[Any]:
    with hostile_mount("close-eio") as mount:
        yield mount


# -- 1. a spawn/forkserver Pool worker's background publish dies with the worker --------------

POOL_WORKER = """
    import multiprocessing, os, sys
    import torch

    def init(root):
        import safestage
        safestage.activate(root, background=True)   # or SAFESTAGE_BACKGROUND=1 in the job's env

    def work(dest):
        from safetensors.torch import save_file
        save_file({"w": torch.full((2 << 20,), 7.0)}, dest)   # 8 MiB
        return os.getpid()

    if __name__ == "__main__":
        dest, root, method = sys.argv[1:4]
        ctx = multiprocessing.get_context(method)
        with ctx.Pool(1, initializer=init, initargs=(root,)) as pool:   # __exit__ = terminate()
            pool.apply(work, (dest,))
        print("pool done")
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_pool_worker_background_publish_is_lost_when_the_pool_block_ends(tmp_path, root, slow_mount, method):
    """`with Pool() as pool:` ends with terminate(): SIGTERM to every worker as soon as the
    results are in. A worker that activated staging itself (initializer, or the start-up hook
    with SAFESTAGE_BACKGROUND=1 in a spawned/forkserver child) returned from save_file once
    the file was staged; SIGTERM kills its publisher thread mid-copy. What the user loses: the
    checkpoint never reaches the destination, nothing is printed, the program exits 0, and the
    complete staged copy sits unnamed in the staging root (never swept). README promises
    "nothing of it may be pending then" only for stages inherited through fork()."""
    script = tmp_path / "pool_worker.py"
    script.write_text(textwrap.dedent(POOL_WORKER))
    dest = Path(slow_mount.path) / f"{method}.safetensors"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run([PY, str(script), str(dest), str(root), method],
                          capture_output=True, text=True, timeout=60, env=base)  # fmt: skip
    assert "pool done" in done.stdout, done.stderr
    time.sleep(1.0)  # anything still in flight would have landed by now (8 MiB at 20 MB/s)
    landed = loads_as(dest, 7.0)
    loud = done.returncode != 0 and str(dest) in done.stderr
    assert landed or loud, (
        f"the worker's save returned, the pool ended, the program exited {done.returncode}, "
        f"and {dest} is not there (destination: {entries(dest.parent)}; staging root: "
        f"{[(d, entries(root / d)) for d in entries(root)]}; stderr: {done.stderr[-300:]!r})"
    )


# -- 2. only the first failed background publish is ever reported -----------------------------

TWO_FAILURES = """
    import sys, torch, safestage
    from safetensors.torch import save_file
    a, b, root = sys.argv[1:4]
    try:
        with safestage.staged(root, background=True):
            save_file({"w": torch.ones(64)}, a)
            save_file({"w": torch.ones(64)}, b)
    except safestage.PublishError as exc:      # the user handles it: saves that one again
        print("RETRY", exc.filename)
"""


def test_a_second_failed_background_publish_is_invisible(root, eio_mount):
    """Two background publishes fail (an upload failing at close). The end of the block raises
    the first PublishError; the second is "logged at ERROR" into the NullHandler safestage
    installs, so with logging not configured nothing anywhere mentions it. A program that
    handles the error it is given (saves that file again) exits 0 believing every other file
    landed. What the user loses: b.safetensors, silently."""
    a, b = Path(eio_mount.path) / "a.safetensors", Path(eio_mount.path) / "b.safetensors"
    done = run_python(TWO_FAILURES, str(a), str(b), str(root))
    assert "RETRY" in done.stdout, done.stderr
    assert not b.exists()
    told = done.stdout + done.stderr
    assert "b.safetensors" in told, (
        f"b.safetensors was never published and nothing says so (exit {done.returncode}); "
        f"stdout {done.stdout!r}, stderr {done.stderr[-300:]!r}"
    )


# -- 3. Ctrl-C while a save waits for a background slot ---------------------------------------


def _descriptors_into(directory: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)):
                found.append(target)
    return found


def test_ctrl_c_while_waiting_for_a_background_slot_orphans_the_staged_copy(root):
    """background=1: the second save is serialized, then waits for the
    first publish to free the slot. A Ctrl-C there (a notebook's "interrupt kernel", a
    training loop's Ctrl-C) leaves the complete staged copy in a private directory whose
    descriptor and flock stay open for the life of the process; the KeyboardInterrupt carries
    no note saying where the copy is (README: a Ctrl-C keeps the staged copy "named in the
    traceback"), and once the process exits nothing ever sweeps it (it holds a complete
    file). What the user loses: the save, silently, plus a leaked lock and disk space."""
    with hostile_mount("slow", mbps=5) as mount:
        stage = safestage.activate(root, background=1)
        try:
            save_file(tensors(1, numel=1 << 20), str(Path(mount.path) / "a.safetensors"))  # ~0.8 s
            timer = threading.Timer(0.3, _thread.interrupt_main)
            timer.start()
            note: list[str] = []
            try:
                save_file(tensors(2), str(Path(mount.path) / "b.safetensors"))
                pytest.fail("the Ctrl-C did not land while waiting for the slot")
            except KeyboardInterrupt as exc:
                note = list(getattr(exc, "__notes__", []))
            timer.join()
        finally:
            stage.close()
        left = [d for d in entries(root) if entries(root / d)]
        held = _descriptors_into(root)
        assert not held, f"descriptors into the staging root still open after close(): {held}"
        assert not left or any(d in " ".join(note) for d in left), (
            f"staged copies {left} kept in {root}, and the KeyboardInterrupt says nothing ({note})"
        )


# -- 4. a later synchronous save of the same file is overwritten by an older background one ---


@pytest.mark.parametrize("later", ["nested-stage", "staged_file"])
def test_an_older_background_publish_lands_over_a_newer_save_of_the_same_file(root, slow_mount, later):
    """The run stages with background=True (activate(), or SAFESTAGE_BACKGROUND=1); the same
    file is then saved again synchronously, by a library's own `with safestage.staged():` or
    through `safestage.staged_file`. README: "publishes of the same destination run in
    order" - but only among background publishes: the synchronous one lands at once, and the
    still-pending older publish replaces it afterwards. What the user loses: the newer
    checkpoint; the file silently holds the older one."""
    dest = Path(slow_mount.path) / "model.safetensors"
    outer = safestage.activate(root, background=True)
    try:
        save_file(tensors(1, numel=1 << 20), str(dest))  # v1: 4 MiB, ~0.2 s to publish
        if later == "nested-stage":
            with safestage.staged(root):
                save_file(tensors(2), str(dest))  # v2, saved after v1, returns after publishing
        else:
            from safetensors.torch import save as to_bytes

            with safestage.staged_file(dest, root) as local:
                local.write_bytes(to_bytes(tensors(2)))  # any writer (torch.save, a copy, ...)
    finally:
        outer.close()
    assert loads_as(dest, 2.0), "the older background publish replaced the newer save"


# -- 5. staged_file around a safetensors save, inside a background stage ----------------------


def test_staged_file_around_a_safetensors_save_in_a_background_stage(root, tmp_path):
    """SAFESTAGE_BACKGROUND=1 for the job, and a helper that publishes every artifact with
    `staged_file` (README: "any other writer ... with the same strategies and guarantees").
    The save_file into the yielded local path is itself staged and goes to the background,
    so `staged_file` finds nothing there yet, deletes the private directory and raises
    StagingError "nothing was written to ..." - false: something was written, and is still
    being published into the directory just deleted, which then fails a second time at close.
    What the user loses: the file, with an error that blames the wrong thing."""
    dest = tmp_path / "model.safetensors"
    job_root = tmp_path / "job-root"  # the job's staging root, on another device than `root`
    job_root.mkdir()
    stage = safestage.activate(job_root, background=True)
    try:
        with safestage.staged_file(dest, root) as local:
            save_file(tensors(3, numel=16 << 20), str(local))  # 64 MiB: its publish takes a while
    finally:
        with contextlib.suppress(Exception):
            stage.close()
    assert loads_as(dest, 3.0)


# -- 6. skip_local_disk=True caches "local disk" by device number; FUSE reuses device numbers -----------


def test_when_auto_writes_a_fuse_mount_unstaged_after_a_tmpfs_had_its_device_number(root, tmp_path):
    """skip_local_disk=True writes local-disk destinations with the original writer, unstaged, and
    caches that verdict per st_dev (_mounts.is_local_disk). Anonymous device numbers (tmpfs,
    FUSE, overlay, btrfs subvolumes) are reused as soon as a mount goes - README says so
    itself ("FUSE reuses device numbers") and keys the rename verdict per mount, but not this
    one. Save once to a tmpfs, unmount it, mount an object store (here the kit's close-eio:
    an upload that fails at close) that gets the same number: the save goes straight to the
    plain safetensors writer. What the user loses: the previous checkpoint is replaced by a
    discarded upload (the file is gone) and the error is a bare FileNotFoundError from a
    chmod, not a PublishError keeping the staged copy."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stage = safestage.activate(root, skip_local_disk=True)
    try:
        for _attempt in range(5):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
            try:
                local_device = os.stat(mnt).st_dev
                save_file(tensors(0), str(mnt / "scratch.safetensors"))  # "local": cached
            finally:
                subprocess.run(["umount", str(mnt)], check=True)
            with hostile_mount("close-eio", mnt) as mount:
                if os.stat(mount.path).st_dev != local_device and _attempt < 4:
                    continue  # another mount took the number meanwhile: try again
                # (On the last attempt the check runs anyway: without the reuse it still
                # proves the object store is staged, and nothing is ever skipped.)
                from safetensors.torch import save as to_bytes

                previous = Path(mount.backing) / "model.safetensors"
                previous.write_bytes(to_bytes(tensors(1)))  # the previous checkpoint
                error: BaseException | None = None
                try:
                    save_file(tensors(2), str(Path(mount.path) / "model.safetensors"))
                except Exception as exc:
                    error = exc
                assert loads_as(previous, 1.0) or loads_as(previous, 2.0), (
                    f"the previous checkpoint is gone and the new one is not there: the save went "
                    f"unstaged onto the object store (error: {error!r})"
                )
                return
    finally:
        stage.close()


# -- 7. fork() while a publisher thread holds one of the module locks not reset at fork --------


@pytest.mark.parametrize("lock", ["capabilities", "local-devices"])
def test_a_child_forked_while_a_thread_holds_a_safestage_lock_hangs_in_its_first_save(root, tmp_path, lock):
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
    stage = safestage.activate(root, skip_local_disk=lock == "local-devices")
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
            save_file(tensors(5), str(tmp_path / "child.safetensors"))
            code = 0
        finally:
            os._exit(code)
    release.set()
    holder.join()
    try:
        deadline = time.monotonic() + 5  # a staged save of 16 KiB takes milliseconds
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in its first save (a lock copied while held)")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        stage.close()


# -- 8. the exit-time report of a lost background publish, with sys.stderr closed --------------

UNCLOSED_THEN = """
    import io, os, sys, time, torch, safestage
    from safetensors.torch import save_file
    dest, root, how = sys.argv[1:4]
    safestage.activate(root, background=True)      # never closed: exit must report a failure
    save_file({"w": torch.ones(64)}, dest)
    if how == "stderr-closed":
        sys.stderr.close()                         # fd 2 itself stays open (closefd=False)
    elif how == "both-streams-replaced":
        sys.__stderr__.close()
        sys.stderr = io.StringIO()                 # a test harness / a GUI capturing stderr
    elif how == "os._exit":
        time.sleep(1)                              # the publish has failed by now
        os._exit(0)                                # Ray, Megatron, launchers, forked workers
"""


@pytest.mark.parametrize("how", ["stderr-closed", "both-streams-replaced"])
def test_the_exit_report_of_a_lost_publish_needs_a_python_stderr(root, eio_mount, how):
    """README: a publish that fails with nobody left to raise it to "is written to stderr
    whatever the logging setup". _exit_loudly writes to sys.__stderr__ (or sys.stderr) only;
    when the program closed that object (file descriptor 2 stays open: Python's std streams
    never close their fd) the message is dropped and the process exits 1 with no word of
    why. What the user loses: the only record of which checkpoint is missing."""
    dest = Path(eio_mount.path) / "model.safetensors"
    done = run_python(UNCLOSED_THEN, str(dest), str(root), how)
    assert done.returncode != 0
    assert str(dest) in done.stderr, f"exit {done.returncode}, stderr {done.stderr!r}"


def test_a_lost_background_publish_then_os_exit_leaves_no_trace(root, eio_mount):
    """The background publish fails (EIO at close), the program ends with os._exit(0) as many
    launchers and workers do. No atexit runs, and the failure was only "logged at ERROR"
    into safestage's NullHandler: nothing reaches stderr, ever, and the exit status is 0.
    Whatever the exit path, the moment of failure could report it (stderr when no handler
    takes the record). What the user loses: the checkpoint, silently."""
    dest = Path(eio_mount.path) / "model.safetensors"
    done = run_python(UNCLOSED_THEN, str(dest), str(root), "os._exit")
    assert not dest.exists()
    assert done.returncode != 0 or str(dest) in done.stderr, (
        f"the checkpoint was lost, the program exited {done.returncode} and stderr is {done.stderr!r}"
    )


# -- 9. two saves of one file with publish="direct" on a POSIX filesystem ----------------------


def test_two_direct_saves_of_one_file_on_a_posix_disk_mix_their_bytes(root, tmp_path):
    """README: "saves to the same file: the last os.replace wins and the file is always
    complete". With publish="direct" (SAFESTAGE_PUBLISH=direct, the README's own recipe for
    object stores, applies to every save of the job) there is no os.replace: two threads (or
    two ranks) saving the same file open it O_TRUNC and write it at the same time; each checks
    only the size, which matches, and both return success. What the user loses: the file
    loads without error with half of one save and half of the other - silently wrong weights
    (or, other times, a success whose file the other save's clean-up deleted)."""
    dest = tmp_path / "model.safetensors"
    numel = 6 << 20  # 24 MiB: six 4 MiB chunks each
    for trial in range(20):  # bounded retry: a trial mixes about half the time
        errors: list[BaseException] = []

        def save(tag: float, errors: list[BaseException] = errors) -> None:
            try:
                save_file(tensors(tag, numel), str(dest))
            except BaseException as exc:
                errors.append(exc)

        with safestage.staged(root, publish="direct"):
            threads = [threading.Thread(target=save, args=(tag,)) for tag in (1.0, 2.0)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if not errors:
            assert loads_as(dest, 1.0) or loads_as(dest, 2.0), (
                f"trial {trial}: both saves returned success and {dest.name} holds "
                f"{torch.unique(load_file(str(dest))['w']).tolist() if dest.exists() else 'nothing'}"
            )
        elif len(errors) == 1:
            assert dest.exists(), f"trial {trial}: one save succeeded, yet {dest.name} is gone ({errors[0]})"


# -- 10. direct writes through a symlink at the final name ------------------------------------


def test_direct_writes_through_a_symlink_at_the_final_name(root, tmp_path):
    """`latest.safetensors -> step-1000.safetensors` is a common layout. A plain safetensors
    save of latest.safetensors (and publish="replace"/"rename") replaces the link with the
    new file, leaving step-1000 alone; README and _paths say so ("a symlink there is
    replaced, as safetensors 0.8 does"). publish="direct" opens the final name O_TRUNC,
    following the link. What the user loses: step-1000.safetensors, overwritten with the new
    weights (the link still points at it; the old checkpoint is gone)."""
    older = tmp_path / "step-1000.safetensors"
    save_file(tensors(1000), str(older))
    latest = tmp_path / "latest.safetensors"
    latest.symlink_to(older.name)
    with safestage.staged(root, publish="direct"):
        save_file(tensors(2000), str(latest))
    assert loads_as(older, 1000.0), "the symlink's target (an older checkpoint) was overwritten"
    assert not latest.is_symlink() and loads_as(latest, 2000.0)


# -- 11. safestage doctor leaves its own failed staged copy behind ----------------------------


def test_doctor_leaves_its_failed_staged_copy_when_the_root_is_given_through_a_symlink(root, tmp_path, eio_mount):
    """README: doctor "removes its probe directory and touches nothing else". On a
    destination where the staged save fails (the close-eio upload), the publish keeps its
    complete staged copy and doctor means to delete it, but only if the copy's directory is
    textually under settings.staging_root(); the StagingRoot root is the kernel's path. With
    --dir (or SAFESTAGE_DIR) given through a symlink (/scratch -> /local/nvme/scratch), the
    copy stays - a complete file, so no sweep or `safestage clean` ever removes it - while
    the report says cleanup removed=True. What the user loses: disk space in the staging
    root, one probe at a time, with nothing saying so."""
    given = tmp_path / "scratch-link"
    given.symlink_to(root)
    from safestage._doctor import run_doctor

    report = run_doctor(Path(eio_mount.path), root=given)
    assert report.staged_save.result == "failed" and report.cleanup.removed
    left = [(d, entries(root / d)) for d in entries(root)]
    assert not left, f"doctor said cleanup removed=True but left {left} in the staging root"


# -- 12. the staging root is still normalized as text ------------------------------------------


def test_the_staging_root_is_normalized_as_text(tmp_path):
    """The destination is resolved by the kernel (issue 9: "paths normalized as text"), the
    staging root is not: _config.parse_root applies os.path.abspath, which drops `link/..`
    as text. `SAFESTAGE_DIR=/scratch/nvme/../stage` with nvme -> /mnt/nvme0/user stages in
    /scratch/stage - another directory, maybe another filesystem (or refused as "does not
    exist" though the path the user gave exists). What the user loses: staging lands where
    they did not ask (a slow or small disk, a shared directory), or staging is off."""
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "real" / "stage").mkdir()  # the kernel's answer for link/../stage
    (tmp_path / "stage").mkdir()  # what abspath answers
    (tmp_path / "link").symlink_to("real/deep")
    given = f"{tmp_path}/link/../stage"
    assert os.path.samefile(given, tmp_path / "real" / "stage")
    stage = safestage.activate(given)
    try:
        used = safestage._save.staging_root(stage.settings).path  # where the save directories are made
    finally:
        stage.close()
    assert os.path.samefile(used, tmp_path / "real" / "stage"), f"staging in {used}, not in {given}"


# -- 13. doctor probe directories carry no lock ------------------------------------------------

SLOW_DOCTOR = """
    import json, sys
    from pathlib import Path
    from safestage._doctor import run_doctor
    report = run_doctor(Path(sys.argv[1]), root=Path(sys.argv[2]))
    print(json.dumps({"verdict": report.verdict, "problems": report.problems}))
"""


def test_clean_from_another_pid_namespace_removes_a_running_doctors_probe(root, tmp_path):
    """README: "A live owner holds a flock on its staging directory and on its temp file, so
    an entry that cannot be locked is in use, also by a process in another PID namespace".
    `safestage doctor`'s probe directory (.safestage-doctor-<host>-<pid>-<token>) is never
    locked, so a `safestage clean` of the same directory from a container (another PID
    namespace, where the doctor's pid does not exist) takes the lock nobody holds, decides
    "its owner is gone" and removes the probe mid-run. What the user loses: a correct
    diagnosis - doctor then reports ENOENT failures and calls a healthy mount "unsafe"."""
    with hostile_mount("slow", mbps=0.2) as mount:  # a slow mount: doctor runs for seconds
        target = Path(mount.path) / "ckpt"
        target.mkdir()
        base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        doctor = subprocess.Popen([PY, "-c", textwrap.dedent(SLOW_DOCTOR), str(target), str(root)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)  # fmt: skip
        deadline = time.monotonic() + 15
        while not any(n.startswith(".safestage-doctor-") for n in os.listdir(target)):
            assert time.monotonic() < deadline and doctor.poll() is None, "doctor never made its probe"
            time.sleep(0.01)
        time.sleep(0.2)
        cleaned = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", PY, "-m", "safestage", "clean", str(target)],
            capture_output=True, text=True, timeout=30, env=base,
        )  # fmt: skip
        out, _ = doctor.communicate(timeout=60)
    report = json.loads(out)
    assert "removed" not in cleaned.stdout.split("\n")[0], f"clean removed a live probe: {cleaned.stdout}"
    assert report["verdict"] == "plain-ok", report


# -- 14. safestage clean on a directory it cannot list ------------------------------------------


def test_clean_on_an_unreadable_directory_is_a_traceback(tmp_path):
    """`safestage clean PATH` where PATH exists but cannot be listed (another user's
    checkpoint directory, a mount that refuses readdir) dies with a Python traceback from
    os.scandir instead of the CLI's own one-line error and status; scripts that parse its
    --json output get no JSON. (Root bypasses the permission: the test drops the
    capabilities that let it.) What the user loses: a clear error; cron jobs log a crash."""
    locked = tmp_path / "theirs"
    locked.mkdir(mode=0o000)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search",
         PY, "-m", "safestage", "clean", "--json", str(locked)],
        capture_output=True, text=True, timeout=60, env=base,
    )  # fmt: skip
    locked.chmod(0o700)
    assert done.returncode in (1, 2), done
    assert "Traceback" not in done.stderr, done.stderr[-600:]


# -- 15. @staged on a generator or coroutine function stages nothing -----------------------------


def test_staged_as_a_decorator_on_a_generator_function_stages_nothing(root):
    """README: "As a decorator: @safestage.staged(...) stages every call of the function."
    ContextDecorator closes the stage when the call returns - for a generator function (a
    training loop yielding metrics, a checkpoint iterator) or an `async def`, that is before
    its body runs, so every save inside it is unstaged. On HDFS FUSE the plain writer fails
    (ENOSYS); on an object store whose upload fails at close it reports success and loses
    the file. What the user loses: every checkpoint the decorated loop writes."""
    with hostile_mount("hdfs") as mount:
        dest = Path(mount.path) / "model.safetensors"

        @safestage.staged(root)
        def train() -> Iterator[int]:
            for step in range(1):
                save_file(tensors(step + 1), str(dest))
                yield step

        list(train())  # safetensors raises ENOSYS from ftruncate: the save was not staged
        assert loads_as(dest, 1.0)


# -- 16. a directory whose name ends in " (deleted)" ---------------------------------------------


def test_a_directory_named_like_a_deleted_one_is_saved_unstaged(root):
    """_paths.real_directory reads /proc/self/fd/N and treats a path ending in " (deleted)"
    as a removed directory, so resolve_destination returns None and the save goes to the
    original writer, unstaged. A real directory can have that name ("run 7 (deleted)",
    a restored folder). On HDFS FUSE the plain writer then fails with ENOSYS; on an object
    store that fails at close it loses the file silently. What the user loses: staging, for
    every save into that directory, without a word (the check could fstat the descriptor:
    st_nlink == 0 means removed)."""
    with hostile_mount("hdfs") as mount:
        directory = Path(mount.path) / "run 7 (deleted)"
        directory.mkdir()
        with safestage.staged(root) as stage:
            save_file(tensors(7), str(directory / "model.safetensors"))  # ENOSYS: unstaged
        assert [r.publish for r in stage.records] == ["replace"]
        assert loads_as(directory / "model.safetensors", 7.0)


# -- 17. staged_file under a path whose parent is a file ----------------------------------------


def test_staged_file_under_a_regular_file_reports_enoent_not_enotdir(root, tmp_path):
    """_save.destination promises "the error a plain open would give"; open() of
    `afile/x` where afile is a regular file fails with ENOTDIR. staged_file raises
    PublishError(ENOENT, "the directory of ... does not exist (or is not a directory): create
    it"), advice that makes the user try `mkdir -p` over an existing file. Cosmetic."""
    (tmp_path / "afile").write_bytes(b"not a directory")
    with pytest.raises(OSError) as plain:
        open(tmp_path / "afile" / "x.bin", "wb")  # noqa: SIM115
    with pytest.raises(OSError) as staged, safestage.staged_file(tmp_path / "afile" / "x.bin", root) as local:
        local.write_bytes(b"data")
    assert staged.value.errno == plain.value.errno == errno.ENOTDIR, str(staged.value)


# -- 18. Ctrl-C during the directory fsync, after the file is published --------------------------


def test_ctrl_c_after_the_replace_keeps_a_needless_copy_and_says_the_publish_was_interrupted(root, tmp_path):
    """publish="replace" with fsync: the temp is os.replace'd over the final name, then the
    directory is fsync'ed (on HDFS FUSE or NFS that takes a while). A Ctrl-C there: the new
    file IS at its destination, but publish_local sees its staged copy still present, keeps
    it, and notes "interrupted while publishing <dest>; the complete staged copy is kept".
    The copy holds a complete file, so no sweep or clean will ever remove it. What the user
    loses: disk space in the staging root, and a note that makes them believe the
    destination is stale. (The fault is injected with tests/_tap.py: a Ctrl-C cannot be timed
    to one syscall otherwise.)"""
    sys.path.insert(0, str(Path(__file__).parent))
    from _tap import Tap

    def save(name: str, tap: Tap) -> None:
        with safestage.staged(root, publish="replace"), tap:
            save_file(tensors(9), str(tmp_path / name))

    save("warm.safetensors", Tap())
    dry = Tap()
    save("dry.safetensors", dry)
    replaced = next(s.index for s in dry.steps if s.name == "replace")
    fsync_dir = next(s.index for s in dry.steps[replaced:] if s.name == "open" and s.module == "safestage._publish")
    notes: list[str] = []
    tap = Tap(at=fsync_dir, action="interrupt")
    try:
        save("model.safetensors", tap)
    except KeyboardInterrupt as exc:
        notes = list(getattr(exc, "__notes__", []))
    assert tap.fired is not None and tap.fired.name == "open" and str(tmp_path) in tap.fired.arg
    assert loads_as(tmp_path / "model.safetensors", 9.0), "the publish had completed"
    kept = [(d, entries(root / d)) for d in entries(root)]
    assert not kept, f"a copy of an already published file is kept forever: {kept}; note: {notes}"


# -- 19. direct over a file this process has mapped: unlink first, then fail -------------------


def test_direct_over_a_loaded_file_deletes_it_then_fails_and_says_untouched(root, tmp_path):
    """To protect tensors loaded from the old file (safetensors#762), _direct unlinks the
    final name before creating a new inode. An unlinked file that is still mapped keeps its
    inode, so on a filesystem out of inodes (a real 2 MiB tmpfs with nr_inodes=3 here; the
    same happens with any create failure: EACCES, EDQUOT, EEXIST from a concurrent writer, a
    staging read error) the O_EXCL create fails after the old file is gone - and the
    PublishError, built for the "create" step, says "<dest> still holds its previous file
    (untouched)". A plain O_TRUNC overwrite would have succeeded in place. What the user
    loses: the previous checkpoint, while being told it is intact."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=3", "tmpfs", str(mnt)], check=True)
    try:
        dest = mnt / "model.safetensors"
        with safestage.staged(root, publish="direct"):
            save_file(tensors(1), str(dest))  # the previous checkpoint
        with contextlib.suppress(OSError):
            for n in range(8):
                (mnt / f"other-{n}").touch()  # the filesystem's last inodes
        loaded = load_file(str(dest))  # mapped by this process
        message = ""
        try:
            with safestage.staged(root, publish="direct"):
                save_file(tensors(2), str(dest))
        except OSError as exc:
            message = str(exc)
        assert dest.exists() or "still holds its previous file" not in message, (
            f"{dest.name} is gone, and the error says: {message}"
        )
        assert dest.exists(), f"the previous checkpoint was deleted by a save that failed: {message}"
        del loaded
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- 20. safestage run swallows a SIGINT sent to it ----------------------------------------------

SLEEPER = """
import sys, time
try:
    print("ready", flush=True)  # inside the try: the signal may come at once
    time.sleep(4)
    print("slept through", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_safestage_run_swallows_a_sigint_sent_to_it(tmp_path, root):
    """`safestage run -- CMD` ignores SIGINT while CMD runs, assuming Ctrl-C reaches CMD from
    the terminal's process group. A SIGINT sent to the `safestage run` process itself - docker
    stop with STOPSIGNAL SIGINT (it is PID 1), a supervisor's or scheduler's graceful stop,
    Jupyter's "interrupt kernel", `kill -INT` - is dropped: CMD never learns it should stop
    and checkpoint, and is SIGKILLed at the end of the grace period. SIGTERM and SIGHUP are
    forwarded; SIGINT is not. What the user loses: the graceful shutdown (its last checkpoint)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    runner = subprocess.Popen(
        [PY, "-m", "safestage", "run", "--dir", str(root), "--", PY, "-c", SLEEPER],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base,
        start_new_session=True,  # no terminal: the signal comes from another process
    )  # fmt: skip
    try:
        assert runner.stdout.readline().strip() == "ready"
        runner.send_signal(signal.SIGINT)
        out, err = runner.communicate(timeout=15)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    assert "interrupted" in out, f"CMD never saw the SIGINT sent to safestage run: {out!r} {err[-300:]!r}"


# -- 21. safestage clean prints a non-UTF-8 leftover name with a strict stdout ------------------


def test_clean_output_crashes_on_a_non_utf8_leftover_name(tmp_path):
    """A killed save of `caf\\xe9.safetensors` (a Latin-1 name, which test_hardening stages
    fine) leaves `.caf\\xe9.safetensors.safestage-<host>-<pid>-<token>.tmp`. `safestage clean`
    removes it, then prints the name: under a UTF-8 locale other than C (en_US.UTF-8, here
    forced with PYTHONIOENCODING=utf-8) stdout is strict and the print raises
    UnicodeEncodeError: a traceback, exit 1, no summary. What the user loses: the report of
    what was removed (cron mails a crash)."""
    from safestage._names import HOST

    name = b".caf\xe9.safetensors.safestage-" + HOST.encode() + b"-999999-deadbeef.tmp"
    (Path(os.fsdecode(bytes(tmp_path))) / os.fsdecode(name)).write_bytes(b"torn")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run([PY, "-m", "safestage", "clean", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env={**base, "PYTHONIOENCODING": "utf-8"})  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-400:]
    assert done.returncode == 0 and "1 removed" in done.stdout


# -- 22. a child forked while the main thread defers Ctrl-C ignores Ctrl-C forever -------------


def test_a_child_forked_during_a_deferred_clean_up_never_sees_ctrl_c(root, tmp_path):
    """_interrupts.deferred() swaps SIGINT's handler for one that only notes the signal while
    a clean-up runs in the main thread. A fork() from another thread at that moment
    (multiprocessing's Pool re-forks workers from its handler thread; test_walk forks the
    same way) copies that handler into the child, whose forking thread becomes its main
    thread; nothing ever restores it there. What the user loses: Ctrl-C in that worker is
    noted into a list nobody reads - the worker never stops. (The fork is timed with
    tests/_tap.py at the clean-up's rmtree, the step test_walk forks at.)"""
    sys.path.insert(0, str(Path(__file__).parent))
    from _tap import Tap

    def save(name: str, tap: Tap) -> None:
        with safestage.staged(root), tap:
            save_file(tensors(1), str(tmp_path / name))

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


# -- 23. Ctrl-C twice while the interpreter waits for pending publishes at exit ----------------

ENDS_WITH_A_PENDING_PUBLISH = """
    import sys, torch, safestage
    from safetensors.torch import save_file
    safestage.activate(sys.argv[2], background=True)
    save_file({"w": torch.ones(4 << 20)}, sys.argv[1])   # 16 MiB at 5 MB/s: ~3 s to publish
    print("main done", flush=True)
"""


def test_ctrl_c_twice_while_exit_waits_for_a_publish_exits_0_and_loses_it(root):
    """README: "at interpreter exit pending publishes are completed, never dropped" and "a
    program that lost a checkpoint never exits 0". The program ends while a background
    publish runs; the user, seeing it hang at exit, presses Ctrl-C twice. (Once, the Ctrl-C
    landed in concurrent.futures' join (ignored), the second in safestage's own at-exit wait,
    which caught BaseException and returned quietly.) The interpreter then exits 0 and kills the
    publisher thread mid-copy. What the user loses: the checkpoint (a temp is left beside
    it, the complete copy unnamed in the staging root), with exit status 0 and no message."""
    with hostile_mount("slow", mbps=5) as mount:
        dest = Path(mount.path) / "model.safetensors"
        base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        program = subprocess.Popen([PY, "-c", textwrap.dedent(ENDS_WITH_A_PENDING_PUBLISH), str(dest), str(root)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)  # fmt: skip
        assert program.stdout.readline().strip() == "main done"
        time.sleep(0.5)
        program.send_signal(signal.SIGINT)  # lands in safestage's _complete_at_exit
        time.sleep(0.5)
        program.send_signal(signal.SIGINT)  # if the process is still there
        _, err = program.communicate(timeout=60)
        time.sleep(0.5)
        landed = loads_as(dest, 1.0)
        listing = entries(Path(mount.path))
    assert landed or (program.returncode != 0 and str(dest) in err), (
        f"exit {program.returncode}, destination {listing}, stderr tail {err[-200:]!r}"
    )


@pytest.mark.regression(
    "v0.2 hostile review: the first Ctrl-C at exit landed in concurrent.futures' worker join "
    "(threading._shutdown, before atexit), was printed as 'Exception ignored', and the process "
    "exited 0 with no safestage message"
)
def test_ctrl_c_while_exit_waits_for_a_background_publish_exits_130_naming_the_staged_copy(root):
    """docs/guarantees.md: "A Ctrl-C while exit waits for a publish ends the process with
    status 130 and the same message, naming where each complete staged copy is kept". The
    program ends with a background publish of 32 MiB onto kit `slow` at 10 MB/s (~3 s) still
    running; one real SIGINT a second later."""
    with hostile_mount("slow", mbps=10) as mount:
        dest = Path(mount.path) / "model.safetensors"
        base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        code = ENDS_WITH_A_PENDING_PUBLISH.replace("4 << 20", "8 << 20")  # 32 MiB
        program = subprocess.Popen([PY, "-c", textwrap.dedent(code), str(dest), str(root)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)  # fmt: skip
        assert program.stdout.readline().strip() == "main done"
        time.sleep(1.0)  # the script has ended; exit is waiting for the publish
        program.send_signal(signal.SIGINT)
        _, err = program.communicate(timeout=120)
        kept = [root / d / f for d in entries(root) for f in entries(root / d)]
    assert program.returncode == 130, (program.returncode, err[-2000:])
    assert f"safestage: interrupted at exit while publishing {dest}" in err, err[-2000:]
    assert len(kept) == 1 and f"the complete staged copy is kept at {kept[0]}" in err, (kept, err[-2000:])
    assert torch.equal(load_file(str(kept[0]))["w"], torch.ones(8 << 20)), "the kept copy is not the save"
    assert "Exception ignored" not in err, err[-2000:]


# -- 24. staged_file publishes a symlink the writer left at the local path ----------------------


def test_staged_file_with_rename_publishes_the_writers_symlink_and_chmods_its_target(tmp_path):
    """A writer that links instead of copying (shutil.copy2(..., follow_symlinks=False) of a
    cached file, a hub download into local_dir) leaves a symlink at the path staged_file
    yielded. With the staging root on the destination's filesystem (`rename`), publish
    chmods the link's TARGET to the destination's mode and renames the link itself into
    place: the "published" checkpoint is a symlink into the cache, not a file (`replace`
    copies the bytes instead). What the user loses: the checkpoint, as soon as the cache is
    cleaned; and the cache file's mode is changed behind their back (0444 -> 0644)."""
    root = tmp_path / "scratch"
    root.mkdir()
    cache = tmp_path / "cache" / "blob"
    cache.parent.mkdir()
    cache.write_bytes(b"weights" * 1000)
    cache.chmod(0o444)
    dest = tmp_path / "ckpt" / "optimizer.bin"
    dest.parent.mkdir()
    with safestage.staged_file(dest, root) as local:
        os.symlink(cache, local)
    assert oct(cache.stat().st_mode & 0o777) == "0o444", "publish chmod'ed the cache file"
    cache.unlink()  # the cache is cleaned
    assert not dest.is_symlink() and dest.read_bytes() == b"weights" * 1000


# -- 25. safestage clean on a symlink loop ---------------------------------------------------------


def test_clean_on_a_symlink_loop_says_it_does_not_exist(tmp_path):
    """`safestage clean PATH` where PATH is a symlink loop (a broken `latest` link chain)
    answers "PATH does not exist: give the directory to clean" - it exists; it cannot be
    resolved (ELOOP). The CLI tests pathlib's is_dir()/exists(), which turn every OSError
    into False. Cosmetic: the user is sent looking for a missing directory."""
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run([PY, "-m", "safestage", "clean", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=60, env=base)  # fmt: skip
    assert done.returncode == 2
    assert "does not exist" not in done.stderr, done.stderr


# -- 26. rename: the staged file is chmod'ed before it is opened for fsync -----------------------

WRITE_ONLY_DEST = """
    import os, sys, torch, safestage
    from safetensors.torch import save_file
    dest, root = sys.argv[1:3]
    save_file({"w": torch.zeros(4)}, dest)
    os.chmod(dest, 0o200)                       # an existing write-only file (a drop box)
    save_file({"w": torch.zeros(4)}, dest)      # a plain safetensors save works here
    os.chmod(dest, 0o200)
    with safestage.staged(root):
        save_file({"w": torch.ones(4)}, dest)
    print("staged ok")
"""


def test_rename_fails_over_a_write_only_file_a_plain_save_replaces(tmp_path):
    """With the staging root on the destination's filesystem (`rename`), _rename_into_place
    chmods the staged file to the destination's mode (0200 here) and THEN opens it O_RDONLY
    to fsync it: EACCES for any user but root. The save fails with "This process may not
    write in the destination directory: fix its permissions" - wrong: the directory is
    writable and a plain save of the same file works. What the user loses: the save, with
    advice that sends them to the wrong place. (fsync before chmod, or fsync the fd the
    writer's copy had, fixes it.)"""
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="safestage-review-"))  # pytest's tmp is 0700 root
    try:
        work.chmod(0o755)
        (work / "root").mkdir()
        (work / "dst").mkdir()
        subprocess.run(["chown", "-R", "65534:65534", str(work)], check=True)
        done = run_python(WRITE_ONLY_DEST, str(work / "dst" / "model.safetensors"), str(work / "root"),
                          prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "staged ok" in done.stdout, done.stderr[-500:]


# -- 27. the start-up hook imports wrapt (and asyncio) eagerly ------------------------------------


def test_the_start_up_hook_imports_wrapt_eagerly(root):
    """README (Environment): with a SAFESTAGE variable set the hook "imports no torch,
    safetensors or wrapt eagerly but patches when the program first imports
    safetensors.torch". Activation registers the post-import hooks through wrapt, so every
    Python process of the job imports wrapt - and with it asyncio - at start-up (~80 ms of
    the ~0.3 s the hook adds to `python -c pass` here), including the many processes that
    never save. Documentation promises more than the code does."""
    done = run_python("import sys; print('wrapt' in sys.modules, 'asyncio' in sys.modules)",
                      env={"SAFESTAGE_DIR": str(root)})  # fmt: skip
    assert done.stdout.split() == ["False", "False"], (done.stdout, done.stderr[-300:])


# -- 28. staged_file deletes a directory written at its path and says nothing was written ------


def test_staged_file_deletes_a_directory_the_writer_made_and_says_nothing_was_written(root, tmp_path):
    """A writer that makes a directory at the path it is given (save_pretrained,
    accelerator.save_state, torch.distributed.checkpoint - the very writers README sends to
    staged_file) inside `with staged_file(dest) as local:`. Afterwards staged_file sees no
    regular file, removes the private directory with everything written into it, and raises
    "nothing was written to <local>". What the user loses: the whole local save (hours of
    a save_state, say), with an error that says it never happened instead of "a directory
    was written where a file was expected; it is kept at ...\""""
    dest = tmp_path / "state"
    message = ""
    try:
        with safestage.staged_file(dest, root) as local:
            local.mkdir()
            (local / "model.safetensors").write_bytes(b"weights" * 1000)
            (local / "optimizer.bin").write_bytes(b"state" * 1000)
    except OSError as exc:
        message = str(exc)
    kept = list(root.rglob("optimizer.bin"))
    assert "nothing was written" not in message, message
    assert kept or dest.exists(), f"the writer's directory was deleted: {message}"
