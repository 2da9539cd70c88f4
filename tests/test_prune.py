"""Retention that waits for durability: ``safestage.prune``, ``staged_dir(keep=N)`` and
`safestage prune` remove only what is superseded by a complete checkpoint, never a save in
progress (Megatron-Bridge#5184), never a checkpoint a live commit holds. Real filesystems, real
commits on throttled FUSE mounts, real processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

import safestage
from safestage import COMMIT_NAME, ConfigError, _work
from safestage import cli as _cli
from safestage._names import KEPT_RECORD, parse_stage_dir, parse_temp_name
from safestage.checkpoint import _prune
from safestage.testing import hostile_mount

NOBODY = 65534
BIG = 32 << 20  # 32 MiB: about 1.6 s to publish at 20 MB/s


@pytest.fixture(scope="module")
def slow_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """20 MB/s: a commit of BIG bytes is still publishing for over a second."""
    with hostile_mount("slow", tmp_path_factory.mktemp("slow20") / "mnt", mbps=20) as mount:
        yield mount


@pytest.fixture
def slow_run(slow_mount: Any) -> Path:
    run = Path(slow_mount.path) / f"run-{uuid.uuid4().hex[:8]}"
    run.mkdir()
    return run


def commit(dest: Path, root: Path, data: bytes = b"weights", **options: Any) -> Path:
    with safestage.staged_dir(dest, root, **options) as local:
        (local / "model.bin").write_bytes(data)
        (local / "state").mkdir()
        (local / "state" / "optimizer.pt").write_bytes(data[::-1])
    return dest


def leftover(dest: Path, *, committed: bool = False) -> Path:
    """What a killed plain save or a failed commit leaves: files and no (valid) commit file."""
    dest.mkdir()
    (dest / "model.bin").write_bytes(b"half")
    if committed:  # a commit file whose files are not all there (torn: a size mismatch)
        (dest / COMMIT_NAME).write_text("{}")
    return dest


def names(parent: Path) -> list[str]:
    return sorted(os.listdir(parent))


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def publishing(dest: Path) -> bool:
    """A commit of ``dest`` is copying a file there now: its hidden temp file exists."""
    try:
        return any(parse_temp_name(name) is not None for name in os.listdir(dest))
    except FileNotFoundError:
        return False


# -- the Megatron-Bridge#5184 sequence ----------------------------------------------------------------


@pytest.mark.regression("Megatron-Bridge#5184: cleanup deleted the checkpoint that had just finished, "
                        "because a newer one still being written looked newest")
def test_a_pending_commit_of_a_newer_checkpoint_never_makes_the_last_complete_one_go(
    slow_run: Path, stage_root: Path
) -> None:
    """Commit 1, commit 2, start a commit of 3 (on a 20 MB/s mount, another thread); prune with
    keep=1 while 3 is publishing: 1 goes, 2 survives, 3 is untouched and lands complete; once
    it has, a prune removes 2."""
    commit(slow_run / "checkpoint-1", stage_root)
    commit(slow_run / "checkpoint-2", stage_root)
    third = slow_run / "checkpoint-3"
    errors: list[BaseException] = []

    def commit_third() -> None:
        try:
            commit(third, stage_root, b"3" * BIG)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=commit_third)
    thread.start()
    try:
        wait_for(lambda: publishing(third), "the commit of checkpoint-3 to publish")
        before = names(third)
        removed = safestage.prune(slow_run, keep=1)
        assert not (third / COMMIT_NAME).exists(), "3 landed during the prune: the test proved nothing"
        assert removed == [slow_run / "checkpoint-1"]
        assert names(slow_run) == ["checkpoint-2", "checkpoint-3"]
        assert safestage.verify(slow_run / "checkpoint-2").complete
        landed = {name for name in before if parse_temp_name(name) is None}  # a temp may land meanwhile
        assert landed <= set(names(third)), "the prune touched the checkpoint being committed"
    finally:
        thread.join(timeout=120)
    assert not errors, errors
    assert safestage.verify(third, deep=True).complete
    assert safestage.prune(slow_run, keep=1) == [slow_run / "checkpoint-2"]
    assert names(slow_run) == ["checkpoint-3"]
    assert safestage.latest_complete(slow_run) == third


# -- what goes and what stays -------------------------------------------------------------------------


def test_complete_checkpoints_beyond_keep_go_oldest_first(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (5, 10, 15, 20, 25):
        commit(run / f"checkpoint-{step}", stage_root)
    assert safestage.prune(run, keep=2) == [run / f"checkpoint-{step}" for step in (5, 10, 15)]
    assert names(run) == ["checkpoint-20", "checkpoint-25"]
    assert safestage.prune(run, keep=2) == []  # nothing more to do
    assert safestage.latest_complete(run) == run / "checkpoint-25"


def test_the_order_is_latest_completes_step_numbers_not_names(tmp_path: Path, stage_root: Path) -> None:
    """checkpoint-900 is older than checkpoint-1000 though it sorts after it as text."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (900, 1000, 1100):  # in step order: a lower step committed later is a rollback
        commit(run / f"checkpoint-{step}", stage_root)
    assert safestage.prune(run, keep=2) == [run / "checkpoint-900"]


def test_an_old_incomplete_checkpoint_goes_a_newer_one_stays(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    commit(run / "checkpoint-1", stage_root)
    leftover(run / "checkpoint-2")  # never committed: a killed plain save
    leftover(run / "checkpoint-3", committed=True)  # a commit file that vouches for nothing
    commit(run / "checkpoint-4", stage_root)
    newer = leftover(run / "checkpoint-5")  # a save in progress, as far as anyone can tell
    newer_files = tree(newer)
    assert safestage.prune(run, keep=5) == [run / "checkpoint-2", run / "checkpoint-3"]
    assert names(run) == ["checkpoint-1", "checkpoint-4", "checkpoint-5"]
    assert tree(newer) == newer_files


def test_nothing_goes_while_no_checkpoint_is_complete(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2, 3):
        leftover(run / f"checkpoint-{step}")
    assert safestage.prune(run, keep=1) == []
    assert names(run) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_names_without_a_step_symlinks_files_and_other_patterns_are_never_removed(
    tmp_path: Path, stage_root: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    elsewhere = commit(tmp_path / "checkpoint-0", stage_root)  # outside the run, linked in
    (run / "checkpoint-1").symlink_to(elsewhere)
    commit(run / "checkpoint-best", stage_root)  # hand-made: no step number
    commit(run / "step-3", stage_root)  # another pattern
    (run / "checkpoint-2.log").write_text("a file matching the pattern")
    commit(run / "checkpoint-4", stage_root)
    commit(run / "checkpoint-5", stage_root)
    assert safestage.prune(run, keep=1) == [run / "checkpoint-4"]
    assert names(run) == ["checkpoint-1", "checkpoint-2.log", "checkpoint-5", "checkpoint-best", "step-3"]
    assert safestage.verify(elsewhere).complete


@pytest.mark.regression("issue 30 item 11: checkpoint-9 -> checkpoint-1 counted as the newest complete checkpoint, "
                        "latest named it, and prune --keep 1 then removed its target")
def test_a_symlinked_candidate_is_never_counted_named_or_removed_and_its_target_is_judged_by_its_own_name(
    tmp_path: Path, stage_root: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    commit(run / "checkpoint-1", stage_root)
    commit(run / "checkpoint-2", stage_root)
    (run / "checkpoint-9").symlink_to("checkpoint-1")
    (run / "checkpoint-8").symlink_to(run / "checkpoint-2")  # absolute, to the newest itself

    assert safestage.latest_complete(run) == run / "checkpoint-2"
    assert _cli.main(["latest", str(run)]) == 0
    assert safestage.prune(run, keep=1, dry_run=True) == [run / "checkpoint-1"]
    assert subprocess.run([sys.executable, "-m", "safestage", "prune", str(run), "--keep", "1"],
                          capture_output=True, text=True).returncode == 0  # fmt: skip
    assert names(run) == ["checkpoint-2", "checkpoint-8", "checkpoint-9"]
    assert safestage.verify(run / "checkpoint-2").complete
    # keep=2 counts checkpoint-2 and checkpoint-3, never checkpoint-8 (a second name of 2).
    with safestage.staged_dir(run / "checkpoint-3", stage_root, keep=2) as local:
        (local / "model.bin").write_bytes(b"3")
    assert names(run) == ["checkpoint-2", "checkpoint-3", "checkpoint-8", "checkpoint-9"]
    assert safestage.latest_complete(run) == run / "checkpoint-3"


def test_dry_run_removes_nothing_and_names_what_would_go(tmp_path: Path, stage_root: Path, caplog: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2, 3):
        commit(run / f"checkpoint-{step}", stage_root)
    leftover(run / "checkpoint-0")
    before = {name: tree(run / name) for name in names(run)}
    with caplog.at_level(logging.INFO, logger="safestage"):
        would = safestage.prune(run, keep=1, dry_run=True)
    assert would == [run / "checkpoint-0", run / "checkpoint-1", run / "checkpoint-2"]
    assert {name: tree(run / name) for name in names(run)} == before
    assert all((run / f"checkpoint-{step}" / COMMIT_NAME).exists() for step in (1, 2, 3))
    assert [r.getMessage() for r in caplog.records if "would remove" in r.getMessage()] == [
        f"safestage.prune: would remove {path} ({why})"
        for path, why in zip(would, ["not complete, and older than the newest complete checkpoint checkpoint-3"]
                             + ["complete, older than the newest complete one, checkpoint-3"] * 2)
    ]
    assert safestage.prune(run, keep=1) == would


def test_each_removal_is_logged_at_info_naming_the_checkpoint(tmp_path: Path, stage_root: Path, caplog: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2, 3):
        commit(run / f"checkpoint-{step}", stage_root)
    with caplog.at_level(logging.INFO, logger="safestage"):
        safestage.prune(run, keep=2)
    removals = [r for r in caplog.records if "removed" in r.getMessage()]
    assert len(removals) == 1 and removals[0].levelno == logging.INFO
    assert str(run / "checkpoint-1") in removals[0].getMessage()


# -- live commits ---------------------------------------------------------------------------------------

_CHILD_COMMIT = """
import sys
import safestage
dest, root, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
with safestage.staged_dir(dest, root) as local:
    (local / "model.bin").write_bytes(b"c" * size)
print("committed", flush=True)
"""


def start_child_commit(dest: Path, root: Path) -> subprocess.Popen[str]:
    """Another process committing ``dest``, returned once it is publishing there."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD_COMMIT, str(dest), str(root), str(BIG)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: publishing(dest) or child.poll() is not None, "the child's commit to publish")
    except BaseException:
        child.kill()
        child.wait()
        raise
    assert child.poll() is None, "the child ended before it published"
    return child


def test_a_checkpoint_another_live_process_is_committing_is_untouched_and_a_warning_says_why(
    slow_run: Path, stage_root: Path, caplog: Any
) -> None:
    """A re-commit of the older checkpoint-1 in another process (running, holding its staging
    directory) while checkpoint-2 is complete: checkpoint-1 is incomplete meanwhile and older
    than the newest complete one, and stays, through the API and the CLI; a WARNING names it
    and why (keep= sparing a checkpoint never does so silently)."""
    commit(slow_run / "checkpoint-1", stage_root)
    commit(slow_run / "checkpoint-2", stage_root)
    older = slow_run / "checkpoint-1"
    child = start_child_commit(older, stage_root)
    try:
        assert not safestage.verify(older).complete  # its commit file went first
        with caplog.at_level(logging.WARNING, logger="safestage"):
            assert safestage.prune(slow_run, keep=5, root=stage_root) == []
        assert any(str(older) in r.getMessage() and "is committing it" in r.getMessage()
                   and r.levelno == logging.WARNING for r in caplog.records), caplog.text  # fmt: skip
        assert _cli.main(["prune", str(slow_run), "--keep", "1", "--dir", str(stage_root)]) == 0
        assert child.poll() is None, "the child finished during the prune: the test proved nothing"
        assert older.is_dir()
    finally:
        out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out == "committed\n"
    assert safestage.verify(older, deep=True).complete
    assert (older / "model.bin").read_bytes() == b"c" * BIG


def test_a_commit_in_flight_in_this_process_is_busy_and_untouched(slow_run: Path, tmp_path: Path) -> None:
    """The same from another thread of this process, its staging root one prune is not told of."""
    root = tmp_path / "own-root"
    root.mkdir()
    commit(slow_run / "checkpoint-1", root)
    commit(slow_run / "checkpoint-2", root)
    older = slow_run / "checkpoint-1"
    thread = threading.Thread(target=commit, args=(older, root, b"t" * BIG))
    thread.start()
    try:
        wait_for(lambda: publishing(older), "the re-commit of checkpoint-1 to publish")
        assert older in _work.busy()
        assert safestage.prune(slow_run, keep=5) == []
        assert not (older / COMMIT_NAME).exists(), "it landed during the prune: the test proved nothing"
    finally:
        thread.join(timeout=120)
    assert older not in _work.busy()
    assert safestage.verify(older, deep=True).complete


def test_a_killed_commits_leftovers_go_and_its_kept_copy_still_recovers_it(slow_run: Path, stage_root: Path) -> None:
    """SIGKILLed mid-publish, a commit leaves some files at the destination and the whole
    checkpoint in its kept copy. Prune removes the leftovers as any incomplete checkpoint older
    than the newest complete one (the copy holds every file, so nothing is lost, and the answer
    does not depend on knowing the root the copy is in), and recover then commits it whole."""
    older = slow_run / "checkpoint-1"
    child = start_child_commit(older, stage_root)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    kept = [stage_root / name for name in os.listdir(stage_root) if parse_stage_dir(name)]
    assert len(kept) == 1 and json.loads((kept[0] / KEPT_RECORD).read_bytes())["destination"] == str(older)
    assert older.is_dir() and not safestage.verify(older).complete  # the kill left it half-published
    commit(slow_run / "checkpoint-2", stage_root)
    decisions = _prune.plan(slow_run, 1, "checkpoint-*", roots=_prune.known_roots(stage_root))
    assert [(d.path.name, d.action) for d in decisions] == [("checkpoint-2", "keep"), ("checkpoint-1", "remove")]
    assert safestage.prune(slow_run, keep=1) == [older]
    (result,) = safestage.recover(stage_root)
    assert result.action == "committed", result
    assert safestage.verify(older, deep=True).complete and (older / "model.bin").read_bytes() == b"c" * BIG


# -- object stores: no rename ---------------------------------------------------------------------------


@pytest.mark.parametrize("kit_dir", ["mountpoint"], indirect=True)
def test_keep_on_staged_dir_prunes_after_each_commit_on_a_mount_without_rename(
    kit_dir: Path, stage_root: Path
) -> None:
    """mountpoint-s3 semantics (rename ENOSYS): commits go direct, removals are unlink and rmdir."""
    leftover(kit_dir / "checkpoint-0")
    for step in (1, 2, 3):
        commit(kit_dir / f"checkpoint-{step}", stage_root, keep=2)
        expected = [f"checkpoint-{s}" for s in (1, 2, 3) if step - 2 < s <= step]
        assert names(kit_dir) == expected, step
    assert all(safestage.verify(kit_dir / name, deep=True).complete for name in names(kit_dir))
    assert safestage.prune(kit_dir, keep=1) == [kit_dir / "checkpoint-2"]
    assert names(kit_dir) == ["checkpoint-3"]


# -- keep= on staged_dir --------------------------------------------------------------------------------


def test_keep_takes_the_siblings_named_like_the_checkpoint(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        commit(run / f"step_{step:06d}", stage_root)
        commit(run / f"checkpoint-{step}", stage_root)
    commit(run / "step_000300", stage_root, keep=1)
    assert names(run) == ["checkpoint-100", "checkpoint-200", "step_000300"]
    commit(run / "checkpoint-300", stage_root, keep=2)
    assert names(run) == ["checkpoint-200", "checkpoint-300", "step_000300"]


def test_keep_never_removes_the_checkpoint_it_just_committed_nor_what_a_rollback_set_aside(
    tmp_path: Path, stage_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-commit of an older step (a rollback) with keep=1 stays, and is the newest: the
    checkpoints it set aside are neither counted nor removed, and named in a WARNING."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2, 3):
        commit(run / f"checkpoint-{step}", stage_root)
    with caplog.at_level(logging.WARNING, logger="safestage"):
        commit(run / "checkpoint-1", stage_root, keep=1)
    assert names(run) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert safestage.latest_complete(run) == run / "checkpoint-1"
    for step in (2, 3):
        aside = safestage.verify(run / f"checkpoint-{step}")
        assert aside.complete and aside.set_aside is not None and aside.set_aside.by == "checkpoint-1"
        assert any(f"checkpoint-{step}" in r.getMessage() and "set aside" in r.getMessage() for r in caplog.records)


@pytest.fixture
def busy_leftover(tmp_path: Path) -> Iterator[Path]:
    """An old incomplete checkpoint that cannot be removed: a tmpfs is mounted inside it
    (rmdir of a mount point: a real EBUSY)."""
    run = tmp_path / "run"
    run.mkdir()
    old = leftover(run / "checkpoint-5")
    (old / "mnt").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(old / "mnt")], check=True)
    yield run
    subprocess.run(["umount", "-l", str(old / "mnt")], check=False)


def test_a_prune_failure_after_a_landed_commit_is_a_warning_not_an_error(
    busy_leftover: Path, stage_root: Path, caplog: Any
) -> None:
    run = busy_leftover
    commit(run / "checkpoint-6", stage_root)
    with caplog.at_level(logging.WARNING, logger="safestage"):
        dest = commit(run / "checkpoint-7", stage_root, keep=1)  # no exception: it landed
    assert safestage.verify(dest, deep=True).complete
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"{dest} was committed (it is complete)" in warnings[0]
    assert str(run / "checkpoint-5") in warnings[0] and "EBUSY" in warnings[0]
    assert f"safestage prune {run} --keep 1" in warnings[0]
    # Oldest first, stopping at the failure: checkpoint-6 (newer than checkpoint-5) stays.
    assert names(run) == ["checkpoint-5", "checkpoint-6", "checkpoint-7"]
    assert not (run / "checkpoint-5" / "model.bin").exists()  # removal had begun there


def test_a_failed_removal_raises_naming_the_path_the_errno_and_what_went_before(
    busy_leftover: Path, stage_root: Path
) -> None:
    run = busy_leftover
    commit(run / "checkpoint-3", stage_root)  # removed first: the oldest
    commit(run / "checkpoint-7", stage_root)
    commit(run / "checkpoint-8", stage_root)
    with pytest.raises(OSError) as caught:
        safestage.prune(run, keep=1)
    error = caught.value
    assert error.errno == 16 and error.filename == str(run / "checkpoint-5" / "mnt")
    text = str(error)
    assert f"could not remove {run / 'checkpoint-5'}" in text and "EBUSY" in text
    assert "its commit file was removed first" not in text  # it had none
    assert f"removed before it: {run / 'checkpoint-3'}" in text and text.endswith(f": '{error.filename}'")
    assert names(run) == ["checkpoint-5", "checkpoint-7", "checkpoint-8"]


def test_bad_keep_and_pattern_are_config_errors(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for keep in (0, -1, True, 1.5, "2", None):
        with pytest.raises(ConfigError, match="keep="):
            safestage.prune(run, keep=keep)  # type: ignore[arg-type]
    for pattern in ("", "run/checkpoint-*", None):
        with pytest.raises(ConfigError, match="pattern="):
            safestage.prune(run, keep=1, pattern=pattern)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keep=0"):
        safestage.staged_dir(run / "checkpoint-1", stage_root, keep=0)
    for name in ("final", "1000", "checkpoint-10-best"):
        with pytest.raises(ConfigError, match="step number at the end"):
            safestage.staged_dir(run / name, stage_root, keep=2)  # at staged_dir(), before any write
    assert names(run) == [] and os.listdir(stage_root) == []


def test_a_derived_pattern_matches_the_name_literally(tmp_path: Path, stage_root: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    commit(run / "ckpt[a]-1", stage_root)
    commit(run / "ckpta-1", stage_root)  # what an unescaped ckpt[a]-* would also match
    commit(run / "ckpt[a]-2", stage_root, keep=1)
    assert names(run) == ["ckpt[a]-2", "ckpta-1"]


def test_a_parent_that_cannot_be_listed_raises_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="cannot list the checkpoints in"):
        safestage.prune(tmp_path / "missing", keep=1)


# -- the command ---------------------------------------------------------------------------------------


def test_the_command_prints_what_it_removes_and_what_it_would(tmp_path: Path, stage_root: Path, capsys: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2, 3):
        commit(run / f"step-{step}", stage_root)
    assert _cli.main(["prune", str(run), "--keep", "2", "--pattern", "step-*", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"would remove  {run / 'step-1'}  (complete, older than the 2 newest")
    assert out[-1] == f"1 would be removed, 2 kept (checkpoints matching 'step-*' in {run})"
    assert names(run) == ["step-1", "step-2", "step-3"]
    assert _cli.main(["prune", str(run), "--keep", "2", "--pattern", "step-*"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"removed       {run / 'step-1'}  (")
    assert names(run) == ["step-2", "step-3"]


def test_the_command_exit_statuses_for_bad_usage(tmp_path: Path, capsys: Any) -> None:
    for argv in (["prune", str(tmp_path), "--keep", "0"], ["prune", str(tmp_path), "--keep", "x"],
                 ["prune", str(tmp_path)], ["prune", str(tmp_path), "--keep", "1", "--pattern", "a/b"]):  # fmt: skip
        with pytest.raises(SystemExit) as caught:
            _cli.main(argv)
        assert caught.value.code == 2, argv
    assert _cli.main(["prune", str(tmp_path / "missing"), "--keep", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A run directory the unprivileged user `nobody` can reach (root ignores permissions)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as top:
        os.chmod(top, 0o755)
        yield Path(top)


def prune_as_nobody(parent: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import os, sys\n"
        "import tempfile, safestage.cli, safestage.checkpoint._prune  # before the drop: root's paths\n"
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        f"sys.exit(safestage.cli.main(['prune', {str(parent)!r}, '--keep', '1']))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_command_could_not_look_or_could_not_remove(run_dir: Path, stage_root: Path) -> None:
    for step in (1, 2):
        commit(run_dir / f"checkpoint-{step}", stage_root)
    for path in [run_dir, *run_dir.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chmod(run_dir, 0o311)  # nobody may enter it, not list it: EACCES on readdir
    done = prune_as_nobody(run_dir)
    assert done.returncode == 3, done
    assert done.stderr.startswith("safestage prune: could not look:") and "Permission denied" in done.stderr
    os.chmod(run_dir, 0o755)  # listable, but nobody may delete inside root's checkpoint
    done = prune_as_nobody(run_dir)
    assert done.returncode == 1, done
    assert f"could not remove {run_dir / 'checkpoint-1'}" in done.stderr and "EACCES" in done.stderr
    assert "Traceback" not in done.stderr
    assert names(run_dir) == ["checkpoint-1", "checkpoint-2"]
    assert safestage.verify(run_dir / "checkpoint-1").complete  # its commit file could not go either
