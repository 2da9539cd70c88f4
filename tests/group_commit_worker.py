"""A rank of a distributed job for tests/test_group_commit.py: runs the cases of a JSON plan
(argv[1]) through ``staged_dir(dest, group=WORLD)`` and reports what each returned or raised.
A case's dest is a path or an object-store URL (the AWS environment comes from the launch)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import safestage
from tests._two_nodes import report


def shard(rank: int, case: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(hash((rank, case)) % 2**31)
    return {"w": torch.randn(2048, generator=generator), "rank": torch.tensor([rank])}


def write(local: Path, rank: int, case: str, plan: dict) -> None:
    """What a DDP/FSDP rank writes: its shard and its optimizer state; rank 0 the config."""
    save_file(shard(rank, case), str(local / f"model-rank{rank}.safetensors"))
    (local / "optim").mkdir(exist_ok=True)
    torch.save({"rank": rank, "case": case}, local / "optim" / f"rank{rank}.pt")
    if rank == 0:
        (local / "config.json").write_text(json.dumps({"case": case}))
    if case == "clash" and rank in (1, 3):
        (local / "same.json").write_text(str(rank))
    if case == "raise" and rank == plan.get("rank", 1):
        raise ValueError(f"the block of rank {rank} failed on purpose")
    if case == "enospc" and rank == 3:  # full/ is a 2 MiB tmpfs at the destination
        (local / "full").mkdir()
        (local / "full" / "big.bin").write_bytes(os.urandom(4 << 20))  # more than it holds


def unreachable(case: dict, rank: int) -> Optional[str]:
    """Case "unreachable": the store cannot be reached from rank ``case["rank"]`` (its bucket's
    endpoint, for this process only, a port nobody listens on; no retries). The URL to reset."""
    if case["name"] != "unreachable" or rank != case["rank"]:
        return None
    safestage.configure_store(case["dest"], {"endpoint": case["endpoint"], "retry_config": {"max_retries": 0}})
    return str(case["dest"])


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for case in plan["cases"]:
        started = time.monotonic()
        cut = unreachable(case, rank)
        try:
            background = case["name"] == "background"
            handle = safestage.staged_dir(case["dest"], group=dist.group.WORLD, background=background)
            with handle as local:
                write(local, rank, case["name"], case)
            steps = 0
            in_flight = background and not handle.done()
            for _ in range(20 if background else 0):  # training goes on, on the job's own group
                total = torch.ones(1)
                dist.all_reduce(total)
                assert total.item() == dist.get_world_size()
                steps += 1
            manifest = handle.wait()
            results.append({"case": case["name"], "ok": True, "seconds": time.monotonic() - started,
                            "root": os.environ["SAFESTAGE_DIR"], "local": str(local), "steps": steps, "in_flight": in_flight,
                            "files": len(manifest.files)})
        except BaseException as exc:  # reported, the next case goes on
            results.append({"case": case["name"], "ok": False, "type": type(exc).__name__, "error": str(exc),
                            "errno": getattr(exc, "errno", None), "staged_path": getattr(exc, "staged_path", None)})
        finally:
            if cut is not None:
                safestage.configure_store(cut, None)
    report(results=results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
