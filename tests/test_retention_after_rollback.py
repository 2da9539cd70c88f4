"""Retention and "latest" after a rollback (the class of unsloth-zoo#782, transformers#37260,
SimpleTuner#2989, RLinf#1469): a job that resumes from an older checkpoint keeps the one it
resumed from, and once its new timeline has committed, ``latest_complete`` never names a
checkpoint of the abandoned one. ``keep=`` and ``latest_complete``'s default pattern count the
step-numbered checkpoints only (``checkpoint-N``), never a merged export beside them.

Real commits on the local disk; the resumed run is a process of its own, as a restarted job is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import safestage

REPO = Path(__file__).resolve().parent.parent


def commit(dest: Path, root: Path, content: str, **options: object) -> None:
    with safestage.staged_dir(dest, root, **options) as local:  # type: ignore[arg-type]
        (local / "model.bin").write_text(content)
        (local / "trainer_state.json").write_text(json.dumps({"content": content}))


def names(parent: Path) -> list[str]:
    return sorted(os.listdir(parent))


def tree(path: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}


# The resumed run: loads checkpoint-300 (the run went bad after it), trains on, commits 350 and
# 400 with keep=3, and reports what a user would look at after each commit.
_RESUMED_RUN = """
import json, os, sys
from pathlib import Path
import safestage
parent, root = Path(sys.argv[1]), Path(sys.argv[2])
resumed = json.loads((parent / "checkpoint-300" / "trainer_state.json").read_text())  # the resume
seen = {"resumed": resumed["content"]}
for step in (350, 400):
    with safestage.staged_dir(parent / f"checkpoint-{step}", root, keep=3) as local:
        (local / "model.bin").write_text(f"run 2 step {step}")
        (local / "trainer_state.json").write_text(json.dumps({"content": f"run 2 step {step}"}))
    latest = safestage.latest_complete(parent)
    seen[str(step)] = {
        "names": sorted(os.listdir(parent)),
        "300 complete": safestage.verify(parent / "checkpoint-300").complete,
        "latest": None if latest is None else latest.name,
    }
print(json.dumps(seen))
"""


@pytest.mark.regression("issue 24: after resuming from checkpoint-300, keep=3 removed it and latest_complete kept "
                        "naming the abandoned run's checkpoint-500")
def test_a_run_resumed_from_an_older_checkpoint_keeps_it_and_latest_follows_the_new_timeline(
    tmp_path: Path, stage_root: Path
) -> None:
    parent = tmp_path / "run"
    parent.mkdir()
    for step in (100, 200, 300, 400, 500):  # run 1; 500 turns out bad
        commit(parent / f"checkpoint-{step}", stage_root, f"run 1 step {step}", keep=3)
    assert names(parent) == ["checkpoint-300", "checkpoint-400", "checkpoint-500"]
    assert safestage.latest_complete(parent) == parent / "checkpoint-500"

    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(REPO)
    run2 = subprocess.run(
        [sys.executable, "-c", _RESUMED_RUN, str(parent), str(stage_root)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run2.returncode == 0, run2.stdout + run2.stderr
    seen = json.loads(run2.stdout)
    assert seen["resumed"] == "run 1 step 300"

    after_350 = seen["350"]
    assert "checkpoint-300" in after_350["names"] and after_350["300 complete"], after_350
    assert after_350["latest"] == "checkpoint-350", after_350  # not the abandoned run's 400 or 500
    after_400 = seen["400"]
    assert after_400["latest"] == "checkpoint-400", after_400
    assert safestage.latest_complete(parent) == parent / "checkpoint-400"
    assert safestage.verify(parent / "checkpoint-400", deep=True).complete
    assert (parent / "checkpoint-400" / "model.bin").read_text() == "run 2 step 400"  # the new content
    assert json.loads((parent / "checkpoint-400" / "trainer_state.json").read_text()) == {"content": "run 2 step 400"}
    assert "checkpoint-500" not in {after_350["latest"], after_400["latest"]}


def merged_export_beside(parent: Path, root: Path) -> dict[str, tuple[bytes, int]]:
    """checkpoint-500 committed, then its merged export checkpoint-500-merged (committed last)."""
    commit(parent / "checkpoint-500", root, "step 500")
    commit(parent / "checkpoint-500-merged", root, "step 500, adapters merged")
    assert safestage.verify(parent / "checkpoint-500-merged", deep=True).complete
    return tree(parent / "checkpoint-500-merged")


@pytest.mark.regression("issue 24: keep=2 on checkpoint-600 removed the training checkpoint-500 and kept its merged "
                        "export: the pattern was the stem plus '*', not the stem plus a step number")
def test_keep_counts_step_numbered_checkpoints_only_and_leaves_a_merged_export_alone(
    tmp_path: Path, stage_root: Path
) -> None:
    parent = tmp_path / "run"
    parent.mkdir()
    merged = merged_export_beside(parent, stage_root)

    commit(parent / "checkpoint-600", stage_root, "step 600", keep=2)

    assert names(parent) == ["checkpoint-500", "checkpoint-500-merged", "checkpoint-600"]
    assert safestage.verify(parent / "checkpoint-500", deep=True).complete  # one of the 2 newest: 500, 600
    assert tree(parent / "checkpoint-500-merged") == merged  # untouched
    assert safestage.latest_complete(parent) == parent / "checkpoint-600"


@pytest.mark.regression("issue 24: latest_complete's default pattern matched a merged export checkpoint-500-merged")
def test_latest_complete_never_names_a_merged_export_even_committed_last(tmp_path: Path, stage_root: Path) -> None:
    parent = tmp_path / "run"
    parent.mkdir()
    merged_export_beside(parent, stage_root)

    assert safestage.latest_complete(parent) == parent / "checkpoint-500"
    commit(parent / "checkpoint-600", stage_root, "step 600")
    assert safestage.latest_complete(parent) == parent / "checkpoint-600"
