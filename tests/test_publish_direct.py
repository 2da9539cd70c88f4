"""publish="direct": the destination is written in place after the writer has finished, where it cannot rename (mountpoint-s3); special files refused, loaded files kept, one writer at a time within a process."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from _support import (
    CHUNK,
    CHUNKS,
    _save_in_thread,
    _write_file,
    arange_tensors,
    filled_tensors,
    listing,
    loads_as,
)
from safetensors.torch import load_file, save_file

import safestage
from safestage import PublishError

MAPPED = """
    import sys, torch, safestage
    from safetensors.torch import load_file, save_file
    dest, root, publish = sys.argv[1], sys.argv[2], sys.argv[3]
    with safestage.staged(root, publish=publish):
        save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, dest)
    loaded = load_file(dest)                                   # mmap-backed
    with safestage.staged(root, publish=publish):
        save_file({"w": torch.full((16,), -1.0)}, dest)        # smaller: SIGBUS if rewritten
    assert torch.equal(loaded["w"], torch.arange(1 << 20, dtype=torch.float32)), "loaded tensors changed"
    assert torch.equal(load_file(dest)["w"], torch.full((16,), -1.0))
    print("ok")
"""


@pytest.mark.slow
@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): saving over a file this process has loaded")
@pytest.mark.parametrize("publish", ["direct", "replace", "auto"])
def test_saving_over_a_file_this_process_has_loaded_keeps_its_tensors(tmp_path, shm_root, publish):
    dest = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MAPPED), str(dest), str(shm_root), publish],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
    assert listing(tmp_path) == ["model.safetensors"]


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): direct onto the mountpoint model over a loaded file")
def test_direct_onto_the_mountpoint_model_over_a_loaded_file_lands(mount_dir, stage_root):
    directory, _ = mount_dir("mountpoint")
    dest = directory / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MAPPED), str(dest), str(stage_root), "auto"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): direct onto a special file is refused promptly")
@pytest.mark.parametrize("kind", ["fifo", "chardev"])
def test_direct_onto_a_special_file_is_refused_promptly(tmp_path, shm_root, kind):
    dest = tmp_path / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(dest)
    else:
        os.mknod(dest, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    result: list[BaseException] = []

    def save() -> None:
        try:
            with safestage.staged(shm_root, publish="direct"):
                save_file(arange_tensors(1), str(dest))
        except BaseException as exc:
            result.append(exc)

    worker = threading.Thread(target=save, daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():
        with open(dest, "rb") if kind == "fifo" else open(os.devnull, "rb"):
            pass  # unblock the writer so the thread can finish
        worker.join(5)
        pytest.fail("publish='direct' blocked on a special file")
    assert result and isinstance(result[0], PublishError), result
    message = str(result[0])
    assert str(dest) in message
    assert ("FIFO" in message) if kind == "fifo" else ("character device" in message)
    assert "previous complete file" not in message
    assert stat.S_ISFIFO(os.lstat(dest).st_mode) if kind == "fifo" else stat.S_ISCHR(os.lstat(dest).st_mode)


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a second writer on mountpoint is told so")
def test_a_second_writer_on_mountpoint_is_told_so(mount_dir, stage_root):
    directory, _ = mount_dir("mountpoint")
    dest = directory / "model.safetensors"
    holder = os.open(dest, os.O_WRONLY | os.O_CREAT, 0o644)  # another writer, mid-upload
    try:
        os.write(holder, b"x" * 100)
        with pytest.raises(PublishError) as info, safestage.staged(stage_root, publish="direct"):
            save_file(arange_tensors(1), str(dest))
    finally:
        os.close(holder)
    message = str(info.value)
    assert "another" in message and "writ" in message, message
    assert "doctor" not in message


def _slow_writer(delay: float = 0.03):
    """Like safetensors 0.8: a sibling .tmpXXXXXX preallocated, one write per 1 MiB chunk,
    renamed at the end (the staged name exists only once the writer is done)."""
    import time

    def write(path: str) -> None:
        target = os.path.join(os.path.dirname(path), ".tmpAbC123")
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, CHUNK * CHUNKS)
            for index in range(CHUNKS):
                time.sleep(delay)
                os.write(fd, bytes([index + 1]) * CHUNK)
        finally:
            os.close(fd)
        os.replace(target, path)

    return write


@pytest.mark.regression("0.1 hostile review 7: a full destination under direct gave an error that did not say what happened")
def test_direct_destination_full_error_says_what_happened(small_tmpfs, shm_root):
    """A ``direct`` save (follow asked for) of a new 12 MiB file onto a 2 MiB filesystem:
    the copy fails (real ENOSPC) and the complete staged copy is kept. The PublishError says
    what every other PublishError says: the destination and step, what to do, that nothing
    torn is left under the final name, and where the complete copy is kept."""
    import safestage

    dest = small_tmpfs / "model.safetensors"
    with (
        safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage,
        pytest.raises(safestage.PublishError) as info,
    ):
        stage._save(_slow_writer(), dest)
    error = info.value
    assert error.errno == 28, error  # the fault fired: a real ENOSPC from the destination
    assert error.staged_path is not None and os.path.exists(error.staged_path)
    assert os.listdir(small_tmpfs) == []
    text = str(error)
    assert str(dest) in text and error.staged_path in text and "direct" in text, (
        f"the PublishError reads only {text!r}: no destination, no step, no advice, no word "
        f"of what is under {dest}, and not where the complete copy ({error.staged_path}) is kept"
    )


_LOCK_HOLDER = r'''
import fcntl, sys, time
f = open(sys.argv[1], "rb")
fcntl.flock(f, fcntl.LOCK_SH)
print("LOCKED", flush=True)
time.sleep(120)
'''


@pytest.mark.regression("0.1 hostile review 8: a reader holding a shared flock on the destination hangs a direct save forever")
def test_a_reader_holding_a_shared_flock_on_the_destination_never_hangs_a_direct_save(
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


@pytest.mark.regression("0.1 hostile review 8: direct save onto a fifo opens it waking its blocked writer")
def test_direct_save_onto_a_fifo_is_refused_without_opening_it(tmp_path, shm_root):
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


@pytest.mark.regression("0.1 hostile review 8: direct overwrite on mountpoint keeps a reader open while opening the writer")
def test_direct_overwrite_on_mountpoint_holds_no_reader_open_beside_the_writer(
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
        assert [r.publish for r in stage.records] == ["direct"]
        assert load_file(str(dest))["w"].eq(2.0).all()
    finally:
        import shutil

        shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)
    assert seen, "the direct write was never opened"
    assert os.O_RDONLY not in seen[0], (
        f"a read-only descriptor of {dest} was open while its writer was opened ({seen}): "
        "mountpoint-s3 refuses that open with EPERM"
    )


@pytest.mark.slow
@pytest.mark.regression("0.1 hostile review 1: two direct saves of one file on a posix disk mix their bytes")
def test_two_direct_saves_of_one_file_in_one_process_never_mix_their_bytes(shm_root, tmp_path):
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
                save_file(filled_tensors(tag, numel), str(dest))
            except BaseException as exc:
                errors.append(exc)

        with safestage.staged(shm_root, publish="direct"):
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


@pytest.mark.regression("0.1 hostile review 1: direct writes through a symlink at the final name")
def test_direct_replaces_a_symlink_at_the_final_name_and_leaves_its_target(shm_root, tmp_path):
    """`latest.safetensors -> step-1000.safetensors` is a common layout. A plain safetensors
    save of latest.safetensors (and publish="replace"/"rename") replaces the link with the
    new file, leaving step-1000 alone; README and _paths say so ("a symlink there is
    replaced, as safetensors 0.8 does"). publish="direct" opens the final name O_TRUNC,
    following the link. What the user loses: step-1000.safetensors, overwritten with the new
    weights (the link still points at it; the old checkpoint is gone)."""
    older = tmp_path / "step-1000.safetensors"
    save_file(filled_tensors(1000), str(older))
    latest = tmp_path / "latest.safetensors"
    latest.symlink_to(older.name)
    with safestage.staged(shm_root, publish="direct"):
        save_file(filled_tensors(2000), str(latest))
    assert loads_as(older, 1000.0), "the symlink's target (an older checkpoint) was overwritten"
    assert not latest.is_symlink() and loads_as(latest, 2000.0)


@pytest.mark.regression("0.1 hostile review 1: direct over a loaded file deletes it then fails and says untouched")
def test_a_direct_save_over_a_loaded_file_that_fails_keeps_the_old_file(shm_root, tmp_path):
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
        with safestage.staged(shm_root, publish="direct"):
            save_file(filled_tensors(1), str(dest))  # the previous checkpoint
        with contextlib.suppress(OSError):
            for n in range(8):
                (mnt / f"other-{n}").touch()  # the filesystem's last inodes
        loaded = load_file(str(dest))  # mapped by this process
        message = ""
        try:
            with safestage.staged(shm_root, publish="direct"):
                save_file(filled_tensors(2), str(dest))
        except OSError as exc:
            message = str(exc)
        assert dest.exists() or "still holds its previous file" not in message, (
            f"{dest.name} is gone, and the error says: {message}"
        )
        assert dest.exists(), f"the previous checkpoint was deleted by a save that failed: {message}"
        del loaded
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class _FailsAfterOneChunk(io.FileIO):
    """The staged copy, whose second read fails with a real-looking EIO (a staging disk going bad
    mid-copy): the fault is counted so the test can assert it fired."""

    fired = 0

    def readinto(self, buffer):  # type: ignore[override]
        if self.tell() > 0:
            type(self).fired += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().readinto(buffer)


@pytest.mark.regression("v0.2 review of _publish: a direct publish whose staged copy failed to read mid-copy left a torn file and said the old one was untouched")
def test_a_direct_publish_whose_staged_copy_fails_mid_copy_leaves_no_torn_file_and_says_so(
    tmp_path, shm_root, monkeypatch
):
    directory = tmp_path / "dest"
    directory.mkdir()
    dest = directory / "model.safetensors"
    save_file({"old": torch.zeros(4)}, str(dest))
    staged_root = str(shm_root)

    def open_staged_badly(path, mode="r", *args, **kwargs):
        if mode == "rb" and str(path).startswith(staged_root):
            return _FailsAfterOneChunk(path, "rb")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(safestage._publish, "open", open_staged_badly, raising=False)
    big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: three 4 MiB chunks
    with pytest.raises(PublishError) as info, safestage.staged(shm_root, publish="direct"):
        save_file(big, str(dest))
    assert _FailsAfterOneChunk.fired == 1  # the fault fired, after the first chunk was written
    error = info.value
    assert error.errno == errno.EIO, error
    text = str(error)
    assert "untouched" not in text and "previous file" not in text, text
    assert f"No incomplete file is left under {dest}" in text, text
    assert os.listdir(directory) == []  # neither a torn file under the final name nor a temp
