"""safestage.dcp.StagedWriter: dcp.save / async_save from 4 ranks on two "nodes" (each its own
staging root) onto hostile destinations, read back by stock DCP, committed last.

One two-node job runs every case (a job costs ~15 s of start-up on 2 cores): the worker
(dcp_worker.py) saves, in order, to the destinations of a plan, and each rank reports what
each case did; the assertions then run here, in a process that never imported safestage's
writer into the reading path (stock ``dcp.load``).
"""

from __future__ import annotations

import json
import pickle
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _two_nodes import Job, launch
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

import safestage
from safestage import COMMIT_NAME

WORKER = Path(__file__).with_name("dcp_worker.py")
RANKS = 4
DATA = [f"__{rank}_0.distcp" for rank in range(RANKS)]
HF_SHARDS = [f"shard-0000{rank + 1}-model-00001-of-00001.safetensors" for rank in range(RANKS)]

# (case name, kind, mount): every destination we serve, then async_save, DCP's own writer as the
# baseline, a re-save whose one rank fails, and the HuggingFace writer.
CASES = [
    ("hdfs", "save", "kit:hdfs"),
    ("mountpoint", "save", "kit:mountpoint"),
    ("s3fs", "save", "real:s3fs"),
    ("rclone-s3", "save", "real:rclone-s3"),
    ("async-thread", "async", "kit:hdfs"),
    ("async-process", "async-process", "kit:mountpoint"),
    ("stock-mountpoint", "stock", "kit:mountpoint"),
    ("resave-fail", "resave-fail", "kit:hdfs"),
    ("hf", "hf", "kit:mountpoint"),
]


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
) -> Iterator[tuple[Job, dict[str, Path], tuple[Path, Path]]]:
    base = tmp_path_factory.mktemp("dcp")
    roots = (base / "node0", base / "node1")
    for root in roots:
        root.mkdir()
    parents, dests, plan = [], {}, []
    for name, kind, where in CASES:
        family, mode = where.split(":")
        mount = (kit_mounts if family == "kit" else real_mounts)[mode]
        parent = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
        parent.mkdir()
        parents.append(parent)
        dests[name] = parent / "step-7"  # made by the writer: its parent must exist
        plan.append({"name": name, "kind": kind, "dest": str(dests[name])})
    (base / "plan.json").write_text(json.dumps(plan))
    result = launch(WORKER, [str(base / "plan.json")], roots=roots, result_dir=base / "results", timeout=400)
    yield result, dests, roots
    for parent in parents:
        shutil.rmtree(parent, ignore_errors=True)


def outcomes(job: Job, case: str) -> dict[int, dict[str, Any]]:
    assert not job.timed_out, job.output()
    assert job.returncodes == [0, 0], job.output()
    assert sorted(job.reports) == list(range(RANKS)), job.output()
    return {rank: report["results"][case] for rank, report in job.reports.items()}


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
@pytest.mark.parametrize("case", ["hdfs", "mountpoint", "s3fs", "rclone-s3", "async-thread", "async-process"])
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
    assert list(roots[0].iterdir()) == []  # node 0 had no failure at all
    kept = list(roots[1].iterdir())
    assert len(kept) == 1  # rank 2's copy of the failed re-save, and nothing else


@pytest.mark.slow
def test_a_failing_rank_makes_every_rank_raise_and_leaves_no_vouching_file(job: Any) -> None:
    """A re-save over a committed checkpoint, whose rank 2 cannot publish (a directory is where
    its file goes): every rank raises, naming rank 2 and the file; the old commit file and the
    old .metadata were removed before any rank wrote, so neither safestage nor a stock
    dcp.load takes the half-overwritten directory for a checkpoint."""
    result, dests, roots = job
    dest = dests["resave-fail"]
    for rank, outcome in outcomes(result, "resave-fail").items():
        assert outcome["ok"] is False and outcome["type"] == "CheckpointException", (rank, outcome)
        assert outcome["failed_ranks"] == [2]
        kind, text = outcome["causes"]["2"]
        assert kind == "PublishError"
        assert "rank 2" in text and "__2_0.distcp" in text and "Errno 21" in text
    assert not safestage.verify(dest).complete
    names = sorted(p.name for p in dest.iterdir())
    assert COMMIT_NAME not in names and ".metadata" not in names
    assert safestage.latest_complete(dest.parent, "step-*") is None
    with pytest.raises(BaseException, match=r"No such file or directory: .*\.metadata"):
        stock_load(dest)  # DCP's CheckpointException (a BaseException), wrapping the ENOENT
    # rank 2 (node 1) keeps its local copy, with what it is for
    (kept,) = list(roots[1].iterdir())
    record = json.loads((kept / "safestage-kept.json").read_text())
    assert record["destination"] == str(dest) and record["left"] == ["__2_0.distcp"]
    assert (kept / record["local"] / "__2_0.distcp").is_file()


@pytest.mark.slow
def test_dcp_own_writer_fails_on_mountpoint_and_leaves_no_metadata(job: Any) -> None:
    """The baseline (issue 19): DCP's FileSystemWriter straight onto mountpoint-s3 semantics."""
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
