"""What a user is told about a copy that is one rank's part of a checkpoint (a rank of a
collective commit, a rank's files of a DCP save): that it is not a checkpoint on its own and
the save must run again, never that `safestage recover` commits it (recover refuses it by
construction, docs/distributed.md and docs/dcp.md), nor to copy it to the destination by hand.

Real saves: a single-process ``dcp.save`` through ``StagedWriter`` whose publish fails with a
real ENOSPC on a 2 MiB tmpfs, and a ``staged_dir(group=WORLD)`` in a real two-rank gloo world
whose rank 0 gets a real SIGINT (Ctrl-C) while the commit runs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _kept_copies import cli, remount, user_env
from test_recover_checkpoint_parts import kept_save_dirs, run_ranks

import safestage


@pytest.mark.regression("fresh-eyes review of issue 24: a failed StagedWriter publish said '`safestage recover` "
                        "commits it again' and 'copy it there yourself', beside 'not a checkpoint on their own'; "
                        "recover refuses it")
def test_a_failed_dcp_save_never_tells_the_user_that_recover_commits_a_ranks_files(
    small_tmpfs: Path, tmp_path: Path, stage_root: Path
) -> None:
    from safestage.dcp import StagedWriter

    dest = small_tmpfs / "step-1"
    with pytest.raises(BaseException) as raised, warnings.catch_warnings():  # DCP's CheckpointException
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(768 * 1024)}, storage_writer=StagedWriter(dest, stage_root))  # 3 MiB
    text = str(raised.value)
    assert "No space left on device" in text, text  # the fault fired
    assert len(kept_save_dirs(stage_root)) == 1  # the rank's files were kept
    remount(small_tmpfs, "16m")
    (result,) = safestage.recover(stage_root)  # in this process, which kept it
    assert result.action == "refused", result  # what recover really does

    assert "recover` commits" not in text, text
    assert "copy it there yourself" not in text, text


def _interrupted_collective(dest: Path, roots: list[Path]) -> Any:
    def body(rank: int, world: int) -> dict[str, Any]:
        import torch.distributed as dist

        try:
            with safestage.staged_dir(dest, roots[rank], group=dist.group.WORLD, timeout=60) as local:
                (local / f"rank{rank}.bin").write_bytes(bytes([rank]) * (1 << 20))
                if rank == 0:  # Ctrl-C lands while rank 0 waits for rank 1 to finish its block
                    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
                else:
                    time.sleep(2.0)
        except KeyboardInterrupt as exc:
            return {"raised": "KeyboardInterrupt", "notes": list(getattr(exc, "__notes__", []))}
        except BaseException as exc:
            return {"raised": type(exc).__name__, "text": str(exc)}
        return {"raised": None}

    return body


@pytest.mark.regression("fresh-eyes review of issue 24: Ctrl-C during a collective commit: the note said 'The "
                        "checkpoint is kept at ...: `safestage recover` commits it'; recover refuses a rank's part")
def test_ctrl_c_during_a_collective_commit_never_promises_that_recover_commits_a_ranks_part(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    dest = run / "checkpoint-100"
    roots = [tmp_path / "node0", tmp_path / "node1"]
    for root in roots:
        root.mkdir()

    seen = run_ranks(_interrupted_collective(dest, roots), 2, tmp_path / "store")

    assert seen[0]["raised"] == "KeyboardInterrupt", seen  # the fault fired on rank 0
    assert seen[1]["raised"] is not None, seen
    assert not safestage.verify(dest).complete
    (save_dir,) = kept_save_dirs(roots[0])
    recover = cli("recover", str(roots[0]), env=user_env(tmp_path))
    assert "refused" in recover.stdout, recover.stdout + recover.stderr
    notes = "\n".join(seen[0]["notes"])
    assert str(save_dir) in notes, notes  # the note names the copy
    assert "recover` commits" not in notes, notes
