"""A rank of a two-node DCP job (tests/test_dcp.py): runs the cases of a JSON plan in order,
each a dcp.save / async_save onto one destination, and reports what each did.

    dcp_worker.py PLAN.json

PLAN: [{"name": ..., "kind": "save" | "async" | "async-process" | "stock" | "resave-fail"
| "hf", "dest": ...}, ...]. Every rank's state dict holds a tensor of its own
("own.<rank>"), one replicated on every rank ("shared", which DCP's planner gives to one
rank), a DTensor sharded over the ranks ("sharded") and the step (an int, pickled bytes).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _two_nodes import report
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from safestage.dcp import StagedHuggingFaceWriter, StagedWriter

STEP = 7


def full_sharded() -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def state_dict(rank: int, mesh: Any, *, hf: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {
        f"own.{rank}": torch.full((16, 4), float(rank)) + torch.arange(4),
        "shared": torch.linspace(0, 1, 33),
        "sharded": distribute_tensor(full_sharded(), mesh, [Shard(0)]),
    }
    if not hf:  # the HuggingFace writer stores tensors only
        state["step"] = STEP
    return state


def outcome(exc: BaseException) -> dict[str, Any]:
    """What a rank saw: the exception's type and text (DCP's CheckpointException carries each
    failed rank's own exception in ``failures``)."""
    failures = getattr(exc, "failures", None) or {}
    return {
        "ok": False,
        "type": type(exc).__name__,
        "text": str(exc),
        "failed_ranks": sorted(failures),
        "causes": {str(rank): [type(pair[0]).__name__, str(pair[0])] for rank, pair in failures.items()},
    }


def run_case(case: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    kind, dest = case["kind"], case["dest"]
    if kind == "save":
        dcp.save(state_dict(rank, mesh), storage_writer=StagedWriter(dest))
    elif kind == "async":
        dcp.async_save(state_dict(rank, mesh), storage_writer=StagedWriter(dest)).result()
    elif kind == "async-process":
        future = dcp.async_save(
            state_dict(rank, mesh), storage_writer=StagedWriter(dest),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )  # fmt: skip
        future.result()
    elif kind == "hf":
        dcp.save(state_dict(rank, mesh, hf=True), storage_writer=StagedHuggingFaceWriter(dest, save_distributed=True))
    elif kind == "stock":  # DCP's own writer, straight onto the destination: the baseline
        dcp.save(state_dict(rank, mesh), storage_writer=dcp.FileSystemWriter(dest))
    elif kind == "resave-fail":
        # A good checkpoint first; then rank 2's file is made a directory, so that its publish
        # of the second save fails while the other ranks' land.
        dcp.save(state_dict(rank, mesh), storage_writer=StagedWriter(dest))
        dist.barrier()
        if rank == 0:
            blocker = Path(dest) / "__2_0.distcp"
            blocker.unlink()
            blocker.mkdir()
        dist.barrier()
        dcp.save(state_dict(rank, mesh), storage_writer=StagedWriter(dest))
    else:
        raise ValueError(f"unknown case kind {kind!r}")
    return {"ok": True}


def main() -> None:
    warnings.simplefilter("ignore")  # DCP warns about the overwrite default
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results: dict[str, Any] = {}
    for case in plan:
        try:
            results[case["name"]] = run_case(case, rank, mesh)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            results[case["name"]] = outcome(exc)
            if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
                raise
        dist.barrier()  # every case starts with every rank done with the one before
    root = Path(os.environ["SAFESTAGE_DIR"])
    report(results=results, node_root=str(root), local_rank=int(os.environ["LOCAL_RANK"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
