"""Lightning's sharded checkpoints (FSDPStrategy, ModelParallelStrategy with state_dict_type
"sharded") under the switch alone: the ``.distcp`` files of every rank, DCP's ``.metadata`` and
rank 0's ``meta.pt`` land under one commit file, written last.

Lightning's sharded save bypasses the CheckpointIO (``StagedCheckpointIO`` never sees it): every
rank ``dcp.save``s into the checkpoint directory, then rank 0 writes ``meta.pt``, whose presence
makes the directory a checkpoint to Lightning. A job of 4 ranks on two torchrun "nodes" (each its
own SAFESTAGE_DIR, gloo on CPU, the one job of tests/_dcp_job.py; the worker never names
safestage to save) runs:

- FSDPStrategy's own ``save_checkpoint`` below the Trainer (which refuses FSDP on CPU), onto kit
  hdfs and the real s3fs mount;
- a real ModelParallelStrategy (FSDP2) fit on CPU onto kit mountpoint with ModelCheckpoint's
  top-k and ``save_last``, resumed from ``latest_complete`` and from ``ckpt_path="last"``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

import safestage
from safestage import COMMIT_NAME
from tests import _dcp_job
from tests._two_nodes import Job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RANKS = _dcp_job.RANKS
DATA = [f"__{rank}_0.distcp" for rank in range(RANKS)]


@pytest.fixture(scope="module")
def job(
    tmp_path_factory: pytest.TempPathFactory, kit_mounts: dict[str, Any], real_mounts: dict[str, Any]
) -> tuple[Job, dict[str, Path], tuple[Path, Path]]:
    return _dcp_job.shared(tmp_path_factory, kit_mounts, real_mounts)


def assert_one_commit(checkpoint: Path) -> None:
    """Every rank's shard, .metadata and meta.pt, 0644, nothing else, under one commit file that
    lists each with the rank that wrote it (and passes a deep verify)."""
    names = sorted(p.name for p in checkpoint.iterdir())
    assert names == sorted([*DATA, ".metadata", "meta.pt", COMMIT_NAME]), names
    for name in names:
        assert (checkpoint / name).stat().st_mode & 0o777 == 0o644, name
    result = safestage.verify(checkpoint, deep=True)
    assert result.complete and result.manifest is not None, result.problems
    assert {entry.path: entry.rank for entry in result.manifest.files} == {
        **{name: rank for rank, name in enumerate(DATA)}, ".metadata": 0, "meta.pt": 0,
    }  # fmt: skip
    assert _is_sharded_checkpoint(checkpoint)  # what Lightning asks


@pytest.mark.parametrize("case", ["lightning-strategy-hdfs", "lightning-strategy-s3fs"])
def test_fsdp_strategy_sharded_save_is_one_commit_with_meta_pt(job: Any, case: str) -> None:
    result, dests, _ = job
    dest = dests[case]
    saved = _dcp_job.seen(result, case)
    assert_one_commit(dest)
    state = {"model": {"weight": torch.zeros(8, 8), "bias": torch.zeros(8)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single reader, no process group
        dcp.load(state, checkpoint_id=dest)  # stock DCP
    assert torch.equal(state["model"]["weight"], torch.tensor(saved["weight"]))
    assert torch.equal(state["model"]["bias"], torch.tensor(saved["bias"]))
    assert torch.load(dest / "meta.pt", weights_only=False) == {"epoch": 3, "global_step": 7}
    assert safestage.latest_complete(dest.parent, "step-*") == dest


def test_model_parallel_fit_commits_each_checkpoint_keeps_top_k_and_resumes(job: Any) -> None:
    result, dests, roots = job
    fit = _dcp_job.seen(result, "lightning-fit")  # every rank saw the same
    # ModelCheckpoint as with one file per checkpoint: the new one saved, then the evicted removed
    assert fit["best_k"] == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"]
    assert fit["last"] == "last.ckpt"
    # resumed from latest_complete (step 4), then from Lightning's own "last" (step 5)
    assert fit["latest"] == "epoch=0-step=4.ckpt"
    assert (fit["resumed_at"], fit["last_resumed_at"]) == (4, 5)
    directory = dests["lightning-fit"]
    assert sorted(p.name for p in directory.iterdir()) == sorted([*fit["final_best_k"], "last.ckpt"])
    for checkpoint in directory.iterdir():
        assert_one_commit(checkpoint)
    assert safestage.latest_complete(directory, "epoch=*-step=*.ckpt") == directory / "epoch=0-step=6.ckpt"
    for root in roots:  # every local copy went once its files had landed
        assert not list(root.rglob("safestage-kept.json")), list(root.rglob("*"))


def test_the_gpu_script_runs_on_cpu_and_every_check_holds(tmp_path: Path) -> None:
    """benchmarks/gpu_lightning_fsdp.sh, the one command of the GPU run (FSDPStrategy on one GPU),
    in its CPU form (ModelParallelStrategy, a world of one): the same checks, so that the GPU
    run fails only for what only a GPU shows."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_lightning_fsdp.sh"), "cpu"], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ok"] and len(report["checks"]) >= 10, report["checks"]
    assert "ALL CHECKS HELD" in (tmp_path / "out" / "report.txt").read_text()
