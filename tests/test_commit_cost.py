"""What a commit looks at beside its checkpoint: its cost must not grow with the run's earlier
checkpoints. A commit reads a same-series sibling only where the timeline needs it (a higher
step: a rollback sets it aside; a lower one only for a resumed commit, ``safestage recover``),
and then only its commit file and marker, never its files (docs/retention.md).

The filesystem calls of the committing thread (every ``os`` and ``open`` call that touches a
path or descriptor, counted by a profile hook as the interpreter makes them) of a one-file
commit beside 1 and beside 100 committed lower-step checkpoints of 5 files each, on the
local disk. benchmarks/commit_siblings.py times the same on the kit's FUSE mounts."""

from __future__ import annotations

import collections
import io
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import safestage

# The calls that reach the filesystem (each a syscall or more; on a FUSE mount a round trip).
_FS_CALLS = {os.stat, os.lstat, os.fstat, os.open, io.open, os.scandir, os.listdir, os.read, os.unlink,
             os.mkdir, os.rmdir, os.replace, os.utime, os.chmod, os.fsync, os.link}  # fmt: skip


def _run_with_siblings(run: Path, root: Path, siblings: int) -> Path:
    run.mkdir()
    first = run / "checkpoint-1"
    with safestage.staged_dir(first, root) as local:
        for index in range(5):
            (local / f"shard-{index}.bin").write_bytes(os.urandom(64))
    for step in range(2, siblings + 1):  # committed checkpoints, as a commit leaves them
        shutil.copytree(first, run / f"checkpoint-{step}")
    return run / f"checkpoint-{siblings + 1}"


def _calls_of_a_commit(dest: Path, root: Path) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    this = threading.get_ident()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg in _FS_CALLS and threading.get_ident() == this:
            counts[arg.__name__] += 1

    sys.setprofile(profile)
    try:
        with safestage.staged_dir(dest, root) as local:
            (local / "model.bin").write_bytes(b"x" * 128)
    finally:
        sys.setprofile(None)
    assert safestage.verify(dest).complete
    return counts


@pytest.mark.regression("issue 30 item 13: every commit read the commit file and stat'ed every file of every "
                        "same-series sibling, lower steps included (1.2-1.9 s beside 40 siblings on s3fs)")
def test_a_commit_makes_as_many_filesystem_calls_beside_100_earlier_checkpoints_as_beside_one(
    tmp_path: Path, stage_root: Path
) -> None:
    one = _calls_of_a_commit(_run_with_siblings(tmp_path / "one", stage_root, 1), stage_root)
    hundred = _calls_of_a_commit(_run_with_siblings(tmp_path / "hundred", stage_root, 100), stage_root)
    assert sum(one.values()) > 0, "the profile hook saw no filesystem call: it counts nothing"
    assert hundred == one, f"beside 1 sibling: {dict(one)}; beside 100: {dict(hundred)}"
