"""``latest_complete``, ``prune`` and `safestage latest --pattern` take an fnmatch pattern of
checkpoint names (docs/checkpoints.md, docs/retention.md: "fnmatch, case-sensitive") and order
what it matches by step number, the last run of digits in the name: whatever pattern a user
writes to pick the step-numbered checkpoints, the newest step is the newest, and retention
never removes it in favour of an older one.

Real commits on the local disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import safestage


def commit(dest: Path, root: Path) -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_text(dest.name)


@pytest.mark.regression("fresh-eyes review of issue 24: with pattern 'checkpoint-[0-9]*' (the step-numbered ones, "
                        "not checkpoint-best) latest_complete named checkpoint-150 over checkpoint-1000, and "
                        "prune(keep=2) removed checkpoint-900")
def test_a_pattern_that_picks_step_numbered_checkpoints_orders_them_by_their_step(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoint-150", "checkpoint-900", "checkpoint-1000", "checkpoint-best"):
        commit(run / name, stage_root)
    pattern = "checkpoint-[0-9]*"  # every checkpoint-N, never checkpoint-best

    assert safestage.latest_complete(run, pattern) == run / "checkpoint-1000"
    assert safestage.prune(run, keep=2, pattern=pattern, dry_run=True) == [run / "checkpoint-150"]


@pytest.mark.regression("fresh-eyes review of issue 24: latest_complete(run, 'step-?') found nothing beside a "
                        "committed step-7: a pattern without '*' now matches only the name it spells")
def test_a_pattern_without_a_star_still_matches_as_fnmatch(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("step-5", "step-7"):
        commit(run / name, stage_root)

    assert safestage.latest_complete(run, "step-?") == run / "step-7"
    assert safestage.latest_complete(run, "step-[0-9]") == run / "step-7"
