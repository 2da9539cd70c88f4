"""`latest_complete` and `safestage latest` never answer older, or "none", in silence.

A resume script maps `safestage latest`'s status to what it does next: 0 resume from the
printed path, 1 start from scratch. So a run directory that cannot be listed (EACCES, EIO from a
FUSE readdir) must not give 1, and a newer checkpoint skipped because it could not be read must
be named.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import safestage
from safestage import COMMIT_NAME

NOBODY = 65534


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A run directory that the unprivileged user `nobody` can reach (pytest's tmp_path is
    0700 root's): the permission tests run the CLI as nobody, since root reads everything."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as top:
        os.chmod(top, 0o755)
        yield Path(top)


def commit(parent: Path, name: str, stage_root: Path, seed: int) -> Path:
    dest = parent / name
    with safestage.staged_dir(dest, stage_root) as local:
        save_file({"w": torch.full((8,), float(seed))}, str(local / "model.safetensors"))
        (local / "shards").mkdir()
        (local / "shards" / "s0.bin").write_bytes(b"s" * seed)
    for path in [dest, *dest.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return dest


def latest_as_nobody(parent: Path) -> subprocess.CompletedProcess[str]:
    """`safestage latest PARENT` in a process that imports as root, then drops to nobody."""
    code = (
        "import os, sys\n"
        "import safestage.cli, safestage.checkpoint._verify, safestage.checkpoint._manifest\n"
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        f"sys.exit(safestage.cli.main(['latest', {str(parent)!r}]))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_latest_of_a_directory_it_cannot_list_says_it_could_not_look(run_dir: Path, stage_root: Path) -> None:
    commit(run_dir, "checkpoint-1", stage_root, 1)
    os.chmod(run_dir, 0o311)  # nobody may stat and enter it, not list it: EACCES on readdir
    done = latest_as_nobody(run_dir)
    assert done.returncode == 3, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("safestage latest: could not look:"), done.stderr
    assert str(run_dir) in lines[0] and "Permission denied" in lines[0], lines[0]
    assert "Traceback" not in done.stderr


def test_latest_complete_of_a_directory_it_cannot_list_raises_naming_it(run_dir: Path, stage_root: Path) -> None:
    code = (
        "import os, errno\n"
        "import safestage, safestage.checkpoint._verify\n"
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "try:\n"
        f"    safestage.latest_complete({str(run_dir)!r})\n"
        "except PermissionError as exc:\n"
        "    assert exc.errno == errno.EACCES, exc\n"
        "    print(exc)\n"
    )
    commit(run_dir, "checkpoint-1", stage_root, 1)
    os.chmod(run_dir, 0o311)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done
    assert "cannot list the checkpoints in" in done.stdout and str(run_dir) in done.stdout, done.stdout


def test_a_newer_checkpoint_whose_commit_file_cannot_be_read_is_named_not_skipped_silently(
    run_dir: Path, stage_root: Path
) -> None:
    older = commit(run_dir, "checkpoint-1", stage_root, 1)
    newer = commit(run_dir, "checkpoint-2", stage_root, 2)
    os.chmod(newer / COMMIT_NAME, 0o600)  # root's: EACCES for nobody
    done = latest_as_nobody(run_dir)
    assert done.returncode == 0, done
    assert done.stdout == f"{older}\n"
    assert done.stderr.splitlines() == [
        line for line in done.stderr.splitlines() if line.startswith("safestage latest: WARNING: skipped")
    ]
    assert len(done.stderr.splitlines()) == 1 and str(newer) in done.stderr, done.stderr
    assert "Permission denied" in done.stderr


def test_a_newer_checkpoint_of_a_newer_format_is_named_by_latest_complete(
    run_dir: Path, stage_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older = commit(run_dir, "checkpoint-1", stage_root, 1)
    newer = commit(run_dir, "checkpoint-2", stage_root, 2)
    document = json.loads((newer / COMMIT_NAME).read_bytes())
    document["version"] = 99
    (newer / COMMIT_NAME).write_text(json.dumps(document))
    problems = safestage.verify(newer).problems  # not torn: unreadable by this version
    assert [p.kind for p in problems] == ["unreadable"] and "newer safestage" in problems[0].message
    with caplog.at_level(logging.WARNING, logger="safestage"):
        assert safestage.latest_complete(run_dir) == older
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newer) in warnings[0] and "newer safestage" in warnings[0], warnings


def test_when_no_candidate_can_be_read_latest_could_not_look_rather_than_none(
    run_dir: Path, stage_root: Path
) -> None:
    only = commit(run_dir, "checkpoint-1", stage_root, 1)
    os.chmod(only / COMMIT_NAME, 0o600)
    done = latest_as_nobody(run_dir)
    assert done.returncode == 3, done
    assert done.stdout == ""
    assert "WARNING: skipped" in done.stderr and "could not look" in done.stderr


def test_an_incomplete_newer_checkpoint_is_passed_over_quietly(
    run_dir: Path, stage_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A commit that was killed (no commit file) is the ordinary case: no warning."""
    older = commit(run_dir, "checkpoint-1", stage_root, 1)
    newer = commit(run_dir, "checkpoint-2", stage_root, 2)
    (newer / COMMIT_NAME).unlink()
    with caplog.at_level(logging.WARNING, logger="safestage"):
        assert safestage.latest_complete(run_dir) == older
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_listed_file_whose_directory_is_gone_is_missing(run_dir: Path, stage_root: Path) -> None:
    dest = commit(run_dir, "checkpoint-1", stage_root, 1)
    (dest / "shards" / "s0.bin").unlink()
    (dest / "shards").rmdir()
    result = safestage.verify(dest)
    assert not result.complete
    assert [(p.path, p.kind) for p in result.problems] == [("shards/s0.bin", "missing")]


def test_readers_take_the_bytes_paths_staged_dir_takes(run_dir: Path, stage_root: Path) -> None:
    dest = commit(run_dir, "checkpoint-1", stage_root, 1)
    assert safestage.verify(os.fsencode(dest)).complete
    assert safestage.latest_complete(os.fsencode(run_dir)) == dest
    assert safestage.verify(os.fsencode(dest), deep=True).complete


@pytest.mark.regression("issue 30 review: 0.4 committed blocks that wrote nothing")
def test_a_commit_file_listing_no_file_is_never_a_complete_checkpoint(run_dir: Path, stage_root: Path) -> None:
    older = commit(run_dir, "checkpoint-1", stage_root, 1)
    empty = commit(run_dir, "checkpoint-2", stage_root, 2)
    # What 0.4 wrote for a staged_dir block that saved nothing: a commit file listing no file.
    document = json.loads((empty / COMMIT_NAME).read_bytes())
    document["files"] = []
    (empty / COMMIT_NAME).write_text(json.dumps(document))
    for path in [p for p in empty.rglob("*") if p.name != COMMIT_NAME and p.is_file()]:
        path.unlink()
    result = safestage.verify(empty)
    assert not result.complete and [p.kind for p in result.problems] == ["empty"], result.problems
    assert safestage.latest_complete(run_dir) == older
    safestage.prune(run_dir, keep=1)
    assert (older / "model.safetensors").is_file()  # the newest complete checkpoint stays
