"""``latest_complete``, ``prune`` and `safestage latest --pattern` take an fnmatch pattern of
checkpoint names (docs/checkpoints.md, docs/retention.md: "fnmatch, case-sensitive") and order
what it matches by step number, the last run of digits in the name: whatever pattern a user
writes to pick the step-numbered checkpoints, the newest step is the newest, and retention
never removes it in favour of an older one.

Real commits on the local disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import safestage
from safestage.checkpoint import _verify


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


NOT_STEPS = ("checkpoint-500-epoch-2", "checkpoint-final-v2", "checkpoint-1e3", "checkpoint-2.5", "checkpoint- 7",
             "checkpoint-0x10", "checkpoint-٣")  # the last: an Arabic-Indic three, a Unicode digit  # fmt: skip


@pytest.mark.regression("issue 30 item 2: checkpoint-* took checkpoint-500-epoch-2 (step 2), checkpoint-final-v2 "
                        "and checkpoint-1e3 (step 3, 'newer' than checkpoint-2): keep=/prune removed the first "
                        "two, latest named the third")
def test_the_step_wildcard_takes_digits_only_and_a_name_it_does_not_take_is_never_touched(
    tmp_path: Path, stage_root: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoint-1", "checkpoint-2", *NOT_STEPS):
        commit(run / name, stage_root)

    assert safestage.latest_complete(run) == run / "checkpoint-2"
    assert safestage.prune(run, keep=1, dry_run=True) == [run / "checkpoint-1"]
    commit(run / "checkpoint-3", stage_root)  # keep=1 as staged_dir runs it, after the commit
    with safestage.staged_dir(run / "checkpoint-4", stage_root, keep=1) as local:
        (local / "model.bin").write_text("4")
    assert sorted(p.name for p in run.iterdir()) == sorted(("checkpoint-4", *NOT_STEPS))
    for name in NOT_STEPS:
        assert safestage.verify(run / name).complete, name
    assert safestage.latest_complete(run) == run / "checkpoint-4"


@pytest.mark.regression("issue 30 item 2: epoch=*-step=*.ckpt took Lightning's re-save epoch=3-step=500-v1.ckpt "
                        "as step 1")
def test_a_pattern_with_two_wildcards_takes_the_step_of_its_last_one_whole(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("epoch=0-step=20.ckpt", "epoch=3-step=500-v1.ckpt", "epoch=1-x=2-step=30.ckpt"):
        commit(run / name, stage_root)
    step = _verify.matcher("epoch=*-step=*.ckpt")

    assert step("epoch=3-step=500.ckpt") == 500
    assert step("epoch=1-x=2-step=30.ckpt") == 30  # what the first * takes is free
    assert step("epoch=3-step=500-v1.ckpt") is None  # not step 1: not a step of this pattern at all
    assert step("epoch=3-step=.ckpt") is None
    assert safestage.latest_complete(run, "epoch=*-step=*.ckpt") == run / "epoch=1-x=2-step=30.ckpt"
    assert safestage.prune(run, keep=1, pattern="epoch=*-step=*.ckpt", dry_run=True) == [run / "epoch=0-step=20.ckpt"]


@pytest.mark.regression("issue 30 item 2: checkpoint-[0-9]* took checkpoint-1e3 as step 3")
def test_the_step_is_what_the_last_run_of_wildcards_matches() -> None:
    # checkpoint-[0-9]*: the class and the star together are the step; step-? one digit.
    assert _verify.matcher("checkpoint-[0-9]*")("checkpoint-5") == 5
    assert _verify.matcher("checkpoint-[0-9]*")("checkpoint-1000") == 1000
    assert _verify.matcher("checkpoint-[0-9]*")("checkpoint-1e3") is None
    assert _verify.matcher("step-?")("step-7") == 7
    assert _verify.matcher("step-?")("step-x") is None
    assert _verify.matcher("step_*")("step_000100") == 100
    assert _verify.matcher("*checkpoint-*")("b-checkpoint-10") == 10
    assert _verify.matcher("*checkpoint-*")("checkpoint-10-merged") is None
    assert _verify.matcher("run[!x]-*")("runa-5") == 5
    assert _verify.matcher("run[!x]-*")("runx-5") is None
    assert _verify.matcher("ckpt-*")("ckpt-5\n") is None


@pytest.mark.regression("issue 30 review: with pattern 'ckpt-1*' the step of ckpt-100 was 0 (what the * matched): "
                        "latest named ckpt-15 and prune --keep 1 removed ckpt-100, the newest")
def test_digits_a_pattern_spells_beside_its_step_wildcard_are_part_of_the_step(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("ckpt-2", "ckpt-15", "ckpt-100"):  # in step order: no rollback
        commit(run / name, stage_root)

    assert _verify.matcher("ckpt-1*")("ckpt-100") == 100
    assert _verify.matcher("ckpt-1*")("ckpt-2") is None and _verify.matcher("ckpt-1*")("ckpt-1") is None
    assert _verify.matcher("step_*00")("step_500") == 500  # digits after it too
    assert safestage.latest_complete(run, "ckpt-1*") == run / "ckpt-100"
    assert safestage.prune(run, keep=1, pattern="ckpt-1*") == [run / "ckpt-15"]
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-100", "ckpt-2"]


@pytest.mark.regression("issue 30 review: a bracket escaping one character just before the step wildcard "
                        "('ckpt[[]*', which keep= makes of 'ckpt[100') joined the step, which then took nothing: "
                        "keep= never pruned and latest found nothing")
def test_a_bracket_of_one_character_before_the_step_is_that_character(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("ckpt[50", "ckpt[90"):
        commit(run / name, stage_root)
    with safestage.staged_dir(run / "ckpt[100", stage_root, keep=2) as local:  # keep=: pattern ckpt[[]*
        (local / "model.bin").write_text("100")

    assert sorted(p.name for p in run.iterdir()) == ["ckpt[100", "ckpt[90"]
    assert safestage.latest_complete(run, "ckpt[[]*") == run / "ckpt[100"
    assert _verify.matcher("step[*]*")("step*7") == 7 and _verify.matcher("step[*]*")("step7") is None
    assert _verify.matcher("checkpoint-[5]")("checkpoint-5") == 5  # a pattern without a wildcard left


@pytest.mark.regression("issue 30 review: `safestage latest RUN --pattern 'RUN/checkpoint-*'` said 'no complete "
                        "checkpoint' and exited 1 (a resume script starts from scratch) where prune refuses the "
                        "pattern as a usage error")
@pytest.mark.parametrize("pattern", ["run/checkpoint-*", "checkpoint-*/", ""])
def test_a_pattern_with_a_directory_part_is_refused_by_latest_as_by_prune(
    tmp_path: Path, stage_root: Path, pattern: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    commit(run / "checkpoint-1", stage_root)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    for command in ("latest", "prune"):
        extra = ["--keep", "1"] if command == "prune" else []
        done = subprocess.run([sys.executable, "-m", "safestage", command, str(run), "--pattern", pattern, *extra],
                              env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2 and "no '/'" in done.stderr, (command, done.stdout + done.stderr)
    with pytest.raises(safestage.ConfigError, match="no '/'"):
        safestage.latest_complete(run, pattern)
    assert safestage.verify(run / "checkpoint-1").complete
