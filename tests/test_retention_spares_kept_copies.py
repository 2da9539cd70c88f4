"""Retention and kept copies: a kept copy holds every file of its checkpoint, so retention does
not wait for it (`safestage prune --dry-run` gives one answer, whether or not ``--dir`` names the
staging root the kept copy is in), and recover still commits it whole. (Retention sparing a
checkpoint a live commit writes says so in a WARNING: tests/test_prune.py.)

The kept copy is a real one (tests/_kept_copies.py): a commit of checkpoint-6 that failed with
ENOSPC on a 2 MiB tmpfs, in a process that has exited; the tmpfs is then grown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _kept_copies import cli, failed_commit, remount, user_env

import safestage


def commit(dest: Path, root: Path, **options: Any) -> None:
    with safestage.staged_dir(dest, root, **options) as local:
        (local / "model.bin").write_text(dest.name)


@pytest.mark.regression("issue 24: keep=2 left three checkpoints (6, 10, 12) and said nothing: a kept copy "
                        "naming checkpoint-6 protected it, seen only from the job's own staging root")
def test_keep_does_not_wait_for_a_kept_copy_which_still_commits_the_checkpoint_whole(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    """A kept copy holds every file of its checkpoint: retention removes what its failed commit
    left at the destination like any incomplete checkpoint older than the newest complete one
    (one answer, wherever the copy lies), and recover still commits the checkpoint whole."""
    run = small_tmpfs
    kept = failed_commit(run / "checkpoint-6", stage_root, tmp_path)
    remount(small_tmpfs, "16m")
    assert (run / "checkpoint-6").is_dir() and not safestage.verify(run / "checkpoint-6").complete

    commit(run / "checkpoint-10", stage_root, keep=2)
    commit(run / "checkpoint-12", stage_root, keep=2)

    assert sorted(os.listdir(run)) == ["checkpoint-10", "checkpoint-12"]
    assert kept.local.is_dir()
    (result,) = safestage.recover(stage_root)
    assert result.action == "committed", result
    assert safestage.verify(run / "checkpoint-6", deep=True).complete
    assert safestage.latest_complete(run) == run / "checkpoint-12"


def would_remove(stdout: str) -> list[str]:
    return sorted(line.split()[2] for line in stdout.splitlines() if line.startswith("would remove"))


@pytest.mark.regression("issue 24: `safestage prune --dry-run` answered differently with and without --dir")
def test_prune_dry_run_gives_one_answer_with_and_without_dir(small_tmpfs: Path, tmp_path: Path, stage_root: Path) -> None:
    run = small_tmpfs
    failed_commit(run / "checkpoint-6", stage_root, tmp_path)
    remount(small_tmpfs, "16m")
    commit(run / "checkpoint-10", stage_root)
    commit(run / "checkpoint-12", stage_root)
    env = user_env(tmp_path)  # the user's shell: SAFESTAGE_DIR not set, as in a job's epilogue

    without = cli("prune", str(run), "--keep", "2", "--dry-run", env=env)
    with_dir = cli("prune", str(run), "--keep", "2", "--dry-run", "--dir", str(stage_root), env=env)

    assert without.returncode == 0 and with_dir.returncode == 0, without.stderr + with_dir.stderr
    assert with_dir.stdout.splitlines()[-1].startswith(("0 would be removed", "1 would be removed")), with_dir.stdout
    assert would_remove(without.stdout) == would_remove(with_dir.stdout), (without.stdout, with_dir.stdout)
    assert sorted(os.listdir(run)) == ["checkpoint-10", "checkpoint-12", "checkpoint-6"]  # a dry run
