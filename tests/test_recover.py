"""`safestage recover` and ``safestage.recover()``: a commit killed after its block returned,
or failed, is finished from its kept copy; what cannot be done right is refused, untouched.

Kept copies here are made the way users get them: a real child process committing with
``staged_dir`` onto a real slow FUSE mount, SIGKILLed mid-publish; a real commit onto a real
2 MiB tmpfs failing with ENOSPC. Nothing is written into a save directory by hand.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_crash_child import generation

import safestage
from safestage import COMMIT_NAME
from safestage._names import KEPT_RECORD, parse_stage_dir, parse_temp_name
from safestage.testing import hostile_mount

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
CHILD = TESTS / "ckpt_crash_child.py"
MBPS = 0.5  # generation(seed) is ~0.35 MB: ~0.7 s of publishing, a wide window to kill in


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)])
    return env


def recover_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "safestage", "recover", *args],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def paced_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The kit's slow mode (replace) and mountpoint mode (direct), paced slower than the
    session's: a commit is mid-publish for long enough to be killed there."""
    from contextlib import ExitStack

    from safestage.testing import fuse_available

    ok, reason = fuse_available()
    if not ok:
        pytest.fail(f"FUSE is required for this test and is unavailable: {reason}", pytrace=False)
    base = tmp_path_factory.mktemp("paced")
    with ExitStack() as stack:
        mounts = {
            mode: Path(stack.enter_context(hostile_mount(mode, base / mode, mbps=MBPS)).path)
            for mode in ("slow", "mountpoint")
        }
        # ~3.5 s per commit: still committing once a `safestage recover` process has looked
        mounts["crawl"] = Path(stack.enter_context(hostile_mount("slow", base / "crawl", mbps=MBPS / 5)).path)
        yield mounts


def save_dirs(root: Path) -> list[Path]:
    return sorted(root / name for name in os.listdir(root) if parse_stage_dir(name) is not None)


def record_of(save_dir: Path) -> dict[str, Any]:
    return json.loads((save_dir / KEPT_RECORD).read_bytes())


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every entry below ``path``: (size, mtime_ns): what "touched nothing" compares."""
    found = {}
    for directory, names, files in os.walk(path):
        for name in names + files:
            info = os.lstat(os.path.join(directory, name))
            found[os.path.relpath(os.path.join(directory, name), path)] = (info.st_size, info.st_mtime_ns)
    return found


def assert_recovered(dest: Path, expected: dict[str, bytes], root: Path) -> None:
    """What a user checks after recover: complete, the bytes the job wrote, no temp file left
    at the destination, the commit file's digests those of the bytes, the copy gone."""
    result = safestage.verify(dest, deep=True)
    assert result.complete and result.extra == [], result
    found = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert found == sorted([*expected, COMMIT_NAME]), found  # no temp file, nothing else
    for relative, data in expected.items():
        assert (dest / relative).read_bytes() == data, relative
    document = json.loads((dest / COMMIT_NAME).read_bytes())
    assert {e["path"]: e["digest"] for e in document["files"]} == {
        path: f"{zlib.crc32(data):08x}" for path, data in expected.items()
    }
    assert save_dirs(root) == [], "the recovered copy was not removed from the staging root"


def start_commit(dest: Path, root: Path, seed: int) -> subprocess.Popen[bytes]:
    """A child committing generation ``seed`` to ``dest`` (tests/ckpt_crash_child.py)."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(os.getpid()), str(dest), str(root), str(seed), "auto"],
        env=child_env(), stdout=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None
    ready = json.loads(child.stdout.readline())
    assert ready == {"ready": child.pid}
    os.kill(child.pid, signal.SIGUSR1)
    return child


def wait_mid_publish(child: subprocess.Popen[bytes], dest: Path, root: Path) -> Path:
    """Until the child's commit has started (its record is written) and is copying a file
    into a temp at the destination; returns its save directory."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert child.poll() is None, "the commit finished before it could be caught mid-publish"
        for save_dir in save_dirs(root):
            if (save_dir / KEPT_RECORD).exists() and dest.is_dir() and _in_flight(dest):
                return save_dir
        time.sleep(0.005)
    raise AssertionError("the child never started publishing")


def _in_flight(dest: Path) -> list[str]:
    """What checkpoint files being published left at the top of ``dest``: their temp files
    (``replace``: ``.<file>.safestage-<host>-<pid>-<token>.tmp``, not the rename probes) or
    the files themselves (``direct``)."""
    files = {name for name in generation(0) if "/" not in name}
    return [
        name for name in os.listdir(dest)
        if name in files or (parse_temp_name(name) is not None
                             and any(name.startswith(f".{file}.safestage-") for file in files))
    ]  # fmt: skip


def killed_mid_publish(dest: Path, root: Path, seed: int) -> Path:
    """A kept copy as a preempted job leaves it: SIGKILLed mid-publish, after its block."""
    child = start_commit(dest, root, seed)
    try:
        save_dir = wait_mid_publish(child, dest, root)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert not safestage.verify(dest).complete
    return save_dir


FAILING_COMMIT = """
import json, sys, safestage
from ckpt_crash_child import generation
dest, root, seed, shard = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    with safestage.staged_dir(dest, root) as local:
        for relative, data in generation(seed, shard).items():
            (local / relative).parent.mkdir(parents=True, exist_ok=True)
            (local / relative).write_bytes(data)
except safestage.PublishError as exc:
    print(json.dumps({"kept": exc.staged_path, "errno": exc.errno}))
else:
    print(json.dumps({"kept": None}))
"""


def failed_commit(dest: Path, root: Path, seed: int, shard: int = 1 << 20) -> Path:
    """A kept copy of a commit that failed in a process that has exited since."""
    child = subprocess.run(
        [sys.executable, "-c", FAILING_COMMIT, str(dest), str(root), str(seed), str(shard)],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert report["kept"] is not None, "the commit did not fail"
    return Path(report["kept"])


def remount(target: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(target)], check=True)


# -- recover commits -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.regression("issue 20 (Recover): a job killed after its block returned leaves a complete local copy")
@pytest.mark.parametrize("mode", ["slow", "mountpoint"])  # replace, direct
def test_a_commit_killed_mid_publish_is_committed_by_recover(paced_mounts, mode, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    dest = paced_mounts[mode] / f"t-{uuid.uuid4().hex[:10]}" / "checkpoint-3"
    dest.parent.mkdir()
    save_dir = killed_mid_publish(dest, root, seed=3)
    record = record_of(save_dir)
    assert record["destination"] == str(dest) and record["kind"] == "directory"
    assert sorted(record["left"]) == sorted(generation(3)) and record["landed"] == []
    assert _in_flight(dest), "the kill did not leave a publish half-done at the destination"

    result = recover_cli(str(root))

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"committed  {save_dir / 'checkpoint-3'} -> {dest}: committed 7 files")
    assert_recovered(dest, generation(3), root)
    assert recover_cli(str(root)).stdout.strip().startswith("no kept copy")  # idempotent


@pytest.mark.slow
@pytest.mark.regression("issue 20 (Recover): a failed commit keeps its copy; recover finishes it once the destination works")
def test_a_failed_commit_is_committed_once_the_destination_has_room(small_tmpfs, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "checkpoint-5"
    local = failed_commit(dest, root, seed=5)  # 3.5 MB onto 2 MiB: ENOSPC
    first = record_of(local.parent)
    assert first["error"] and "No space left" in first["error"], first
    assert first["left"], first

    still_full = safestage.recover(root)  # the destination is as full as it was

    assert [r.action for r in still_full] == ["failed"], still_full
    assert still_full[0].error is not None and still_full[0].error.errno == 28
    assert local.is_dir() and save_dirs(root) == [local.parent], "a failing recover lost the copy"
    again = record_of(local.parent)
    assert again["time"] > first["time"] and "No space left" in again["error"], "the record was not rewritten"
    assert not safestage.verify(dest).complete

    remount(small_tmpfs, "16m")
    result = recover_cli(str(root))

    assert result.returncode == 0, result.stdout + result.stderr
    assert_recovered(dest, generation(5, 1 << 20), root)


# -- recover refuses, touching nothing ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.regression("issue 20 (Recover): a newer save of the same name must not be replaced by an older one")
def test_recover_refuses_a_copy_older_than_the_complete_checkpoint_at_its_destination(small_tmpfs, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "checkpoint-7"
    local = failed_commit(dest, root, seed=7)
    remount(small_tmpfs, "16m")
    newer = generation(8)
    with safestage.staged_dir(dest, tmp_path / "root") as fresh:  # the job's next save of it
        for relative, data in newer.items():
            (fresh / relative).parent.mkdir(parents=True, exist_ok=True)
            (fresh / relative).write_bytes(data)
    before_dest, before_copy = tree(dest), tree(local.parent)

    result = recover_cli(str(root))

    assert result.returncode == 1, result.stdout + result.stderr
    line = result.stdout.splitlines()[0]
    assert line.startswith(f"refused  {local} -> {dest}: {dest} holds a complete checkpoint committed"), line
    assert "newer save of it would be replaced by an older one" in line and "Nothing was touched" in line
    assert tree(dest) == before_dest and tree(local.parent) == before_copy
    assert all((dest / relative).read_bytes() == data for relative, data in newer.items())
    assert safestage.verify(dest, deep=True).complete


@pytest.mark.slow
@pytest.mark.regression("issue 20 (Recover): never create parents on a mount point that is not mounted")
def test_recover_refuses_a_destination_whose_parent_is_gone_and_creates_nothing(small_tmpfs, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (small_tmpfs / "run").mkdir()
    dest = small_tmpfs / "run" / "checkpoint-9"
    local = failed_commit(dest, root, seed=9)
    subprocess.run(["umount", str(small_tmpfs)], check=True)  # the mount went away
    assert os.listdir(small_tmpfs) == []
    before = tree(local.parent)

    results = safestage.recover(root)

    assert [(r.action, r.destination) for r in results] == [("refused", dest)], results
    assert "parent directory of" in results[0].reason and "never creates it" in results[0].reason
    assert os.listdir(small_tmpfs) == [], "recover created the destination's parents on the local disk"
    assert tree(local.parent) == before
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small_tmpfs)], check=True)


@pytest.mark.slow
@pytest.mark.regression("issue 20 (Recover): a copy is committed only as it was saved")
def test_recover_refuses_a_copy_whose_files_differ_from_its_record(small_tmpfs, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "checkpoint-11"
    local = failed_commit(dest, root, seed=11)
    remount(small_tmpfs, "16m")
    (local / "config.json").unlink()  # a user tidying up, a tmp cleaner
    before_dest = tree(dest)

    results = safestage.recover(root)

    assert [r.action for r in results] == ["refused"], results
    assert "1 missing (config.json)" in results[0].reason and "re-run the save" in results[0].reason
    assert tree(dest) == before_dest and local.is_dir()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"part": {"of": "collective", "rank": 1, "world_size": 4}},
         "rank 1 of 4's part of a collective commit: no staging root holds the whole checkpoint"),
        ({"version": 3}, "written by a newer safestage (version 3"),
    ],
)
def test_recover_refuses_one_rank_of_a_distributed_commit_and_a_newer_record(small_tmpfs, tmp_path, fields, why):
    """The record as a distributed commit (issue 19) or a newer safestage writes it."""
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "checkpoint-19"
    local = failed_commit(dest, root, seed=19)
    remount(small_tmpfs, "16m")
    record = {**record_of(local.parent), **fields}
    (local.parent / KEPT_RECORD).write_text(json.dumps(record))
    before_root, before_dest = tree(root), tree(dest)

    result = recover_cli(str(root))

    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith(f"refused  {local} -> {dest}: ") and why in result.stdout, result.stdout
    assert tree(root) == before_root and tree(dest) == before_dest


@pytest.mark.slow
@pytest.mark.regression("issue 30 item 7: `recover ROOT --dest RUN` printed 'no kept copy' and exited 0 when RUN's "
                        "only copy had a record of a newer version; a plain recover refused it and exited 1")
def test_recover_dest_refuses_a_copy_whose_record_it_cannot_read_as_a_plain_recover_does(small_tmpfs, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "run" / "checkpoint-30"
    dest.parent.mkdir()
    local = failed_commit(dest, root, seed=30)
    remount(small_tmpfs, "16m")
    (local.parent / KEPT_RECORD).write_text(json.dumps({**record_of(local.parent), "version": 3}))
    before_root, before_dest = tree(root), tree(dest)

    for dest_argument in (dest.parent, dest):
        result = recover_cli(str(root), "--dest", str(dest_argument))

        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stdout.startswith(f"refused  {local} -> {dest}: "), result.stdout
        assert "written by a newer safestage (version 3" in result.stdout, result.stdout
        assert "no kept copy" not in result.stdout
    assert recover_cli(str(root), "--dest", str(small_tmpfs / "elsewhere")).returncode == 0  # not this one's
    assert tree(root) == before_root and tree(dest) == before_dest


@pytest.mark.slow
def test_a_copy_a_live_process_is_committing_is_not_touched(paced_mounts, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    dest = paced_mounts["crawl"] / f"t-{uuid.uuid4().hex[:10]}" / "checkpoint-13"
    dest.parent.mkdir()
    child = start_commit(dest, root, seed=13)
    try:
        save_dir = wait_mid_publish(child, dest, root)
        result = recover_cli(str(root))
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith(f"in-use  {save_dir / 'checkpoint-13'} -> {dest}: not touched"), result.stdout
        assert child.wait(60) == 0
    finally:
        child.kill()
        child.wait(30)
    assert_recovered(dest, generation(13), root)  # the live commit finished, undisturbed


@pytest.mark.slow
def test_dry_run_says_what_it_would_do_and_touches_nothing(small_tmpfs, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "checkpoint-15"
    local = failed_commit(dest, root, seed=15)
    remount(small_tmpfs, "16m")
    before_root, before_dest = tree(root), tree(dest)

    result = recover_cli(str(root), "--dry-run")

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"would-commit  {local} -> {dest}: would commit 7 files"), result.stdout
    assert tree(root) == before_root and tree(dest) == before_dest
    assert json.loads(recover_cli(str(root), "--dry-run", "--json").stdout)["would_commit"] == 1


def test_recover_of_a_root_that_cannot_be_read_exits_3(tmp_path):
    result = recover_cli(str(tmp_path / "missing"))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "does not exist" in result.stderr


# -- the next activation names them, and does nothing else ------------------------------------


@pytest.mark.slow
def test_the_next_activation_warns_once_and_publishes_nothing(small_tmpfs, tmp_path, caplog):
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "checkpoint-17"
    local = failed_commit(dest, root, seed=17)
    remount(small_tmpfs, "16m")
    before_dest = tree(dest)

    with caplog.at_level(logging.WARNING, logger="safestage"):
        with safestage.staged(root):
            pass
        with safestage.staged(root):  # the same process and root: checked once
            pass

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"safestage recover {root}" in warnings[0] and str(dest) in warnings[0], warnings[0]
    assert tree(dest) == before_dest and local.is_dir(), "the activation touched the kept copy"
