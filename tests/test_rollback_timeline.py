"""A checkpoint is set aside (``_SAFESTAGE_SET_ASIDE.json``, never named by ``latest_complete``)
only when a run abandoned it: a save that began after it was complete, from an older
checkpoint of the same run. Never a checkpoint of another run, never one a user commits
after the fact; and once a resumed run's new timeline has committed, ``latest_complete`` never
names a checkpoint of the abandoned one, however the checkpoints are named and however the
abandoned one became complete.

Real commits on the local disk (and a real 2 MiB tmpfs for a real ENOSPC where a kept copy is
needed); a resumed run is a commit that begins after the newer checkpoints were complete, as
a restarted job's is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _kept_copies import cli, failed_commit, remount, user_env

import safestage
from safestage import COMMIT_NAME
from safestage._names import KEPT_RECORD

MARKER = "_SAFESTAGE_SET_ASIDE.json"


def commit(dest: Path, root: Path, content: str) -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_text(content)
        (local / "trainer_state.json").write_text(json.dumps({"content": content}))


def content(checkpoint: Path) -> str:
    return json.loads((checkpoint / "trainer_state.json").read_text())["content"]


# -- never a checkpoint nobody abandoned -------------------------------------------------------


@pytest.mark.regression("fresh-eyes review of issue 24: committing a run's existing checkpoint directories in "
                        "place, in sorted() order, set aside every newer one (checkpoint-1000 sorts before "
                        "checkpoint-200)")
def test_committing_written_checkpoints_in_place_in_any_order_sets_none_aside(tmp_path: Path, stage_root: Path) -> None:
    # A Trainer run without the callback wrote these in place; the user then adopts safestage
    # and commits them, in the order sorted() gives.
    run = tmp_path / "output"
    run.mkdir()
    for step in (200, 600, 1000):
        checkpoint = run / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "model.bin").write_bytes(bytes([step % 256]) * step)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    order = sorted(run.iterdir())
    assert [p.name for p in order] == ["checkpoint-1000", "checkpoint-200", "checkpoint-600"]

    for checkpoint in order:
        safestage.commit_in_place(checkpoint, stage_root)

    assert all(safestage.verify(run / f"checkpoint-{step}", deep=True).complete for step in (200, 600, 1000))
    assert not (run / "checkpoint-1000" / MARKER).exists(), "the newest checkpoint was set aside"
    assert safestage.latest_complete(run) == run / "checkpoint-1000"


@pytest.mark.regression("fresh-eyes review of issue 24: a run's first commit wrote a set-aside marker into another "
                        "run's checkpoint through a symlink, and that run's latest_complete became None")
def test_a_commit_never_sets_aside_another_runs_checkpoint_through_a_symlink(tmp_path: Path, stage_root: Path) -> None:
    pretrain, finetune = tmp_path / "pretrain", tmp_path / "finetune"
    pretrain.mkdir()
    finetune.mkdir()
    commit(pretrain / "checkpoint-1000", stage_root, "pretrain step 1000")
    before = sorted(os.listdir(pretrain / "checkpoint-1000"))
    # The fine-tuning run links the checkpoint it starts from into its own run directory.
    os.symlink(pretrain / "checkpoint-1000", finetune / "checkpoint-1000")

    commit(finetune / "checkpoint-100", stage_root, "finetune step 100")

    assert sorted(os.listdir(pretrain / "checkpoint-1000")) == before, "written into another run's checkpoint"
    assert safestage.latest_complete(pretrain) == pretrain / "checkpoint-1000"


# -- never the abandoned timeline, once the new one has committed ------------------------------


@pytest.mark.regression("fresh-eyes review of issue 24: the copy a failed commit of checkpoint-400 kept was "
                        "recovered after the resumed run had committed checkpoint-350, and latest_complete named "
                        "the abandoned run's checkpoint-400")
def test_recovering_a_copy_of_an_abandoned_timeline_never_makes_it_the_latest(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    run = small_tmpfs / "run"
    run.mkdir()
    for step in (100, 200, 300):  # run 1
        commit(run / f"checkpoint-{step}", stage_root, f"run 1 step {step}")
    kept = failed_commit(run / "checkpoint-400", stage_root, tmp_path)  # run 1's last save: ENOSPC
    assert safestage.latest_complete(run) == run / "checkpoint-300"
    # Run 2 resumes from checkpoint-300 (the newest complete) and checkpoints every 50 steps.
    commit(run / "checkpoint-350", stage_root, "run 2 step 350")
    assert safestage.latest_complete(run) == run / "checkpoint-350"

    remount(small_tmpfs, "16m")  # the mount has room again; the user runs what the warning says
    result = cli("recover", str(stage_root), env=user_env(tmp_path))
    assert result.returncode in (0, 1), result.stdout + result.stderr
    assert str(kept.local) in result.stdout, result.stdout  # the copy was looked at

    latest = safestage.latest_complete(run)
    assert latest == run / "checkpoint-350", (latest, result.stdout)
    assert content(latest) == "run 2 step 350"


# -- a copy kept by safestage 0.3 (record format version 1) -----------------------------------


def as_written_by_safestage_0_3(save_dir: Path, *, time: float) -> None:
    """Rewrite the record beside a kept copy as safestage 0.3's ``_stage.record_kept`` wrote it
    (`git show 9b4f3c0:safestage/_stage.py`): version 1, no part, no job, no start time; its
    ``time`` is when the record was last written (0.3 wrote it again at every failure, its
    `safestage recover` included)."""
    record = json.loads((save_dir / KEPT_RECORD).read_bytes())
    document = {
        "format": "safestage.kept", "version": 1, "destination": record["destination"], "local": record["local"],
        "kind": record["kind"], "left": record["left"], "landed": record["landed"],
        "commit_file": record["commit_file"], "error": record["error"], "time": time,
    }  # fmt: skip
    (save_dir / KEPT_RECORD).write_text(json.dumps(document, indent=1))


@pytest.mark.regression("fresh-eyes review of issue 24: recovering checkpoint-100 from a copy safestage 0.3 kept "
                        "set aside checkpoint-200, committed long after checkpoint-100's save began")
def test_a_copy_kept_by_safestage_0_3_is_refused_by_recover_and_sets_nothing_aside(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    """A 0.3 record neither says when its save began nor whether the copy is a whole
    checkpoint or one rank's files of a DCP save: recover refuses it, touching nothing."""
    run = small_tmpfs / "run"
    run.mkdir()
    kept = failed_commit(run / "checkpoint-100", stage_root, tmp_path)  # ENOSPC: a real kept copy
    commit(run / "checkpoint-200", stage_root, "step 200")  # the job went on
    # 0.3's `safestage recover` was tried once more after checkpoint-200 landed, and failed.
    as_written_by_safestage_0_3(kept.save_dir, time=time.time())
    remount(small_tmpfs, "16m")

    result = cli("recover", str(stage_root), env=user_env(tmp_path))

    assert result.returncode == 1 and "refused" in result.stdout, result.stdout + result.stderr
    assert "safestage 0.3" in result.stdout and "commit_in_place" in result.stdout, result.stdout
    assert not safestage.verify(run / "checkpoint-100").complete
    assert not (run / "checkpoint-200" / MARKER).exists(), "checkpoint-200 was set aside"
    assert safestage.latest_complete(run) == run / "checkpoint-200"
    assert kept.local.is_dir()


# A rollback's commit SIGKILLed after it staged the set-aside marker in its save directory and
# before it published it (a kill point the model test of the wing found).
KILLED_WHILE_SETTING_ASIDE = """
import os, signal, sys
from pathlib import Path
import safestage
from safestage.checkpoint import _sequence
publish_file = _sequence.publish_file
def publish_or_die(source, *args, **kwargs):
    if Path(source).name == "safestage-set-aside.json":
        os.kill(os.getpid(), signal.SIGKILL)  # the marker staged, not published
    return publish_file(source, *args, **kwargs)
_sequence.publish_file = publish_or_die
with safestage.staged_dir(sys.argv[1], sys.argv[2]) as local:
    (local / "model.bin").write_text("run 2 step 1")
"""


@pytest.mark.regression("issue 30 section 3: a rollback's commit killed after it staged the set-aside marker: "
                        "recover committed it, but the marker's staged copy was in the way (EEXIST), so the "
                        "abandoned checkpoint-2 was not set aside and latest_complete named it")
def test_recovering_a_rollback_killed_while_it_set_aside_still_sets_aside_what_it_abandoned(
    tmp_path: Path, stage_root: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    commit(run / "checkpoint-2", stage_root, "run 1 step 2")
    child = subprocess.run([sys.executable, "-c", KILLED_WHILE_SETTING_ASIDE, str(run / "checkpoint-1"),
                            str(stage_root)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr  # killed where it was meant to be
    assert not (run / "checkpoint-2" / MARKER).exists()

    assert [result.action for result in safestage.recover(stage_root)] == ["committed"]

    assert safestage.verify(run / "checkpoint-2").set_aside is not None  # run 2 abandoned it
    assert safestage.latest_complete(run) == run / "checkpoint-1"
