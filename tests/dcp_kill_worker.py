"""A rank of a small job for the DCP kill trials (tests/test_dcp_kills.py): resume from
``latest_complete`` with stock ``dcp.load``, step, ``dcp.save(checkpoint_id=...)`` every few
steps with the switch alone staging it (SAFESTAGE_DIR, set by the launcher; this file saves
with DCP only), and, if told to, SIGKILL itself at a moment of one save.

argv: run_dir total_steps every
  - the state at step S is a function of S alone (``state_at``): a tensor of each rank's own,
    one replicated on every rank, a DTensor sharded over the ranks (1 MiB a rank, so that a
    save takes a while), and the step; a resumed job checks that what it loaded is that state
    ("resumed_equal");
  - every step ends with a barrier (training's collective), so that a rank killed between
    saves is noticed there.
env SAFESTAGE_TEST_KILL: {"rank": R, "checkpoint": K, "delay": D}: rank R kills itself D
seconds after entering its K-th save of this job.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import safestage  # the reader's side only: latest_complete
from tests._two_nodes import report

SHARD = 256 * 1024  # floats of the sharded tensor per rank: 1 MiB


def state_at(step: int, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    full = torch.arange(world * SHARD, dtype=torch.float32) + step * 1000
    return {
        f"own.{rank}": torch.full((64, 64), float(step * 10 + rank)),
        "shared": torch.linspace(0, 1, 257) * step,
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "step": step,
    }


def equal(loaded: dict[str, Any], expected: dict[str, Any]) -> bool:
    for key, value in expected.items():
        got = loaded[key]
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            if not torch.equal(got.to_local() if hasattr(got, "to_local") else got, local):
                return False
        elif got != value:
            return False
    return True


def main() -> None:
    warnings.simplefilter("ignore")  # DCP's overwrite warning
    run_dir, total, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    kill = json.loads(os.environ.get("SAFESTAGE_TEST_KILL") or "null")
    # A rank that neither answers nor dies stops the others after this (no hang).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    step, resumed_from, resumed_equal = 0, None, None
    latest = [str(found) if rank == 0 and (found := safestage.latest_complete(run_dir, "step-*")) else None]
    dist.broadcast_object_list(latest, src=0)  # every rank resumes from rank 0's answer
    if latest[0] is not None:
        resumed_from = Path(latest[0]).name
        saved_step = int(resumed_from.split("-")[1])
        expected = state_at(saved_step, rank, world, mesh)
        loaded = {key: (torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0) for key, value in expected.items()}
        dcp.load(loaded, checkpoint_id=latest[0])  # stock DCP
        resumed_equal = equal(loaded, expected)
        step = saved_step
    saves, durations, error, phase = 0, [], None, "training"
    try:
        while step < total:
            time.sleep(0.02)
            step += 1
            dist.barrier()
            if step % every:
                continue
            if kill is not None and kill["rank"] == rank and kill["checkpoint"] == saves:
                threading.Thread(target=_die_after, args=(kill["delay"],), daemon=True).start()
            started, phase = time.monotonic(), "checkpoint"
            dcp.save(state_at(step, rank, world, mesh), checkpoint_id=run_dir / f"step-{step}")
            durations.append(time.monotonic() - started)
            saves, phase = saves + 1, "training"
    except BaseException as exc:  # a rank was killed (DCP's CheckpointException is a BaseException)
        error = {"type": type(exc).__name__, "message": str(exc)[:2000], "phase": phase}
    report(resumed_from=resumed_from, resumed_equal=resumed_equal, step=step, durations=durations, error=error,
           staging_on=safestage.is_active())  # fmt: skip
    if error is not None:
        os._exit(1)  # the job's group is broken: no teardown to wait for
    dist.destroy_process_group()


def _die_after(delay: float) -> None:
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
