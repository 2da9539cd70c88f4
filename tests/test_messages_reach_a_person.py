"""What safestage says reaches a person, once: a WARNING of a script that activates in code
and configures no logging is on stderr (safestage's handler stands in for Python's last
resort, which a library's NullHandler silences), and never twice when the script configures
logging itself.

Real processes, as a user runs them: a script saving onto the kit's mountpoint-like mount,
which cannot rename, so ``publish="auto"`` falls back to ``direct`` and says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _kept_copies import user_env

_SAVES = """\
import sys
import torch
from safetensors.torch import save_file
import safestage
dest, root = sys.argv[1], sys.argv[2]
with safestage.staged(root):
    save_file({"w": torch.ones(4)}, dest + "/a.safetensors")
    save_file({"w": torch.ones(4)}, dest + "/b.safetensors")
print("saved")
"""

_CONFIGURED = "import logging, runpy, sys; logging.basicConfig(); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def _run(kit_mounts: dict[str, Any], tmp_path: Path, *, configured: bool) -> tuple[Path, str]:
    dest = Path(kit_mounts["mountpoint"].path) / f"said-{os.urandom(4).hex()}"
    dest.mkdir()
    root = tmp_path / f"root-{configured}"
    root.mkdir()
    script = tmp_path / "train.py"
    script.write_text(_SAVES)
    prefix = [sys.executable, "-c", _CONFIGURED] if configured else [sys.executable]
    run = subprocess.run([*prefix, str(script), str(dest), str(root)], env=user_env(tmp_path),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0 and run.stdout == "saved\n", run.stdout + run.stderr
    assert sorted(os.listdir(dest)) == ["a.safetensors", "b.safetensors"]  # landed, direct
    return dest, run.stderr


@pytest.mark.regression("issue 30 item 15: under `with safestage.staged(...)` and no logging set up, the "
                        "'cannot rename, using direct' warning was not shown at all")
def test_a_warning_of_an_in_code_activation_reaches_stderr_once_without_logging_set_up(
    kit_mounts: dict[str, Any], tmp_path: Path
) -> None:
    dest, stderr = _run(kit_mounts, tmp_path, configured=False)
    said = [line for line in stderr.splitlines() if "cannot rename files" in line]
    assert len(said) == 1, stderr
    assert said[0].startswith("safestage: WARNING: ") and str(dest) in said[0], said[0]


def test_a_script_that_configures_logging_hears_each_warning_once_through_its_own_handler(
    kit_mounts: dict[str, Any], tmp_path: Path
) -> None:
    _dest, stderr = _run(kit_mounts, tmp_path, configured=True)
    said = [line for line in stderr.splitlines() if "cannot rename files" in line]
    assert len(said) == 1, stderr
    assert said[0].startswith("WARNING:safestage:"), said[0]  # basicConfig's format: its handler


_ACTIVATES = """\
import sys
import safestage
safestage.activate(sys.argv[1]).close()
print("training")
"""


@pytest.mark.regression("issue 30 item 15: every rank of a node named the kept copies of the staging root they share")
def test_of_the_ranks_a_launcher_started_on_a_node_only_local_rank_0_names_its_kept_copies(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    """srun and mpirun start every rank themselves (no launcher of ours names anything first):
    each rank activates in code on the node's root; local rank 0 says it, the others do not."""
    from _kept_copies import failed_commit

    kept = failed_commit(small_tmpfs / "checkpoint-1", stage_root, tmp_path)
    script = tmp_path / "rank.py"
    script.write_text(_ACTIVATES)
    told = {}
    for variables in ({"LOCAL_RANK": "0", "RANK": "2"}, {"LOCAL_RANK": "1", "RANK": "3"}, {"SLURM_LOCALID": "1"}):
        run = subprocess.run([sys.executable, str(script), str(stage_root)], env=user_env(tmp_path, **variables),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0 and run.stdout == "training\n", run.stdout + run.stderr
        told[tuple(variables.items())] = [line for line in run.stderr.splitlines() if "safestage recover" in line]
    spoken = list(told.values())
    assert len(spoken[0]) == 1 and kept.save_dir.name in spoken[0][0], told
    assert spoken[1] == [] and spoken[2] == [], told


@pytest.mark.mounts
@pytest.mark.regression("issue 30 item 15: a save blocked for seconds behind a background publish said nothing")
def test_a_save_waiting_seconds_behind_a_background_publish_says_what_it_waits_for(
    tmp_path: Path, stage_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A background save of model.safetensors publishes at 4 MB/s (the kit's slow mount); a
    synchronous save of the same file lands after it, so it waits: after 5 s it says for what."""
    import logging
    import time

    import torch
    from safetensors.torch import load_file, save_file

    import safestage
    from safestage.testing import hostile_mount

    with hostile_mount("slow", tmp_path / "slow", mbps=4) as mount:
        dest = Path(mount.path) / "model.safetensors"
        caplog.set_level(logging.INFO, logger="safestage")
        started = time.monotonic()
        with safestage.staged(stage_root, background=True):
            save_file({"w": torch.zeros(7 << 20)}, str(dest))  # 28 MiB: about 7 s to publish
            with safestage.staged(stage_root):
                save_file({"w": torch.ones(4)}, str(dest))  # waits for the one before
        waited = time.monotonic() - started
        assert torch.equal(load_file(str(dest))["w"], torch.ones(4))  # the newer one landed last
    said = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("waiting for")]
    assert waited > 5.5 and len(said) == 1, (waited, [r.getMessage() for r in caplog.records])
    assert f"the background save of {dest}" in said[0].getMessage(), said[0].getMessage()
    ended = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waited ")]
    assert len(ended) == 1 and str(dest) in ended[0], ended
