"""`safestage recover --dest PATH` acts on the copies kept for PATH as the job named it: a run
directory reached through a symlink (``/mnt/link/run42`` for ``/mnt/real/run42``) or a relative
path names the same destination once resolved, whether or not the checkpoint directory is
still there (retention removes an incomplete one older than the newest complete checkpoint,
docs/retention.md; its kept copy holds what recover needs).

A real kept copy (tests/_kept_copies.py: a commit that failed with ENOSPC on a 2 MiB tmpfs),
its job having named the checkpoint through a symlinked run directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _kept_copies import cli, failed_commit, remount, user_env

import safestage


@pytest.mark.regression("fresh-eyes review of issue 24: `safestage recover --dest <the job's path>` said 'no kept "
                        "copy' for a copy kept for exactly that checkpoint, once retention had removed its "
                        "incomplete directory and the run directory was reached through a symlink")
def test_recover_dest_finds_the_copy_for_a_checkpoint_named_through_a_symlink_after_retention_removed_it(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    (small_tmpfs / "run42").mkdir()
    link = tmp_path / "runs"
    os.symlink(small_tmpfs, link)  # the job writes to runs/run42/...
    job_path = link / "run42" / "checkpoint-5"
    kept = failed_commit(job_path, stage_root, tmp_path)
    remount(small_tmpfs, "16m")
    with safestage.staged_dir(link / "run42" / "checkpoint-6", stage_root) as local:  # the job went on
        (local / "model.bin").write_bytes(b"6")
    safestage.prune(link / "run42", keep=1)
    assert not job_path.exists(), "retention kept the incomplete checkpoint-5"  # the case at hand

    for named in (str(job_path), os.path.relpath(job_path, tmp_path)):
        result = cli("recover", str(stage_root), "--dest", named, "--dry-run", env=user_env(tmp_path), cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert str(kept.local) in result.stdout, (named, result.stdout)
