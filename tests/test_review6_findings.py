"""Sixth review: what follow-by-default (follow=None, "auto") newly exposes, with the real
safetensors 0.8 writer and real filesystems. Each test fails on the reviewed code."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import safestage
from safestage import _follow


def big_tensors(seed: int = 0, mib: int = 64) -> dict[str, torch.Tensor]:
    """Exactly ``mib`` MiB of float32 tensors: at the default follow threshold or above."""
    assert mib << 20 >= _follow.FOLLOW_MIN_BYTES
    return {f"w{j}": torch.full((1 << 18,), float(seed * 1000 + j + 1)) for j in range(mib)}


def same(loaded: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> bool:
    return set(loaded) == set(wanted) and all(torch.equal(loaded[k], wanted[k]) for k in wanted)


@pytest.fixture(params=["full", "read-only"])
def failing_destination(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A real tmpfs destination that refuses the publish: 1 MiB (ENOSPC in the middle of the
    copy) or read-only (EROFS at the creation of our temp)."""
    target = tmp_path / "dest"
    target.mkdir()
    if request.param == "full":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(target)], check=True)
        code = errno.ENOSPC
    else:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0755", "tmpfs", str(target)], check=True)
        code = errno.EROFS
    try:
        yield target, code
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_destination_failing_while_the_writer_writes_names_the_kept_copy(failing_destination, stage_root):
    """A default save (follow auto) of a 64 MiB model onto a destination that is full or
    read-only. The followed copy fails while safetensors is still writing the staged file,
    so the PublishError is built before the staged file exists under its name: it says "No
    staged copy could be kept." and ``staged_path`` is None. Then the writer finishes and
    write_following keeps the complete staged file anyway (keep_unpublished), in a directory
    no sweep and no `safestage clean` ever removes (it holds a complete copy). What the user
    loses: the error tells them nothing was kept, recovery code that copies
    ``exc.staged_path`` has nothing to copy, and every retry against the full destination
    silently leaves one more full-size checkpoint in the staging root until it fills.
    With follow=False the same failure names the kept copy."""
    dest_dir, code = failing_destination
    dest = dest_dir / "model.safetensors"
    tensors = big_tensors()
    with pytest.raises(safestage.PublishError) as info:
        with safestage.staged(stage_root):  # the defaults (root on local disk): follow auto
            save_file(tensors, str(dest))
    error = info.value
    assert error.errno == code, error  # the fault fired: the destination refused the publish
    assert not dest.exists() and os.listdir(dest_dir) == []  # nothing torn under the final name
    left = sorted(p for p in stage_root.rglob("*") if p.is_file())
    if error.staged_path is None:
        assert left == [], (
            f"the error says {str(error)[-60:]!r} (staged_path=None), yet the staging root keeps "
            f"{[str(p) for p in left]}"
        )
    else:
        assert left == [Path(error.staged_path)], (error.staged_path, left)
        assert same(load_file(error.staged_path), tensors)
        assert "No staged copy could be kept" not in str(error)


_NO_THREADS_CHILD = r'''
import json, os, resource, sys, threading
from pathlib import Path
import encodings.ascii, zlib, logging
import torch
from safetensors.torch import save_file
import safestage
root, dest_dir, warm = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
big = {f"w{j}": torch.full((1 << 18,), float(j + 1)) for j in range(64)}  # 64 MiB
with safestage.staged(warm):  # every lazy import done before the limits (a followed save)
    save_file(big, str(dest_dir / "warm.safetensors"))
os.unlink(dest_dir / "warm.safetensors")
os.setgid(65534); os.setuid(65534)  # RLIMIT_NPROC binds only non-root users
count = len(os.listdir("/proc/self/task"))
resource.setrlimit(resource.RLIMIT_NPROC, (count, count))  # like a full pids cgroup
report = {}
try:
    threading.Thread(target=lambda: None).start()
    report["thread"] = "started"
except RuntimeError as exc:
    report["thread"] = str(exc)
for name, follow in (("plain.safetensors", False), ("default.safetensors", None)):
    try:
        with safestage._api.force_follow(safestage.staged(root), follow):
            save_file(big, str(dest_dir / name))
        report[name] = "saved"
    except BaseException as exc:
        report[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(report))
'''


def test_a_default_save_works_where_no_new_thread_can_start():
    """Following needs a second thread; a plain save does not. In a process that cannot
    start one (a container at its pids limit, RLIMIT_NPROC, or an atexit handler on Python
    3.12, which refuses every new thread at interpreter shutdown: "can't create new thread
    at interpreter shutdown"), a big save that worked before follow became the default now
    raises RuntimeError("can't start new thread") from publisher.start(), the checkpoint is
    not saved at all, and an empty private directory is left in the staging root. Real
    limits here: uid 65534 with RLIMIT_NPROC at its current thread count; the same save
    with follow=False in the same process succeeds. What the user loses: the checkpoint
    (often the final one, saved at exit). Expected: fall back to the plain publish."""
    tag = uuid.uuid4().hex[:8]
    # Directories uid 65534 can reach: the root on /dev/shm, the destination on the disk
    # (another device: replace, the strategy that is followed).
    root, warm, dest_dir = Path(f"/dev/shm/r6-root-{tag}"), Path(f"/dev/shm/r6-warm-{tag}"), Path(f"/tmp/r6-dest-{tag}")
    for directory in (root, warm, dest_dir):
        directory.mkdir()
        os.chmod(directory, 0o777)
    script = dest_dir.with_name(f"r6-child-{tag}.py")
    script.write_text(_NO_THREADS_CHILD)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    try:
        run = subprocess.run(
            [sys.executable, str(script), str(root), str(dest_dir), str(warm)],
            env=env, capture_output=True, text=True, timeout=240,
        )
        report = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else run.stderr[-2000:]
        left_in_root = os.listdir(root)
        left_in_dest = sorted(os.listdir(dest_dir))
        loaded = {name: load_file(str(dest_dir / name)) for name in left_in_dest}
    finally:
        subprocess.run(["rm", "-rf", str(root), str(warm), str(dest_dir), str(script)], check=False)
    assert isinstance(report, dict), report
    assert report["thread"] != "started", report  # the limit is real: no new thread
    assert report["plain.safetensors"] == "saved", report  # a plain save works there
    wanted = {f"w{j}": torch.full((1 << 18,), float(j + 1)) for j in range(64)}
    assert same(loaded["plain.safetensors"], wanted)
    assert report["default.safetensors"] == "saved", report
    assert left_in_dest == ["default.safetensors", "plain.safetensors"]
    assert same(loaded["default.safetensors"], wanted)
    assert left_in_root == []
