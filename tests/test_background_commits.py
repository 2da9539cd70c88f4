"""staged_dir(background=True): the block returns, training goes on, the commit lands later;
its handle waits for it; at most one is in flight; a failure is raised at wait(), at the next
staged_dir and at exit; a job killed while its background commit runs is finished by recover.

The destinations are real: a kit mount paced slow enough for a commit to be seen in flight, a
real 2 MiB tmpfs for a real ENOSPC."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import safestage
from safestage import COMMIT_NAME, PublishError
from safestage._names import KEPT_RECORD
from safestage.testing import hostile_mount

REPO = Path(__file__).resolve().parent.parent
MBPS = 4.0  # 2 MiB: about half a second in flight


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The kit's slow mode paced at MBPS: a commit stays in flight long enough to look at."""
    base = tmp_path_factory.mktemp("paced")
    with hostile_mount("slow", base / "slow", mbps=MBPS) as mount:
        yield Path(mount.path)


@pytest.fixture
def run_dir(paced: Path) -> Path:
    directory = paced / f"run-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    return directory


def _write(local: Path, seed: int, size: int = 2 << 20) -> bytes:
    data = seed.to_bytes(4, "little") * (size // 4)
    (local / "shard.bin").write_bytes(data)
    (local / "state.json").write_text(json.dumps({"step": seed}))
    return data


def _save_dirs(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("safestage-"))


@pytest.mark.mounts
def test_a_background_commit_returns_at_the_end_of_the_block_and_is_complete_only_once_landed(run_dir: Path, tmp_path: Path) -> None:
    with safestage.staged_dir(run_dir / "checkpoint-1", tmp_path) as local:
        _write(local, 1)
    handle = safestage.staged_dir(run_dir / "checkpoint-2", tmp_path, background=True)
    started = time.monotonic()
    with handle as local:
        data = _write(local, 2)
    returned = time.monotonic() - started
    assert not handle.done()  # still publishing: training goes on meanwhile
    assert safestage.latest_complete(run_dir) == run_dir / "checkpoint-1"  # not durable yet
    manifest = handle.wait()
    assert handle.done() and time.monotonic() - started > returned
    assert sorted(entry.path for entry in manifest.files) == ["shard.bin", "state.json"]
    assert safestage.verify(run_dir / "checkpoint-2", deep=True).complete
    assert safestage.latest_complete(run_dir) == run_dir / "checkpoint-2"
    assert (run_dir / "checkpoint-2" / "shard.bin").read_bytes() == data
    assert _save_dirs(tmp_path) == []  # the local copy went once the commit landed


@pytest.mark.mounts
def test_the_next_checkpoint_waits_before_its_block_for_the_commit_in_flight(run_dir: Path, tmp_path: Path) -> None:
    first = safestage.staged_dir(run_dir / "checkpoint-1", tmp_path, background=True)
    with first as local:
        _write(local, 1)
    assert not first.done()
    with safestage.staged_dir(run_dir / "checkpoint-2", tmp_path, background=True) as local:
        # One in flight: by the time this block runs, the first has landed, and only this
        # checkpoint's local copy exists.
        assert first.done() and safestage.verify(run_dir / "checkpoint-1").complete
        assert len(_save_dirs(tmp_path)) == 1
        _write(local, 2)
    safestage.wait()  # every background publish and commit of the process
    assert safestage.verify(run_dir / "checkpoint-2").complete


def test_a_failed_background_commit_is_raised_by_wait_and_by_the_next_staged_dir(small_tmpfs: Path, tmp_path: Path) -> None:
    """The next staged_dir raises a failure that happened by then (a background next one
    first waits for the commit in flight, so it always sees it)."""
    handle = safestage.staged_dir(small_tmpfs / "checkpoint-1", tmp_path, background=True)
    with handle as local:
        _write(local, 1, size=3 << 20)  # more than the 2 MiB tmpfs holds
    while not handle.done():
        time.sleep(0.01)
    with pytest.raises(PublishError) as raised, safestage.staged_dir(small_tmpfs / "checkpoint-2", tmp_path) as local:
        pytest.fail("the block ran although the previous commit had failed")
    assert raised.value.errno == 28
    with pytest.raises(PublishError) as again:
        handle.wait()
    assert again.value is raised.value  # wait() raises it every time, the same error
    assert not (small_tmpfs / "checkpoint-1" / COMMIT_NAME).exists()
    kept = Path(raised.value.staged_path)  # type: ignore[arg-type]
    record = json.loads((kept.parent / KEPT_RECORD).read_text())
    assert record["destination"] == str(small_tmpfs / "checkpoint-1") and "shard.bin" in record["left"]


_UNWAITED = """
import sys, safestage
with safestage.staged_dir(sys.argv[1], sys.argv[2], background=True) as local:
    (local / "shard.bin").write_bytes(b"x" * (3 << 20))
print("block returned", flush=True)
"""


def test_a_failed_background_commit_nobody_waited_for_fails_the_process_at_exit(small_tmpfs: Path, tmp_path: Path) -> None:
    dest = small_tmpfs / "checkpoint-1"
    child = subprocess.run(
        [sys.executable, "-c", _UNWAITED, str(dest), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.stdout.strip() == "block returned"
    assert child.returncode == 1, child.stderr  # a lost checkpoint never looks successful
    assert f"background commit of {dest} failed" in child.stderr and "ENOSPC" in child.stderr


_PREEMPTED = """
import sys, safestage
with safestage.staged_dir(sys.argv[1], sys.argv[2], background=True) as local:
    (local / "shard.bin").write_bytes(bytes(range(256)) * (8 << 10))
    (local / "state.json").write_text('{"step": 7}')
print("block returned", flush=True)
sys.stdin.read()  # training goes on until the test SIGKILLs it
"""


@pytest.mark.mounts
@pytest.mark.slow
def test_a_job_killed_during_its_background_commit_is_finished_by_recover(run_dir: Path, tmp_path: Path) -> None:
    dest = run_dir / "checkpoint-7"
    env = {key: value for key, value in os.environ.items() if not key.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(REPO)
    child = subprocess.Popen(
        [sys.executable, "-c", _PREEMPTED, str(dest), str(tmp_path)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "block returned"
        deadline = time.monotonic() + 30
        while not (dest.exists() and os.listdir(dest)):  # the publish has started there
            assert time.monotonic() < deadline, "the background commit never started publishing"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)  # preempted mid-publish; the node survives
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert not safestage.verify(dest).complete and safestage.latest_complete(run_dir) is None

    recovered = subprocess.run(
        [sys.executable, "-m", "safestage", "recover", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    assert recovered.stdout.startswith("committed")
    assert safestage.verify(dest, deep=True).complete and safestage.latest_complete(run_dir) == dest
    assert (dest / "shard.bin").read_bytes() == bytes(range(256)) * (8 << 10)
    assert sorted(os.listdir(dest)) == sorted(["shard.bin", "state.json", COMMIT_NAME])  # no temp left
    assert _save_dirs(tmp_path) == []
