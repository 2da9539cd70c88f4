"""safestage.dcp.StagedWriter, and DCP's own writers under the switch: dcp.save / async_save
from 4 ranks on two "nodes" (each its own staging root, SAFESTAGE_DIR) onto hostile
destinations, read back by stock DCP, committed last.

One two-node job runs every case (tests/_dcp_job.py, shared with the Lightning and accelerate
tests): the worker (dcp_worker.py) saves, in order, to the destinations of a plan, and each
rank reports what each case did; the assertions then run here, in a process that never
imported safestage's writer into the reading path (stock ``dcp.load``).
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import ObjectURL, url_of
from tests import _dcp_job
from tests._stores import download, s3_environment
from tests._two_nodes import Job

RANKS = _dcp_job.RANKS
DATA = [f"__{rank}_0.distcp" for rank in range(RANKS)]
HF_SHARDS = [f"shard-0000{rank + 1}-model-00001-of-00001.safetensors" for rank in range(RANKS)]
SWITCHED = ["switch-id-mountpoint", "switch-id-hdfs", "switch-id-s3fs", "switch-writer", "switch-async",
            "switch-async-process"]


def expected_state() -> dict[str, Any]:
    """What every rank saved together (dcp_worker.state_dict), as plain tensors."""
    state: dict[str, Any] = {f"own.{rank}": torch.full((16, 4), float(rank)) + torch.arange(4) for rank in range(RANKS)}
    state["shared"] = torch.linspace(0, 1, 33)
    state["sharded"] = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    return state


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {key: torch.zeros_like(value) for key, value in state.items()}


@pytest.fixture(scope="module")
def job(
    tmp_path_factory: pytest.TempPathFactory, kit_mounts: dict[str, Any], real_mounts: dict[str, Any]
) -> tuple[Job, dict[str, Path], tuple[Path, Path]]:
    return _dcp_job.shared(tmp_path_factory, kit_mounts, real_mounts)


outcomes = _dcp_job.outcomes


def assert_committed(dest: Path, data: list[str], *, index: str = ".metadata") -> None:
    """Every rank's file and DCP's index landed, 0644, nothing else (no temp), and the commit
    file lists each with the rank that wrote it and its digest (deep verify)."""
    names = sorted(p.name for p in dest.iterdir())
    assert names == sorted([*data, *([index] if index else []), COMMIT_NAME])
    for name in names:
        assert (dest / name).stat().st_mode & 0o777 == 0o644, name
    result = safestage.verify(dest, deep=True)
    assert result.complete, result.problems
    assert result.manifest is not None
    ranks = {entry.path: entry.rank for entry in result.manifest.files}
    assert ranks == {**{path: rank for rank, path in enumerate(data)}, **({index: 0} if index else {})}
    assert safestage.latest_complete(dest.parent, "step-*") == dest


def stock_load(dest: Path) -> dict[str, Any]:
    state = {**empty_like(expected_state()), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": a single reader
        dcp.load(state, checkpoint_id=dest)
    return state


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hdfs", "mountpoint", "s3fs", "rclone-s3", "async-thread", "async-process", *SWITCHED])
def test_every_rank_lands_and_stock_dcp_loads_it(job: Any, case: str) -> None:
    result, dests, _ = job
    assert all(outcome == {"ok": True} for outcome in outcomes(result, case).values())
    dest = dests[case]
    assert_committed(dest, DATA)
    state = stock_load(dest)
    assert state.pop("step") == 7
    for key, value in expected_state().items():
        assert torch.equal(state[key], value), key
    # .metadata holds DCP's classes only: what safestage added to the WriteResults is gone
    metadata = pickle.loads((dest / ".metadata").read_bytes())
    assert "safestage" not in pickle.dumps(metadata).decode("latin-1")
    assert metadata.storage_meta.checkpoint_id == str(dest)  # not the local copy's path


@pytest.mark.slow
def test_no_local_copy_outlives_a_committed_save(job: Any) -> None:
    result, _, roots = job
    outcomes(result, "hdfs")
    assert all(report["staging_on"] for report in result.reports.values())  # the switch, from the environment
    assert list(roots[0].iterdir()) == []  # node 0 had no failure at all
    # Rank 2's re-save was refused before it published (a directory is where its file goes):
    # a refused copy is not kept (it would be refused again), and no rank's files are a
    # checkpoint on their own.
    assert list(roots[1].iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", ["resave-fail", "switch-resave-fail"])
def test_a_failing_rank_makes_every_rank_raise_and_leaves_no_vouching_file(job: Any, case: str) -> None:
    """A re-save over a committed checkpoint, whose rank 2 cannot publish (a directory is where
    its file goes): every rank raises, naming rank 2 and the file; the old commit file and the
    old .metadata were removed before any rank wrote, so neither safestage nor a stock
    dcp.load takes the half-overwritten directory for a checkpoint."""
    result, dests, roots = job
    dest = dests[case]
    for rank, outcome in outcomes(result, case).items():
        assert outcome["ok"] is False and outcome["type"] == "CheckpointException", (rank, outcome)
        assert outcome["failed_ranks"] == [2]
        kind, text = outcome["causes"]["2"]
        assert kind == "PublishError"
        assert "rank 2" in text and "__2_0.distcp" in text and ("Errno 21" in text or "Errno 20" in text), text
    assert not safestage.verify(dest).complete
    names = sorted(p.name for p in dest.iterdir())
    assert COMMIT_NAME not in names and ".metadata" not in names
    assert safestage.latest_complete(dest.parent, "step-*") is None
    with pytest.raises(BaseException, match=r"No such file or directory: .*\.metadata"):
        stock_load(dest)  # DCP's CheckpointException (a BaseException), wrapping the ENOENT
    # Refused before it published anything: rank 2 (node 1) keeps no copy (it would be refused
    # again, and one rank's files are no checkpoint on their own).
    assert list(roots[1].iterdir()) == []


@pytest.mark.slow
def test_dcp_own_writer_fails_on_mountpoint_and_leaves_no_metadata(job: Any) -> None:
    """The baseline (issue 19): DCP's FileSystemWriter straight onto mountpoint-s3 semantics,
    with the switch on: ``safestage.dcp.unstaged`` turns it off for this one writer."""
    result, dests, _ = job
    for outcome in outcomes(result, "stock-mountpoint").values():
        assert outcome["ok"] is False, outcome
    dest = dests["stock-mountpoint"]
    assert ".metadata" not in [p.name for p in dest.iterdir()]


@pytest.mark.slow
def test_huggingface_writer_shards_land_and_load(job: Any) -> None:
    result, dests, _ = job
    assert all(outcome == {"ok": True} for outcome in outcomes(result, "hf").values())
    dest = dests["hf"]
    assert_committed(dest, HF_SHARDS, index="")
    state = empty_like(expected_state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(dest)))
    for key, value in expected_state().items():
        assert torch.equal(state[key], value), key


@pytest.mark.slow
def test_switch_commits_the_huggingface_writers_consolidated_files_with_its_shards(job: Any) -> None:
    """HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True) under the
    switch: each rank's shard lands in dest/sharded, the coordinator consolidates them (read at
    the destination) into the full file and its index, and one commit file lists them all."""
    result, dests, _ = job
    assert all(outcome == {"ok": True} for outcome in outcomes(result, "switch-hf").values())
    dest = dests["switch-hf"]
    committed = safestage.verify(dest, deep=True)
    assert committed.complete, committed.problems
    assert committed.manifest is not None
    ranks = {entry.path: entry.rank for entry in committed.manifest.files}
    assert ranks == {**{f"sharded/{name}": rank for rank, name in enumerate(HF_SHARDS)},
                     "model-00001-of-00001.safetensors": 0, "model.safetensors.index.json": 0}  # fmt: skip
    state = empty_like(expected_state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(dest)))  # the consolidated file
    for key, value in expected_state().items():
        assert torch.equal(state[key], value), key


@pytest.mark.slow
def test_switch_commits_rank_zeros_huggingface_shards_and_index_on_s3fs(job: Any) -> None:
    result, dests, _ = job
    assert all(outcome == {"ok": True} for outcome in outcomes(result, "switch-hf-rank0").values())
    dest = dests["switch-hf-rank0"]
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    names = sorted(p.name for p in dest.iterdir())
    assert names == sorted([*shards, "model.safetensors.index.json", COMMIT_NAME])
    committed = safestage.verify(dest, deep=True)
    assert committed.complete and committed.manifest is not None, committed.problems
    assert {entry.rank for entry in committed.manifest.files} == {0}
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    state = empty_like(expected_state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(dest)))
    for key, value in expected_state().items():
        assert torch.equal(state[key], value), key


@pytest.mark.slow
def test_switch_leaves_a_writer_subclass_alone_and_says_so_once(job: Any) -> None:
    """A subclass of FileSystemWriter may write anywhere: the switch does not stage it (it
    writes in place, as without safestage) and says so once per job: a WARNING from rank 0,
    the other ranks' at INFO."""
    result, dests, _ = job
    assert all(outcome == {"ok": True} for outcome in outcomes(result, "switch-subclass").values())
    dest = dests["switch-subclass"]
    assert sorted(p.name for p in dest.iterdir()) == sorted([*DATA, ".metadata"])  # no commit file
    assert not safestage.verify(dest).complete
    assert stock_load(dest).pop("step") == 7
    said = [line for line in result.output().splitlines()
            if "SubclassWriter, a subclass of DCP's FileSystemWriter, is not staged" in line]
    assert len([line for line in said if "WARNING" in line]) == 1, result.output()  # once per job


@pytest.mark.slow
def test_switch_commits_every_ranks_dcp_files_to_a_url_with_their_etags_and_stock_dcp_loads_a_copy(
    job: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """dcp.save(checkpoint_id="s3://...") on 4 ranks, the switch on, no fsspec: every rank
    uploads its own .distcp from its own node, and the commit object lists each with its rank
    and the ETag the store has for it."""
    result, dests, _ = job
    assert all(outcome == {"ok": True} for outcome in outcomes(result, "switch-id-url").values())
    for key, value in s3_environment().items():
        monkeypatch.setenv(key, value)
    _object_store.after_fork_in_child()  # clients made for another test's environment
    url = dests["switch-id-url"]
    dest = url_of(url)
    assert isinstance(dest, ObjectURL)
    objects = {info.key[len(dest.prefix) :]: info for info in _object_store.listing(dest)}
    assert sorted(objects) == sorted([*DATA, ".metadata", COMMIT_NAME])
    document = json.loads(_object_store.read(dest / COMMIT_NAME) or b"")
    entries = {entry["path"]: entry for entry in document["files"]}
    assert {path: entry["rank"] for path, entry in entries.items()} == {
        **{path: rank for rank, path in enumerate(DATA)}, ".metadata": 0
    }
    for path, entry in entries.items():
        assert entry["etag"] and (entry["size"], entry["etag"]) == (objects[path].size, objects[path].etag), path
    copy = download(url, tmp_path / "step-7")
    assert pickle.loads((copy / ".metadata").read_bytes()).storage_meta.checkpoint_id == url
    state = stock_load(copy)
    assert state.pop("step") == 7
    for key, value in expected_state().items():
        assert torch.equal(state[key], value), key
