"""A kept copy says which job kept it (the default staging root is shared by every job of a user
on a host, issue 24), and keeps saying so: a `safestage recover` that fails (the destination is
still full) or is interrupted rewrites the record with what landed and why, never with its own
identity in place of the training job's.

A real kept copy (tests/_kept_copies.py: a training script's commit that failed with ENOSPC on
a 2 MiB tmpfs); recover is run as a user runs it, and fails the same real way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _kept_copies import cli, failed_commit, user_env


@pytest.mark.regression("fresh-eyes review of issue 24: after one failed `safestage recover`, the copy was listed "
                        "as 'kept by pid N: __main__.py recover ROOT', the training job's name lost")
def test_a_failed_recover_keeps_naming_the_job_that_kept_the_copy(small_tmpfs: Path, tmp_path: Path, stage_root: Path) -> None:
    kept = failed_commit(small_tmpfs / "checkpoint-3", stage_root, tmp_path, script="train_job_42.py")
    env = user_env(tmp_path)
    before = cli("recover", str(stage_root), "--dry-run", env=env)
    assert "train_job_42.py" in before.stdout, before.stdout

    failed = cli("recover", str(stage_root), env=env)  # the tmpfs is still full: ENOSPC again
    assert failed.returncode == 1 and failed.stdout.startswith("failed"), failed.stdout + failed.stderr
    assert kept.save_dir.exists()

    after = cli("recover", str(stage_root), "--dry-run", env=env)
    assert "train_job_42.py" in after.stdout, after.stdout
    assert "__main__.py recover" not in after.stdout.split("kept by", 1)[1].splitlines()[0], after.stdout
