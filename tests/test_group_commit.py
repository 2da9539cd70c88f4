"""staged_dir(group=...): four ranks on two torchrun "nodes" (own staging root each) commit one
checkpoint directory onto the kit's hdfs and mountpoint mounts, the real s3fs and rclone-S3
mounts, and an s3:// URL with no mount (the local moto server, reached through the AWS
environment the launch passes on); a failure on one rank makes every rank raise and publishes
nothing (or no commit file).

One job runs every case (a launch costs about 15 s here): tests/group_commit_worker.py."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import ObjectURL, url_of
from safestage.testing._s3 import shared_s3_server
from tests._stores import download, new_bucket, s3_environment
from tests._two_nodes import free_port, launch

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
def bucket() -> Iterator[str]:
    """A bucket of the module's own, the AWS environment set while its tests run."""
    with pytest.MonkeyPatch.context() as patch:
        yield new_bucket(patch, "group")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, kit_mounts: dict[str, Any], real_mounts: dict[str, Any],
        request: pytest.FixtureRequest, bucket: str) -> dict[str, Any]:  # fmt: skip
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
        # To a URL: a commit, a re-commit, a background one, and one whose rank 3 cannot reach the store.
        {"name": "ok", "dest": f"s3://{bucket}/run/checkpoint-1", "mode": "s3"},
        {"name": "ok", "dest": f"s3://{bucket}/run/checkpoint-1", "mode": "s3-again"},
        {"name": "background", "dest": f"s3://{bucket}/run/checkpoint-2", "mode": "s3-background"},
    ]  # fmt: skip
    cases.append({"name": "unreachable", "dest": f"s3://{bucket}/run/checkpoint-3", "rank": 3,
                  "endpoint": f"http://127.0.0.1:{free_port()}"})  # fmt: skip
    plan = base / "plan.json"
    plan.write_text(json.dumps({"cases": cases}))
    roots = (base / "node0", base / "node1")
    for root in roots:
        root.mkdir()
    ran = launch(WORKER, [str(plan)], roots=roots, result_dir=base / "results", timeout=300, env=s3_environment())
    assert not ran.timed_out and ran.returncodes == [0, 0], ran.output()
    assert sorted(ran.reports) == list(range(RANKS)), ran.output()
    return {"job": ran, "cases": cases, "dests": dests, "previous": previous, "roots": roots, "tiny": tiny,
            "bucket": bucket}  # fmt: skip


def _index(job: dict[str, Any], mode: str) -> int:
    return next(i for i, case in enumerate(job["cases"]) if case.get("mode") == mode)


def _results(job: dict[str, Any], index: int) -> list[dict[str, Any]]:
    return [job["job"].reports[rank]["results"][index] for rank in range(RANKS)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hdfs", "mountpoint", "s3fs", "rclone-s3"])
def test_four_ranks_on_two_nodes_commit_one_checkpoint_listing_every_file_and_its_rank(job: dict[str, Any], mode: str) -> None:
    results = _results(job, _index(job, mode))
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
    results = _results(job, [case["name"] for case in job["cases"]].index("background"))
    assert all(result["ok"] and result["files"] == 2 * RANKS + 1 for result in results), results
    dest = job["dests"]["hdfs"] / "background" / "checkpoint-2"
    assert _listing(dest) == _expected_files() and safestage.verify(dest, deep=True).complete
    assert safestage.latest_complete(dest.parent) == dest
    # The ranks ran 20 all_reduce calls on the job's group after their blocks, while the
    # commit's exchanges went on over safestage's own group (a mix-up would hang or fail them).
    assert [result["steps"] for result in results] == [20] * RANKS


@pytest.mark.slow
def test_a_recommit_by_many_ranks_replaces_the_previous_commit_on_a_mount_without_rename(job: dict[str, Any]) -> None:
    results = _results(job, _index(job, "mountpoint-again"))
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


# -- to an object-store URL --------------------------------------------------------------------------

_REQUEST = re.compile(r'"(?P<method>[A-Z]+) /(?P<target>[^ ?]+)(?P<query>\?\S*)? HTTP/[\d.]+" (?P<status>\d+)')


def _requests(bucket: str, prefix: str) -> list[tuple[str, str, str]]:
    """(method, path below ``prefix``, status) of every request the server answered for an
    object below it, and ("DELETE", "*", status) for a batched delete in the bucket, in the
    order it answered them (moto's access log: a line is written before the response is
    sent, so a request sent after another's answer comes after it)."""
    seen = []
    for line in shared_s3_server().log().splitlines():
        found = _REQUEST.search(line)
        if found and found["target"].startswith(f"{bucket}/{prefix}"):
            seen.append((found["method"], found["target"][len(f"{bucket}/{prefix}"):], found["status"]))
        elif found and found["target"] == bucket and found["method"] == "POST" and found["query"] == "?delete":
            seen.append(("DELETE", "*", found["status"]))
    return seen


def _commit_object(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The commit object's document, and each other object below ``url`` ({path: ObjectInfo})."""
    dest = url_of(url)
    assert isinstance(dest, ObjectURL)
    objects = {info.key[len(dest.prefix):]: info for info in _object_store.listing(dest)}
    return json.loads(_object_store.read(dest / COMMIT_NAME) or b""), objects


def _assert_landed_from_every_rank(url: str, copy: Path) -> dict[str, Any]:
    """Exactly every rank's objects and the commit object below ``url``, which lists each with
    the rank that uploaded it and the size and ETag the store has for it; the shards load."""
    document, objects = _commit_object(url)
    assert sorted(objects) == _expected_files()  # no temp object, nothing else
    entries = {entry["path"]: entry for entry in document["files"]}
    assert sorted(entries) == sorted(path for path in objects if path != COMMIT_NAME)
    for path, entry in entries.items():
        assert entry["etag"] and (entry["size"], entry["etag"]) == (objects[path].size, objects[path].etag), path
    assert entries["config.json"]["rank"] == 0
    local = download(url, copy)
    for rank in range(RANKS):
        assert entries[f"model-rank{rank}.safetensors"]["rank"] == entries[f"optim/rank{rank}.pt"]["rank"] == rank
        assert load_file(str(local / f"model-rank{rank}.safetensors"))["rank"].item() == rank
        assert torch.load(local / "optim" / f"rank{rank}.pt")["rank"] == rank
    return objects


def _rounds(bucket: str, prefix: str) -> list[list[tuple[str, str, str]]]:
    """The requests below ``prefix``, one list per commit (each starts with the coordinator's
    HEAD of the commit object)."""
    rounds: list[list[tuple[str, str, str]]] = []
    for method, path, status in _requests(bucket, prefix):
        if (method, path) == ("HEAD", COMMIT_NAME):
            rounds.append([])
        if rounds:
            rounds[-1].append((method, path, status))
    return rounds


@pytest.mark.slow
def test_four_ranks_on_two_nodes_commit_one_checkpoint_to_a_url_the_commit_object_created_once_after_every_object(
    job: dict[str, Any], tmp_path: Path
) -> None:
    results = _results(job, _index(job, "s3"))
    assert all(result["ok"] for result in results), results
    assert [Path(result["root"]) for result in results] == [job["roots"][0]] * 2 + [job["roots"][1]] * 2
    for result in results:  # every rank's local copy went once the commit landed
        assert not Path(result["local"]).parent.exists(), result
    _assert_landed_from_every_rank(f"s3://{job['bucket']}/run/checkpoint-1", tmp_path / "copy")
    first = _rounds(job["bucket"], "run/checkpoint-1/")[0]
    assert first[:2] == [("HEAD", COMMIT_NAME, "404"), ("DELETE", "*", "200")], first  # nothing to remove
    writes = [path for method, path, _ in first if method == "PUT"]
    # Every rank's objects, each once, then the commit object, once, last.
    assert writes[-1] == COMMIT_NAME and writes.count(COMMIT_NAME) == 1, first
    assert sorted(writes[:-1]) == sorted(path for path in _expected_files() if path != COMMIT_NAME), first


@pytest.mark.slow
def test_a_recommit_by_many_ranks_to_a_url_removes_the_commit_object_before_any_rank_uploads(
    job: dict[str, Any], tmp_path: Path
) -> None:
    results = _results(job, _index(job, "s3-again"))
    assert all(result["ok"] for result in results), results
    objects = _assert_landed_from_every_rank(f"s3://{job['bucket']}/run/checkpoint-1", tmp_path / "copy")
    again = _rounds(job["bucket"], "run/checkpoint-1/")[1]
    # The previous commit object is there, and removed (in a request of its own) before any upload.
    assert again[:3] == [("HEAD", COMMIT_NAME, "200"), ("DELETE", "*", "200"), ("DELETE", "*", "200")], again
    writes = [path for method, path, _ in again if method == "PUT"]
    assert writes[-1] == COMMIT_NAME and writes.count(COMMIT_NAME) == 1, again
    assert len(objects) == len(_expected_files())


@pytest.mark.slow
def test_a_collective_background_commit_to_a_url_lands_while_the_ranks_go_on_training(
    job: dict[str, Any], tmp_path: Path
) -> None:
    results = _results(job, _index(job, "s3-background"))
    assert all(result["ok"] and result["files"] == 2 * RANKS + 1 for result in results), results
    assert [result["steps"] for result in results] == [20] * RANKS  # the job's own all_reduce meanwhile
    _assert_landed_from_every_rank(f"s3://{job['bucket']}/run/checkpoint-2", tmp_path / "copy")


@pytest.mark.slow
@pytest.mark.regression(
    "0.6.0: 5 of 10 such jobs had a rank that could reach the store abort at its exit (SIGABRT, "
    "'terminate called without an active exception'): gloo freed an exchange's tensors during "
    "finalization (pytorch/pytorch#179291); fixed in _collective._gather"
)
def test_a_rank_that_cannot_reach_the_store_makes_every_rank_raise_and_no_commit_object_is_created(
    job: dict[str, Any],
) -> None:
    index = [case["name"] for case in job["cases"]].index("unreachable")
    results = _results(job, index)
    url = job["cases"][index]["dest"]
    for result in results:
        assert result["type"] == "PublishError", result
        assert "rank 3 could not publish" in result["error"] and "model-rank3.safetensors" in result["error"], result
        assert "testing" not in result["error"]  # no secret in a message
        assert ".." not in result["error"].replace(url, ""), result["error"]  # rank 3's sentence ends once
    dest = url_of(url)
    assert isinstance(dest, ObjectURL)
    objects = {info.key[len(dest.prefix):] for info in _object_store.listing(dest)}
    assert COMMIT_NAME not in objects and not any("rank3" in path for path in objects), objects
    # Every rank kept its copy, its record naming the URL and which rank of how many it was.
    for rank, result in enumerate(results):
        kept = Path(result["staged_path"])
        record = json.loads((kept.parent / "safestage-kept.json").read_text())
        assert record["destination"] == url and record["part"] == {"of": "collective", "rank": rank, "world_size": RANKS}
