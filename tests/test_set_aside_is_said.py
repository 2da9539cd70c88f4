"""A checkpoint a resumed run set aside is still complete, and `safestage verify` says both: that
it is complete and that it was set aside, by which checkpoint (``_timeline``: "verify still says
complete ... and names what set it aside"). A user who asks why `safestage latest` passes over a
complete checkpoint-500 must hear it from the command they run, not only from ``--json``.

Real commits on the local disk: a run commits checkpoint-100 to 500, then a run resumed from
checkpoint-300 commits checkpoint-350.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
from _kept_copies import cli, user_env

import safestage
from safestage.checkpoint._manifest import SET_ASIDE_NAME
from safestage.testing import hostile_mount


def commit(dest: Path, root: Path) -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_text(dest.name)


@pytest.mark.regression("fresh-eyes review of issue 24: `safestage verify` on a set-aside checkpoint printed "
                        "'complete' and nothing else; only --json named what set it aside")
def test_verify_says_a_checkpoint_was_set_aside_and_by_which(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200, 300, 400, 500):
        commit(run / f"checkpoint-{step}", stage_root)
    commit(run / "checkpoint-350", stage_root)  # a run resumed from checkpoint-300
    env = user_env(tmp_path)
    as_json = json.loads(cli("verify", str(run / "checkpoint-500"), "--json", env=env).stdout)
    assert as_json["complete"] and as_json["set_aside"]["by"] == "checkpoint-350", as_json  # it was set aside

    text = cli("verify", str(run / "checkpoint-500"), env=env)

    assert text.returncode == 0, text.stdout + text.stderr  # complete
    assert "set aside" in text.stdout and "checkpoint-350" in text.stdout, text.stdout


@pytest.mark.mounts
@pytest.mark.regression("issue 30 item 10: an EIO or EACCES from the lookup of the set-aside marker counted as "
                        "'set aside': latest_complete passed over the newest checkpoint at INFO only")
@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES], ids=["EIO", "EACCES"])
def test_a_set_aside_marker_that_cannot_be_looked_up_is_said_never_taken_for_set_aside(
    tmp_path: Path, stage_root: Path, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    backing = tmp_path / "backing"
    (backing / "run").mkdir(parents=True)
    for step in (1, 2):  # committed where lookups work; no marker in either
        commit(backing / "run" / f"checkpoint-{step}", stage_root)
    with hostile_mount("passthrough", tmp_path / "mnt", backing=backing,
                       lookup_errors={f"run/checkpoint-2/{SET_ASIDE_NAME}": code}) as mount:  # fmt: skip
        run = Path(mount.path) / "run"
        with caplog.at_level(logging.INFO, logger="safestage"):
            assert safestage.latest_complete(run) == run / "checkpoint-1"
            kept = safestage.prune(run, keep=1, dry_run=True)
        result = safestage.verify(run / "checkpoint-2")
        faults = mount.faults()

    assert faults["lookup"] >= 3, faults  # the fault fired, for each reader
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    skipped = [w for w in warnings if w.startswith("safestage.latest_complete: skipped")]
    assert len(skipped) == 1 and str(run / "checkpoint-2") in skipped[0], warnings
    name = errno.errorcode[code]
    assert SET_ASIDE_NAME in skipped[0] and name in skipped[0], skipped
    assert not any("passed over" in r.getMessage() for r in caplog.records)  # not taken for set aside
    assert kept == []  # checkpoint-2 cannot be told apart from the newest complete one: nothing goes
    pruned = [w for w in warnings if w.startswith(f"safestage.prune: keeping {run / 'checkpoint-2'}")]
    assert len(pruned) == 1 and name in pruned[0] and "set aside" not in pruned[0], warnings
    assert result.set_aside is None and not result.complete
    assert [(p.path, p.kind) for p in result.problems] == [(SET_ASIDE_NAME, "unreadable")], result.problems
    assert name in result.problems[0].message
