"""accelerate's save_state: model.safetensors goes through safetensors (staged), but
optimizer.bin and random_states_0.pkl are torch.save pickles that safestage never sees.

What happens to those (test_clients covers save_state inside staged()): torch.save writes
sequentially, with no ftruncate and no rename, so on the hdfs and mountpoint kits the pickles
land directly, non-atomically, with no check beyond close(). safestage.staged_file gives
them the same publish path as the safetensors files: below, the whole save_state is written to
local disk and each file is published with staged_file.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _clients import CLIENTS, assert_nested_equal
from _helpers import assert_checkpoint, fresh_dir

import safestage

pytestmark = pytest.mark.integration

CLIENT = CLIENTS["accelerate-save_state"]


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_save_state_locally_then_publish_every_file_with_staged_file(mode, kit_mounts, shm_root, tmp_path):
    trained = CLIENT.build(tmp_path)
    local = tmp_path / "state"
    trained.accelerator.save_state(str(local))  # local disk: no staging needed
    dest = fresh_dir(kit_mounts[mode], "state")
    for path in sorted(local.iterdir()):
        with safestage.staged_file(dest / path.name, shm_root) as staged:
            shutil.copyfile(path, staged)
    assert sorted(os.listdir(dest)) == sorted(os.listdir(local)) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl",
    ]
    assert_checkpoint(dest, CLIENT, CLIENT.reference(trained))  # loads equal, 0644, no temp files
    assert os.listdir(shm_root) == []


def test_staged_file_keeps_the_optimizer_state_when_the_upload_fails(kit_mounts, shm_root, tmp_path):
    """close-eio (an upload failing at close): torch.save raises and the state is gone;
    through staged_file the error names the complete local copy it kept."""
    trained = CLIENT.build(tmp_path)
    dest = fresh_dir(kit_mounts["close-eio"], "state")
    with pytest.raises(RuntimeError, match="iostream error"):  # torch.save's C++ writer
        trained.accelerator.save(trained.optimizer.state_dict(), dest / "optimizer.bin")
    assert not (dest / "optimizer.bin").exists()
    with pytest.raises(safestage.PublishError) as info, safestage.staged_file(dest / "optimizer.bin", shm_root) as staged:
        trained.accelerator.save(trained.optimizer.state_dict(), staged)
    assert info.value.errno == 5
    kept = torch.load(info.value.staged_path, weights_only=False)
    assert_nested_equal(kept, trained.optimizer.state_dict(), "kept optimizer.bin")
    assert os.listdir(dest) == []


# -- save_state of many ranks, one commit per checkpoint (docs/integrations.md's recipe) ------------

RANKS = 4


@pytest.fixture(scope="module")
def dcp_job(tmp_path_factory, kit_mounts, real_mounts):
    from tests import _dcp_job

    return _dcp_job.shared(tmp_path_factory, kit_mounts, real_mounts)


@pytest.mark.slow
def test_save_state_of_every_rank_with_its_dcp_directories_is_one_commit_and_keep_prunes(dcp_job):
    """4 ranks on two nodes (tests/_dcp_job.py): each step's ``checkpoint_N`` (model.safetensors,
    optimizer.bin, every rank's random_states_<rank>.pkl, and the DCP subdirectories of
    accelerate's FSDP save) is one commit, written last; ``keep=2`` left the two newest; every
    rank's ``load_state`` of ``latest_complete`` restored what was saved."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from tests import _dcp_job

    job, dests, roots = dcp_job
    seen = _dcp_job.seen(job, "accelerate")
    assert seen["latest"] == "checkpoint_3" and seen["loaded_equal"] is True, seen
    parent = dests["accelerate"]
    assert sorted(p.name for p in parent.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    data = {f"{sub}/__{rank}_0.distcp": rank for sub in ("pytorch_model_fsdp_0", "optimizer_0") for rank in range(RANKS)}
    for checkpoint in parent.iterdir():
        result = safestage.verify(checkpoint, deep=True)
        assert result.complete and result.manifest is not None, result.problems
        assert {entry.path: entry.rank for entry in result.manifest.files} == {
            "model.safetensors": 0, "optimizer.bin": 0, **{f"random_states_{rank}.pkl": rank for rank in range(RANKS)},
            "pytorch_model_fsdp_0/.metadata": 0, "optimizer_0/.metadata": 0, **data,
        }  # fmt: skip
        assert sorted(p.name for p in checkpoint.iterdir() if p.is_file()) == sorted(
            ["model.safetensors", "optimizer.bin", *(f"random_states_{rank}.pkl" for rank in range(RANKS)), safestage.COMMIT_NAME]
        )  # no temp file, no commit file of a DCP subdirectory's own: one checkpoint
    state = {"model": {"weight": torch.zeros(8, 8), "bias": torch.zeros(8)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=parent / "checkpoint_3" / "pytorch_model_fsdp_0")  # stock DCP
    assert torch.equal(state["model"]["weight"], torch.tensor(seen["weight"]))
    for root in roots:
        assert not list(root.rglob("safestage-kept.json"))
