"""`safestage recover` reads the records safestage 0.3 wrote (format version 1) and still never
commits one rank's part of a checkpoint as the whole: a copy 0.3's DCP writers kept is one
rank's files whatever they are named (``.distcp`` for ``StagedWriter``, safetensors shards
for ``StagedHuggingFaceWriter``).

The copy is real: a two-rank ``dcp.save`` through ``StagedHuggingFaceWriter(save_distributed=
True)`` whose rank 1 fails to publish with a real ENOSPC on a 2 MiB tmpfs; its record is then
written as safestage 0.3's ``_stage.record_kept`` wrote it (`git show
9b4f3c0:safestage/_stage.py`: version 1, no part, no rank; 0.3's DCP writers recorded no rank).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _kept_copies import cli, remount, user_env
from test_recover_checkpoint_parts import failed_save, kept_save_dirs, run_ranks

import safestage
from safestage._names import KEPT_RECORD


def as_written_by_safestage_0_3(save_dir: Path) -> None:
    record = json.loads((save_dir / KEPT_RECORD).read_bytes())
    document = {
        "format": "safestage.kept", "version": 1, "destination": record["destination"], "local": record["local"],
        "kind": record["kind"], "left": record["left"], "landed": record["landed"],
        "commit_file": record["commit_file"], "error": record["error"], "time": record["time"],
    }  # fmt: skip
    (save_dir / KEPT_RECORD).write_text(json.dumps(document, indent=1))


@pytest.mark.regression("fresh-eyes review of issue 24: recover committed rank 1's shard of a 0.3 "
                        "StagedHuggingFaceWriter save as a complete checkpoint (verify --deep: complete)")
def test_recover_never_commits_one_ranks_shards_of_a_huggingface_dcp_save_kept_by_safestage_0_3(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    from safestage.dcp import StagedHuggingFaceWriter

    run = small_tmpfs / "run"
    run.mkdir()
    dest = run / "step-100"
    roots = [tmp_path / "node0", tmp_path / "node1"]
    for root in roots:
        root.mkdir()

    def body(rank: int, world: int) -> dict[str, Any]:
        # rank 1's shard (3 MiB) does not fit on the 2 MiB tmpfs: a real ENOSPC
        state = {f"w{rank}": torch.full((1000 if rank == 0 else 768 * 1024,), float(rank + 1))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return failed_save(lambda: dcp.save(state, storage_writer=StagedHuggingFaceWriter(
                dest, roots[rank], save_distributed=True)))  # fmt: skip

    seen = run_ranks(body, 2, tmp_path / "store")
    assert all(result.get("raised") for result in seen.values()), seen
    (save_dir,) = kept_save_dirs(roots[1])
    record = json.loads((save_dir / KEPT_RECORD).read_bytes())
    assert "No space left" in (record["error"] or ""), record  # the fault fired
    assert all(path.endswith(".safetensors") for path in record["left"]), record
    as_written_by_safestage_0_3(save_dir)
    remount(small_tmpfs, "16m")

    result = cli("recover", str(roots[1]), env=user_env(tmp_path))

    assert "refused" in result.stdout and "committed" not in result.stdout, result.stdout + result.stderr
    assert not safestage.verify(dest).complete
    assert safestage.latest_complete(run, "step-*") is None
