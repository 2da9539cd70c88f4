"""A ``staged_dir`` block that wrote nothing into its local directory is refused, as
``staged_file`` refuses a save that wrote nothing: nothing is committed, nothing at the
destination is removed, and no retention runs. Committed, an empty checkpoint would be the
newest complete one (``latest_complete`` names it, ``keep=`` removes a real one to make room),
and a block whose save went to the destination itself (``dcp.save(sd, checkpoint_id=dest)``)
would lose DCP's ``.metadata`` to the commit and be vouched for while ``dcp.load`` cannot read it.

Real commits on the local disk, a real DCP save. The collective form (every rank wrote nothing;
one rank wrote) runs in tests/test_commit_edge_cases.py's launch.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import safestage
from safestage import COMMIT_NAME, StagingError


def commit(dest: Path, root: Path) -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_text(dest.name)


def listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.regression("issue 30 item 5: an empty staged_dir block was committed complete: latest_complete named "
                        "it and keep=2 removed a real checkpoint to make room")
@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
@pytest.mark.parametrize("what", ["nothing", "an-empty-directory"])
def test_a_block_that_wrote_nothing_is_refused_and_nothing_at_the_destination_goes(
    tmp_path: Path, stage_root: Path, background: bool, what: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2):
        commit(run / f"checkpoint-{step}", stage_root)
    before = listing(run)

    handle = safestage.staged_dir(run / "checkpoint-3", stage_root, keep=2, background=background)
    with pytest.raises(StagingError) as refused, handle as local:
        if what == "an-empty-directory":
            (local / "optimizer").mkdir()

    assert refused.value.errno == errno.ENOENT
    message = str(refused.value)
    assert f"nothing was written to {local}" in message and f"so nothing was committed to {run / 'checkpoint-3'}" in message
    assert "Save into the directory the block yields" in message, message
    assert listing(run) == before and sorted(os.listdir(run)) == ["checkpoint-1", "checkpoint-2"]
    assert safestage.latest_complete(run) == run / "checkpoint-2"
    assert not local.exists() and os.listdir(stage_root) == []  # nothing kept: there is nothing to keep
    commit(run / "checkpoint-3", stage_root)  # the refusal is not raised again at the next commit
    assert safestage.latest_complete(run) == run / "checkpoint-3"


@pytest.mark.regression("issue 30 item 5: dcp.save(sd, checkpoint_id=dest) inside `with staged_dir(dest)`: the "
                        "commit removed DCP's .metadata and vouched for a directory dcp.load cannot read")
def test_a_dcp_save_to_the_destination_itself_inside_the_block_is_refused_and_stays_as_dcp_wrote_it(
    tmp_path: Path, stage_root: Path
) -> None:
    dest = tmp_path / "run" / "checkpoint-1"
    dest.parent.mkdir()
    state = {"w": torch.arange(16, dtype=torch.float32)}

    with pytest.raises(StagingError) as refused, safestage.staged_dir(dest, stage_root):
        dcp.save(state, checkpoint_id=dest)  # around the commit, into the destination itself

    assert str(dest) in str(refused.value)
    assert (dest / ".metadata").is_file() and not (dest / COMMIT_NAME).exists()
    loaded = {"w": torch.zeros(16)}
    dcp.load(loaded, checkpoint_id=dest)
    assert torch.equal(loaded["w"], state["w"])
    assert not safestage.verify(dest).complete and safestage.latest_complete(dest.parent) is None
