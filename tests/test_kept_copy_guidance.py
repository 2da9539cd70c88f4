"""What a user is told about a kept copy, and what they can do with exactly it: a script that
activates in code and configures no logging hears about it on stderr, once; `safestage clean`
points to `safestage recover` (not to a hand copy that writes no commit file); a refusal gives
the command that deletes the copy, and that command deletes it alone; `safestage recover`
says which job each copy belongs to (the default staging root is shared by every job of the
user on the host) and acts on one destination when asked.

Kept copies are real (tests/_kept_copies.py): a training script's commit that failed with
ENOSPC on a 2 MiB tmpfs, in a process that has exited; every command is run as a user runs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _kept_copies import Kept, cli, failed_commit, remount, user_env

import safestage
from safestage._names import HOST


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every entry below ``path`` with (size, mtime_ns): what "touched nothing" compares."""
    found = {}
    for directory, names, files in os.walk(path):
        for name in names + files:
            info = os.lstat(os.path.join(directory, name))
            found[os.path.relpath(os.path.join(directory, name), path)] = (info.st_size, info.st_mtime_ns)
    return found


def word(text: str, value: str) -> bool:
    """``value`` appears in ``text`` as a word of its own (a host "vm", a pid)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(value)}(?![A-Za-z0-9_])", text) is not None


# -- activation: one line on stderr ----------------------------------------------------------

_ACTIVATING_SCRIPT = """\
import sys
import safestage
root = sys.argv[1]
safestage.activate(root).close()
safestage.activate(root).close()  # activated again in the same process
with safestage.staged(root):
    pass
print("training")
"""


@pytest.mark.regression("issue 24: a script that activates in code and sets up no logging heard nothing about "
                        "the copy a failed save left: the warning was only a log record")
def test_an_activation_in_code_names_a_kept_copy_on_stderr_once(small_tmpfs: Path, tmp_path: Path, stage_root: Path) -> None:
    kept = failed_commit(small_tmpfs / "checkpoint-1", stage_root, tmp_path)
    script = tmp_path / "resume.py"
    script.write_text(_ACTIVATING_SCRIPT)
    # The same script in a job that set up logging: the activation does find the kept copy.
    logged = subprocess.run(
        [sys.executable, "-c", "import logging, runpy, sys; logging.basicConfig(); sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')", str(script), str(stage_root)],
        env=user_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert logged.returncode == 0 and kept.save_dir.name in logged.stderr, logged.stderr

    run = subprocess.run([sys.executable, str(script), str(stage_root)], env=user_env(tmp_path),
                         capture_output=True, text=True, timeout=120)  # fmt: skip

    assert run.returncode == 0 and run.stdout == "training\n", run.stdout + run.stderr
    assert kept.save_dir.is_dir(), "the activation removed the kept copy"
    lines = [line for line in run.stderr.splitlines() if "safestage recover" in line]
    assert len(lines) == 1, f"{len(lines)} lines name `safestage recover` on stderr: {run.stderr!r}"
    assert kept.save_dir.name in lines[0], lines[0]


# -- clean points to recover -----------------------------------------------------------------


@pytest.mark.regression("issue 24: `safestage clean` advised for a kept commit copy to copy it by hand, which "
                        "writes no commit file, so `latest` never sees it")
def test_clean_points_a_kept_checkpoint_copy_to_recover(small_tmpfs: Path, tmp_path: Path, stage_root: Path) -> None:
    kept = failed_commit(small_tmpfs / "checkpoint-2", stage_root, tmp_path)
    before = tree(stage_root)

    result = cli("clean", str(stage_root), env=user_env(tmp_path))

    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if kept.save_dir.name in line]
    assert line.startswith("kept"), line
    assert tree(stage_root) == before, "clean touched the kept copy"
    assert "then delete the directory by hand" not in result.stdout and "copy it to" not in line, line
    assert "safestage recover" in line, line


# -- a refusal gives the command that deletes the copy -------------------------------------------


@pytest.mark.regression("issue 24: recover said 'delete the copy' but gave no command for it (only rm -rf inside "
                        "the staging root)")
def test_a_refused_copy_is_deleted_by_the_command_the_refusal_gives_and_nothing_else(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    dest = small_tmpfs / "checkpoint-7"
    refused = failed_commit(dest, stage_root, tmp_path, script="job_a.py")
    other = failed_commit(small_tmpfs / "checkpoint-8", stage_root, tmp_path, script="job_b.py")
    remount(small_tmpfs, "16m")
    with safestage.staged_dir(dest, tmp_path / "user-tmp") as local:  # the job's newer save of it
        (local / "model.bin").write_text("newer")
    before_dest, before_other = tree(dest), tree(other.save_dir)
    env = user_env(tmp_path)

    looked = cli("recover", str(stage_root), "--dry-run", env=env)

    (line,) = [line for line in looked.stdout.splitlines() if line.startswith("refused")]
    printed = line.split()[1]  # "refused  LOCAL -> DEST: reason"
    assert printed == str(refused.local), line
    assert "newer save" in line, line  # refused for the newer complete checkpoint at its destination
    assert "safestage recover --discard" in line, line

    discarded = cli("recover", "--discard", printed, env=env)

    assert discarded.returncode == 0, discarded.stdout + discarded.stderr
    assert not refused.save_dir.exists(), "the refused copy is still there"
    assert tree(other.save_dir) == before_other, "--discard touched another copy"
    assert tree(dest) == before_dest and safestage.verify(dest, deep=True).complete
    assert (dest / "model.bin").read_text() == "newer"


# -- which job a copy belongs to; one destination at a time ---------------------------------------


def without_copy_names(text: str, kept: Kept) -> str:
    """``text`` less the copy's own paths (its save directory's name carries host and pid)."""
    return text.replace(str(kept.local), "").replace(str(kept.save_dir), "").replace(kept.save_dir.name, "")


def flattened(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [text for item in value.values() for text in flattened(item)]
    if isinstance(value, list):
        return [text for item in value for text in flattened(item)]
    return [str(value)]


@pytest.mark.regression("issue 24: the default staging root is shared by every job of the user; recover did not "
                        "say which job a copy belongs to")
def test_recover_says_which_job_kept_each_copy(small_tmpfs: Path, tmp_path: Path, stage_root: Path) -> None:
    kept = failed_commit(small_tmpfs / "checkpoint-3", stage_root, tmp_path, script="train_job_42.py")
    env = user_env(tmp_path)

    text = cli("recover", str(stage_root), "--dry-run", env=env)
    as_json = cli("recover", str(stage_root), "--dry-run", "--json", env=env)

    assert text.returncode in (0, 1) and as_json.returncode in (0, 1), text.stderr + as_json.stderr
    shown = without_copy_names(text.stdout, kept)
    assert "train_job_42.py" in shown, text.stdout
    assert word(shown, str(kept.pid)) and word(shown, HOST), text.stdout
    (entry,) = json.loads(as_json.stdout)["entries"]
    facts = without_copy_names("\n".join(flattened({k: v for k, v in entry.items() if k != "local"})), kept)
    assert "train_job_42.py" in facts, entry
    assert word(facts, str(kept.pid)) and word(facts, HOST), entry


@pytest.mark.regression("issue 24: recover acted on every copy of the shared staging root; let the user act on one destination")
def test_recover_dest_acts_only_on_the_copies_for_that_destination_or_under_it(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    (small_tmpfs / "run-a").mkdir()
    (small_tmpfs / "run-b").mkdir()
    mine = failed_commit(small_tmpfs / "run-a" / "checkpoint-1", stage_root, tmp_path, script="job_a.py")
    theirs = failed_commit(small_tmpfs / "run-b" / "checkpoint-1", stage_root, tmp_path, script="job_b.py")
    remount(small_tmpfs, "16m")
    before_theirs = tree(theirs.save_dir)

    result = cli("recover", str(stage_root), "--dest", str(small_tmpfs / "run-a"), env=user_env(tmp_path))

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"committed  {mine.local} -> {small_tmpfs / 'run-a' / 'checkpoint-1'}"), result.stdout
    assert str(theirs.local) not in result.stdout, "a copy for another destination was listed"
    assert not mine.save_dir.exists() and tree(theirs.save_dir) == before_theirs
    dest = small_tmpfs / "run-a" / "checkpoint-1"
    assert safestage.verify(dest, deep=True).complete
    assert (dest / "model.bin").read_bytes() == bytes(range(256)) * ((3 << 20) // 256)
    assert not safestage.verify(small_tmpfs / "run-b" / "checkpoint-1").complete

    exact = cli("recover", str(stage_root), "--dest", str(small_tmpfs / "run-b" / "checkpoint-1"), env=user_env(tmp_path))

    assert exact.returncode == 0 and exact.stdout.startswith(f"committed  {theirs.local}"), exact.stdout + exact.stderr
    assert safestage.verify(small_tmpfs / "run-b" / "checkpoint-1", deep=True).complete


# -- a failed single-file publish points to recover ------------------------------------------------

# A training script's background save_file onto a 2 MiB tmpfs: the publish fails with a real
# ENOSPC on safestage's thread; the block's end raises it. Prints the error's message.
_BACKGROUND_SAVE = """\
import sys
import torch
from safetensors.torch import save_file
import safestage
dest, root = sys.argv[1], sys.argv[2]
try:
    with safestage.staged(root, background=True):
        save_file({"weight": torch.ones(768 * 1024)}, dest)  # 3 MiB
except safestage.PublishError as exc:
    print(exc)
"""


@pytest.mark.regression("issue 30 item 14: a failed single-file background publish said to copy the kept copy "
                        "there by hand")
def test_a_failed_background_save_file_gives_the_recover_command_that_publishes_its_copy(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    dest = small_tmpfs / "model.safetensors"
    script = tmp_path / "train.py"
    script.write_text(_BACKGROUND_SAVE)
    run = subprocess.run([sys.executable, str(script), str(dest), str(stage_root)], env=user_env(tmp_path),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    message = run.stdout
    assert "No space left on device" in message, run.stdout + run.stderr  # the fault fired
    assert "copy it there yourself" not in message and "by hand" not in message, message
    command = re.search(r"`(safestage recover [^`]*)`", message)
    assert command is not None, message
    assert command[1] == f"safestage recover {stage_root} --dest {dest}", command[1]

    remount(small_tmpfs, "16m")
    result = cli(*command[1].split()[1:], env=user_env(tmp_path))

    assert result.returncode == 0, result.stdout + result.stderr
    assert os.listdir(small_tmpfs) == ["model.safetensors"]
    assert torch.equal(load_file(str(dest))["weight"], torch.ones(768 * 1024))
    assert os.listdir(stage_root) == [], "recover left the copy"
