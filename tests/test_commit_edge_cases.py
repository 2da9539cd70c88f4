"""Edge cases of collective commits (staged_dir(group=...)) and background commits
(staged_dir(background=True)), found by trying to break them: each test states the promise a
user relies on.

Real parts only: kit FUSE mounts (close-eio, slow), real processes, real SIGKILL, four ranks on
two torchrun "nodes" (tests/edge_group_worker.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _kept_copies import failed_commit, remount

import safestage
from safestage import COMMIT_NAME, PublishError
from safestage.testing import hostile_mount
from tests._two_nodes import launch

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("edge_group_worker.py")


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


# -- background commits ---------------------------------------------------------------------------


@pytest.mark.mounts
@pytest.mark.regression("issue 20: background commits tried to the breaking point")
def test_wait_on_a_failed_synchronous_commit_raises_its_publish_error_not_that_the_block_raised(
    tmp_path: Path,
) -> None:
    (tmp_path / "root").mkdir()
    with hostile_mount("close-eio", tmp_path / "eio") as mount:
        handle = safestage.staged_dir(Path(mount.path) / "checkpoint-1", tmp_path / "root")
        with pytest.raises(PublishError) as failed, handle as local:
            (local / "shard.bin").write_bytes(b"x" * 4096)  # the block returns normally
        with pytest.raises(PublishError) as again:
            handle.wait()
        assert again.value is failed.value


@pytest.mark.mounts
@pytest.mark.regression("issue 20: background commits tried to the breaking point")
def test_a_background_failure_seen_through_safestage_wait_does_not_stop_the_next_checkpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with hostile_mount("close-eio", tmp_path / "eio") as mount:
        handle = safestage.staged_dir(Path(mount.path) / "checkpoint-1", root, background=True)
        with handle as local:
            (local / "shard.bin").write_bytes(b"x" * 4096)
        with pytest.raises(PublishError):
            safestage.wait()  # the job saw the failure here and goes on
    good = tmp_path / "run" / "checkpoint-2"
    good.parent.mkdir()
    with safestage.staged_dir(good, root) as local:  # raises the old PublishError today
        (local / "state.json").write_text("{}")
    assert safestage.verify(good).complete


_FORK_CHILD = r"""
import os, sys, time
from pathlib import Path
import safestage
run, root = Path(sys.argv[1]), Path(sys.argv[2])
handle = safestage.staged_dir(run / "checkpoint-2", root, background=True)
with handle as local:
    (local / "shard.bin").write_bytes(b"\2" * (8 << 20))
pid = os.fork()
if pid == 0:  # a helper process that outlives the job (a data loader, a logger)
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


@pytest.mark.mounts
@pytest.mark.regression("issue 20: background commits tried to the breaking point")
def test_a_child_forked_during_a_background_commit_does_not_keep_recover_from_finishing_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with hostile_mount("slow", tmp_path / "slow", mbps=4) as mount:
        run = Path(mount.path) / "run"
        run.mkdir()
        job = subprocess.Popen([sys.executable, "-c", _FORK_CHILD, str(run), str(root)], stdout=subprocess.PIPE,
                               text=True, env=_env())  # fmt: skip
        helper = int(job.stdout.readline())  # type: ignore[union-attr]
        try:
            time.sleep(0.3)  # the commit is in flight (8 MiB at 4 MB/s)
            job.kill()
            job.wait()
            recovered = safestage.recover(root)
            assert [result.action for result in recovered] == ["committed"], recovered
            assert safestage.verify(run / "checkpoint-2", deep=True).complete
        finally:
            os.kill(helper, signal.SIGKILL)


# -- collective commits ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group_job(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """One launch of four ranks on two nodes for every collective finding (a launch costs
    20-70 s): the cases run in order, each rank reporting after each case, and the last one
    SIGKILLs rank 0 (so the job itself fails: each case is judged by every rank's report).
    Node 0's staging root holds a copy an earlier job kept (a commit that failed with a real
    ENOSPC on a 2 MiB tmpfs, since grown so that recover can commit it)."""
    base = tmp_path_factory.mktemp("breaker-group")
    local = base / "local"
    local.mkdir()
    run = base / "run"
    run.mkdir()
    with safestage.staged_dir(local / "nothing-written", base) as there:  # a commit that must stay
        (there / "model.bin").write_bytes(b"committed before")
    cases = [
        # No rank writes anything (sync, then background): refused on every rank, nothing goes;
        # one rank of four writes: committed.
        {"name": "nothing-written", "dest": str(local / "nothing-written"), "write_ranks": []},
        {"name": "nothing-written-background", "dest": str(local / "nothing-written"), "write_ranks": [],
         "background": True},
        {"name": "one-rank-wrote", "dest": str(local / "one-rank-wrote"), "write_ranks": [2]},
        # Every rank creates [0, 1] and [1, 2] (torch's default new_group: all ranks call it);
        # then ranks 1 and 2 commit on [1, 2]. Rank 1 belongs to one more group than rank 2.
        {"name": "overlapping-subgroup", "dest": str(local / "sub12"), "precreate": [[0, 1], [1, 2]],
         "subgroup": [1, 2], "timeout": 15},
        # Last: rank 0 is SIGKILLed right after the commit file landed.
        {"name": "kill", "dest": str(run / "checkpoint-2"), "barrier": True},
    ]  # fmt: skip
    plan = base / "plan.json"
    plan.write_text(json.dumps({"cases": cases}))
    roots = (base / "node0", base / "node1")
    for root in roots:
        root.mkdir()
    tiny = base / "tiny"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(tiny)], check=True)
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(tiny)], check=False))
    kept = failed_commit(tiny / "checkpoint-1", roots[0], base)
    remount(tiny, "16m")
    ran = launch(WORKER, [str(plan)], roots=roots, result_dir=base / "results", timeout=240,
                 env={"SAFESTAGE_BREAK_KILL": json.dumps({"case": "kill", "rank": 0, "at": "commit-file-written"})})  # fmt: skip
    assert not ran.timed_out, ran.output()
    assert "breaker: rank 0 SIGKILLs itself at commit-file-written" in ran.output(), ran.output()
    return {"job": ran, "local": local, "run": run, "roots": roots, "kept": kept}


def _case(group_job: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Every rank's report of case ``name``: each rank reports after each case."""
    reports = group_job["job"].reports
    assert sorted(reports) == list(range(4)), group_job["job"].output()
    found = [[e for e in reports[rank]["results"] if e["case"] == name] for rank in range(4)]
    assert all(len(entries) == 1 for entries in found), (name, reports)
    return [entries[0] for entries in found]


@pytest.mark.slow
@pytest.mark.regression("issue 30 item 5: an empty staged_dir block was committed complete (a collective one "
                        "too, every rank having written nothing)")
@pytest.mark.parametrize("case", ["nothing-written", "nothing-written-background"])
def test_a_collective_commit_where_no_rank_wrote_anything_is_refused_on_every_rank_and_nothing_goes(
    group_job: dict[str, Any], case: str
) -> None:
    results = _case(group_job, case)
    for rank, result in enumerate(results):
        assert not result["ok"] and result["type"] == "StagingError" and result["errno"] == 2, (rank, result)
        assert "nothing was written to" in result["error"] and "nor by any other rank" in result["error"], result
    dest = group_job["local"] / "nothing-written"
    assert safestage.verify(dest).complete and (dest / "model.bin").read_bytes() == b"committed before"
    assert sorted(os.listdir(dest)) == sorted([COMMIT_NAME, "model.bin"])
    for root in group_job["roots"]:  # nothing kept anywhere: there was nothing to keep
        assert not any("nothing-written" in str(path) for path in root.rglob("*")), list(root.rglob("*"))


@pytest.mark.slow
def test_a_collective_commit_where_one_rank_wrote_is_committed(group_job: dict[str, Any]) -> None:
    results = _case(group_job, "one-rank-wrote")
    assert all(result["ok"] and result["files"] == 2 for result in results), results
    assert safestage.verify(group_job["local"] / "one-rank-wrote", deep=True).complete


@pytest.mark.slow
@pytest.mark.regression("issue 19: collective commits tried to the breaking point")
def test_a_collective_commit_over_a_subgroup_is_refused_at_once_naming_the_world_group(
    group_job: dict[str, Any],
) -> None:
    """torch names a group its members make alone from how many groups each already has:
    ranks in different other groups never meet. The collective is narrowed to the world."""
    results = _case(group_job, "overlapping-subgroup")
    for rank in (1, 2):
        assert results[rank]["type"] == "ConfigError" and "group=torch.distributed.group.WORLD" in results[rank]["error"]
    assert not (group_job["local"] / "sub12").exists()


@pytest.mark.slow
@pytest.mark.regression("issue 19: collective commits tried to the breaking point")
def test_a_rank_killed_after_the_commit_file_landed_leaves_no_copy_that_recover_refuses(
    group_job: dict[str, Any],
) -> None:
    run, roots = group_job["run"], group_job["roots"]
    assert safestage.verify(run / "checkpoint-2", deep=True).complete  # holds: the commit landed
    recovered = safestage.recover(roots[0])
    assert all(result.action != "refused" for result in recovered), recovered


@pytest.mark.slow
@pytest.mark.regression("issue 30 item 15: a 2-rank job printed the ~600-character kept-copy warning three "
                        "times (torchrun's launcher and each rank)")
def test_a_kept_copy_in_a_nodes_staging_root_is_named_once_per_node_not_once_per_rank(
    group_job: dict[str, Any],
) -> None:
    node0, node1 = group_job["job"].outputs
    root = group_job["roots"][0]
    said = [line for line in node0.splitlines() if "kept cop" in line and f"staging root {root}" in line]
    assert len(said) == 1, group_job["job"].output()
    assert group_job["kept"].save_dir.name in said[0], said[0]
    assert "kept cop" not in node1, node1  # node 1's root holds none
