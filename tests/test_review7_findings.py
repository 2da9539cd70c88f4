"""Review 7: failing tests against followed ``direct`` saves of new files (2a467b1) and the
abandoned private staging directory fix (f079306).

Every test here fails on the code under review; each docstring says what the user loses.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["local-direct", "kit-mountpoint"])
def direct_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A destination published to by ``direct``: local disk with publish="direct", or the
    kit's mountpoint (no rename: auto picks direct)."""
    if request.param == "local-direct":
        directory = tmp_path / "dest"
        directory.mkdir()
        yield directory, "direct"
        return
    mount = request.getfixturevalue("kit_mounts")["mountpoint"]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    yield directory, "auto"
    shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)


# A writer that writes a real safetensors file (tensors A) sequentially, slowly, then fixes it
# up in place with pwrite into its final content (tensors B, same shapes): the non-append-only
# writer the CRC read-back exists for. The follower copies A while it is written; the read-back
# mismatches; the followed copy is abandoned. The child is SIGKILLed at that moment (the
# abandon's clean-up): where a kill leaves the destination is what the test looks at.
_MISMATCH_CHILD = r'''
import os, signal, sys, time
sys.path.insert(0, {repo!r})
import torch
from safetensors.torch import save
import safestage
from safestage import _publish
from safestage._follow import FollowMismatch

root, dest, publish = sys.argv[1], sys.argv[2], sys.argv[3]
a = {{"w": torch.full((1 << 20,), 1.0)}}     # 4 MiB of 1.0
b = {{"w": torch.full((1 << 20,), 2.0)}}     # the final content: 2.0
bytes_a, bytes_b = save(a), save(b)
assert len(bytes_a) == len(bytes_b)

def write(path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        step = 256 << 10
        for offset in range(0, len(bytes_a), step):
            time.sleep(0.01)
            os.write(fd, bytes_a[offset:offset + step])
        time.sleep(0.2)  # the follower has copied all of it by now
        os.pwrite(fd, bytes_b, 0)  # fix-up in place: the final file is B
    finally:
        os.close(fd)

real = _publish._unlink_torn

def killed_while_abandoning(path, ours):
    kind = type(sys.exc_info()[1]).__name__
    print("ABANDON", kind, os.path.getsize(path) if os.path.exists(path) else -1, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

_publish._unlink_torn = killed_while_abandoning
with safestage._api.force_follow(safestage.staged(root, publish=publish)) as stage:
    stage._save(write, __import__("pathlib").Path(dest))
print("RETURNED", flush=True)
'''


def test_sigkill_while_a_mismatched_followed_direct_copy_is_abandoned_leaves_a_loadable_wrong_file(
    direct_dir, shm_root, tmp_path
):
    """A followed ``direct`` copy writes the final name itself, and the CRC read-back that
    proves the followed bytes are the staged bytes runs only once the copy has written every
    byte: the unverified bytes are complete under the final name before the check (and on an
    object store, the close in the abandon path commits them as the object). A process killed
    there (or a reader of the mount) gets a full-size, valid safetensors file with bytes the
    writer overwrote: it loads, with the wrong values. The README promises for a kill under
    ``direct``: old, new, or a file safetensors refuses to load, "never loads with wrong data";
    before this change (replace-only following) a mismatch only ever cost a hidden temp."""
    from safetensors.torch import load_file

    directory, publish = direct_dir
    dest = directory / "model.safetensors"
    script = tmp_path / "child.py"
    script.write_text(_MISMATCH_CHILD.format(repo=str(REPO)))
    run = subprocess.run(
        [sys.executable, str(script), str(shm_root), str(dest), publish],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stdout, run.stderr)
    assert "ABANDON FollowMismatch" in run.stdout, run.stdout + run.stderr  # the fault fired
    if not dest.exists():
        return  # nothing under the name: allowed
    try:
        loaded = load_file(str(dest))
    except Exception:
        return  # refused to load: allowed
    values = set(loaded["w"].unique().tolist())
    assert values == {2.0}, (
        f"{dest} loads after the kill, with values {values}: bytes the writer overwrote "
        "(1.0), not the save's final content (2.0)"
    )


@pytest.mark.parametrize("first_bytes", [0, 2 << 20])
def test_writer_failing_while_a_fork_holds_the_followed_copy_leaves_nothing(
    kit_mounts, shm_root, tmp_path, caplog, first_bytes
):
    """The followed ``direct`` copy writes the final name while the writer writes. A process
    forked meanwhile (a DataLoader worker, a launcher) inherits its descriptor; then the
    writer raises. On mountpoint a descriptor still open in another process keeps the upload
    open: our close does not end it, the clean-up's unlink is refused ("cannot delete a file
    while it is being written"), and the save raises while a torn object stays under the
    final name. Promised: a writer that raises leaves the destination untouched.

    Found with the name created before the writer's first byte (``first_bytes=0``: the copy
    now creates it only once there are bytes, so then nothing exists to fork); with bytes
    written first, the fork really holds the final name's descriptor, which the child now
    closes at once (``_publish._outputs``)."""
    import logging
    import time

    import safestage

    mount = kit_mounts["mountpoint"]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    dest = directory / "model.safetensors"
    children: list[int] = []
    existed: list[bool] = []

    def write(path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if first_bytes:
                os.write(fd, b"\x01" * first_bytes)
            deadline = time.monotonic() + (5 if first_bytes else 1)
            while not os.path.lexists(dest) and time.monotonic() < deadline:
                time.sleep(0.005)
            existed.append(os.path.lexists(dest))
            pid = os.fork()  # e.g. a DataLoader worker started while the save runs
            if pid == 0:
                time.sleep(2)
                os._exit(0)
            children.append(pid)
            raise ValueError("writer failed")
        finally:
            os.close(fd)

    caplog.set_level(logging.DEBUG, logger="safestage")
    try:
        with safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage, pytest.raises(ValueError):
            stage._save(write, dest)
        left = sorted(os.listdir(directory))
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        for pid in children:
            os.waitpid(pid, 0)
        shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)  # type: ignore[attr-defined]
    assert children, "no fork happened: the scenario did not run"
    assert existed == [bool(first_bytes)], "the final name was (not) being written when the fork came"
    assert left == [], f"the save raised, yet {left} is left under the destination ({warnings})"
    assert warnings == []


CHUNK = 1 << 20
CHUNKS = 12


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


def test_followed_direct_destination_full_error_says_what_happened(small_tmpfs, shm_root):
    """A followed ``direct`` save of a new 12 MiB file onto a 2 MiB filesystem: the copy
    fails (real ENOSPC) while the writer still writes, and the complete staged copy is kept.
    The PublishError the user gets must say what every other PublishError says: the
    destination and step, what to do, that nothing torn is left under the final name, and
    where the complete copy is kept. It says only "No space left on device":
    ``_naming_the_kept_copy`` rebuilds the error from ``error.strerror``, which for
    safestage's errors is os.strerror(errno), not the message; the whole explanation,
    including the path of the only complete copy, is thrown away (``staged_path`` is set,
    the text a user reads in a log is not). Every followed direct save whose destination
    fails while the writer writes (full, read-only, EPERM on an object store's second
    writer, a vanished directory) now ends like this."""
    import safestage

    dest = small_tmpfs / "model.safetensors"
    with safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage:
        with pytest.raises(safestage.PublishError) as info:
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


_OTHER_SAVER = r'''
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import safestage

def write(path):
    with open(path, "wb") as f:
        for index in range({chunks}):
            f.write(bytes([200 + index]) * {chunk})

import logging
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
with safestage._api.force_follow(safestage.staged(sys.argv[1], publish="direct"), False) as stage:
    Path(sys.argv[3]).touch()  # about to save
    stage._save(write, Path(sys.argv[2]))
print("OTHER SAVED", stage.records[-1].strategy, flush=True)
'''


def test_a_direct_save_from_another_process_during_a_followed_one_ends_in_a_torn_file_both_reporting_success(
    tmp_path, shm_root
):
    """Two processes save the same new file with ``direct`` on a POSIX filesystem (two
    ranks writing the same shard, a retried job and its zombie). The followed save creates
    the final name at the start of its serialization and writes it for as long as the
    writer runs; the other save, starting meanwhile, sees an existing file (so it does not
    follow), opens it O_TRUNC -- the same inode -- writes its whole file and returns. The
    followed copy then goes on writing its tail at its own offset into that inode. Both
    saves return success, both verify the size, and the file under the final name is the
    other save's head and our tail: neither save's bytes. Before this change the name did
    not exist until the writer had returned, and the overlap window was one copy, not the
    whole serialization. Promised: never a torn file under the final name after a save
    returns, never a silent success."""
    import safestage

    directory = tmp_path / "dest"
    directory.mkdir()
    dest = directory / "model.safetensors"
    other_root = tmp_path / "other-root"
    other_root.mkdir()
    script = tmp_path / "other.py"
    script.write_text(_OTHER_SAVER.format(repo=str(REPO), chunks=CHUNKS, chunk=CHUNK))
    other: list[subprocess.Popen[str]] = []
    ready = tmp_path / "other-ready"
    import time

    def write(path: str) -> None:
        target = os.path.join(os.path.dirname(path), ".tmpAbC123")
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, CHUNK * CHUNKS)
            for index in range(CHUNKS):
                time.sleep(0.03)
                os.write(fd, bytes([index + 1]) * CHUNK)
                if index == 3:
                    time.sleep(0.2)  # our followed copy has written chunks 0-3 into dest
                    assert os.path.getsize(dest) > 0, "the followed copy was not writing yet"
                    # Started, not waited for: it runs while our save goes on (waiting for it
                    # here would hold our writer, and so our followed write, forever).
                    other.append(subprocess.Popen(
                        [sys.executable, str(script), str(other_root), str(dest), str(ready)],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    ))  # fmt: skip
                    deadline = time.monotonic() + 60
                    while not ready.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)  # it imports torch meanwhile
                    time.sleep(0.5)  # its publish reaches the file we are writing
        finally:
            os.close(fd)
        os.replace(target, path)

    with safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage:
        stage._save(write, dest)  # returns: success
    assert other
    output, _ = other[0].communicate(timeout=120)
    assert "OTHER SAVED direct" in output, output  # the other save succeeded too
    assert "waiting for another process's direct write" in output, output  # it met ours
    assert [r.strategy for r in stage.records] == ["direct"]
    ours = b"".join(bytes([i + 1]) * CHUNK for i in range(CHUNKS))
    theirs = b"".join(bytes([200 + i]) * CHUNK for i in range(CHUNKS))
    data = dest.read_bytes()
    heads = [data[i * CHUNK] for i in range(CHUNKS)]
    whole = heads in (list(range(1, CHUNKS + 1)), list(range(200, 200 + CHUNKS)))
    assert whole and data in (ours, theirs), (
        f"both saves returned success, and {dest} holds neither: chunk first bytes {heads} "
        "(1-12 are ours, 200-211 the other save's)"
    )
