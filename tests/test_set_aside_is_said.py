"""A checkpoint a resumed run set aside is still complete, and `safestage verify` says both: that
it is complete and that it was set aside, by which checkpoint (``_timeline``: "verify still says
complete ... and names what set it aside"). A user who asks why `safestage latest` passes over a
complete checkpoint-500 must hear it from the command they run, not only from ``--json``.

Real commits on the local disk: a run commits checkpoint-100 to 500, then a run resumed from
checkpoint-300 commits checkpoint-350.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _kept_copies import cli, user_env

import safestage


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
