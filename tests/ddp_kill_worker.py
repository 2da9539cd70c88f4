"""A rank of a small DDP training job for the distributed kill trials
(tests/test_group_commit_kills.py): resume from ``latest_complete``, train, checkpoint every
few steps through ``staged_dir(group=WORLD)``, and, if told to, SIGKILL itself at a moment of
one checkpoint.

argv: run_dir reference_dir total_steps every [record]
  - resume: the newest complete checkpoint of run_dir, if any; its state must equal the
    reference run's state at that step (checked here, reported as "resumed_equal");
  - each checkpoint holds, from rank 0, the model (model.safetensors) and from every rank its
    optimizer state and step (optim/rank<R>.pt), its RNG state (rng/rank<R>.pt) and a shard of
    its own (shard-rank<R>.safetensors, 1 MiB, so that publishing takes a while);
  - ``record``: rank 0 writes the reference state of every step into reference_dir.
env SAFESTAGE_TEST_KILL: {"rank": R, "checkpoint": K, "delay": D}: rank R kills itself D
seconds after entering its K-th checkpoint of this job; with "once": "<path>" instead of a
delay, as soon as that object of the checkpoint is in the store (run_dir an object-store URL:
a step of the commit, seen from outside).

run_dir may be an object-store URL (s3://bucket/run): the job then starts from step 0 (it
does not resume) and checkpoints to run_dir/checkpoint-<step>.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel

import safestage
from safestage import _object_store
from safestage._destination import ObjectURL, url_of
from tests._two_nodes import report


def model_for(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)


def shard_of(step: int, rank: int) -> dict[str, torch.Tensor]:
    return {"shard": torch.full((256 * 1024,), float(step * 10 + rank))}


def main() -> None:
    url = url_of(sys.argv[1])
    run_dir, reference = sys.argv[1].rstrip("/") if url else Path(sys.argv[1]), Path(sys.argv[2])
    total, every = int(sys.argv[3]), int(sys.argv[4])
    record = len(sys.argv) > 5 and sys.argv[5] == "record"
    kill = json.loads(os.environ.get("SAFESTAGE_TEST_KILL") or "null")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = model_for()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, resumed_from, resumed_equal = 0, None, None
    latest = None if url else safestage.latest_complete(run_dir)
    if latest is not None:
        saved = load_file(str(latest / "model.safetensors"))
        saved_step = int(saved.pop("_step").item())
        model.load_state_dict(saved)
        own = torch.load(latest / "optim" / f"rank{rank}.pt", weights_only=False)
        optimizer.load_state_dict(own["optimizer"])
        step, resumed_from = own["step"], latest.name
        expected = load_file(str(reference / f"step-{step}.safetensors"))
        # The step exactly; the parameters closely (a checkpoint written after an earlier resume
        # rounds differently, see _final_equal); this rank's own shard exactly.
        resumed_equal = saved_step == step and all(
            torch.allclose(value, expected[key], rtol=1e-4, atol=1e-6) for key, value in model.state_dict().items()
        )
        resumed_equal = resumed_equal and torch.equal(load_file(str(latest / f"shard-rank{rank}.safetensors"))["shard"],
                                                      shard_of(step, rank)["shard"])
    ddp = DistributedDataParallel(model)
    checkpoints, durations, error, phase = 0, [], None, "training"
    try:
        while step < total:
            inputs, targets = batch(step, rank)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
            optimizer.step()
            step += 1
            if record and rank == 0:
                save_file(dict(model.state_dict()), str(reference / f"step-{step}.safetensors"))
            if step % every:
                continue
            if kill is not None and kill["rank"] == rank and kill["checkpoint"] == checkpoints:
                if "once" in kill:
                    seen = url_of(f"{run_dir}/checkpoint-{step}/{kill['once']}")
                    threading.Thread(target=_die_once, args=(seen,), daemon=True).start()
                else:
                    threading.Thread(target=_die_after, args=(kill["delay"],), daemon=True).start()
            started, phase = time.monotonic(), "checkpoint"
            # timeout: a rank killed while the first commit makes safestage's gloo group is seen
            # only after it (docs/distributed.md); every other death at once.
            dest = f"{run_dir}/checkpoint-{step}" if url else run_dir / f"checkpoint-{step}"
            with safestage.staged_dir(dest, group=dist.group.WORLD, timeout=60) as local:
                if rank == 0:  # with its step, so that a reader can tell the steps apart exactly
                    save_file({**model.state_dict(), "_step": torch.tensor([step])}, str(local / "model.safetensors"))
                save_file(shard_of(step, rank), str(local / f"shard-rank{rank}.safetensors"))
                (local / "optim").mkdir()
                torch.save({"optimizer": optimizer.state_dict(), "step": step}, local / "optim" / f"rank{rank}.pt")
                (local / "rng").mkdir()
                torch.save(torch.get_rng_state(), local / "rng" / f"rank{rank}.pt")
            durations.append(time.monotonic() - started)
            checkpoints, phase = checkpoints + 1, "training"
    except BaseException as exc:  # a rank was killed: reported, then exit non-zero
        error = {"type": type(exc).__name__, "message": str(exc), "phase": phase}
    final = {key: value.tolist() for key, value in model.state_dict().items()} if error is None else None
    report(resumed_from=resumed_from, resumed_equal=resumed_equal, step=step, durations=durations,
           error=error, final_equal=_final_equal(model, reference, step) if error is None else None,
           has_final=final is not None)  # fmt: skip
    if error is not None:
        sys.exit(1)
    dist.destroy_process_group()


def _final_equal(model: torch.nn.Module, reference: Path, step: int) -> bool:
    path = reference / f"step-{step}.safetensors"
    if not path.exists():
        return True  # the reference job itself
    expected = load_file(str(path))
    # Close, not equal: DDP's first iteration after a restart reduces gradients in its initial
    # bucket layout, the uninterrupted run in the rebuilt one, and ring allreduce sums each
    # element in an order that depends on its offset (float rounding). The resumed state
    # itself is compared exactly.
    return all(torch.allclose(value, expected[key], rtol=1e-4, atol=1e-6) for key, value in model.state_dict().items())


def _die_after(delay: float) -> None:
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_once(seen: ObjectURL) -> None:
    while _object_store.head(seen) is None:
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
