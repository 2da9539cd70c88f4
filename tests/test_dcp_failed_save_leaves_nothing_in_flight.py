"""A ``dcp.save`` through ``safestage.dcp.StagedWriter`` that fails before it published anything
(DCP cannot serialize a value of the state dict) leaves nothing behind in the process that goes
on training: no local copy in the staging root (nothing was published: it is not worth
keeping, docs/dcp.md), and no job of this process still "committing" the checkpoint, so
retention treats it as the leftover it is (docs/retention.md: a live process's commit is one
"from the moment its block returns until the commit has landed or failed").

A real single-process ``dcp.save`` on the local disk; the failure is DCP's own, raised while the
writer's ``write_data`` serializes an object that cannot be pickled.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

import safestage
from safestage._names import parse_stage_dir


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this value cannot be pickled")


def save(state: dict[str, Any], dest: Path, root: Path) -> None:
    from safestage.dcp import StagedWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process
        dcp.save(state, storage_writer=StagedWriter(dest, root, single_file_per_rank=False))


@pytest.mark.regression("fresh-eyes review of issue 24: after a dcp.save that raised in write_data, prune kept "
                        "the checkpoint 'because this process is committing it', and every failed attempt left its "
                        "local files in the staging root until the process exited")
def test_a_dcp_save_that_failed_before_publishing_leaves_no_copy_and_no_commit_in_flight(
    tmp_path: Path, stage_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        save({"w": torch.full((1024,), float(step))}, run / f"step-{step}", stage_root)
    assert safestage.latest_complete(run, "step-*") == run / "step-200"

    for _ in range(3):  # the training loop catches the failure and goes on
        with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
            save({"a": torch.ones(256 * 1024), "b": Unpicklable(), "c": torch.ones(256 * 1024)},
                 run / "step-150", stage_root)  # fmt: skip
        assert "cannot be pickled" in str(raised.value), raised.value  # the fault fired

    left = [name for name in os.listdir(stage_root) if parse_stage_dir(name) is not None]
    assert left == [], f"{len(left)} local copies left in the staging root"
    with caplog.at_level(logging.INFO, logger="safestage"):
        removed = safestage.prune(run, keep=1, pattern="step-*")
    assert "this process is committing" not in caplog.text, caplog.text
    assert run / "step-150" in removed, removed


class RefusingPlanner(DefaultSavePlanner):
    """A planner that refuses the state dict (a planning error, as another rank's would be: DCP
    raises it on every rank before any ``write_data``, and never tells the writer)."""

    def create_local_plan(self) -> Any:
        raise ValueError("this planner refuses the state dict")


def _nothing_in_flight(run: Path, stage_root: Path, refused: Path, caplog: pytest.LogCaptureFixture) -> None:
    left = [name for name in os.listdir(stage_root) if parse_stage_dir(name) is not None]
    assert left == [], f"{len(left)} local directories left in the staging root: {left}"
    with caplog.at_level(logging.INFO, logger="safestage"):
        removed = safestage.prune(run, keep=1, pattern="step-*")
    assert "this process is committing" not in caplog.text, caplog.text
    assert refused in removed, removed


@pytest.mark.regression("issue 30 item 8: a DCP save refused before write_data stayed work in flight for the life "
                        "of the process (overwrite=False, a planning error)")
@pytest.mark.parametrize("refusal", ["overwrite-false", "planner"])
def test_a_dcp_save_refused_before_writing_leaves_no_directory_and_no_commit_in_flight(
    tmp_path: Path, stage_root: Path, caplog: pytest.LogCaptureFixture, refusal: str
) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        save({"w": torch.full((1024,), float(step))}, run / f"step-{step}", stage_root)
    refused = run / "step-150"
    refused.mkdir()  # a torn checkpoint: retention's to remove once nothing saves it
    (refused / (".metadata" if refusal == "overwrite-false" else "__0_0.distcp")).write_bytes(b"")
    with warnings.catch_warnings(), safestage.staged(stage_root):  # the switch stages DCP's own writer
        warnings.simplefilter("ignore")
        for _ in range(3):  # the training loop catches the failure and goes on
            with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
                if refusal == "overwrite-false":
                    dcp.save({"w": torch.ones(1024)}, storage_writer=FileSystemWriter(refused, overwrite=False))
                else:
                    dcp.save({"w": torch.ones(1024)}, checkpoint_id=refused, planner=RefusingPlanner())
            expected = "already exists" if refusal == "overwrite-false" else "refuses the state dict"
            assert expected in str(raised.value), raised.value  # the refusal fired
        _nothing_in_flight(run, stage_root, refused, caplog)


@pytest.mark.slow
@pytest.mark.regression("issue 30 item 8: a planning error on another rank left every rank's save in flight")
def test_a_dcp_save_another_rank_refused_while_planning_leaves_nothing_in_flight_on_any_rank(tmp_path: Path) -> None:
    """A real 2-rank job (gloo on CPU): rank 1's planner refuses; rank 0, the coordinator,
    never hears of it from DCP but leaves no local directory and no work in flight either."""
    import json
    import subprocess
    import sys

    from tests._two_nodes import free_port

    worker = Path(__file__).with_name("dcp_refused_worker.py")
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                    os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path / "step-100"), str(tmp_path / "roots"),
                               str(results)], env={**env, "RANK": str(rank)}, stderr=subprocess.PIPE)
             for rank in (0, 1)]  # fmt: skip
    errors = [proc.communicate(timeout=120)[1].decode(errors="replace") for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errors
    for rank in (0, 1):
        report = json.loads((results / f"rank{rank}.json").read_text())
        assert "refuses the state dict" in (report["error"] or ""), report  # the refusal fired, on every rank
        assert report["left"] == [], f"rank {rank} left local directories: {report}"
        assert report["busy"] == [], f"rank {rank} still counts the save as in flight: {report}"


class LateRefusingPlanner(DefaultSavePlanner):
    """A planner that refuses the plan DCP scattered (``finish_plan``: after the coordinator's
    ``prepare_global_plan``, before any ``write_data``)."""

    def finish_plan(self, new_plan: Any) -> Any:
        raise ValueError("this planner refuses the state dict late")


@pytest.mark.regression("issue 30 review: a DCP save under the switch refused after the coordinator prepared (the "
                        "planner's finish_plan) stayed work in flight for the life of the process")
def test_a_dcp_save_refused_after_the_coordinator_prepared_leaves_no_commit_in_flight(
    tmp_path: Path, stage_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (100, 200):
        save({"w": torch.full((1024,), float(step))}, run / f"step-{step}", stage_root)
    refused = run / "step-150"
    with warnings.catch_warnings(), safestage.staged(stage_root):  # the switch stages DCP's own writer
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
            dcp.save({"w": torch.ones(1024)}, checkpoint_id=refused, planner=LateRefusingPlanner())
        assert "refuses the state dict late" in str(raised.value), raised.value  # the refusal fired
        assert refused.is_dir()  # the coordinator had prepared it
        _nothing_in_flight(run, stage_root, refused, caplog)
