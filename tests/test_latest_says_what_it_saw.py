"""`safestage latest PARENT` that finds no checkpoint matching its pattern says what it did see
and how to ask for it: DCP's docs name checkpoint directories ``step-*``, and the default
pattern is ``checkpoint-*``. A resume script reads the exit status; a person reads stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import safestage

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.regression("issue 24: `safestage latest` beside a committed step-7 said only 'no complete checkpoint'")
def test_latest_with_no_match_names_the_checkpoints_it_saw_and_suggests_pattern(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with safestage.staged_dir(run / "step-7", tmp_path) as local:
        (local / "__0_0.distcp").write_bytes(b"\0" * 64)
    assert safestage.verify(run / "step-7").complete
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(REPO)

    result = subprocess.run([sys.executable, "-m", "safestage", "latest", str(run)],
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip

    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr  # still "none found"
    assert "step-7" in result.stderr and "--pattern" in result.stderr, result.stderr
    found = subprocess.run([sys.executable, "-m", "safestage", "latest", str(run), "--pattern", "step-*"],
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert found.returncode == 0 and found.stdout.strip() == str(run / "step-7"), found.stdout + found.stderr
