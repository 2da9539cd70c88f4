"""staged_dir(group=...): four ranks on two torchrun "nodes" (own staging root each) commit one
checkpoint directory onto the kit's hdfs and mountpoint mounts and the real s3fs and rclone-S3
mounts; a failure on one rank makes every rank raise and publishes nothing (or no commit file).

One job runs every case (a launch costs about 15 s here): tests/group_commit_worker.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import safestage
from safestage import COMMIT_NAME
from tests._two_nodes import launch

WORKER = Path(__file__).with_name("group_commit_worker.py")
RANKS = 4


def _listing(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())


def _expected_files() -> list[str]:
    files = ["config.json", COMMIT_NAME]
    for rank in range(RANKS):
        files += [f"model-rank{rank}.safetensors", f"optim/rank{rank}.pt"]
    return sorted(files)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, kit_mounts: dict[str, Any], real_mounts: dict[str, Any],
        request: pytest.FixtureRequest) -> dict[str, Any]:  # fmt: skip
    base = tmp_path_factory.mktemp("group")
    dests = {}
    for mode, mounts in (("hdfs", kit_mounts), ("mountpoint", kit_mounts), ("s3fs", real_mounts), ("rclone-s3", real_mounts)):
        directory = Path(mounts[mode].path) / f"group-{base.name}"
        directory.mkdir()
        dests[mode] = directory
    (dests["hdfs"] / "background").mkdir()
    # ENOSPC for rank 3's big.bin alone: a 2 MiB tmpfs where only that file goes. On a tmpfs
    # holding the whole checkpoint, another rank writing while big.bin filled it failed too,
    # and the error named that rank (the lowest failing one) instead of rank 3.
    tiny = base / "enospc" / "checkpoint-1" / "full"
    tiny.mkdir(parents=True)
    os.system(f"mount -t tmpfs -o size=2m,mode=0755 tmpfs {tiny}")
    request.addfinalizer(lambda: os.system(f"umount -l {tiny}"))
    local = base / "local"
    local.mkdir()
    # A previous commit the failing cases must leave untouched.
    previous = local / "kept-commit"
    with safestage.staged_dir(previous, root=base) as staged:
        (staged / "old.json").write_text("{}")
    cases = [{"name": "ok", "dest": str(dests[mode] / "checkpoint-1"), "mode": mode} for mode in dests]
    cases += [
        {"name": "raise", "dest": str(previous), "rank": 2},
        {"name": "clash", "dest": str(previous)},
        {"name": "enospc", "dest": str(tiny.parent)},
        {"name": "ok", "dest": str(dests["mountpoint"] / "checkpoint-1"), "mode": "mountpoint-again"},
        {"name": "background", "dest": str(dests["hdfs"] / "background" / "checkpoint-2")},
    ]
    plan = base / "plan.json"
    plan.write_text(json.dumps({"cases": cases}))
    roots = (base / "node0", base / "node1")
    for root in roots:
        root.mkdir()
    ran = launch(WORKER, [str(plan)], roots=roots, result_dir=base / "results", timeout=300)
    assert not ran.timed_out and ran.returncodes == [0, 0], ran.output()
    assert sorted(ran.reports) == list(range(RANKS)), ran.output()
    return {"job": ran, "cases": cases, "dests": dests, "previous": previous, "roots": roots, "tiny": tiny}


def _results(job: dict[str, Any], index: int) -> list[dict[str, Any]]:
    return [job["job"].reports[rank]["results"][index] for rank in range(RANKS)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hdfs", "mountpoint", "s3fs", "rclone-s3"])
def test_four_ranks_on_two_nodes_commit_one_checkpoint_listing_every_file_and_its_rank(job: dict[str, Any], mode: str) -> None:
    index = next(i for i, case in enumerate(job["cases"]) if case.get("mode") == mode)
    results = _results(job, index)
    assert all(result["ok"] for result in results), results
    # Each node staged under its own root (ranks 0, 1 on node 0; 2, 3 on node 1).
    assert [Path(result["root"]) for result in results] == [job["roots"][0]] * 2 + [job["roots"][1]] * 2
    dest = job["dests"][mode] / "checkpoint-1"
    assert _listing(dest) == _expected_files()  # no temp file, nothing else
    document = json.loads((dest / COMMIT_NAME).read_bytes())
    ranks = {entry["path"]: entry["rank"] for entry in document["files"]}
    assert ranks["config.json"] == 0
    for rank in range(RANKS):
        assert ranks[f"model-rank{rank}.safetensors"] == rank and ranks[f"optim/rank{rank}.pt"] == rank
        assert load_file(str(dest / f"model-rank{rank}.safetensors"))["rank"].item() == rank
        assert torch.load(dest / "optim" / f"rank{rank}.pt")["rank"] == rank
    if mode in ("hdfs", "mountpoint"):  # the S3 mounts show their own modes
        assert stat.S_IMODE(os.stat(dest / "config.json").st_mode) == 0o644
    assert safestage.verify(dest, deep=True).complete
    assert safestage.latest_complete(job["dests"][mode]) == dest
    for result in results:  # every rank's local copy went once the commit landed
        assert not Path(result["local"]).parent.exists(), result


@pytest.mark.slow
def test_a_collective_background_commit_lands_while_the_ranks_go_on_with_their_own_collectives(job: dict[str, Any]) -> None:
    index = [case["name"] for case in job["cases"]].index("background")
    results = _results(job, index)
    assert all(result["ok"] and result["files"] == 2 * RANKS + 1 for result in results), results
    dest = job["dests"]["hdfs"] / "background" / "checkpoint-2"
    assert _listing(dest) == _expected_files() and safestage.verify(dest, deep=True).complete
    assert safestage.latest_complete(dest.parent) == dest
    # The ranks ran 20 all_reduce calls on the job's group after their blocks, while the
    # commit's exchanges went on over safestage's own group (a mix-up would hang or fail them).
    assert [result["steps"] for result in results] == [20] * RANKS


@pytest.mark.slow
def test_a_recommit_by_many_ranks_replaces_the_previous_commit_on_a_mount_without_rename(job: dict[str, Any]) -> None:
    results = _results(job, len(job["cases"]) - 1)
    assert all(result["ok"] for result in results), results
    dest = job["dests"]["mountpoint"] / "checkpoint-1"
    assert _listing(dest) == _expected_files() and safestage.verify(dest, deep=True).complete


@pytest.mark.slow
def test_a_block_raising_on_one_rank_makes_every_rank_raise_and_publishes_nothing(job: dict[str, Any]) -> None:
    index = [case["name"] for case in job["cases"]].index("raise")
    results = _results(job, index)
    assert results[2]["type"] == "ValueError"  # that rank's own exception
    for rank in (0, 1, 3):
        assert results[rank]["type"] == "PublishError" and "on rank 2" in results[rank]["error"], results[rank]
    assert _listing(job["previous"]) == sorted(["old.json", COMMIT_NAME])  # the previous commit untouched
    assert safestage.verify(job["previous"]).complete


@pytest.mark.slow
def test_two_ranks_writing_one_path_is_refused_on_every_rank_before_anything_is_published(job: dict[str, Any]) -> None:
    index = [case["name"] for case in job["cases"]].index("clash")
    for result in _results(job, index):
        assert result["type"] == "PublishError" and result["errno"] == 17, result
        assert "ranks 1 and 3 both wrote same.json" in result["error"]
    assert _listing(job["previous"]) == sorted(["old.json", COMMIT_NAME]) and safestage.verify(job["previous"]).complete


@pytest.mark.slow
def test_a_publish_failing_on_one_rank_makes_every_rank_raise_naming_that_rank_and_file(job: dict[str, Any]) -> None:
    index = [case["name"] for case in job["cases"]].index("enospc")
    results = _results(job, index)
    for result in results:
        assert result["type"] == "PublishError", result
        assert "rank 3 could not publish" in result["error"] and "big.bin" in result["error"], result
    assert results[3]["errno"] == 28  # the real ENOSPC of the 2 MiB tmpfs
    dest = job["tiny"].parent
    assert not (dest / COMMIT_NAME).exists() and not safestage.verify(dest).complete
    # Every rank kept its copy, as a failed single-process commit does, saying which rank it was.
    for rank, result in enumerate(results):
        kept = Path(result["staged_path"])
        assert kept.is_dir(), result
        record = json.loads((kept.parent / "safestage-kept.json").read_text())
        assert record["destination"] == str(dest) and record["part"]["of"] == "collective"
        assert record["part"]["world_size"] == RANKS and record["part"]["rank"] == rank, record
