"""A commit whose staging root is on the destination's own filesystem publishes by ``rename``:
each file that lands leaves the local copy. Killed half-way (a preemption), what it leaves is
what the message of every kept copy promises elsewhere: ``safestage recover`` commits it
(docs/checkpoints.md, "What a kill leaves": "while files are published ... commits it"), and
nothing safestage does meanwhile (retention included) deletes the only copy of a file of it.

Real processes on the local disk: a training script's commit SIGKILLed once some of its files
have landed and before its commit file has.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _kept_copies import cli, user_env

import safestage
from safestage import COMMIT_NAME
from safestage._names import parse_stage_dir

FILES = 400

# argv: DEST ROOT. Waits for SIGUSR1 (the kill window covers the commit alone), then commits
# FILES small files (fsync'ed one by one: the publish takes a while).
_SAVE = f"""
import os, signal, sys
from pathlib import Path
import safestage
dest, root = sys.argv[1], sys.argv[2]
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})
print("ready", flush=True)
signal.sigwait({{signal.SIGUSR1}})
with safestage.staged_dir(dest, root) as local:
    for i in range({FILES}):
        (local / f"f{{i:03d}}.bin").write_bytes(i.to_bytes(2, "big") * 2048)
print("committed", flush=True)
"""


def expected(i: int) -> bytes:
    return i.to_bytes(2, "big") * 2048


def commit(dest: Path, root: Path) -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_text(dest.name)


def killed_mid_publish(dest: Path, root: Path, tmp_path: Path) -> int:
    """Run the save, SIGKILL it once some files have landed at ``dest`` (never its commit
    file); returns how many had landed (the fault fired: some, not all, no commit file)."""
    child = subprocess.Popen([sys.executable, "-c", _SAVE, str(dest), str(root)], env=user_env(tmp_path),
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        landed = 0
        while time.monotonic() < deadline:
            try:
                landed = sum(name.endswith(".bin") and not name.startswith(".") for name in os.listdir(dest))
            except FileNotFoundError:
                landed = 0
            if landed >= 3:
                break
            time.sleep(0.0005)
        child.kill()
    finally:
        child.wait()
    landed = sum(name.endswith(".bin") and not name.startswith(".") for name in os.listdir(dest))
    assert 0 < landed < FILES, landed
    assert not (dest / COMMIT_NAME).exists(), "the kill came too late: the commit had landed"
    assert child.returncode == -signal.SIGKILL
    return landed


def copies(root: Path) -> list[Path]:
    return [root / name for name in os.listdir(root) if parse_stage_dir(name) is not None]


@pytest.mark.regression("fresh-eyes review of issue 24: a commit killed mid-publish with its staging root on the "
                        "destination's filesystem: stderr and the note said `safestage recover` commits it, "
                        "recover refused ('its files are not those its record lists')")
def test_a_commit_killed_mid_publish_on_the_staging_roots_filesystem_is_committed_by_recover(
    tmp_path: Path,
) -> None:
    run, root = tmp_path / "run", tmp_path / "scratch"  # one filesystem: publish by rename
    run.mkdir()
    root.mkdir()
    assert os.stat(run).st_dev == os.stat(root).st_dev
    dest = run / "checkpoint-200"
    killed_mid_publish(dest, root, tmp_path)

    result = cli("recover", str(root), env=user_env(tmp_path))

    assert result.returncode == 0 and result.stdout.startswith("committed"), result.stdout + result.stderr
    assert safestage.verify(dest, deep=True).complete
    assert all((dest / f"f{i:03d}.bin").read_bytes() == expected(i) for i in range(FILES))
    assert copies(root) == []


@pytest.mark.regression("fresh-eyes review of issue 24: retention no longer waits for a kept copy whose owner is "
                        "gone ('it holds every file'), but a rename-published copy holds only the files that had "
                        "not landed: keep=1 deleted the only copy of the others")
def test_retention_never_deletes_the_only_copy_of_a_file_a_killed_commit_landed(tmp_path: Path) -> None:
    run, root = tmp_path / "run", tmp_path / "scratch"
    run.mkdir()
    root.mkdir()
    dest = run / "checkpoint-200"
    killed_mid_publish(dest, root, tmp_path)
    commit(run / "checkpoint-300", root)  # the job restarts and goes on

    safestage.prune(run, keep=1, root=root)

    found = {}
    for place in [dest, *(save_dir / "checkpoint-200" for save_dir in copies(root))]:
        for i in range(FILES):
            path = place / f"f{i:03d}.bin"
            if path.is_file():
                found[i] = hashlib.sha256(path.read_bytes()).hexdigest()
    lost = sorted(set(range(FILES)) - set(found))
    assert not lost, f"{len(lost)} files of checkpoint-200 exist nowhere any more: {lost[:5]}"
