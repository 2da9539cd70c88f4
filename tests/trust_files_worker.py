"""A rank of the 2-rank job of tests/test_trust_files_land_last.py: Lightning's sharded save,
as its FSDP strategy makes it under the switch (``safestage.lightning.sharded_save``): every
rank ``dcp.save``s its shard into its own local directory of one ``staged_dir(dest,
group=WORLD)``, and rank 0 ``torch.save``s ``meta.pt``. Step 1, then (once the test says go)
a re-save of step 2 into the same directory, which the test SIGKILLs half-way.

argv: dest root result_dir big_floats
env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo on CPU)
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import safestage


def state_at(step: int, rank: int, big: int) -> dict[str, torch.Tensor]:
    """Rank 1's shard is big (its publish takes a while on the throttled mount), rank 0's tiny."""
    return {f"own.{rank}": torch.full((big if rank == 1 else 64,), float(step))}


def main() -> None:
    dest, root, results, big = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    (root / f"rank{rank}").mkdir(parents=True, exist_ok=True)  # each rank its own staging root
    for step in (1, 2):
        if step == 2:  # the test has seen step 1 committed and watches the re-save
            while not (results / "go").exists():
                time.sleep(0.02)
        with safestage.staged_dir(dest, root / f"rank{rank}", group=dist.group.WORLD) as local:
            dcp.save(state_at(step, rank, big), checkpoint_id=local)
            if rank == 0:
                torch.save({"step": step}, local / "meta.pt")
        (results / f"saved-{step}-rank{rank}").write_text("")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
