"""A rank of the 2-rank job of tests/test_dcp_failed_save_leaves_nothing_in_flight.py: a
``dcp.save`` through ``StagedWriter`` that rank 1's planner refuses (DCP raises it on every
rank before any ``write_data``, and tells no writer), then what each rank has left: local
directories in its staging root, and work this process still counts as in flight.

argv: dest root result_dir
env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo on CPU)
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from safestage import _work
from safestage._names import parse_stage_dir
from safestage.dcp import StagedWriter


class RefusingPlanner(DefaultSavePlanner):
    def create_local_plan(self) -> Any:
        raise ValueError("this planner refuses the state dict")


def main() -> None:
    warnings.simplefilter("ignore")
    dest, root, results = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    root = root / f"rank{rank}"
    root.mkdir(parents=True, exist_ok=True)
    planner = RefusingPlanner() if rank == 1 else DefaultSavePlanner()
    try:
        dcp.save({f"own.{rank}": torch.ones(1024)}, storage_writer=StagedWriter(dest, root), planner=planner)
        error = None
    except BaseException as exc:  # DCP's CheckpointException, on every rank
        error = str(exc)
    left = [name for name in os.listdir(root) if parse_stage_dir(name) is not None]
    report = {"error": error, "left": left, "busy": [str(path) for path in _work.busy()]}
    (results / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
